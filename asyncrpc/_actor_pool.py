"""`asyncrpc.ActorPool`: Ray's `ActorPool` over asyncrpc handles.

Work goes to an idle handle; when none is idle it waits in the pool, and
each call that ends gives its handle to the next waiting work (from the
thread its Future completed on). Results come back in the order submitted
(`get_next`) or as they finish (`get_next_unordered`)::

    submit(fn, v) ──> idle handle? ── yes ──> fn(handle, v): a Future, by index
                          └── no ──> waiting ──┐
    a Future done ──> its handle idle again ───┘ (the next waiting work starts)
    get_next() ──> the Future of the next index ── wait ──> its value
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

from torch.futures import Future

from ._core import _torch
from ._core._failures import hold
from ._core._futures import new_future
from ._handles import RemoteObject
from ._wait import wait

__all__ = ("ActorPool",)

H = TypeVar("H", bound=RemoteObject[Any])
Submit = Callable[[Any, Any], Future[Any]]


class ActorPool(Generic[H]):
    """Spread work over handles, one call per handle at a time (Ray's `ActorPool`).

    `fn(handle, value)` makes one call and returns its Future (a handle's
    `call_async`). `map` and `map_unordered` yield the results of many;
    `submit`, `has_next`, `get_next` and `get_next_unordered` do it by hand.

    Example::

        pool = asyncrpc.ActorPool([asyncrpc.spawn(w, Model) for w in ctx.workers("gpu")])
        for y in pool.map(lambda h, x: h.call_async("predict", x), batches):
            print(y)
    """

    def __init__(self, handles: Iterable[H]) -> None:
        self._idle: list[H] = list(handles)
        for h in self._idle:
            if not isinstance(h, RemoteObject):
                raise TypeError(
                    f"ActorPool takes handles from asyncrpc.spawn, got {type(h).__name__} "
                    f"{h!r:.60}"
                )
        self._lock = threading.Lock()
        self._size = len(self._idle)  # handles in the pool, idle or busy
        self._futures: dict[int, Future[Any]] = {}  # index -> its Future
        self._waiting: deque[tuple[int, Submit, Any]] = deque()
        self._submitted = 0  # the next index to give
        self._returned = 0  # the next index get_next returns

    def map(self, fn: Submit, values: Iterable[Any]) -> Iterator[Any]:
        """`fn(handle, v)` for each of `values`, spread over the pool; results in order.

        As Ray's: results of work submitted before, not yet returned, are
        dropped first, and every value is submitted at once.
        """
        self._start_over(fn, values)
        return self._results(self.get_next)

    def map_unordered(self, fn: Submit, values: Iterable[Any]) -> Iterator[Any]:
        """As `map`, each result as soon as it is ready."""
        self._start_over(fn, values)
        return self._results(self.get_next_unordered)

    def _start_over(self, fn: Submit, values: Iterable[Any]) -> None:
        with self._lock:
            self._waiting.clear()  # not started: dropped
            self._futures.clear()  # started: their handles come back as they end
            self._returned = self._submitted
        for value in list(values):
            self.submit(fn, value)

    def _results(self, get: Callable[[], Any]) -> Iterator[Any]:
        while self.has_next():
            yield get()

    def submit(self, fn: Submit, value: Any) -> None:
        """Schedule `fn(handle, value)` on the next idle handle (or once one is idle)."""
        with self._lock:
            if self._size == 0:
                raise ValueError(
                    "ActorPool.submit: the pool has no handles (none given, or all taken "
                    "out with pop_idle); give it some: ActorPool(handles) or pool.push(h)"
                )
            index = self._submitted
            self._submitted += 1
            out = self._futures[index] = new_future()  # filled when its call ends
            if not self._idle:
                self._waiting.append((index, fn, value))
                return
            handle = self._idle.pop()
        self._start(index, handle, fn, value, out)

    def has_next(self) -> bool:
        """Whether any submitted work has a result not yet returned."""
        with self._lock:
            return bool(self._futures)

    def has_free(self) -> bool:
        """Whether a handle is idle (a `submit` would start at once)."""
        with self._lock:
            return bool(self._idle) and not self._waiting

    def get_next(self, timeout: float | None = None) -> Any:
        """The result of the next work in submission order (raises its error).

        Raises `TimeoutError` when it is not ready within `timeout` s (the
        work stays next), `StopIteration` when nothing is left.
        """
        with self._lock:
            fut = self._futures.get(self._returned)
        if fut is None:
            raise StopIteration("ActorPool.get_next: no submitted work is left")
        if not wait([fut], 1, timeout)[0]:
            raise TimeoutError(f"ActorPool.get_next: no result within {timeout} s")
        with self._lock:
            del self._futures[self._returned]
            self._returned += 1
        return fut.wait()

    def get_next_unordered(self, timeout: float | None = None) -> Any:
        """The result of whichever work finishes first (raises its error)."""
        with self._lock:
            pending = dict(self._futures)
        if not pending:
            raise StopIteration("ActorPool.get_next_unordered: no submitted work is left")
        done, _ = wait(list(pending.values()), 1, timeout)
        if not done:
            raise TimeoutError(f"ActorPool.get_next_unordered: no result within {timeout} s")
        index = next(i for i, f in pending.items() if f is done[0])
        with self._lock:
            del self._futures[index]
            if index == self._returned:
                while self._returned < self._submitted and self._returned not in self._futures:
                    self._returned += 1
        return done[0].wait()

    def push(self, handle: H) -> None:
        """Add a handle to the pool (it takes waiting work at once)."""
        with self._lock:
            self._size += 1
        self._idle_again(handle)

    def pop_idle(self) -> H | None:
        """Take an idle handle out of the pool; None when none is idle."""
        with self._lock:
            if not self._idle:
                return None
            self._size -= 1
            return self._idle.pop()

    def _start(self, index: int, handle: H, fn: Submit, value: Any, out: Future[Any]) -> None:
        try:
            fut = fn(handle, value)
            if not isinstance(fut, _torch.FutureType):
                raise TypeError(
                    f"ActorPool: fn must return the Future of one call, e.g. "
                    f"lambda h, v: h.call_async('method', v); it returned "
                    f"{type(fut).__name__} {fut!r:.60}"
                )
        except BaseException as exc:
            self._idle_again(handle)
            out.set_result(hold(exc))
            return
        fut.add_done_callback(lambda done: self._finished(handle, done, out))

    def _finished(self, handle: H, done: Future[Any], out: Future[Any]) -> None:
        try:
            value = done.wait()
        except BaseException as exc:  # kept as a value: a Future holding it would leak
            value = hold(exc)
        if not out.done():
            out.set_result(value)
        self._idle_again(handle)

    def _idle_again(self, handle: H) -> None:
        with self._lock:
            if not self._waiting:
                self._idle.append(handle)
                return
            index, fn, value = self._waiting.popleft()
            out = self._futures[index]
        self._start(index, handle, fn, value, out)
