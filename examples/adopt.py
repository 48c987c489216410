"""A plain torch RPC program that adopts asyncrpc one call at a time.

The world is started the usual torch way (`mp.spawn` + `rpc.init_rpc`);
asyncrpc adopts it on first use. Worker 0 makes the same call with torch
and with asyncrpc, then uses what only asyncrpc has: errors that keep their
type and name the worker, handles with call options, and awaiting Futures.

    python examples/adopt.py
"""

from __future__ import annotations

import os

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

import asyncrpc


def lookup(table: dict[str, int], key: str) -> int:
    return table[key]


class Counter:
    def __init__(self, start: int) -> None:
        self.value = start

    def add(self, n: int, timeout: float = 0.0) -> int:  # `timeout` is the method's own
        self.value += n
        return self.value


@asyncrpc.async_execution
async def add_chained(to: str, x: torch.Tensor) -> torch.Tensor:
    return await asyncrpc.rpc_async(to, torch.add, args=(x, 1)) + 1


def worker(rank: int) -> None:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3)  # torch's own start
    if rank == 0:
        x = torch.ones(2)
        print("torch:   ", rpc.rpc_sync("worker1", torch.add, args=(x, 1)))
        print("asyncrpc:", asyncrpc.rpc_sync(to="worker1", func=torch.add, args=(x, 1)))
        print("context: ", asyncrpc.current_context().names)
        try:
            asyncrpc.rpc_sync("worker1", lookup, args=({"a": 1}, "b"))
        except KeyError as exc:  # torch alone: RuntimeError("KeyError: ...")
            where = str(exc).splitlines()[2]
            print("error:   ", type(exc).__name__, isinstance(exc, asyncrpc.RemoteError), where)
        counter = asyncrpc.spawn("worker2", Counter, 10)
        print("handle:  ", counter.options(timeout=5).call("add", 1, timeout=0.5))
        print("chained: ", asyncrpc.rpc_sync("worker1", add_chained, args=("worker2", x)))
    rpc.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    mp.spawn(worker, nprocs=3)
