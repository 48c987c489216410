"""`asyncrpc.on_members`: membership events delivered in order, on one thread of their own.

A member learns of joins, departures and replacements on torch's RPC threads
and on the side channel's watcher; neither may run user code that could call
back into the world and wait. Events are queued where they are learnt and a
single thread, `asyncrpc-on-members`, started with the first callback's first
event, hands them to every callback in that order. It stops with the world.
What must run after the events learnt before it (a removal's Future, which
completes once the `Left` of its workers went out) is queued the same way.

A callback that raises does not stop the others: it is logged once per
callback and kind of event (`CallbackFailures`), as an ERROR of the `asyncrpc`
logger naming the callback, the event and the worker where it ran.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import NamedTuple

__all__ = ("CallbackFailures", "Events")

_JOIN_S = 5.0  # how long the world's end waits for a callback still running

_logger = logging.getLogger("asyncrpc")


class _Call(NamedTuple):
    """Queued beside the events: run in their order (`Events.call`)."""

    run: Callable[[], object]


class CallbackFailures:
    """Logs a membership callback that raised, once per callback and kind of event.

    `worker`: the name of the worker where the callbacks run (set once it is
    known); `verb`: how the callback was registered ("on_members").
    """

    def __init__(self, verb: str) -> None:
        self.verb = verb
        self.worker = ""
        self._logged: set[tuple[int, str]] = set()
        self._lock = threading.Lock()

    def call(self, callback: Callable[[object], object], event: object) -> None:
        """`callback(event)`; an exception it raises is logged (once), not raised."""
        try:
            callback(event)
        except Exception as error:  # one callback's failure must not stop the others
            kind = type(event).__name__
            with self._lock:
                if (id(callback), kind) in self._logged:
                    return
                self._logged.add((id(callback), kind))
            name = getattr(callback, "__qualname__", None) or repr(callback)
            module = getattr(callback, "__module__", None)
            named = f"{module}.{name}" if module else name
            _logger.error(
                "%s callback %s, given %r on worker %r, raised %s: %s; the world goes on "
                "(later failures of this callback on %s events are not logged): catch the "
                "error inside the callback",
                self.verb, named, event, self.worker, type(error).__name__, error, kind,
                exc_info=error,
            )  # fmt: skip


class Events:
    """The `on_members` callbacks of one world, and the thread that calls them."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[object], object]] = []
        self.failures = CallbackFailures("on_members")
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopped = False

    def register(self, callback: Callable[[object], object]) -> Callable[[], None]:
        """Add `callback`; the function returned removes it."""
        with self._lock:
            self.callbacks.append(callback)

        def unregister() -> None:
            with self._lock:
                if callback in self.callbacks:
                    self.callbacks.remove(callback)

        return unregister

    def put(self, event: object) -> None:
        """Queue `event` for the callbacks (none registered: dropped)."""
        with self._lock:
            if self._stopped or not self.callbacks:
                return
            self._enqueue(event)

    def call(self, run: Callable[[], object]) -> bool:
        """Queue `run()` after the events queued so far; False once the world ended."""
        with self._lock:
            if self._stopped:
                return False
            self._enqueue(_Call(run))
            return True

    def _enqueue(self, item: object) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._deliver, name="asyncrpc-on-members", daemon=True
            )
            self._thread.start()
        self._queue.put(item)

    def stop(self) -> None:
        """Deliver what is queued (bounded), then end the thread; the world ends."""
        with self._lock:
            self._stopped = True
            thread = self._thread
            self._queue.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN_S)

    def _deliver(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, _Call):
                try:
                    item.run()
                except Exception:  # a Future's own callbacks: the thread goes on
                    _logger.exception("a callback of a membership Future raised")
                continue
            with self._lock:
                callbacks = list(self.callbacks)
            for callback in callbacks:
                self.failures.call(callback, item)
