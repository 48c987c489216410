"""Composing torch Futures (chain, gather, wait_first, as_completed, with_timeout), awaiting them.

Every helper returns a new `torch.futures.Future` and completes it from the
done-callbacks of its inputs, so no thread waits. They use
`add_done_callback`, not `then`: torch's `then` turns an exception raised in
a callback into a bare RuntimeError, while here it reaches the caller with
its own type, and a callback that raises never leaves a Future pending::

    inputs:  fut_a   fut_b   fut_c        (rpc_async, RRef calls, Future())
               |       |       |   done-callbacks, on whichever thread completes them
               v       v       v
             Settle (first outcome wins, under a lock)
               |
    output:  Future  --> .wait() / .then() / await (in async_execution)

Timeouts share one clock thread that sleeps until the nearest deadline; no
thread is held per Future.

`enable_await` gives torch Futures an `__await__`: under a running asyncio
loop (the world's own, where remote coroutines run, or the user's) the
Future is bridged to that loop, and cancelling the await cancels the Future.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
import math
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, TypeVar

from torch.futures import Future

from . import _torch
from ._errors import CancelledError
from ._failures import check_reply, hold

__all__ = [
    "as_completed",
    "as_futures",
    "await_future",
    "call_later",
    "chain",
    "completed",
    "enable_await",
    "failed",
    "gather",
    "new_future",
    "then_child",
    "wait_first",
    "with_timeout",
]

T = TypeVar("T")
_FutureType = _torch.FutureType


def completed(value: T) -> Future[T]:
    """A Future that already holds `value`.

    Example::

        fut = asyncrpc.completed(torch.ones(2))
        assert fut.done()
    """
    fut: Future[T] = Future()
    fut.set_result(value)
    return fut


def failed(error: BaseException) -> Future[Any]:
    """A Future that already failed with `error` (its `wait()` raises it, same type).

    Example::

        fut = asyncrpc.failed(KeyError("no such shard"))
    """
    if not isinstance(error, BaseException):
        raise TypeError(
            f"failed() takes an exception instance, got {type(error).__name__} {error!r:.60}"
        )
    fut = new_future()
    fut.set_result(hold(error))
    return fut


def new_future() -> Future[Any]:
    """A torch Future whose reads raise a carried `Failure` (see `_failures`)."""
    fut: Future[Any] = Future()
    _torch.set_unwrap(fut, check_reply)
    return fut


class Settle:
    """Completes `future` once: the first resolve/reject wins, later ones are ignored.

    Cancelling `future` fails it with CancelledError at once (if nothing won
    before), then cancels the Futures it is made of (`_torch.combine`).
    """

    def __init__(self) -> None:
        self.future = new_future()
        self._lock = threading.Lock()
        self._done = False
        _torch.set_canceller(self.future, self.cancel)  # held weakly there

    def cancel(self) -> bool:
        """Fail the Future with CancelledError; False when it has its outcome already."""
        if not self._claim():
            return False
        parts = _torch.parts_of(self.future)
        self.future.set_result(
            hold(CancelledError(f"this Future, made of {len(parts)} others, was cancelled"))
        )
        for part in parts:
            _torch.cancel(part)
        return True

    def _claim(self) -> bool:
        with self._lock:
            if self._done:
                return False
            self._done = True
            return True

    def resolve(self, value: object) -> bool:
        """Complete with `value`; False when an outcome won before."""
        if not self._claim():
            return False
        self.future.set_result(value)
        return True

    def reject(self, error: BaseException) -> bool:
        """Fail with `error` (a detached copy); False when an outcome won before."""
        if not self._claim():
            return False
        self.future.set_result(hold(error))
        return True

    def copy(self, source: Future[Any]) -> None:
        try:
            value = source.value()
        except BaseException as exc:
            self.reject(exc)
        else:
            self.resolve(value)


class ThenChild(Settle):
    """What `then` on an asyncrpc Future returns: torch's child copied in, unless cancelled.

    torch completes the child `then` makes when its callback returns, and it
    cannot be completed early; this Future can. Cancelling it fails it with
    CancelledError at once and cancels its source; the callback still runs
    when the source completes (with the cancelled source, if that cancel
    took), and what it returns or raises is dropped.
    """

    def __init__(self, child: Future[Any], source: Future[Any]) -> None:
        super().__init__()
        _torch.combine(self.future, [source])  # guards; what its cancel reaches
        _torch.add_callback(child, self.copy)  # the child is torch's: nobody else reads it

    def cancel(self) -> bool:
        """Fail with CancelledError (the source's, if this cancels it); False when done."""
        if not self._claim():
            return False
        error = None
        for source in _torch.parts_of(self.future):  # the one `then` was called on
            if _torch.cancel(source):
                error = _cancelled_by(source)
        if error is None:
            error = CancelledError(
                "this Future, made with then() from another, was cancelled (its callback's "
                "outcome is dropped)"
            )
        self.future.set_result(hold(error))
        return True


def _cancelled_by(source: Future[Any]) -> CancelledError | None:
    """The CancelledError a cancelled `source` holds (it names the call), or None."""
    try:
        _torch.outcome(source)  # raises a carried failure (its unwrap step)
    except CancelledError as cancelled:
        # A new one: the raised one's traceback reaches, through its frames' callers,
        # the Future being cancelled, which would then hold itself for good.
        return CancelledError(str(cancelled), cancelled.name)
    except BaseException:
        return None
    return None


def then_child(child: Future[Any], source: Future[Any]) -> Future[Any]:
    """The Future `source.then(...)` hands out for an asyncrpc `source` (see ThenChild)."""
    return ThenChild(child, source).future


def as_futures(verb: str, items: Iterable[object]) -> list[Future[Any]]:
    """`items` as a list of torch Futures, or a TypeError naming what is not one."""
    if isinstance(items, _FutureType):
        raise TypeError(f"{verb} takes a list of Futures, got one Future; write {verb}([fut])")
    found = list(items)
    for i, item in enumerate(found):
        if not isinstance(item, _FutureType):
            raise TypeError(
                f"{verb}: item {i} is a {type(item).__name__}, not a Future; pass what "
                f"rpc_async returns, or wrap a plain value with asyncrpc.completed(value)"
            )
    return found  # type: ignore[return-value]


def chain(fut: Future[Any], *fns: Callable[[Any], Any]) -> Future[Any]:
    """Feed `fut`'s value through `fns` in turn; the first error skips the rest.

    Each function takes the previous value (not a Future) and returns the next
    value, or a Future whose value is the next one. Example::

        fut = asyncrpc.chain(
            asyncrpc.rpc_async("worker1", torch.add, args=(x, 1)),
            lambda y: asyncrpc.rpc_async("worker2", torch.mul, args=(y, 2)),
            lambda z: z.sum(),
        )
    """
    (fut,) = as_futures("chain", [fut])
    for fn in fns:
        if not callable(fn):
            raise TypeError(
                f"chain: got a {type(fn).__name__} where a callable was expected; pass the "
                f"function itself: chain(fut, f) rather than chain(fut, f(x))"
            )
    out = Settle()
    _torch.combine(out.future, [fut])

    def advance(step: int, source: Future[Any]) -> None:
        try:
            value = source.value()
            while step < len(fns):
                value = fns[step](value)
                step += 1
                if isinstance(value, _FutureType):
                    value.add_done_callback(lambda f, at=step: advance(at, f))
                    return
        except BaseException as exc:
            out.reject(exc)
        else:
            out.resolve(value)

    fut.add_done_callback(lambda f: advance(0, f))
    return out.future


def gather(futs: Iterable[Future[Any]]) -> Future[list[Any]]:
    """A Future of all values, in the order given; fails as soon as one input fails.

    Example::

        futs = [asyncrpc.rpc_async(n, torch.ones, args=((2,),)) for n in ctx.names]
        values = asyncrpc.gather(futs).wait()
    """
    items = as_futures("gather", futs)
    out = Settle()
    _torch.combine(out.future, items)
    if not items:
        out.resolve([])
        return out.future
    results: list[Any] = [None] * len(items)
    remaining = [len(items)]
    lock = threading.Lock()

    def on_done(index: int, source: Future[Any]) -> None:
        try:
            value = source.value()
        except BaseException as exc:
            out.reject(exc)
            return
        with lock:
            results[index] = value
            remaining[0] -= 1
            finished = remaining[0] == 0
        if finished:
            out.resolve(list(results))

    for index, item in enumerate(items):
        item.add_done_callback(functools.partial(on_done, index))
    return out.future


def wait_first(futs: Iterable[Future[Any]]) -> Future[Future[Any]]:
    """A Future of the first input Future to complete (with a value or an error).

    Example::

        first = asyncrpc.wait_first([fast, slow]).wait()
        print(first.wait())
    """
    items = as_futures("wait_first", futs)
    if not items:
        raise ValueError("wait_first needs at least one Future, got none")
    out = Settle()
    _torch.combine(out.future, items)

    def first(done: Future[Any]) -> None:
        out.resolve(done)

    for item in items:
        item.add_done_callback(first)
    return out.future


def as_completed(
    futs: Iterable[Future[Any]], timeout: float | None = None
) -> Iterator[Future[Any]]:
    """Yield the input Futures as they complete; raise TimeoutError after `timeout` s.

    Example::

        for fut in asyncrpc.as_completed(futs, timeout=30):
            print(fut.wait())
    """
    items = as_futures("as_completed", futs)
    deadline = None
    if timeout is not None:
        deadline = time.monotonic() + check_seconds("as_completed", timeout, zero=False)
    done: queue.SimpleQueue[Future[Any]] = queue.SimpleQueue()
    for item in items:
        item.add_done_callback(done.put)
    return _drain(done, items, deadline, timeout)


def _drain(
    done: queue.SimpleQueue[Future[Any]],
    items: list[Future[Any]],
    deadline: float | None,
    timeout: float | None,
) -> Iterator[Future[Any]]:
    count = len(items)
    for yielded in range(count):
        if done.empty():
            for item in items:
                _torch.check_guard(item)  # an input that can never complete: fail now
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            yield done.get(timeout=left)
        except queue.Empty:
            raise TimeoutError(
                f"as_completed: {count - yielded} of {count} Futures still pending after "
                f"{timeout:g} s"
            ) from None


def check_seconds(verb: str, seconds: object, hint: str = "", zero: bool = True) -> float:
    """A timeout in seconds as a float, or a TypeError/ValueError saying what was wrong.

    Everywhere in asyncrpc, as in torch, a timeout of 0 means "no timeout";
    helpers that exist only to time out (`zero=False`) refuse it.
    """
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(f"{verb}: timeout must be seconds as a number, got {seconds!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(
            f"{verb}: timeout must be a finite number of seconds >= 0{hint}, got {seconds!r}"
        )
    if seconds == 0 and not zero:
        raise ValueError(
            f"{verb}: timeout=0 would mean no timeout (torch's meaning, which asyncrpc keeps), "
            f"so {verb} would never time out; pass seconds > 0, or leave the timeout out"
        )
    return float(seconds)


def with_timeout(fut: Future[T], seconds: float, *, cancel: bool = False) -> Future[T]:
    """`fut`'s outcome, or a TimeoutError if it takes longer than `seconds`.

    No thread waits: one shared clock thread fails the returned Future at the
    deadline. The input keeps running unless `cancel=True`: then the call
    behind it is cancelled at the deadline (see `asyncrpc.cancel`). Example::

        fut = asyncrpc.with_timeout(asyncrpc.rpc_async("worker1", slow), 5.0, cancel=True)
    """
    (source,) = as_futures("with_timeout", [fut])
    delay = check_seconds("with_timeout", seconds, zero=False)
    if not isinstance(cancel, bool):
        raise TypeError(f"with_timeout: cancel must be True or False, got {cancel!r}")
    out = Settle()
    _torch.combine(out.future, [source])

    def expire() -> None:
        out.reject(TimeoutError(f"the Future did not complete within {delay:g} s"))
        if cancel:
            _torch.cancel(source)

    alarm = _clock.call_at(time.monotonic() + delay, expire)

    def on_done(f: Future[Any]) -> None:
        alarm.cancel()
        out.copy(f)

    source.add_done_callback(on_done)
    return out.future


class _Alarm:
    __slots__ = ("action", "clock")

    def __init__(self, clock: _Clock, action: Callable[[], None]) -> None:
        self.clock = clock
        self.action: Callable[[], None] | None = action

    def cancel(self) -> None:
        self.clock.cancel(self)


class _Clock:
    """One thread that runs actions at deadlines (a heap, one condition).

    It runs only while an alarm is pending: it ends when the last one has
    fired or been cancelled, and the next `call_at` starts it again.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, _Alarm]] = []
        self._order = itertools.count()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._pending = 0  # alarms neither fired nor cancelled

    def call_at(self, deadline: float, action: Callable[[], None]) -> _Alarm:
        alarm = _Alarm(self, action)
        with self._wake:
            heapq.heappush(self._heap, (deadline, next(self._order), alarm))
            self._pending += 1
            if self._thread is None or not self._thread.is_alive():  # none, or lost in a fork
                self._thread = threading.Thread(
                    target=self._loop, name="asyncrpc-clock", daemon=True
                )
                self._thread.start()
            self._wake.notify()
        return alarm

    def cancel(self, alarm: _Alarm) -> None:
        with self._wake:
            if alarm.action is None:  # fired already, or cancelled before
                return
            alarm.action = None
            self._pending -= 1
            if self._pending == 0:  # only cancelled alarms left: let the thread end now
                self._heap.clear()
                self._wake.notify()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while self._heap and self._heap[0][0] > time.monotonic():
                    self._wake.wait(self._heap[0][0] - time.monotonic())
                if not self._heap:
                    self._thread = None
                    return
                _, _, alarm = heapq.heappop(self._heap)
                action, alarm.action = alarm.action, None
                if action is not None:
                    self._pending -= 1
            if action is not None:
                action()


_clock = _Clock()


def call_later(seconds: float, action: Callable[[], None]) -> Callable[[], None]:
    """Run `action()` on the shared clock thread in `seconds`; returns how to cancel it."""
    return _clock.call_at(time.monotonic() + seconds, action).cancel


def enable_await() -> None:
    """Make torch Futures awaitable (`await fut`) for the rest of the process.

    A world does it too while it runs (its shutdown takes it back); asked
    for here, it stays. Kept if torch ever ships its own `__await__`. Example::

        asyncrpc.enable_await()
        result = await asyncrpc.rpc_async("worker1", torch.add, args=(x, 1))
    """
    _torch.install_await(await_future, keep=True)


# ---- making torch Futures awaitable --------------------------------------------------


def await_future(fut: Future[Any]) -> Generator[Any, None, Any]:
    """torch Future's `__await__` (see the module doc)."""
    if not fut.done():
        _torch.check_guard(fut, blocking=False)  # one that can never complete fails now
        loop = _running_loop()
        if loop is None:
            yield fut  # no event loop runs here: whoever drives the coroutine waits for it
        else:
            yield from _bridge(fut, loop)
    return fut.wait()


def _bridge(fut: Future[Any], loop: asyncio.AbstractEventLoop) -> Generator[Any, None, None]:
    waiter = loop.create_future()

    def wake() -> None:
        if not waiter.done():
            waiter.set_result(None)

    def on_done(_: Future[Any]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
            loop.call_soon_threadsafe(wake)

    fut.add_done_callback(on_done)
    try:
        yield from waiter
    except asyncio.CancelledError:
        _torch.cancel(fut)  # the call it awaited: the next hop stops too
        raise


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
