"""Waiting for what the world's store will say: one deadline, one interval policy, one error.

A world's processes meet in its store (`_rendezvous`, `_records`): a worker
waits until every peer has joined, a supervisor until every member has
acked, a member until an added worker has joined. torch's store can block
on a key (`Store.wait`), but most of these waits watch for more than one
outcome (the key, or a failure, or the world's end), so they look again
and again. Every such wait goes through `until` (or `within`, which does
not raise)::

    until(ready, timeout, awaited)
      ready() ── truthy ──> its value
        │ falsy
        └─ past the deadline? ── yes ──> raise StoreTimeoutError(awaited)  (or the
                                          caller's own error type, with its message)
           no: sleep one interval, look again

The interval: a twentieth of the time waited so far, at least 1 ms and at
most 20 ms. A wait that ends soon is seen at once (a join takes about
50 ms, an ack a few), a wait is never more than 5% (or 1 ms) late, and a
long one looks 50 times a second, not a thousand.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from ._errors import StoreTimeoutError

__all__ = ("interval", "until", "within")

T = TypeVar("T")

_FIRST_S = 0.001  # the shortest interval
_MOST_S = 0.02  # the longest
_SHARE = 0.05  # an interval is this share of the time waited so far


def interval(waited: float) -> float:
    """How long to sleep before the next look, `waited` s into a wait."""
    return min(_MOST_S, max(_FIRST_S, waited * _SHARE))


def until(
    ready: Callable[[], T],
    timeout: float | None,
    awaited: str | Callable[[], str],
    error: Callable[[str], BaseException] = StoreTimeoutError,
) -> T:
    """`ready()`'s first truthy value, looking again at `interval`s; None `timeout`: no bound.

    Past `timeout` s it raises `error(message)`: by default `StoreTimeoutError`
    (a `RendezvousError` and a `TimeoutError`) whose message says what was
    awaited; `awaited` is that message, or makes it at the deadline (to
    name what is still missing then). Example::

        _polling.until(lambda: space.check(keys), 30.0,
                       f"every member's ack of {keys} (30 s)")
    """
    found = within(ready, timeout)
    if found is None:
        raise error(awaited() if callable(awaited) else awaited)
    return found


def within(ready: Callable[[], T], timeout: float | None) -> T | None:
    """`until`, but past `timeout` s it returns None: a wait whose end is no failure.

    Example (a member waits for the others to be ready to stop, then stops anyway)::

        _polling.within(lambda: int(space.add("stopping", 0)) >= count, 30.0)
    """
    start = time.monotonic()
    while True:
        found = ready()
        if found:
            return found
        waited = time.monotonic() - start
        if timeout is not None and waited > timeout:
            return None
        time.sleep(interval(waited))
