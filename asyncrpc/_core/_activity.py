"""What this worker asks of others: its calls in flight, how long calls took, how many failed.

Read by `asyncrpc-dump`, `asyncrpc-top` and hang reports (see `_snapshot`);
the calls this worker runs for others are `_cancel`'s record. Per call it
costs one small object, a set insert and remove, and a deque append::

    send()    sent(worker, label, key) ──> in flight (with the call it was made from)
    reply in  ended(call, failed)      ──> latency kept for the next read, failures counted

Each list is bounded: the latencies of at most `LATENCIES_KEPT` calls wait
for the next read (`take_latencies`), older ones are dropped.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from . import _cancel

__all__ = [
    "LATENCIES_KEPT",
    "Outgoing",
    "count_streams_with",
    "ended",
    "failures",
    "in_flight",
    "sent",
    "streams",
    "take_latencies",
]

LATENCIES_KEPT = 10_000


class Outgoing:
    """One call this worker sent and has no reply for yet."""

    __slots__ = ("key", "label", "parent", "started", "thread", "worker")

    def __init__(self, worker: str, label: object, key: int) -> None:
        self.worker, self.label, self.key = worker, label, key
        self.started = time.monotonic()
        running = _cancel.current()  # the call this one was made from, if any
        self.parent = running.key if running is not None else 0
        self.thread = threading.get_ident()


_in_flight: set[Outgoing] = set()
_latencies: collections.deque[float] = collections.deque(maxlen=LATENCIES_KEPT)
_failed_seen = [0]  # failures counted so far
_lock = threading.Lock()


def sent(worker: str, label: object, key: int) -> Outgoing:
    """Record a call just sent to `worker`."""
    call = Outgoing(worker, label, key)
    _in_flight.add(call)  # one bytecode: atomic under the GIL
    return call


def ended(call: Outgoing, failed: bool) -> None:
    """The call's outcome arrived (or it was cancelled)."""
    _in_flight.discard(call)
    _latencies.append(time.monotonic() - call.started)
    if failed:
        with _lock:
            _failed_seen[0] += 1


def in_flight() -> list[Outgoing]:
    """The calls in flight now, oldest first."""
    return sorted(list(_in_flight), key=lambda call: call.started)


def take_latencies() -> list[float]:
    """Seconds taken by the calls that ended since the last read (then forgotten)."""
    taken = []
    while True:
        try:
            taken.append(_latencies.popleft())
        except IndexError:
            return taken


_stream_counter: list[Callable[[], int]] = []  # set by the first stream opened here


def count_streams_with(counter: Callable[[], int]) -> None:
    """Have `streams()` ask `counter` (the stream module's own count of its producers)."""
    if not _stream_counter:
        _stream_counter.append(counter)


def streams() -> int:
    """Generators this worker holds open for others' streams."""
    return _stream_counter[0]() if _stream_counter else 0


def failures() -> int:
    """Calls this worker sent that failed, since it started."""
    with _lock:
        return _failed_seen[0]
