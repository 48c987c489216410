"""Two embedded worlds and a spawned one, each worker reporting how it started.

    python tests/programs/warm_start.py [FILE]

Prints one line per worker: world, name, the pid of its parent, whether torch
was imported before this script was (by the warm interpreter the worker was
forked from), its intra-op and inter-op thread counts after a parallel op,
and an environment variable the caller set just before that world. Then the
caller's pid. With FILE, the caller's stdout moves to FILE after the first
world: the later worlds' workers must write there too.
"""

from __future__ import annotations

import os
import sys
import warnings

_torch_first = "torch" in sys.modules  # imported by the warm interpreter before the fork

import torch  # noqa: E402

import asyncrpc  # noqa: E402

# Torch ops when the script is imported (in the caller, in each worker) must not
# reach the warm interpreter: forked from a process whose OpenMP pool runs, a
# worker would hang at its first parallel op.
_at_import = torch.rand(256, 256) @ torch.rand(256, 256)


def main(ctx: asyncrpc.Context, world: str) -> None:
    torch.set_num_threads(2)
    a = torch.rand(600, 600)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.fork is deprecated
        futures = [torch.jit.fork(torch.mm, a, a) for _ in range(4)]  # inter-op threads
        products = [torch.jit.wait(f) for f in futures]
    assert all(torch.allclose(p, a @ a) for p in products)  # intra-op threads
    line = (
        f"{world} {ctx.name} parent={os.getppid()} warm={_torch_first} "
        f"intra={torch.get_num_threads()} interop={torch.get_num_interop_threads()} "
        f"env={os.environ.get('WARM_START_WORLD')}\n"
    )
    os.write(1, line.encode())  # one write: the workers' lines never interleave


if __name__ == "__main__":
    for world, method in (("first", "forkserver"), ("second", "forkserver"), ("third", "spawn")):
        if world == "second" and len(sys.argv) > 1:  # the caller's stdout moves to a file
            sys.stdout.flush()
            os.dup2(os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
        os.environ["WARM_START_WORLD"] = world
        asyncrpc.run(main, world_size=2, args=(world,), start_method=method)
    print(f"caller={os.getpid()}", flush=True)
