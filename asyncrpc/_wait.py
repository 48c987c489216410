"""`asyncrpc.wait`: Ray's `ray.wait` over torch Futures.

The calling thread sleeps on one condition that each Future's done-callback
notifies; a callback holds the waiter weakly, so a Future that never
completes keeps a small callback, not the waiter::

    futures ── done-callbacks ──> _Waiter.count ── notify ──> wait() wakes when
                                                              count >= num_returns,
                                                              or at its timeout
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from collections.abc import Iterable
from typing import Any

from torch.futures import Future

from ._core import _torch
from ._core._futures import as_futures

__all__ = ("wait",)


class _Waiter:
    __slots__ = ("__weakref__", "cond", "count")

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.count = 0


def _notify(ref: weakref.ref[_Waiter], _: object) -> None:
    waiter = ref()
    if waiter is not None:
        with waiter.cond:
            waiter.count += 1
            waiter.cond.notify()


def wait(
    futures: Iterable[Future[Any]], num_returns: int = 1, timeout: float | None = None
) -> tuple[list[Future[Any]], list[Future[Any]]]:
    """Wait until `num_returns` of `futures` are done, or `timeout` s; `(done, pending)`.

    As Ray's `ray.wait`: `done` holds at most `num_returns` of the Futures
    given (done with a value or an error, read them to know), `pending` the
    rest; both keep the order given. `timeout=None` waits as long as it
    takes, and, as in Ray, `timeout=0` does not wait at all. A wait that
    would block on a Future that can never complete (a call of a `Batch` not
    sent yet) raises at once, as reading it does. In an `async
    def`, await instead: `asyncio.wait(futures, return_when=...)` (torch
    Futures are awaitable there).

    Example::

        futs = [h.call_async("rollout", i) for i, h in enumerate(actors)]
        done, pending = asyncrpc.wait(futs, num_returns=2, timeout=10)
        first_two = [f.wait() for f in done]
    """
    items = as_futures("wait", futures)
    if len({id(f) for f in items}) != len(items):
        raise ValueError("wait: the same Future was given twice; pass each Future once")
    _check(num_returns, timeout, len(items))
    if not items:
        return [], []
    waiter = _Waiter()
    notify = functools.partial(_notify, weakref.ref(waiter))
    for fut in items:
        fut.add_done_callback(notify)
    with waiter.cond:
        if waiter.count < num_returns and timeout != 0:
            for fut in items:  # one that can never complete (an unsent Batch's): fail now
                _torch.check_guard(fut)
        waiter.cond.wait_for(lambda: waiter.count >= num_returns, timeout)
    done = [f for f in items if f.done()][:num_returns]
    chosen = {id(f) for f in done}
    return done, [f for f in items if id(f) not in chosen]


def _check(num_returns: object, timeout: object, given: int) -> None:
    if isinstance(num_returns, bool) or not isinstance(num_returns, int):
        raise TypeError(f"wait: num_returns must be a whole number, got {num_returns!r}")
    if not 1 <= num_returns <= max(given, 1):
        raise ValueError(
            f"wait: num_returns must be between 1 and the number of Futures ({given}), "
            f"got {num_returns}"
        )
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"wait: timeout must be seconds as a number or None, got {timeout!r}")
    if not math.isfinite(timeout) or timeout < 0:
        raise ValueError(f"wait: timeout must be a finite number of seconds >= 0, got {timeout!r}")
