"""What a worker says of itself when asked through the side channel (dump, top).

The watcher thread answers, so the answer needs no free RPC thread: a world
whose every RPC thread is blocked still answers within milliseconds::

    "dump": {name, rank, attempt, pid, host, total_threads, objects,
             threads:   [{call, caller, age_s, stack, key, thread}]  the calls it runs
                         (stack: the thread's Python frames, or, for an async call
                         waiting at an `await`, its coroutine's)
             in_flight: [{to, call, age_s, key, parent}]            the calls it waits on}
    "top":  {name, rank, attempt, host, pid, rss_mb, cpu_percent, busy_threads, total_threads,
             running, in_flight, streams, failures, p50_ms, p99_ms, objects}

`objects`: {kept, kept_bytes, fetched, fetched_bytes}, the values `put` on
this worker that a ref somewhere still holds, and the values it fetched and
holds (`_activity.held`).

`p50_ms`/`p99_ms` cover the calls that ended since the previous "top" (None
when none did); `cpu_percent` the CPU time since then (since the world
started for the first). `attempt` is 0 but for a replacement in a world
that heals (restart="worker"): 1 for the first under its name, and so on.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import statistics
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import _activity, _cancel
from ._failures import label_of

if TYPE_CHECKING:
    from ._membership import Members

__all__ = ["Reporter", "format_frames"]


class Reporter:
    """Answers requests for one worker of a world (given to the watcher).

    `attempt`: this process's (0: the first under its name; more for a
    replacement in a world that heals). `members`: that world's members
    now (None otherwise), which name a caller by its torch id.
    """

    def __init__(
        self,
        rank: int,
        names: tuple[str, ...],
        threads: int,
        attempt: int = 0,
        members: Callable[[], Members | None] = lambda: None,
    ) -> None:
        self.rank, self.names, self.threads = rank, names, threads
        self.attempt, self.members = attempt, members
        self._lock = threading.Lock()
        self._last = (time.monotonic(), _cpu_seconds())

    def __call__(self, kind: str) -> str:
        if kind == "dump":
            return json.dumps(self.dump())
        if kind == "top":
            return json.dumps(self.top())
        return json.dumps({"error": f"unknown request {kind!r}"})

    def dump(self) -> dict[str, Any]:
        """Name, pid, the calls it runs with their stacks, the calls it waits on."""
        frames = sys._current_frames()
        now = time.monotonic()
        threads = [self._running(state, frames, now) for state in _cancel.running_calls()]
        in_flight = [
            {
                "to": call.worker,
                "call": label_of(call.label),
                "age_s": round(now - call.started, 3),
                "key": call.key,
                "parent": call.parent,
            }
            for call in _activity.in_flight()
        ]
        return {
            **self._who(),
            "total_threads": self.threads,
            "threads": threads,
            "in_flight": in_flight,
            "objects": _activity.held(),
        }

    def _running(
        self, state: _cancel.Running, frames: dict[int, types.FrameType], now: float
    ) -> dict[str, Any]:
        thread = state.thread
        doer = thread if thread is not None else state.worker
        frame = frames.get(doer) if doer is not None else None
        if frame is not None:
            stack = format_frames(frame)
        else:
            stack = _coroutine_stack(state.coro)
        return {
            "call": _call_label(state.call),
            "caller": self._caller(state.key),
            "age_s": round(now - state.started, 3),
            "stack": stack,
            "key": state.key,
            "thread": thread,
        }

    def _caller(self, key: int) -> str | None:
        torch_id = key >> _cancel.KEY_BITS  # the caller's rank, in a world that does not heal
        members = self.members()
        if members is not None:  # a replacement's torch id is not its rank
            for name, now in list(members.ids.items()):
                if now == torch_id:
                    return name
            return members.lost.get(torch_id)
        return self.names[torch_id] if 0 <= torch_id < len(self.names) else None

    def top(self) -> dict[str, Any]:
        """One row of `asyncrpc-top` for this worker."""
        running = _cancel.running_calls()
        with self._lock:
            then, cpu_then = self._last
            now, cpu = time.monotonic(), _cpu_seconds()
            self._last = (now, cpu)
        latencies = sorted(_activity.take_latencies())
        return {
            **self._who(),
            "rss_mb": round(_rss_mb(), 1),
            "cpu_percent": round(100 * (cpu - cpu_then) / max(now - then, 1e-6), 1),
            "busy_threads": sum(1 for state in running if state.thread is not None),
            "total_threads": self.threads,
            "running": len(running),
            "in_flight": len(_activity.in_flight()),
            "streams": _activity.streams(),
            "failures": _activity.failures(),
            "p50_ms": _percentile(latencies, 0.50),
            "p99_ms": _percentile(latencies, 0.99),
            "objects": _activity.held(),
        }

    def _who(self) -> dict[str, Any]:
        return {
            "name": self.names[self.rank],
            "rank": self.rank,
            "attempt": self.attempt,
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }


def format_frames(frame: types.FrameType | None) -> list[str]:
    """`File "...", line N, in func` for each frame, outermost first."""
    lines = []
    while frame is not None:
        code = frame.f_code
        lines.append(f'File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}')
        frame = frame.f_back
    return lines[::-1]


def _coroutine_stack(coro: Any) -> list[str]:
    """Where an async call waits: its coroutine's frames down the chain of awaits."""
    lines = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            code = frame.f_code
            lines.append(f'File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}')
        coro = getattr(coro, "cr_await", None)
    return lines


def _call_label(call: tuple[Any, ...]) -> str:
    if not call:
        return "?"
    func, args = call
    describe: Callable[..., object] | None = getattr(func, "_asyncrpc_describe_call", None)
    if describe is not None:
        try:
            return label_of(describe(*args))
        except Exception:  # naming must never fail a dump
            pass
    return label_of(func)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _rss_mb() -> float:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0] * 1000, 3)
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return round(cuts[min(98, max(0, round(q * 100) - 1))] * 1000, 3)
