"""Checked RPC calls: torch's `rpc_sync`, `rpc_async` and `remote`, same signatures.

The checks run on the caller before anything is sent, so a mistake fails
at once with a message instead of a remote error or a timeout::

    caller: check world running, `to` known, `fn` callable, args a tuple,
            timeout finite and >= 0  --> torch.distributed.rpc.<verb>(...)
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias, cast

import torch.distributed.rpc as rpc
from torch._C._distributed_rpc import WorkerInfo
from torch.futures import Future

from . import _runtime
from ._errors import NotInitializedError, UnknownWorkerError
from ._futures import check_seconds

__all__ = ["check_call", "remote", "rpc_async", "rpc_sync"]

_DEFAULT = rpc.constants.UNSET_RPC_TIMEOUT

Target: TypeAlias = str | int | WorkerInfo


def check_call(
    verb: str, to: object, fn: object, args: object, kwargs: object, timeout: float | None
) -> float:
    """Validate one call; return the timeout in torch's terms (-1: the world's default)."""
    if not _runtime.is_running():
        raise NotInitializedError(_runtime._not_running_message(f"asyncrpc.{verb}"))
    _check_target(verb, to)
    if not callable(fn):
        raise TypeError(
            f"{verb}: got a {type(fn).__name__} where a callable was expected; pass the "
            f"function itself: {verb}(to, f, args=(x,)) rather than {verb}(to, f(x))"
        )
    if args is not None and not isinstance(args, (tuple, list)):
        raise TypeError(
            f"{verb}: args must be a tuple, got {type(args).__name__} {args!r:.60}; "
            f"for one argument write args=(x,)"
        )
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"{verb}: kwargs must be a dict, got {type(kwargs).__name__}")
    return _check_timeout(verb, timeout)


def _check_target(verb: str, to: object) -> None:
    names: Sequence[str] = _runtime.known_names()
    if isinstance(to, str):
        if to not in names:
            close = difflib.get_close_matches(to, names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UnknownWorkerError(
                f"{verb}: no worker is named {to!r}; {hint}this world has {list(names)}"
            )
    elif isinstance(to, int) and not isinstance(to, bool):
        if not 0 <= to < len(names):
            raise UnknownWorkerError(
                f"{verb}: no worker has rank {to}; ranks run from 0 to {len(names) - 1}"
            )
    elif not isinstance(to, WorkerInfo):
        raise TypeError(
            f"{verb}: 'to' must be a worker name, rank or WorkerInfo, got "
            f"{type(to).__name__} {to!r:.60}"
        )


def _check_timeout(verb: str, timeout: float | None) -> float:
    if timeout is None or timeout == _DEFAULT:
        return _DEFAULT
    return check_seconds(verb, timeout, hint=" (0: no timeout)")


def rpc_sync(
    to: Target,
    fn: Callable[..., Any],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float | None = None,
) -> Any:
    """Run `fn(*args, **kwargs)` on worker `to` and return its result.

    Example::

        total = asyncrpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
    """
    seconds = check_call("rpc_sync", to, fn, args, kwargs, timeout)
    return rpc.rpc_sync(to, fn, args=_tuple(args), kwargs=kwargs, timeout=seconds)


def rpc_async(
    to: Target,
    fn: Callable[..., Any],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float | None = None,
) -> Future[Any]:
    """Start `fn(*args, **kwargs)` on worker `to`; return a Future of its result.

    Example::

        fut = asyncrpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 1))
        print(fut.wait())
    """
    seconds = check_call("rpc_async", to, fn, args, kwargs, timeout)
    fut = rpc.rpc_async(to, fn, args=_tuple(args), kwargs=kwargs, timeout=seconds)
    return cast(Future[Any], fut)


def remote(
    to: Target,
    fn: Callable[..., Any],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float | None = None,
) -> rpc.RRef[Any]:
    """Run `fn(*args, **kwargs)` on worker `to` and keep the result there; return an RRef.

    Example::

        rref = asyncrpc.remote("worker1", torch.zeros, args=(3,))
        print(rref.to_here())
    """
    seconds = check_call("remote", to, fn, args, kwargs, timeout)
    rref = rpc.remote(to, fn, args=_tuple(args), kwargs=kwargs, timeout=seconds)
    return cast(rpc.RRef[Any], rref)


def _tuple(args: Sequence[Any] | None) -> tuple[Any, ...] | None:
    return None if args is None else tuple(args)
