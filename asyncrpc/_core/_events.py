"""`asyncrpc.on_members`: membership events delivered in order, on one thread of their own.

A member learns of joins, departures and replacements on torch's RPC threads
and on the side channel's watcher; neither may run user code that could call
back into the world and wait. Events are queued where they are learnt and a
single thread, `asyncrpc-on-members`, started with the first callback's first
event, hands them to every callback in that order. It stops with the world.
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable

__all__ = ("Events",)

_JOIN_S = 5.0  # how long the world's end waits for a callback still running


class Events:
    """The `on_members` callbacks of one world, and the thread that calls them."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[object], object]] = []
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
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._deliver, name="asyncrpc-on-members", daemon=True
                )
                self._thread.start()
            self._queue.put(event)

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
            event = self._queue.get()
            if event is None:
                return
            with self._lock:
                callbacks = list(self.callbacks)
            for callback in callbacks:
                try:
                    callback(event)
                except Exception:  # one callback's failure must not stop the others
                    traceback.print_exc()
