"""A ring: each worker calls the next one and reports the reply.

Run it any of three ways; the output is the same:

    python examples/ring.py
    asyncrpc-launch --nproc-per-node 3 examples/ring.py
    torchrun --nproc-per-node 3 examples/ring.py
"""

import torch

import asyncrpc


def greet(sender: str, payload: torch.Tensor) -> str:
    me = asyncrpc.current_context().name
    return f"{me} got {payload.tolist()} from {sender}"


def call_next(round_trip: int) -> str:
    ctx = asyncrpc.current_context()
    nxt = ctx.names[(ctx.rank + 1) % ctx.world_size]
    payload = torch.full((2,), float(ctx.rank + round_trip))
    return asyncrpc.rpc_sync(nxt, greet, args=(ctx.name, payload))


def main(ctx: asyncrpc.Context) -> None:
    if ctx.rank != 0:
        return  # the other workers serve calls until the world shuts down
    for name in ctx.names:
        print(asyncrpc.rpc_sync(name, call_next, args=(10,)))


if __name__ == "__main__":
    asyncrpc.run(main, world_size=3)
