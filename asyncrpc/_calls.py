"""Checked RPC calls: torch's `rpc_sync`, `rpc_async` and `remote`, same signatures.

The checks run on the caller before anything is sent, so a mistake fails
at once with a message instead of a remote error or a timeout::

    caller: check world running, `to` known, `fn` callable, args a tuple,
            timeout finite and >= 0  --> torch.distributed.rpc.<verb>(...)
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias, cast

import torch.distributed.rpc as rpc
from torch._C._distributed_rpc import WorkerInfo
from torch.futures import Future

from . import _runtime, _trace
from ._errors import (
    CallTimeoutError,
    NestedCallError,
    NotInitializedError,
    SerializationError,
    UnknownWorkerError,
    WorkerUnreachableError,
)
from ._futures import check_seconds

__all__ = [
    "call_async",
    "call_sync",
    "check_call",
    "check_timeout",
    "explain_failure",
    "remote_function",
    "rpc_async",
    "rpc_sync",
]

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
    return check_timeout(verb, timeout)


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


def check_timeout(verb: str, timeout: float | None) -> float:
    """A timeout in torch's terms: None (or torch's -1) means the world's default."""
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
    return call_sync(to, fn, args, kwargs, timeout, fn)


def call_sync(
    to: Target,
    fn: Callable[..., Any],
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    timeout: float | None,
    label: object,
) -> Any:
    """rpc_sync, with `label` naming the call in errors (a handle's method, say)."""
    seconds = check_call("rpc_sync", to, fn, args, kwargs, timeout)
    with _holding_rpc_thread(to, label):
        fut = _send(to, fn, args, kwargs, seconds, label)
        try:
            return fut.wait()
        except RuntimeError as exc:
            raise explain_failure(exc, to, label) from None


class _RpcThreads:
    """How many of this process's RPC threads wait in a nested blocking call."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.blocked = 0


_rpc_threads = _RpcThreads()


class _holding_rpc_thread:
    """Count a blocking call made from an RPC thread; refuse the one that takes the last."""

    def __init__(self, to: object, label: object) -> None:
        # torch's RPC threads are not Python threads: Python sees them as dummies.
        self.nested = isinstance(threading.current_thread(), threading._DummyThread)
        self.to, self.label = to, label

    def __enter__(self) -> None:
        if not self.nested:
            return
        limit = _runtime.current_settings().num_worker_threads - 1
        with _rpc_threads.lock:
            if _rpc_threads.blocked >= limit:
                raise NestedCallError(
                    f"rpc_sync of {_fn_name(self.label)} to {_name_of(self.to)!r} from inside an "
                    f"RPC would block the last free RPC thread of this worker ({limit} of "
                    f"{limit + 1} already wait in nested rpc_sync calls), and the worker would "
                    "stall until they time out; make the function @asyncrpc.async_execution "
                    "and return or await rpc_async(...) instead of calling rpc_sync"
                )
            _rpc_threads.blocked += 1

    def __exit__(self, *exc: object) -> None:
        if self.nested:
            with _rpc_threads.lock:
                _rpc_threads.blocked -= 1


def _unsendable(exc: BaseException, to: object, fn: object) -> BaseException:
    if "pickle" not in str(exc).lower():
        return exc
    return SerializationError(
        f"the arguments of {_fn_name(fn)} could not be sent to {_name_of(to)!r}: {exc}; "
        "pass tensors, numbers, strings and containers of them, or objects of classes "
        "both sides can import (keep others on their owner with asyncrpc.remote)"
    )


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
    # No wrapper Future here: a Python callback per call costs ~8% of a burst's
    # throughput. Handle calls (call_async) name a dead worker; see explain_failure.
    seconds = check_call("rpc_async", to, fn, args, kwargs, timeout)
    return _send(to, fn, args, kwargs, seconds, fn)


def _send(
    to: Target,
    fn: Callable[..., Any],
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    seconds: float,
    label: object,
) -> Future[Any]:
    """torch's rpc_async; arguments that cannot be pickled raise SerializationError."""
    sent, replied = _traced(to, fn)
    try:
        fut = rpc.rpc_async(to, sent, args=_tuple(args), kwargs=kwargs, timeout=seconds)
    except (TypeError, AttributeError) as exc:
        raise _unsendable(exc, to, label) from exc
    if replied is not None:
        fut.add_done_callback(replied)
    return cast(Future[Any], fut)


def call_async(
    to: Target,
    fn: Callable[..., Any],
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    timeout: float | None,
    label: object,
) -> Future[Any]:
    """rpc_async, with `label` naming the call in errors (a handle's method, say)."""
    fut = rpc_async(to, fn, args, kwargs, timeout)
    out: Future[Any] = Future()

    def settle(done: Future[Any]) -> None:
        try:
            out.set_result(done.wait())
        except BaseException as exc:  # every outcome must reach `out`
            out.set_exception(explain_failure(exc, to, label))

    fut.add_done_callback(settle)
    return out


def explain_failure(exc: BaseException, to: object, fn: object) -> BaseException:
    """Name the worker when a call failed because it is unreachable or too slow.

    Other errors (the remote function raised) come back unchanged.
    """
    text = str(exc)
    if "originated at tensorpipe/" in text or "Connection reset" in text:
        name = _name_of(to)
        err: BaseException = WorkerUnreachableError(
            f"worker {name!r} cannot be reached, so the call to {_fn_name(fn)} failed; it "
            f"has probably died (its own output or the launcher says why). Transport: "
            f"{text.splitlines()[0] if text else type(exc).__name__}",
            name,
        )
    elif "ran for more than set timeout" in text:
        name = _name_of(to)
        err = CallTimeoutError(
            f"the call to {_fn_name(fn)} on worker {name!r} timed out: {text.splitlines()[0]}; "
            f"pass a larger timeout=..., or check that {name!r} is not stuck",
            name,
        )
    elif "pickle" in text.lower() and "serialize" in text:
        first = text.splitlines()[0]
        err = SerializationError(
            f"the result of {_fn_name(fn)} on {_name_of(to)!r}, or the exception it raised, "
            f"could not be sent back: {first}; return tensors or plain data (keep other "
            "objects on the worker with asyncrpc.remote) and raise exceptions of built-in "
            "types or of classes the caller can import"
        )
    elif "deserialize" in text and ("No module named" in text or "Can't get attribute" in text):
        first = text.splitlines()[0]
        err = SerializationError(
            f"the reply of {_name_of(to)!r} to {_fn_name(fn)} could not be unpickled here: "
            f"{first}; it holds an object (often a raised exception) of a class this process "
            "cannot import. Make that module importable on the caller too; the worker's "
            "output shows the original error"
        )
    else:
        return exc
    err.__cause__ = exc
    return err


def _name_of(to: object) -> str:
    if isinstance(to, WorkerInfo):
        return str(to.name)
    if isinstance(to, int):
        names = _runtime.known_names()
        return names[to] if 0 <= to < len(names) else str(to)
    return str(to)


def _fn_name(fn: object) -> str:
    if isinstance(fn, str):
        return fn
    return f"{getattr(fn, '__qualname__', type(fn).__name__)}()"


def remote_function(
    to: Target,
    fn: Callable[..., Any],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float | None = None,
) -> rpc.RRef[Any]:
    """Run `fn(*args, **kwargs)` on worker `to` and keep the result there; return an RRef."""
    seconds = check_call("remote", to, fn, args, kwargs, timeout)
    sent, replied = _traced(to, fn)
    rref = rpc.remote(to, sent, args=_tuple(args), kwargs=kwargs, timeout=seconds)
    if replied is not None:
        rref._get_future().add_done_callback(replied)
    return cast(rpc.RRef[Any], rref)


def _traced(to: Target, fn: Callable[..., Any]) -> tuple[Callable[..., Any], Any]:
    if not _trace.recording():
        return fn, None  # the common case costs one global read
    return _trace.outgoing(_name_of(to), fn)


def _tuple(args: Sequence[Any] | None) -> tuple[Any, ...] | None:
    return None if args is None else tuple(args)
