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

_JOIN_S = 1.0
_lock = threading.Lock()
_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_registered = False


def settle_at_exit(threads: Iterable[threading.Thread] = ()) -> None:
    """Join `threads` and drain torch's inter-op pool when this process exits."""
    global _registered
    with _lock:
        _threads.update(threads)
        if not _registered:
            atexit.register(settle)
            _registered = True


def settle() -> None:
    """Join the fan-out threads, then let every inter-op thread finish its task."""
    with _lock:
        threads = list(_threads)
    for thread in threads:
        thread.join(_JOIN_S)
    if _torch.interop_pool_started():
        _drain_interop_pool()


def _drain_interop_pool() -> None:
    global _barrier
    _barrier = threading.Barrier(torch.get_num_interop_threads())
    try:
        with _torch.quiet_torchscript():
            drain: Any = torch.jit.script(_drain)
        drain(_barrier.parties)
    except Exception:  # TorchScript missing, or a pool thread busy: exit anyway
        _barrier.abort()


_barrier = threading.Barrier(1)


@torch.jit.ignore  # type: ignore[untyped-decorator]
def _meet(i: int) -> int:
    # Blocks until every pool thread holds one: each has let go of its last task.
    _barrier.wait(_JOIN_S)
    return i


def _drain(n: int) -> int:
    futures: list[torch.jit.Future[int]] = []
    for i in range(n):
        futures.append(torch.jit.fork(_meet, i))  # type: ignore[no-untyped-call]
    total = 0
    for future in futures:
        total += torch.jit.wait(future)  # type: ignore[no-untyped-call]
    return total
