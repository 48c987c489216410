"""A job that survives losing a worker: the world restarts and `main` resumes.

    python examples/restart.py
    asyncrpc-launch --nproc-per-node 3 --max-restarts 1 examples/restart.py

worker0 drives the job one step at a time (one call per worker per step) and
saves the next step to its checkpoint. On the first run (`ctx.attempt == 0`)
worker1 dies at step 3 (SIGKILL, as a crash or an out-of-memory kill would).
The world is formed again with the same names, and worker0 resumes at step 3.
"""

import os
import pathlib
import signal
import tempfile

import asyncrpc

STEPS = 6
CHECKPOINT = pathlib.Path(tempfile.gettempdir()) / f"asyncrpc-restart-{os.getppid()}.step"


def step(i: int) -> int:
    ctx = asyncrpc.current_context()
    if ctx.attempt == 0 and ctx.name == "worker1" and i == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return i * i


def main(ctx: asyncrpc.Context) -> None:
    if ctx.rank != 0:
        return  # the others serve calls until worker0 is done
    start = int(CHECKPOINT.read_text()) if ctx.attempt and CHECKPOINT.exists() else 0
    print(f"attempt {ctx.attempt}: starting at step {start}", flush=True)
    for i in range(start, STEPS):
        squares = asyncrpc.gather([asyncrpc.rpc_async(n, step, args=(i,)) for n in ctx.names])
        squares.wait()
        CHECKPOINT.write_text(str(i + 1))
        print(f"step {i} done", flush=True)
    CHECKPOINT.unlink()
    print(f"attempt {ctx.attempt}: all {STEPS} steps done", flush=True)


if __name__ == "__main__":
    asyncrpc.run(main, world_size=3, max_restarts=1)
