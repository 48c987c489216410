"""ObjectRefs whose owner died, in a world that heals: lost, named, and nothing pretends.

    python tests/programs/lost_objects.py

worker0 drives. worker2 puts a value and is killed (SIGKILL); its
replacement joins under the same name. The ref then raises ObjectLostError
naming worker2, on `get`, as an argument of a call to another worker, and passed inside a
list (refused as it is sent), although worker1 had read it before; worker1's
`get` of the ref it kept raises too;
a value put on the replacement reads as usual. Prints one line per check.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import torch

import asyncrpc

HEALED = threading.Event()


def check(name: str, ok: bool, detail: object = "") -> None:
    print(f"{name}: {'ok' if ok else f'FAILED {detail}'}", flush=True)


def total(x: torch.Tensor) -> float:
    return float(x.sum())


def read_inside(refs: list[asyncrpc.ObjectRef[torch.Tensor]]) -> str:
    """On a borrower: read a ref given inside a list; the error's type and owner, if any."""
    try:
        return f"value {float(asyncrpc.get(refs[0]).sum())}"
    except asyncrpc.ObjectLostError as exc:
        return f"lost {exc.name}"


KEPT: list[asyncrpc.ObjectRef[torch.Tensor]] = []  # on worker1: a ref it read, and keeps


def keep_read(refs: list[asyncrpc.ObjectRef[torch.Tensor]]) -> float:
    KEPT.append(refs[0])
    return float(asyncrpc.get(refs[0]).sum())


def read_kept() -> str:
    return read_inside(KEPT)


def lost_as(read: Any) -> str:
    try:
        read()
    except asyncrpc.ObjectLostError as exc:
        return f"lost {exc.name}: {str(exc).splitlines()[0][:120]}"
    except Exception as exc:  # the wrong error: shown
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return "no error"


def main(ctx: asyncrpc.Context) -> None:
    if ctx.rank != 0:
        return
    asyncrpc.on_replaced(lambda replaced: HEALED.set())
    ref = asyncrpc.rpc_sync("worker2", asyncrpc.put, args=(torch.ones(4),))
    check("put on worker2", ref.owner == "worker2", ref)
    check(
        "read on worker1", asyncrpc.rpc_sync("worker1", read_inside, args=([ref],)) == "value 4.0"
    )
    check("read and kept on worker1", asyncrpc.rpc_sync("worker1", keep_read, args=([ref],)) == 4)
    os.kill(asyncrpc.rpc_sync("worker2", os.getpid), signal.SIGKILL)
    check("healed", HEALED.wait(60))
    got = lost_as(lambda: asyncrpc.get(ref, timeout=30))
    check("get: lost, named", got.startswith("lost worker2"), got)
    got = lost_as(lambda: asyncrpc.rpc_sync("worker1", total, args=(ref,)))
    check("as an argument: lost, named", got.startswith("lost worker2"), got)
    got = lost_as(lambda: asyncrpc.rpc_sync("worker1", read_inside, args=([ref],)))
    check("passed inside a list: lost, named", got.startswith("lost worker2"), got)
    got = asyncrpc.rpc_sync("worker1", read_kept)
    check("a value read before: lost, named", got == "lost worker2", got)
    fresh = asyncrpc.rpc_sync("worker2", asyncrpc.put, args=(torch.ones(2),))
    check("a put on the replacement", asyncrpc.rpc_sync("worker1", total, args=(fresh,)) == 2.0)


if __name__ == "__main__":
    asyncrpc.run(main, world_size=3, restart="worker", max_restarts=2)
