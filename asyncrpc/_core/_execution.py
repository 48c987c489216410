"""`async_execution`: remote functions that return a Future, or are `async def`.

A callee thread that blocks on a nested RPC is lost until the reply comes;
with every RPC thread blocked that way the callee deadlocks. An
`async_execution` function instead hands torch a Future and returns at once;
torch sends the reply when that Future completes::

    caller            callee (worker1)                            worker2
    rpc_async ----->  f(...) runs on an RPC thread
                        async def: runs until `await fut` -------> nested call
                        returns Future `out`; the thread is free
                      ... reply from worker2 completes `fut`  <--
                        its done-callback resumes the coroutine
                        return value -> `out` completes
    result    <-----  torch sends `out`'s value

Failures travel as a `Failure` value (see `_failures`): an asyncrpc caller
raises the exception with its own type, a plain torch caller a RuntimeError
naming it; locally the Future's `wait()` raises it.

torch Futures become awaitable (`await fut`, see `_futures.enable_await`)
once asyncrpc needs it: when an `async def` is decorated here or a world
starts (or is adopted). Inside an `async_execution` coroutine the coroutine
is suspended until the Future is done; its `_Task` resumes it.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, cast

import torch
from torch.futures import Future

from . import _failures, _torch
from ._errors import AwaitedNonFutureError, NotAFutureError
from ._futures import driving, enable_await

__all__ = ["async_execution", "start_coroutine"]

F = TypeVar("F")

_AWAITABLES = (
    "rpc_async(...), rref.rpc_async().method(...), fut.then(...) or torch.futures.Future()"
)


def async_execution(fn: F) -> F:
    """Mark a function whose result arrives later, so that no RPC thread waits for it.

    A drop-in for `torch.distributed.rpc.functions.async_execution`: `fn` may
    return a torch Future (from `rpc_async`, `then`, `Future()`), or be an
    `async def` that awaits torch Futures. Works on functions, methods
    (through RRef proxies too), `staticmethod`/`classmethod` in either
    decorator order, and `@torch.jit.script` functions returning
    `Future[T]` (this decorator outermost).

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
    if isinstance(fn, torch.jit.ScriptFunction):
        wrapper = _wrap_script(fn)
    elif inspect.iscoroutinefunction(fn):
        wrapper = _wrap_coroutine(fn)
    elif callable(fn):
        wrapper = _wrap_returning_future(fn)
    else:
        raise TypeError(
            f"async_execution expects a function, got {type(fn).__name__} {fn!r}; "
            f"decorate the def itself: @asyncrpc.async_execution above `def` or `async def`"
        )
    _torch.mark_async(wrapper, fn)
    return cast(F, wrapper)


def _wrap_script(fn: torch.jit.ScriptFunction[Any, Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


def _wrap_returning_future(fn: Callable[..., Any]) -> Callable[..., Future[Any]]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Future[Any]:
        fut = fn(*args, **kwargs)
        if not isinstance(fut, _torch.FutureType):
            raise NotAFutureError(
                f"Functions decorated with @rpc.async_function must return a "
                f"torch.futures.Future object, but {_name(fn)} returned "
                f"{type(fut).__name__} {_short(fut)}; return {_AWAITABLES}, "
                f"or write it as `async def` and return the value"
            )
        # A failure becomes the reply's value (a Failure), so that it crosses to the
        # caller with its type; a local wait() raises it.
        out = fut.then(functools.partial(_capture_outcome, fn))
        _torch.set_unwrap(out, _failures.check_reply)
        return cast(Future[Any], out)

    return wrapper


def _wrap_coroutine(fn: Callable[..., Coroutine[Any, Any, Any]]) -> Callable[..., Future[Any]]:
    enable_await()

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Future[Any]:
        return start_coroutine(fn(*args, **kwargs), fn)

    return wrapper


def start_coroutine(coro: Coroutine[Any, Any, Any], fn: object) -> Future[Any]:
    """Run `coro` on this thread until it awaits; a Future of its result (or Failure)."""
    out: Future[Any] = Future()
    _torch.set_unwrap(out, _failures.check_reply)
    _Task(coro, out, fn).step()
    return out


class _Task:
    """Drives one coroutine: each awaited torch Future resumes it from its done-callback."""

    __slots__ = ("_coro", "_fn", "_name", "_out")

    def __init__(self, coro: Coroutine[Any, Any, Any], out: Future[Any], fn: object) -> None:
        self._coro = coro
        self._out = out
        self._fn = fn
        self._name = _name(fn)

    def step(self, error: BaseException | None = None) -> None:
        outer, driving.active = getattr(driving, "active", False), True
        try:
            awaited = self._coro.throw(error) if error else self._coro.send(None)
        except StopIteration as stop:
            self._out.set_result(stop.value)
            return
        except BaseException as exc:  # every failure must reach the caller
            failure = _failures.capture_for_torch(self._explain(exc), _describe_self(), self._fn)
            self._out.set_result(failure)
            return
        finally:
            driving.active = outer
        if isinstance(awaited, _torch.FutureType):
            awaited.add_done_callback(self._resume)
        else:
            self.step(self._not_a_future(awaited))

    def _resume(self, _: Future[Any]) -> None:
        self.step()

    def _not_a_future(self, awaited: object) -> AwaitedNonFutureError:
        what = "an asyncio Future" if asyncio.isfuture(awaited) else _short(awaited)
        return AwaitedNonFutureError(
            f"{self._name} awaited {what}, which RPC threads cannot wait for (they run "
            f"no event loop); await a torch Future instead: {_AWAITABLES}"
        )

    def _explain(self, exc: BaseException) -> BaseException:
        if isinstance(exc, TypeError) and "can't be used in 'await' expression" in str(exc):
            err = AwaitedNonFutureError(
                f"{self._name}: {exc}; only torch Futures can be awaited here: {_AWAITABLES}"
            )
            err.__cause__ = exc
            return err
        if isinstance(exc, RuntimeError) and "no running event loop" in str(exc):
            err = AwaitedNonFutureError(
                f"{self._name}: asyncio needs an event loop, and RPC threads run no event loop "
                f"({exc}); await a torch Future instead: {_AWAITABLES}"
            )
            err.__cause__ = exc
            return err
        return exc


def _capture_outcome(fn: object, fut: Future[Any]) -> Any:
    try:
        return fut.wait()
    except Exception as exc:
        return _failures.capture_for_torch(exc, _describe_self(), fn)


def _describe_self() -> str:
    from ._world import describe_self  # _world imports this module

    return describe_self()


def _name(fn: object) -> str:
    return f"{getattr(fn, '__qualname__', fn)}()"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
