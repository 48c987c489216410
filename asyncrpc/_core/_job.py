"""One method call in an object's mailbox: it waits for its turn, runs, replies once.

A `Job` is made on the owner for each call a handle sends (see `_mailbox`,
which decides when it starts). However it ends (its method's value or
error, a cancel, its timeout passed before its turn), `finish` gives its
place to the next call of its group first, then replies through `out`::

    Mailbox.admit ── its turn ──> Job.run ── sync method ──> finish(value)
                                     │  ── async method ──> its Task or Future ──> finish
                                     └─ late (past its timeout): finish(CallTimeoutError)
    Job.cancel ── waiting: finish(CancelledError) now; running: cancel its Task or Future

`run_now` is the same path for a sync call that took its place as it
arrived: run on this thread, place freed, reply done; no Job is made
unless its method returned a coroutine or a Future.
"""

from __future__ import annotations

import difflib
import inspect
import math
import time
from typing import Any, Protocol

from torch.futures import Future

from . import _cancel, _runtime, _torch
from ._errors import CallTimeoutError, CancelledError
from ._execution import (
    call_capturing,
    cancelled_error,
    outcome_of,
    settle_future,
    start_coroutine,
)
from ._failures import Failure
from ._futures import completed, new_future
from ._sendable import check_sendable
from ._world import describe_self

__all__ = ("Box", "Job", "no_method")


class Box(Protocol):
    """What a job needs of its mailbox (`_mailbox.Mailbox`)."""

    lock: Any
    cls: type

    def done(self, job: Job) -> None: ...

    def free(self, group: tuple[str, bool]) -> None: ...


class Job:
    """One method call in a mailbox: waits for its turn, runs, replies through `out`."""

    __slots__ = ("args", "arrived", "box", "deadline", "ended", "group", "inner", "is_async",
                 "kwargs", "name", "obj", "out", "placed", "started", "state")  # fmt: skip

    def __init__(self, box: Box, obj: object, name: str, args: Any, kwargs: Any) -> None:
        self.box, self.obj, self.name = box, obj, name
        self.args, self.kwargs = args, kwargs
        self.out = new_future()
        self.state: _cancel.Running | None = None
        self.group = ("", False)
        self.is_async = self.placed = self.started = self.ended = False
        self.inner: Any = None  # the Future an async method's call waits for
        self.arrived = time.monotonic()
        self.deadline = math.inf  # past it, its caller has timed out: it never starts

    @property
    def label(self) -> str:
        return f"{self.box.cls.__qualname__}.{self.name}()"

    def run(self) -> None:
        """Start the method (on whichever thread its turn came)."""
        with self.box.lock:
            if self.ended:
                return
            late = time.monotonic() > self.deadline
            self.started = not late
        if late:
            self.finish(Failure(self._timed_out()))
            return
        outer = _cancel.enter(self.state)
        try:
            result = self._call()
        finally:
            _cancel.enter(outer)
        self.follow(result)

    def follow(self, result: Any) -> None:
        """The method has returned `result`: the call ends, or waits for its Future."""
        if isinstance(result, _torch.FutureType):
            self.inner = result
            result.add_done_callback(self._inner_done)
            if self.state is not None and self.state.cancelled:
                _torch.cancel(result)  # cancelled while it started
        else:
            self.finish(result)

    def _call(self) -> Any:
        thread = _runtime.THREAD
        thread.asked, thread.made = True, None  # async_execution methods reply our way
        try:
            result = call_method(
                self.box.cls, self.obj, self.name, self.args, self.kwargs, self.label
            )
        finally:
            made, thread.asked, thread.made = thread.made, False, None
        return _awaited(result, made, self.label, self.state)

    def _timed_out(self) -> CallTimeoutError:
        waited = time.monotonic() - self.arrived
        here = describe_self()
        return CallTimeoutError(
            f"{self.label} waited {waited:.2f} s for its turn on {here}, past its timeout: it "
            f"was not run (its caller had timed out); give it a longer timeout, or put the "
            f"method in a concurrency group of its own",
            here.split("'")[1] if here.count("'") >= 2 else here,
        )

    def _inner_done(self, fut: Future[Any]) -> None:
        self.finish(outcome_of(fut, self.label))

    def finish(self, value: Any) -> None:
        """The call's outcome: its group's place goes to the next, then the reply."""
        with self.box.lock:
            if self.ended:
                return
            self.ended = True
            placed = self.placed
        state = self.state
        if state is not None:
            if state.cancelled and not _is_cancelled(value):
                value = Failure(cancelled_error(self.label))
            _cancel.end(state)
        if placed:  # its place in its group goes to the next
            self.box.done(self)
        reply = check_sendable(value, self.label)
        if state is not None:
            _cancel.hand_over(state, reply)
        self.out.set_result(reply)
        self.obj = self.args = self.kwargs = self.inner = None  # nothing kept once replied

    def cancel(self) -> bool:
        """Cancelled: a waiting call ends now; a running one as its method allows."""
        with self.box.lock:
            if self.ended:
                return False
            started, inner = self.started, self.inner
        if not started:
            self.finish(Failure(cancelled_error(self.label, before=True)))
        elif inner is not None:
            _torch.cancel(inner)  # an async method stops at its await
        return True


def run_now(box: Box, group: tuple[str, bool], obj: object, name: str, args: Any,
            kwargs: Any) -> Future[Any]:  # fmt: skip
    """A sync call that took its group's place as it arrived (`Mailbox.take_turn`): it
    runs on this thread, and its reply is done. A Job's path, without the waiting."""
    label = f"{box.cls.__qualname__}.{name}()"
    state = _cancel.current()
    if state is not None and state.cancelled:  # cancelled as it arrived: it never runs
        result: Any = Failure(cancelled_error(label, before=True))
    else:
        result = call_method(box.cls, obj, name, args, kwargs, label)
    if inspect.iscoroutine(result) or isinstance(result, _torch.FutureType):
        job = Job(box, obj, name, args, kwargs)  # a sync method that returned an awaitable
        job.group, job.placed, job.started = group, True, True
        job.state = state if state is not None and _cancel.claim(state, job.cancel) else None
        job.follow(_awaited(result, None, label, job.state))
        return job.out
    box.free(group)  # its place goes to the next, then the reply
    if state is not None:
        if state.cancelled:
            result = Failure(cancelled_error(label))
        _cancel.end(state, settled=True)
    reply = check_sendable(result, label)
    if state is not None:
        _cancel.hand_over(state, reply)
    return completed(reply)


def call_method(cls: type, obj: object, name: str, args: Any, kwargs: Any, label: str) -> Any:
    """`obj.name(*args, **kwargs)`, or the Failure it raised: whatever it raised, so that
    its place in its group is always given back (a property whose getter raises, a
    method that raises SystemExit or asyncio's CancelledError: the call fails, the object
    goes on; torch's own verbs fail such a call the same way)."""
    try:
        method = getattr(obj, name, None)
        if not callable(method):
            raise AttributeError(no_method(cls, name, method))
    except Exception as exc:
        return call_capturing(_raise, (exc,), {}, label)
    try:
        return call_capturing(method, args, kwargs, label)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # not an Exception: SystemExit, asyncio.CancelledError
        error = RuntimeError(f"{label} raised {type(exc).__name__}: {exc}")
        return call_capturing(_raise, (error,), {}, label)


def _awaited(result: Any, made: Any, label: str, state: _cancel.Running | None) -> Any:
    """What a method returned, made a torch Future when it is one's or a coroutine's."""
    if inspect.iscoroutine(result):
        return start_coroutine(result, label, within=state)
    if isinstance(result, _torch.FutureType) and result is not made:
        return settle_future(result, label)
    return result


def no_method(cls: type, name: str, attr: object) -> str:
    """What to say when `cls` has no method `name` (`attr`: what it has by that name)."""
    names = [n for n in dir(cls) if not n.startswith("_")]
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    what = "has no method" if attr is None else "has an attribute, not a method, named"
    return f"{cls.__name__} {what} {name!r}; {hint}pass a method name: handle.call('name', *args)"


def _is_cancelled(value: object) -> bool:
    return isinstance(value, Failure) and isinstance(value.error, CancelledError)


def _raise(exc: BaseException) -> None:
    raise exc
