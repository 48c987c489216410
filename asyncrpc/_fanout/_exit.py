"""A clean interpreter exit after fan-out: settle torch's worker threads first.

Why: a thread that is still inside torch when Python finalizes, and then needs
the GIL (to drop a Tensor's Python object or a callback), is ended by CPython
with ``pthread_exit``; unwinding through torch's C++ frames then aborts the
whole process ("terminate called without an active exception", exit -6). Two
places hit it after the last result is already in the caller's hands:

    fan-out pool thread:  fut.set_result(value) ── runs torch's callbacks,
                          drops them with the GIL ── main thread already exiting
    inter-op pool thread: jit.fork task done ── destroys its frame, which holds
                          the input Tensor ── main thread already exiting

`settle_at_exit` registers one `atexit` hook (atexit runs before CPython
starts refusing the GIL) that joins the fan-out threads and walks every
inter-op pool thread through one barrier, so each has finished its last task.
"""

import atexit
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from .._core import _torch

__all__ = ("settle", "settle_at_exit")

_JOIN_S = 1.0


class _ExitGuard:
    """What the exit hook settles: the fan-out threads to join, and the barrier of the drain.

    Process-lifetime on purpose: the interpreter's exit is the process's, not
    a world's, and fan-out runs with or without one.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()  # guards `threads` and `registered`
        self.threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        self.registered = False
        # Read by `_meet` on torch's inter-op threads; a new one for each drain.
        self.barrier = threading.Barrier(1)


_GUARD = _ExitGuard()


def settle_at_exit(threads: Iterable[threading.Thread] = ()) -> None:
    """Join `threads` and drain torch's inter-op pool when this process exits."""
    with _GUARD.lock:
        _GUARD.threads.update(threads)
        if not _GUARD.registered:
            atexit.register(settle)
            _GUARD.registered = True


def settle() -> None:
    """Join the fan-out threads, then let every inter-op thread finish its task."""
    with _GUARD.lock:
        threads = list(_GUARD.threads)
    for thread in threads:
        thread.join(_JOIN_S)
    if _torch.interop_pool_started():
        _drain_interop_pool()


def _drain_interop_pool() -> None:
    barrier = _GUARD.barrier = threading.Barrier(torch.get_num_interop_threads())
    try:
        with _torch.quiet_torchscript():
            drain: Any = torch.jit.script(_drain)
        drain(barrier.parties)
    except Exception:  # TorchScript missing, or a pool thread busy: exit anyway
        barrier.abort()


@torch.jit.ignore  # type: ignore[untyped-decorator]
def _meet(i: int) -> int:
    # Blocks until every pool thread holds one: each has let go of its last task.
    _GUARD.barrier.wait(_JOIN_S)
    return i


def _drain(n: int) -> int:
    futures: list[torch.jit.Future[int]] = []
    for i in range(n):
        futures.append(torch.jit.fork(_meet, i))  # type: ignore[no-untyped-call]
    total = 0
    for future in futures:
        total += torch.jit.wait(future)  # type: ignore[no-untyped-call]
    return total
