"""The one call path: torch's `rpc_sync`, `rpc_async` and `remote`, same signatures.

These three, every handle verb, `call_all` and the Ensemble's shards all go
through `check` and `send`, and read their reply through one step, so a
mistake, a dead worker, a timeout or a remote exception is reported the same
way whichever verb made the call::

    caller                                            callee
    check: a world runs, `to` is known, func callable,
           args a tuple, kwargs a dict, timeout >= 0
    trace hook (one global read when not tracing)
    Python function: sent as run_python(func, ...)  ─> runs func; an exception
      (torch operators and TorchScript go as they      is returned as a Failure
      are)                                              value, type and all
    torch.distributed.rpc.rpc_async / remote
    reply read: wait(), value(), await           <──
      a Failure ─> raised (its own type, and RemoteError)
      torch's RuntimeError ─> CallTimeoutError, WorkerUnreachableError,
                              SerializationError, naming the worker
    rpc_sync from an RPC thread: refused when it would take the last free one

No callback runs per call: `rpc_async` returns torch's own Future, whose
value passes torch's unwrap hook (check_reply) and whose failure is named
when it is read (see asyncrpc/_core/_torch.py, name_future_failures); `rpc_sync`
reads the reply on the waiting thread.
"""

from __future__ import annotations

import difflib
import functools
import sys
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, NamedTuple, TypeAlias, TypeVar, cast, overload

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from . import _failures, _torch, _world
from ._errors import NestedCallError, UnknownWorkerError
from ._failures import check_reply, label_of
from ._futures import check_seconds, completed
from ._torch import WorkerInfo

__all__ = [
    "Call",
    "call_sync",
    "check",
    "check_timeout",
    "remote",
    "rpc_async",
    "rpc_sync",
    "run_python",
    "run_python_async",
    "send",
    "send_remote",
    "set_outgoing_hook",
]

T = TypeVar("T")
Target: TypeAlias = str | int | WorkerInfo
UNSET_RPC_TIMEOUT = _torch.UNSET_TIMEOUT


class Call(NamedTuple):
    """One checked call: where it goes, what runs there, and how errors name it."""

    worker: str  # the name of `to`
    to: Target
    func: Callable[..., Any]
    args: Sequence[Any] | None
    kwargs: Mapping[str, Any] | None
    seconds: float  # the timeout in torch's terms (-1: the world's default)
    label: object  # the function, or a text such as "Counter.add()"


# ---- the public verbs -----------------------------------------------------------------


@overload
def rpc_sync(
    to: Target,
    func: Callable[..., Coroutine[Any, Any, T]],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> T: ...
@overload
def rpc_sync(
    to: Target,
    func: Callable[..., T],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> T: ...
def rpc_sync(
    to: Target,
    func: Callable[..., Any],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Any:
    """Run `func(*args, **kwargs)` on worker `to` and return its result (torch's signature).

    Example::

        total = asyncrpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
    """
    return call_sync(check("rpc_sync", to, func, args, kwargs, timeout))


@overload
def rpc_async(
    to: Target,
    func: Callable[..., Coroutine[Any, Any, T]],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Future[T]: ...
@overload
def rpc_async(
    to: Target,
    func: Callable[..., T],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Future[T]: ...
def rpc_async(
    to: Target,
    func: Callable[..., Any],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Future[Any]:
    """Start `func(*args, **kwargs)` on worker `to`; a Future of its result (torch's signature).

    Example::

        fut = asyncrpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 1))
        print(fut.wait())
    """
    return send(check("rpc_async", to, func, args, kwargs, timeout))


def remote(
    to: Target,
    func: Callable[..., T],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> rpc.RRef[T]:
    """Run `func(*args, **kwargs)` on `to` and keep the result there: torch's `remote`.

    Returns torch's RRef, for a function and a class alike (to build an
    object and call its methods, `asyncrpc.spawn` gives a handle instead).

    Example::

        rref = asyncrpc.remote("worker1", torch.zeros, args=((3,),))
        print(rref.to_here())  # tensor([0., 0., 0.])
    """
    return send_remote(check("remote", to, func, args, kwargs, timeout))


# ---- checks ---------------------------------------------------------------------------


def check(
    verb: str,
    to: Any,
    func: Any,
    args: Any,
    kwargs: Any,
    timeout: float | None,
    label: object = None,
) -> Call:
    """Validate one call before anything is sent; `label` names it in errors (default: func)."""
    world = _world._world or _world.current_world(f"asyncrpc.{verb}")
    worker = _worker_name(verb, to, world.context.names)
    if world.infos or _torch.agent_running():  # peers may call before the agent is set
        to = world.info(worker)
    if not callable(func):
        raise TypeError(
            f"{verb}: got a {type(func).__name__} where a callable was expected; pass the "
            f"function itself: {verb}(to, f, args=(x,)) rather than {verb}(to, f(x))"
        )
    if args is not None and not isinstance(args, (tuple, list)):
        raise TypeError(
            f"{verb}: args must be a tuple, got {type(args).__name__} {args!r:.60}; "
            f"for one argument write args=(x,)"
        )
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"{verb}: kwargs must be a dict, got {type(kwargs).__name__}")
    seconds = check_timeout(verb, timeout)
    return Call(worker, to, func, args, kwargs, seconds, func if label is None else label)


def _worker_name(verb: str, to: object, names: Sequence[str]) -> str:
    if isinstance(to, str):
        if to not in names:
            close = difflib.get_close_matches(to, names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UnknownWorkerError(
                f"{verb}: no worker is named {to!r}; {hint}this world has {list(names)}"
            )
        return to
    if isinstance(to, int) and not isinstance(to, bool):
        if not 0 <= to < len(names):
            raise UnknownWorkerError(
                f"{verb}: no worker has rank {to}; ranks run from 0 to {len(names) - 1}"
            )
        return names[to]
    if isinstance(to, WorkerInfo):
        return _worker_name(verb, str(to.name), names)
    raise TypeError(
        f"{verb}: 'to' must be a worker name, rank or WorkerInfo, got "
        f"{type(to).__name__} {to!r:.60}"
    )


def check_timeout(verb: str, timeout: float | None) -> float:
    """A timeout in torch's terms: torch's -1 (or None) means the world's default."""
    if timeout is None or timeout == UNSET_RPC_TIMEOUT:
        return UNSET_RPC_TIMEOUT
    return check_seconds(verb, timeout, hint=" (0: no timeout)")


# ---- sending and reading the reply ----------------------------------------------------


def send(call: Call) -> Future[Any]:
    """torch's rpc_async for a checked call; the reply reads as the module doc says."""
    fut = _start(call)
    _torch.tag_future(fut, (call.worker, call.label))
    _torch.set_unwrap(fut, check_reply)
    if _failures.unwaited_logging():
        _failures.watch_unwaited(fut, call.worker, call.label)
    return fut


def _start(call: Call) -> Future[Any]:
    sent, replied = _traced(call.worker, call.func)
    sent, args, kwargs = _wrapped(sent, call.args, call.kwargs)
    try:
        if kwargs is None and isinstance(call.to, WorkerInfo) and sent in _RUNNERS:
            is_async = sent is run_python_async
            fut = _torch.send_python(call.to, sent, args or (), {}, call.seconds, is_async)
        else:
            fut = _torch.rpc_async(call.to, sent, args=args, kwargs=kwargs, timeout=call.seconds)
    except Exception as exc:
        _failures.raise_unsendable(exc, call.worker, call.label)
    if replied is not None:
        fut.add_done_callback(replied)
    return fut  # type: ignore[no-any-return]


def send_remote(call: Call) -> rpc.RRef[Any]:
    """torch's remote for a checked call; the owner keeps the value (or the exception)."""
    sent, replied = _traced(call.worker, call.func)
    args, kwargs, seconds = _tuple(call.args), call.kwargs, call.seconds
    try:
        rref = _torch.remote(call.to, sent, args=args, kwargs=kwargs, timeout=seconds)
    except Exception as exc:
        _failures.raise_unsendable(exc, call.worker, call.label)
    if replied is not None:
        _torch.rref_future(rref).add_done_callback(replied)
    return rref  # type: ignore[no-any-return]


def call_sync(call: Call) -> Any:
    """`send` and wait for the reply, refusing to block the last free RPC thread.

    The reply is read here, on the waiting thread: no callback runs per call.
    """
    with _holding_rpc_thread(call.worker, call.label):
        fut = _start(call)
        try:
            value = fut.wait()
        except BaseException as exc:
            named = _failures.name_failure(exc, call.worker, call.label)
            if named is exc:
                raise
            raise named from exc
    return check_reply(value)


# While a trace records (asyncrpc._trace), it swaps each outgoing function for a
# recording one and gets a callback for the reply; the core knows only this hook.
OutgoingHook: TypeAlias = Callable[
    [str, Callable[..., Any]], tuple[Callable[..., Any], Callable[[Any], None] | None]
]
_outgoing: OutgoingHook | None = None


def set_outgoing_hook(hook: OutgoingHook | None) -> None:
    """Have every call pass through `hook(worker, func) -> (sent, on_reply)`; None: off."""
    global _outgoing
    _outgoing = hook


def _traced(worker: str, func: Callable[..., Any]) -> tuple[Callable[..., Any], Any]:
    hook = _outgoing
    if hook is None:
        return func, None  # the common case costs one global read
    return hook(worker, func)


def _wrapped(
    func: Callable[..., Any], args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
) -> tuple[Callable[..., Any], tuple[Any, ...] | None, Mapping[str, Any] | None]:
    """A Python function goes inside run_python so that its exception keeps its type."""
    target = _torch.async_target(func)
    if _torch.is_builtin(func) or isinstance(func, torch.jit.ScriptFunction):
        return func, _tuple(args), kwargs
    if isinstance(target, torch.jit.ScriptFunction):
        return func, _tuple(args), kwargs
    runner = run_python if target is None else run_python_async
    return runner, (func, _tuple(args) or (), dict(kwargs or {})), None


def _tuple(args: Sequence[Any] | None) -> tuple[Any, ...] | None:
    return None if args is None else tuple(args)


# ---- the callee's side ----------------------------------------------------------------


def run_python(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run a called function on the callee; an exception becomes the call's value.

    As torch does, the callee also writes the error to its stderr.
    """
    try:
        return func(*args, **kwargs)
    except Exception as exc:
        failure = _failures.capture(exc, _world.describe_self(), func)
        print(failure.msg, file=sys.stderr, flush=True)
        return failure


def run_python_async(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Future[Any]:
    """run_python for an async_execution function: its Future's failure becomes a value."""
    try:
        fut = func(*args, **kwargs)
    except Exception as exc:
        return completed(_failures.capture(exc, _world.describe_self(), func))
    if not isinstance(fut, _torch.FutureType):
        return fut  # type: ignore[no-any-return]  # torch's own check reports it
    return cast(Future[Any], fut.then(functools.partial(_settle_remote, func)))


_torch.mark_async(run_python_async, run_python_async)
_RUNNERS = (run_python, run_python_async)


def _settle_remote(func: Callable[..., Any], fut: Future[Any]) -> Any:
    try:
        return fut.wait()
    except Exception as exc:
        return _failures.capture(exc, _world.describe_self(), func)


# ---- blocking calls from RPC threads --------------------------------------------------


class _RpcThreads:
    """How many of this process's RPC threads wait in a nested blocking call."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.blocked = 0


_rpc_threads = _RpcThreads()


class _holding_rpc_thread:
    """Count a blocking wait made on an RPC thread; refuse the one that takes the last."""

    def __init__(self, worker: str, label: object) -> None:
        self.nested = _torch.is_rpc_thread()
        self.worker, self.label = worker, label

    def __enter__(self) -> None:
        if not self.nested:
            return
        limit = _world.current_world("rpc_sync").threads - 1
        with _rpc_threads.lock:
            if _rpc_threads.blocked >= limit:
                raise NestedCallError(
                    f"rpc_sync of {label_of(self.label)} to {self.worker!r} from inside an RPC "
                    f"would block the last free RPC thread of this worker ({limit} of "
                    f"{limit + 1} already wait in nested rpc_sync calls), and the worker would "
                    "stall until they time out; make the function @asyncrpc.async_execution "
                    "and return or await rpc_async(...) instead of calling rpc_sync"
                )
            _rpc_threads.blocked += 1

    def __exit__(self, *exc: object) -> None:
        if self.nested:
            with _rpc_threads.lock:
                _rpc_threads.blocked -= 1
