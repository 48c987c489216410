"""What this worker asks of others: its calls in flight, how long calls took, how many failed;
and the objects it holds (`put` here, or fetched here).

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

from . import _cancel, _runtime

__all__ = (
    "LATENCIES_KEPT",
    "Activity",
    "Outgoing",
    "ended",
    "failures",
    "held",
    "holding",
    "in_flight",
    "sent",
    "streams",
    "take_latencies",
)

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


class Activity:
    """This world's outgoing calls, their latencies and failures (a part of `_runtime`).

    `streams`: the generators this worker holds open for others' streams,
    kept up to date by `_stream` (which holds them).
    """

    def __init__(self) -> None:
        self.in_flight: set[Outgoing] = set()
        self.latencies: collections.deque[float] = collections.deque(maxlen=LATENCIES_KEPT)
        self.failed = 0  # failures counted so far
        self.lock = threading.Lock()
        self.streams = 0
        # Values `put` here and still referenced, their bytes; values fetched here, theirs.
        self.held = [0, 0, 0, 0]
        # Changes to `held` not counted yet: a finalizer (run by gc on any thread, maybe
        # one that holds `lock`) only appends here, which takes no lock.
        self.holdings: collections.deque[tuple[int, int, int, int]] = collections.deque()


def sent(worker: str, label: object, key: int) -> Outgoing:
    """Record a call just sent to `worker`."""
    call = Outgoing(worker, label, key)
    _runtime.part(Activity).in_flight.add(call)  # one bytecode: atomic under the GIL
    return call


def ended(call: Outgoing, failed: bool) -> None:
    """The call's outcome arrived (or it was cancelled)."""
    activity = _runtime.part(Activity)
    activity.in_flight.discard(call)
    activity.latencies.append(time.monotonic() - call.started)
    if failed:
        with activity.lock:
            activity.failed += 1


def in_flight() -> list[Outgoing]:
    """The calls in flight now, oldest first."""
    return sorted(list(_runtime.part(Activity).in_flight), key=lambda call: call.started)


def take_latencies() -> list[float]:
    """Seconds taken by the calls that ended since the last read (then forgotten)."""
    latencies = _runtime.part(Activity).latencies
    taken = []
    while True:
        try:
            taken.append(latencies.popleft())
        except IndexError:
            return taken


def streams() -> int:
    """Generators this worker holds open for others' streams."""
    return _runtime.part(Activity).streams


def failures() -> int:
    """Calls this worker sent that failed, since it started."""
    activity = _runtime.part(Activity)
    with activity.lock:
        return activity.failed


def holding(kept: int, kept_bytes: int, fetched: int = 0, fetched_bytes: int = 0) -> None:
    """Count objects kept here (`put`) and values fetched here, in or out (negative).

    Safe in a finalizer: it waits for no lock (counted now if the lock is free,
    else by the next `holding` or `held` that finds it free)."""
    activity = _runtime.part(Activity)
    activity.holdings.append((kept, kept_bytes, fetched, fetched_bytes))
    if activity.lock.acquire(blocking=False):
        try:
            _count(activity)
        finally:
            activity.lock.release()


def _count(activity: Activity) -> None:
    while activity.holdings:
        for i, delta in enumerate(activity.holdings.popleft()):
            activity.held[i] += delta


def held() -> dict[str, int]:
    """The objects this worker keeps for the world (`put` here, still referenced), the
    values it fetched and holds, and their bytes (tensors' data, and pickled size)."""
    activity = _runtime.part(Activity)
    with activity.lock:
        _count(activity)
        kept, kept_bytes, fetched, fetched_bytes = activity.held
    return {"kept": kept, "kept_bytes": kept_bytes, "fetched": fetched,
            "fetched_bytes": fetched_bytes}  # fmt: skip
