"""A world with one worker busy in a user function, for asyncrpc-dump and asyncrpc-top.

    python tests/programs/busy_world.py SECONDS [--torch]

worker0 puts 1 MiB that worker1 fetches and holds (asyncrpc-top's objects),
calls `crunch(SECONDS)` on worker1 (a sync sleep in a loop), and prints
BUSY once the call has started. With --torch the world is started by
torch's own rpc.init_rpc (mp.spawn, 2 processes), and asyncrpc only makes
the call. Under a launcher (asyncrpc-launch, torchrun) it joins the
launcher's world.
"""

import os
import sys
import time

import torch

import asyncrpc

_started = [0.0]
_held: list[object] = []


def hold(refs: list[asyncrpc.ObjectRef[torch.Tensor]]) -> float:
    _held.append(refs[0])
    return float(asyncrpc.get(refs[0]).sum())


def crunch(seconds: float) -> str:
    _started[0] = time.time()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)  # the user's own loop: a dump shows this line
    return "done"


def started() -> float:
    return _started[0]


def main(ctx: asyncrpc.Context, seconds: float) -> None:
    if ctx.rank == 0:
        weights = asyncrpc.put(torch.ones(1 << 18))  # 1 MiB, kept here, held by worker1
        asyncrpc.rpc_sync("worker1", hold, args=([weights],))
        fut = asyncrpc.rpc_async("worker1", crunch, args=(seconds,))
        while not asyncrpc.rpc_sync("worker1", started):
            time.sleep(0.05)
        print(f"BUSY {os.getpid()}", flush=True)
        print(fut.wait(), flush=True)


def _torch_worker(rank: int, port: int, seconds: float) -> None:
    import torch.distributed.rpc as rpc

    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    main(asyncrpc.current_context(), seconds)
    rpc.shutdown()


if __name__ == "__main__":
    seconds = float(sys.argv[1])
    if "--torch" in sys.argv:
        import torch.multiprocessing as mp

        from helpers import free_port

        mp.spawn(_torch_worker, args=(free_port(), seconds), nprocs=2)
    else:
        launched = "RANK" in os.environ  # a launcher's world: its size
        asyncrpc.run(main, world_size=None if launched else 2, args=(seconds,))
