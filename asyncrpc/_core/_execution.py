"""What runs on the callee: the kind of a callable, its runner, and `async_execution`.

`classify` decides once, for every verb, how a callable is sent and run:
torch operators and TorchScript functions go as torch sends them; a Python
function runs inside `run_python`; an `async_execution` function, an
`async def` or a coroutine-returning callable runs inside `run_python_async`,
which hands torch a Future and frees the RPC thread::

    caller            callee (worker1)                            worker2
    rpc_async ----->  run_python_async(f, ...) on an RPC thread
                        async def: runs until `await fut` -------> nested call
                        returns Future `out`; the thread is free
                      ... reply from worker2 completes `fut`  <--
                        its done-callback resumes the coroutine (_Task)
                        return value, or a Failure -> `out` completes
    result    <-----  torch sends `out`'s value

A failure becomes the reply's value, a `Failure` (see `_failures`). Its
form is decided per call: asyncrpc's runners ask for asyncrpc's form; when
a plain torch caller calls one of our async_execution functions directly,
the Failure crosses as torch's `RemoteException`, which torch raises there.

torch Futures become awaitable (`await fut`, see `_futures.enable_await`)
once asyncrpc needs it; inside a coroutine run here, `await` suspends it
until the Future is done and its `_Task` resumes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import functools
import inspect
import sys
import threading
import weakref
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar, cast

import torch
from torch.futures import Future

from . import _cancel, _loop, _objects, _promised, _runtime, _torch, _watcher
from ._errors import CancelledError, NotAFutureError
from ._failures import Failure, capture, check_reply, label_of
from ._futures import await_future, completed, new_future
from ._sendable import check_sendable
from ._world import current_world, describe_self

__all__ = [
    "DESCRIBE_CALL",
    "ON_LOOP",
    "ON_SKIPPED",
    "Kind",
    "async_execution",
    "call_capturing",
    "classify",
    "made_early",
    "outcome_of",
    "run_python",
    "run_python_async",
    "runs_on_loop",
    "settle_future",
    "start_coroutine",
    "torch_called",
]

F = TypeVar("F")

_AWAITABLES = (
    "rpc_async(...), rref.rpc_async().method(...), fut.then(...) or torch.futures.Future()"
)


class Kind(enum.Enum):
    """How a callable is sent and run (see `classify`)."""

    TORCH = "torch"  # a torch operator or TorchScript function: sent as torch sends it
    SYNC = "sync"  # a Python function: runs on an RPC thread; its value is the reply
    ASYNC = "async"  # async_execution, async def: runs without holding the RPC thread


_kinds: weakref.WeakKeyDictionary[Any, Kind] = weakref.WeakKeyDictionary()


def classify(func: object) -> Kind:
    """The kind of `func`: every verb, Batch and handle asks this, and only this."""
    try:
        return _kinds[func]
    except (KeyError, TypeError):  # not seen yet, or not weakly referable
        kind = _classify(func)
    try:
        _kinds[func] = kind  # a function's kind does not change: asked once per function
    except TypeError:
        pass
    return kind


def _classify(func: object) -> Kind:
    target = _torch.async_target(func)
    if _torch.is_builtin(func) or isinstance(func, torch.jit.ScriptFunction):
        return Kind.TORCH
    if isinstance(target, torch.jit.ScriptFunction):
        return Kind.TORCH  # torch runs an async TorchScript function by its name
    if target is not None or _is_coroutine_function(func):
        return Kind.ASYNC
    return Kind.SYNC


def _is_coroutine_function(func: object) -> bool:
    call = None if inspect.isroutine(func) else getattr(func, "__call__", None)  # noqa: B004
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(call)


def runs_on_loop(func: object, args: Sequence[Any] | None = ()) -> bool:
    """Whether a call of `func(*args)` runs as a coroutine on its worker's event loop.

    A runner's function may answer for itself (`ON_LOOP`: a handle's method call
    runs on the loop when the method is a coroutine function).
    """
    answer = getattr(func, ON_LOOP, None)
    if answer is not None:
        try:
            return bool(answer(*(args or ())))
        except Exception:  # only a question: never fail the call for it
            return False
    return _is_coroutine_function(func) or _is_coroutine_function(_torch.async_target(func))


# ---- the runners: what an asyncrpc call runs on the callee ---------------------------


def _meet_world() -> None:
    # A worker that only serves calls in a world torch started meets it here: from
    # then on it hears cancels and answers asyncrpc-dump (its watcher runs).
    if not _watcher.watching():
        with contextlib.suppress(Exception):
            current_world("a call")


def run_python(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], key: int = 0
) -> Any:
    """Run a called function on the callee; an exception becomes the call's value.

    `key` names the call for cancellation (0: none). As torch does, the
    callee also writes the error to its stderr.
    """
    _meet_world()
    _runtime.THREAD.replying = None  # a call before this one is replied to by now
    state = _cancel.begin(key, (func, args)) if key else None
    if key and state is None:
        return _cancelled(func, args, before=True)
    outer = _cancel.enter(state)
    try:
        value = call_capturing(func, args, kwargs, _called(func, args))
    finally:
        _cancel.enter(outer)
        if state is not None:
            _cancel.end(state)
    if state is not None:
        if state.cancelled:
            value = _cancelled(func, args)
        _cancel.hand_over(state, value)
    if key:  # torch pickles `value` next, on this thread: an RRef in it goes to the caller
        _runtime.THREAD.replying = key >> _cancel.KEY_BITS
    return value


# The Future an async_execution wrapper returns next goes straight back to an
# asyncrpc caller (run_python_async asks): it carries failures in asyncrpc's form.


def run_python_async(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], key: int = 0
) -> Future[Any]:
    """Run an async callable on the callee; a Future of its value or its Failure.

    The Task or Future the call makes takes charge of its cancellation (`key`).
    """
    _meet_world()
    state = _cancel.begin(key, (func, args)) if key else None
    if key and state is None:
        return completed(_cancelled(func, args, before=True))
    outer = _cancel.enter(state)
    thread = _runtime.THREAD
    thread.asked, thread.made = True, None
    try:
        result = func(*args, **kwargs)
    except Exception as exc:
        result = completed(_captured(exc, _called(func, args), False))
    finally:
        made, thread.asked, thread.made = thread.made, False, None
        _cancel.enter(outer)
        if state is not None:
            state.thread = None  # from here it runs on callbacks, not on this RPC thread
    if inspect.iscoroutine(result):
        return start_coroutine(result, _called(func, args), state=state)
    if not isinstance(result, _torch.FutureType):
        result = completed(result)
    if result is made and (state is None or state.on_cancel is not None):
        return cast(Future[Any], result)  # ours: in asyncrpc's form, in charge of the call
    return settle_future(result, _called(func, args), state=state)


def run_resolved(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], key: int = 0
) -> Future[Any]:
    """Run a call whose top-level arguments hold ObjectRefs once each is its value.

    Values already here run it at once, on this RPC thread; a value to fetch
    runs it where the last fetch ends (an `asyncrpc-fetch` thread), so no RPC
    thread waits. A ref that cannot be read fails the call with its error.
    """
    ready = _objects.resolving(args, kwargs)
    if ready.done():
        return _run_resolved(func, key, ready)
    out = new_future()
    _torch.add_callback(ready, functools.partial(_run_then_reply, func, key, out))
    return out


def _run_resolved(func: Callable[..., Any], key: int, ready: Future[Any]) -> Future[Any]:
    value = _promised.outcome(ready)  # (args, kwargs), or the Failure of an argument
    if isinstance(value, Failure):
        return completed(_captured(value.error, _called(func, ()), False))
    args, kwargs = value
    return run_python_async(func, args, kwargs, key)


def _run_then_reply(func: Callable[..., Any], key: int, out: Future[Any], ready: Any) -> None:
    inner = _run_resolved(func, key, ready)
    label = _called(func, ())
    _torch.add_callback(inner, lambda done: out.set_result(outcome_of(done, label)))


_torch.mark_async(run_resolved, run_resolved)


def call_capturing(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], label: object
) -> Any:
    """`func(*args, **kwargs)`, or the Failure it raised (written to stderr, as torch does)."""
    try:
        return func(*args, **kwargs)
    except Exception as exc:
        value = _captured(exc, label, False)
        text = getattr(value.error, "remote_text", value.error)
        with contextlib.suppress(Exception):  # a closed stderr must not fail the call
            print(text, file=sys.stderr, flush=True)
        return value


def _cancelled(func: Callable[..., Any], args: tuple[Any, ...], before: bool = False) -> Failure:
    """The reply of a cancelled call, naming this worker and the function."""
    skipped = getattr(func, ON_SKIPPED, None) if before else None
    if skipped is not None:  # it holds a place in a queue (a mailbox's order): give it up
        with contextlib.suppress(Exception):
            skipped(*args)
    return Failure(cancelled_error(_called(func, args), before))


def cancelled_error(func: object, before: bool = False) -> CancelledError:
    """CancelledError for a call of `func` on this worker."""
    when = " before it started" if before else ""
    name = describe_self()
    me = name.split("'")[1] if name.count("'") >= 2 else name
    return CancelledError(f"the call to {label_of(func)} on {name} was cancelled{when}", me)


# A runner's function may say what a call of it is, for messages: a handle's owner
# side names the object's method rather than itself (see _handles).
DESCRIBE_CALL = "_asyncrpc_describe_call"
# ... and what to do with a call of it that was cancelled before it started, which
# never runs it: a mailbox's call gives up its place in its caller's order (_mailbox).
ON_SKIPPED = "_asyncrpc_on_skipped"
# ... and whether a call of it runs on the event loop (see `runs_on_loop`).
ON_LOOP = "_asyncrpc_on_loop"


def _called(func: Callable[..., Any], args: tuple[Any, ...]) -> object:
    describe = getattr(func, DESCRIBE_CALL, None)
    if describe is None:
        return func
    try:
        return describe(*args)
    except Exception:  # naming must never fail a call
        return func


_torch.mark_async(run_python_async, run_python_async)


def torch_called() -> bool:
    """Called as one of our wrappers starts: False when run_python_async called it."""
    thread = _runtime.THREAD
    asked = thread.asked
    thread.asked = False
    return not asked


def made_early(out: Future[Any], for_torch: bool) -> Future[Any]:
    """`out` is the reply of the call run_python_async runs: it returns it as it is."""
    if not for_torch:
        _runtime.THREAD.made = out
    return out


def settle_future(
    fut: Any, fn: object, for_torch: bool = False, state: _cancel.Running | None = None
) -> Future[Any]:
    """`fut`'s outcome as a new Future whose failure is a Failure value (named here).

    With `state` (the call it answers, if nobody took charge of it yet), the
    outcome of a cancelled call is CancelledError, and cancelling the call
    cancels `fut` where asyncrpc can.
    """
    state = state if state is not None else _cancel.current()
    owned = state is not None and _cancel.claim(state, lambda: _torch.cancel(fut))
    out: Future[Any] = fut.then(
        functools.partial(_capture_outcome, fn, for_torch, state if owned else None)
    )
    _torch.set_unwrap(out, check_reply)
    _torch.combine(out, [fut])
    return out


def outcome_of(fut: Future[Any], fn: object) -> Any:
    """The value of a done `fut`, or the Failure its read raised (named here as `fn`)."""
    return _capture_outcome(fn, False, None, fut)


def _capture_outcome(
    fn: object, for_torch: bool, state: _cancel.Running | None, fut: Future[Any]
) -> Any:
    try:
        value = fut.wait()
    except BaseException as exc:  # torch would keep it in the Future: carry it as a value
        value = _captured(exc, fn, for_torch)
    if state is not None:
        _cancel.end(state)
        if state.cancelled:
            value = Failure(cancelled_error(fn), for_torch)
        _cancel.hand_over(state, value)
    return value


def _captured(error: BaseException, fn: object, for_torch: bool) -> Any:
    """`capture`, which must give the caller an outcome even if capturing fails."""
    try:
        return capture(error, describe_self(), fn, for_torch)
    except BaseException as inner:
        lost = RuntimeError(
            f"{label_of(fn)} failed with {type(error).__name__}, and that error could not be "
            f"kept to send back ({type(inner).__name__}: {inner})"
        )
        return Failure(lost, for_torch)


# ---- async_execution -------------------------------------------------------------------


def async_execution(fn: F) -> F:
    """Mark a function whose result arrives later, so that no RPC thread waits for it.

    A drop-in for `torch.distributed.rpc.functions.async_execution`: `fn` may
    return a torch Future (from `rpc_async`, `then`, `Future()`), or be an
    `async def` that awaits torch Futures (asyncrpc's verbs also run an
    undecorated `async def` this way). Works on functions, methods (through
    RRef proxies too), `staticmethod`/`classmethod` in either decorator
    order, and `@torch.jit.script` functions returning `Future[T]` (this
    decorator outermost).

    Example::

        @asyncrpc.async_execution
        async def add_chained(to, x, y, z):
            s = await asyncrpc.rpc_async(to, torch.add, args=(x, y))
            return s + z

        asyncrpc.rpc_sync("worker1", add_chained, args=("worker2", torch.ones(2), 1, 1))
        # tensor([3., 3.])
    """
    if isinstance(fn, (staticmethod, classmethod)):
        return cast(F, type(fn)(async_execution(fn.__func__)))
    if inspect.iscoroutinefunction(fn):
        wrapper = _wrap_coroutine(fn)
    elif callable(fn):  # a function or a TorchScript function returning a Future
        wrapper = _wrap_returning_future(fn)
    else:
        raise TypeError(
            f"async_execution expects a function, got {type(fn).__name__} {fn!r}; "
            f"decorate the def itself: @asyncrpc.async_execution above `def` or `async def`"
        )
    _torch.mark_async(wrapper, fn)
    return cast(F, wrapper)


def _wrap_returning_future(fn: Callable[..., Any]) -> Callable[..., Future[Any]]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Future[Any]:
        for_torch = torch_called()
        fut = fn(*args, **kwargs)
        if not isinstance(fut, _torch.FutureType):
            raise NotAFutureError(
                f"Functions decorated with @rpc.async_function must return a "
                f"torch.futures.Future object, but {_name(fn)} returned "
                f"{type(fut).__name__} {_short(fut)}; return {_AWAITABLES}, "
                f"or write it as `async def` and return the value"
            )
        return made_early(settle_future(fut, fn, for_torch), for_torch)

    return wrapper


def _wrap_coroutine(fn: Callable[..., Coroutine[Any, Any, Any]]) -> Callable[..., Future[Any]]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Future[Any]:
        for_torch = torch_called()
        return made_early(start_coroutine(fn(*args, **kwargs), fn, for_torch), for_torch)

    return wrapper


def start_coroutine(
    coro: Coroutine[Any, Any, Any],
    fn: object,
    for_torch: bool = False,
    state: _cancel.Running | None = None,
    within: _cancel.Running | None = None,
    reply: bool = True,
) -> Future[Any]:
    """Run `coro` as a Task on the world's event loop; a Future of its result (or Failure).

    The coroutine takes charge of the call it runs for (`state`, by default
    this thread's current call, if nobody did yet): cancelling that call
    cancels its Task at its current `await`. Cancelling the returned Future
    does too. `within`: the call it runs for, whose cancel someone else has
    taken charge of (a mailbox's job), and which cancels the Future.
    `reply`: its value is a call's reply, checked before torch pickles it.
    """
    _torch.install_await(await_future)  # until the world's shutdown (enable_await: for good)
    out = new_future()
    task = _Task(coro, out, fn, for_torch, reply)
    state = state if state is not None else _cancel.current()
    if within is None and state is not None and _cancel.claim(state, task.cancel):
        within = state
    if within is not None:
        task.state = within
        within.coro = coro  # where it waits, for asyncrpc-dump
        within.thread = None  # it runs on the loop's thread, not on an RPC thread
    _torch.set_canceller(out, task.cancel)
    _loop.submit(task.start)
    return out


class _Task:
    """Runs one coroutine as an asyncio Task on the world's loop and settles its Future.

    Cancelling (from any thread) cancels the Task at its current `await`
    (asyncio's `CancelledError` there, and the torch Future it awaited is
    cancelled too: the next hop stops); the reply, a CancelledError, goes
    once the coroutine has run its `finally` blocks.
    """

    __slots__ = (
        "__weakref__",  # its cancel is held weakly (see _torch.set_canceller)
        "_cancelled",
        "_coro",
        "_fn",
        "_for_torch",
        "_lock",
        "_out",
        "_reply",
        "_settled",
        "_task",
        "state",
    )

    def __init__(
        self,
        coro: Coroutine[Any, Any, Any],
        out: Future[Any],
        fn: object,
        for_torch: bool,
        reply: bool,
    ) -> None:
        self._reply = reply
        self._coro = coro
        self._out = out
        self._fn = fn
        self._for_torch = for_torch
        self._lock = threading.Lock()
        self._task: asyncio.Task[Any] | None = None
        self._cancelled = self._settled = False
        self.state: _cancel.Running | None = None

    def start(self) -> None:
        """On the loop: start the Task (or, cancelled before, settle without running)."""
        if self._cancelled:
            self._coro.close()
            self._settle(None)
            return
        context = contextvars.copy_context()
        context.run(_runtime.TASK_CALL.set, self.state)  # asyncrpc.cancelled() inside it
        coro = _contained(self._coro, self._fn)
        self._task = asyncio.get_running_loop().create_task(coro, context=context)
        self._task.add_done_callback(self._settle)

    def cancel(self) -> bool:
        """Cancel the coroutine at its `await`; False when it has finished (its outcome stands)."""
        with self._lock:
            if self._settled or self._cancelled:
                return not self._settled
            self._cancelled = True
            if self.state is not None:
                self.state.cancelled = True
        with contextlib.suppress(RuntimeError):  # the world's loop has closed
            _loop.submit(self._cancel_task)
        return True

    def _cancel_task(self) -> None:
        if self._task is not None:
            self._task.cancel(f"{_name(self._fn)} was cancelled")

    def _settle(self, task: asyncio.Task[Any] | None) -> None:
        with self._lock:
            if self._settled:
                return
            self._settled = True
        if self.state is not None:
            _cancel.end(self.state)
        reply = self._outcome(task)
        if self.state is not None:
            _cancel.hand_over(self.state, reply)
        self._out.set_result(reply)

    def _outcome(self, task: asyncio.Task[Any] | None) -> Any:
        cancelled = self._cancelled or (self.state is not None and self.state.cancelled)
        if task is None or cancelled or task.cancelled():
            return Failure(cancelled_error(self._fn), self._for_torch)
        error = task.exception()
        if error is not None:
            return _captured(error, self._fn, self._for_torch)
        return check_sendable(task.result(), self._fn) if self._reply else task.result()


async def _contained(coro: Coroutine[Any, Any, Any], fn: object) -> Any:
    """`coro`'s outcome; a SystemExit or KeyboardInterrupt it raises fails its call as a
    RuntimeError (asyncio would end the worker's event loop with it)."""
    try:
        return await coro
    except (SystemExit, KeyboardInterrupt) as exc:
        raise RuntimeError(f"{_name(fn)} raised {type(exc).__name__}: {exc}") from exc


def _name(fn: object) -> str:
    return label_of(fn)


def _short(value: object) -> str:
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."
