"""The world's asyncio event loop: where every `async def` remote function and method runs.

One loop per world, on one thread named ``asyncrpc-loop``, started by the
first coroutine a call runs and stopped when the world ends::

    RPC thread                              asyncrpc-loop thread
    run_python_async(f, ...)
      f(...) is a coroutine ── submit ───>  a Task runs it: it may await anything
      returns Future `out`; the RPC         asyncio awaits (sleep, gather, wait_for,
      thread is free                        Queue, sockets) and torch Futures (their
                                            done-callback wakes the loop)
    torch sends the reply  <── set_result ─ the Task ends: its value, or a Failure

A coroutine holds the loop only between two awaits. A blocking call inside
one (`time.sleep`, `fut.wait()`, a sync `rpc_sync`) holds it until it
returns, and every other coroutine of the worker waits that long: await
instead, or run the blocking part with `await asyncio.to_thread(...)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

from . import _runtime

__all__ = ("EventLoop", "in_loop", "loop", "submit")

_STOP_S = 2.0  # how long shutdown waits for the loop's tasks to take their cancel


class EventLoop:
    """This world's event loop and its thread (a part of `_runtime`), made on first use."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.closed = False

    def get(self) -> asyncio.AbstractEventLoop:
        with self.lock:
            if self.loop is None:
                if self.closed:
                    raise RuntimeError("this world has ended: its event loop runs no more")
                self.loop = asyncio.new_event_loop()
                self.thread = threading.Thread(
                    target=_serve, args=(self.loop,), name="asyncrpc-loop", daemon=True
                )
                self.thread.start()
            return self.loop

    def close(self) -> None:
        """Cancel what still runs, stop the loop and its thread (the world has ended)."""
        with self.lock:
            self.closed = True
            loop, thread = self.loop, self.thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(RuntimeError):  # already closed
            loop.call_soon_threadsafe(_stop, loop)
        thread.join(_STOP_S + 1.0)


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        with contextlib.suppress(Exception):
            loop.close()


def _stop(loop: asyncio.AbstractEventLoop) -> None:
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel("the world is shutting down")
    if not tasks:
        loop.stop()
        return
    done = asyncio.gather(*tasks, return_exceptions=True)
    done.add_done_callback(lambda _: loop.stop())
    loop.call_later(_STOP_S, loop.stop)  # a task that ignores its cancel does not hold us


def loop() -> asyncio.AbstractEventLoop:
    """This world's event loop, started now if it is not yet."""
    return _runtime.part(EventLoop).get()


def submit(fn: Callable[[], Any]) -> None:
    """Run `fn()` on the loop's thread, soon (from any thread)."""
    loop().call_soon_threadsafe(fn)


def in_loop() -> bool:
    """True on the loop's thread."""
    found = _runtime.part(EventLoop).thread
    return found is not None and found.ident == threading.get_ident()
