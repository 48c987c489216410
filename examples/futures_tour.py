"""Composing RPC Futures without blocking threads: chain, gather, wait_first, with_timeout.

Also: Batch, and logging a failure nobody waited for.

python examples/futures_tour.py
"""

import time

import torch

import asyncrpc


def slow_add(x: torch.Tensor, y: float, seconds: float) -> torch.Tensor:
    time.sleep(seconds)
    return x + y


def check_shard(name: str) -> None:
    raise KeyError(name)


def main(ctx: asyncrpc.Context) -> None:
    if ctx.rank != 0:
        return
    x = torch.ones(2)

    # chain: worker1 adds 1, then worker2 adds 1, then we add 1 locally.
    chained = asyncrpc.chain(
        asyncrpc.rpc_async("worker1", slow_add, args=(x, 1, 0.0)),
        lambda y: asyncrpc.rpc_async("worker2", slow_add, args=(y, 1, 0.0)),
        lambda z: z + 1,
    )
    print("chain:", chained.wait())

    # gather: one value per worker, in the order asked.
    everyone = [asyncrpc.rpc_async(n, slow_add, args=(x, r, 0.0)) for r, n in enumerate(ctx.names)]
    print("gather:", [t.tolist() for t in asyncrpc.gather(everyone).wait()])

    # wait_first: whichever replica answers first.
    replicas = [
        asyncrpc.rpc_async("worker1", slow_add, args=(x, 10, 0.5)),
        asyncrpc.rpc_async("worker2", slow_add, args=(x, 20, 0.0)),
    ]
    print("wait_first:", asyncrpc.wait_first(replicas).wait().wait())

    # with_timeout: give up on a slow call after 0.1 s (the call itself runs on).
    slow = asyncrpc.rpc_async("worker1", slow_add, args=(x, 0, 1.0))
    try:
        asyncrpc.with_timeout(slow, 0.1).wait()
    except TimeoutError as exc:
        print("with_timeout:", exc)
    asyncrpc.gather([*replicas, slow]).wait()

    # Batch: 100 small calls to worker1 in one message, each with its own Future.
    with asyncrpc.Batch() as batch:
        sums = [batch.rpc_async("worker1", slow_add, args=(x, i, 0.0)) for i in range(100)]
    print("Batch:", sum(float(t.sum()) for t in torch.futures.wait_all(sums)))

    # A failure nobody reads is logged (WARNING, "asyncrpc" logger) once its
    # Future is dropped; without log_unwaited_failures it would vanish.
    asyncrpc.log_unwaited_failures()
    asyncrpc.rpc_async("worker2", check_shard, args=("shard-7",))  # fire and forget
    time.sleep(0.5)


if __name__ == "__main__":
    asyncrpc.run(main, world_size=3)
