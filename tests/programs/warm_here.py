"""Embedded worlds forked from a copy of the calling process, and the fallback.

    python tests/programs/warm_here.py

The caller runs no torch op before its first two worlds: their workers fork
from a fork of the caller itself (its command line, not multiprocessing's
forkserver's), and still import the script (they do not see what the
caller set under its `__main__` guard). Then the caller runs a
parallel torch op (GNU OpenMP's pool starts), and its third world forks
from multiprocessing's forkserver instead: a fork of this process would hang
at its first parallel op. Every worker runs parallel ops, its heap frozen
at its fork. One line per worker, then one per world's warm interpreter,
whether it still runs.
"""

from __future__ import annotations

import gc
import os

import torch

import asyncrpc

MARK = "unset"  # the caller sets it before its worlds start


def main(ctx: asyncrpc.Context, world: str) -> int:
    torch.set_num_threads(2)
    a = torch.rand(400, 400)
    assert torch.allclose(a @ a, torch.mm(a, a))  # intra-op threads work
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        kind = "forkserver" if b"forkserver" in f.read() else "copy"
    line = (
        f"{world} {ctx.name} parent={os.getppid()} kind={kind} mark={MARK} "
        f"frozen={gc.get_freeze_count() > 1000} threads={torch.get_num_threads()}\n"
    )
    os.write(1, line.encode())
    return os.getppid()


if __name__ == "__main__":
    MARK = "caller"
    parents = {}
    for world in ("first", "second", "third"):
        if world == "third":
            torch.rand(300, 300) @ torch.rand(300, 300)  # OpenMP's thread pool starts here
        parents[world] = asyncrpc.run(main, world_size=2, args=(world,))
    for world, parent in parents.items():
        try:
            os.kill(parent, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        print(f"{world} warm={parent} alive={alive} caller={os.getpid()}", flush=True)
