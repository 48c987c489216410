"""Failures nobody waited for: logged once when their Future is dropped unread.

A fire-and-forget `rpc_async(...)` whose call fails is otherwise silent::

    rpc_async(...) ──> Future ── watched (one done-callback) ──┐
    dropped unread, and failed (in either order)                └─> one WARNING on "asyncrpc"

Off by default: the watch adds a callback to every call.
"""

from __future__ import annotations

import logging

from . import _runtime, _torch
from ._failures import label_of, name_failure

__all__ = ("log_unwaited_failures", "unwaited_logging", "watch_unwaited")

_logger = logging.getLogger("asyncrpc")


def log_unwaited_failures(enabled: bool = True) -> None:
    """Log a call's failure when its Future is dropped without being read.

    Off by default (it adds a callback per call). `asyncrpc.run(...,
    log_unwaited_failures=True)` turns it on in every worker, and so does the
    environment variable ``ASYNCRPC_LOG_UNWAITED=1``. The record goes to the
    ``"asyncrpc"`` logger at WARNING, once per failed call. Example::

        asyncrpc.log_unwaited_failures()
        asyncrpc.rpc_async("worker1", update, args=(grads,))   # fire and forget
        # WARNING asyncrpc: a call nobody waited for failed: ...
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, got {enabled!r}")
    _runtime.SLOT.log_unwaited = enabled


def unwaited_logging() -> bool:
    """True when failures nobody waited for are logged (`log_unwaited_failures`)."""
    return _runtime.SLOT.log_unwaited


def watch_unwaited(fut: object, worker: str, func: object) -> None:
    """Log `fut`'s failure if it is dropped unread (see `log_unwaited_failures`)."""

    def report(error: BaseException) -> None:
        named = name_failure(error, worker, func) if type(error) is RuntimeError else error
        _logger.warning(
            "a call nobody waited for failed: %s on %s raised %s: %s; read its Future "
            "(wait(), value(), await) to handle it",
            label_of(func),
            worker,
            type(named).__name__,
            (str(named).strip().splitlines() or [""])[0],
        )

    _torch.watch_unread(fut, report)
