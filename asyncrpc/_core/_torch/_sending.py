"""How a call reaches torch: its UDF send, its pickler, the marks it reads on a function.

`send_python` is torch's `rpc_async` of a Python function less its per-call
Python bookkeeping; `sending_to` tells the patched RRef pickling (`_rrefs`)
which worker a call's arguments are being pickled for, in the world's
`Sending` part (`_runtime`), one value per thread.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._C import _distributed_rpc as _rpc_c
from torch._C._distributed_rpc import WorkerInfo
from torch.distributed.rpc import api as _rpc_api
from torch.distributed.rpc import internal as _rpc_internal

from .. import _runtime
from ._originals import future_add_done_callback, rpc_async

__all__ = (
    "ASYNC_MARK",
    "Sending",
    "async_target",
    "collect_for_wait_all",
    "deserialize",
    "is_builtin",
    "keep_until_done",
    "mark_async",
    "send_python",
    "send_torch",
    "sending_to",
    "serialize",
)

# torch's caller reads this attribute to send a call as async_execution.
ASYNC_MARK = "_wrapped_async_rpc_function"


def send_python(
    to: WorkerInfo,
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
    is_async: bool,
) -> Any:
    """torch's `rpc_async` of a Python function, less its per-call Python bookkeeping.

    Under an autograd profiler torch's own path runs, since it records RPCs.
    """
    if torch.autograd._profiler_enabled():  # type: ignore[attr-defined]
        return send_torch(to, func, args, kwargs, timeout)
    udf = _rpc_internal.PythonUDF(func, args, kwargs)
    pickled, tensors = _rpc_api._default_pickler.serialize(udf)  # type: ignore[no-untyped-call]
    return _rpc_c._invoke_rpc_python_udf(to, pickled, tensors, timeout, is_async)


def send_torch(to: Any, func: Callable[..., Any], args: Any, kwargs: Any, timeout: float) -> Any:
    """torch's own `rpc_async`, leaving an open `rpc._wait_all()` to the verb that asked."""
    fut = rpc_async(to, func, args=args, kwargs=kwargs, timeout=timeout)
    pending = getattr(_rpc_api._thread_local_var, "future_list", None)
    if pending and pending[-1] is fut:
        pending.pop()  # torch's rpc_async collects; asyncrpc's rpc_sync must not
    return fut


def collect_for_wait_all(fut: Any) -> None:
    """Hand `fut` to torch's `rpc._wait_all()` block if one is open on this thread."""
    pending = getattr(_rpc_api._thread_local_var, "future_list", None)
    if pending is not None:
        pending.append(fut)


def serialize(obj: Any) -> tuple[bytes, list[torch.Tensor]]:
    """`obj` pickled as torch's RPC would: (bytes, its tensors, uncopied); raises if it cannot."""
    payload, tensors = _rpc_api._default_pickler.serialize(obj)  # type: ignore[no-untyped-call]
    return payload, list(tensors)


def deserialize(payload: bytes, tensors: list[torch.Tensor]) -> Any:
    """The object `serialize` made (`payload`, `tensors`)."""
    return _rpc_api._default_pickler.deserialize(payload, tensors)  # type: ignore[no-untyped-call]


# ---- what torch reads of a function it sends -----------------------------------------


def is_builtin(func: object) -> bool:
    """True for a torch operator (torch.add): torch sends it by name, not pickled."""
    return torch.jit._builtins._find_builtin(func) is not None  # type: ignore[no-untyped-call]


def mark_async(wrapper: object, func: object) -> None:
    """Mark `wrapper` so torch sends calls to it as async_execution, running `func`."""
    setattr(wrapper, ASYNC_MARK, func)


def async_target(func: object) -> Any:
    """What an async_execution function wraps, or None for an ordinary function."""
    return getattr(func, ASYNC_MARK, None)


# ---- the callee of the call being pickled ---------------------------------------------


class Sending(threading.local):
    """On each thread, while a call's arguments are pickled: the callee, RRefs to hold."""

    # The callee's torch id, and the RRefs the call refers to by id (held until it is done).
    call: tuple[int, list[Any]] | None = None


@contextlib.contextmanager
def sending_to(to: int) -> Iterator[list[Any]]:
    """While a call to torch id `to` is pickled: what RRefs must outlive it go in the list."""
    sending = _runtime.part(Sending)
    keep: list[Any] = []
    outer, sending.call = sending.call, (to, keep)
    try:
        yield keep
    finally:
        sending.call = outer


def keep_until_done(fut: Any, keep: list[Any]) -> None:
    """Hold `keep` until `fut` completes (the RRefs a call refers to by id)."""
    if keep:
        future_add_done_callback(fut, functools.partial(_release, keep))


def _release(keep: list[Any], _: Any) -> None:
    keep.clear()
