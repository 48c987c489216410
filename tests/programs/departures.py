"""Members that come and go as actors do (`elastic=True`), for tests/test_departures.py.

    python tests/programs/departures.py

Runs these worlds one after the other, each driven by worker0, and prints one
JSON line per world, `{"check": <world>, ...}`, with what `asyncrpc.run` returned
(or raised) there; on stderr, `=== <world>` before each world's lines:

  deaths     an added worker and a first one (worker1) are SIGKILLed while worker0 runs
             a call on each: the calls fail named, every member hears `Left` with the
             signal, `members()` drops them, and the world goes on (an add, calls)
  removals   calls whose callers cancelled them do not hold a removal, blocking or
             not (`wait=False`: a Future that completes after the `Left` went out); a
             call not cancelled still finishes first; worker0 holds an RRef to the
             world's end (torch reports it); run twice, the second time with
             ASYNCRPC_TORCH_WARNINGS=1 (torch's warnings kept)
  callbacks  an `on_members` callback that raises on every event is logged once per
             kind of event, naming itself, the event and the worker; the others run
  rank0      worker0 is SIGKILLed: the world ends with `WorkerFailedError`
  fixed      a world that does not grow: `run` returns rank 0's result
  unpicklable  rank 0's main returns a lock: `run` raises `TypeError` naming its type
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import asyncrpc

from helpers import Counter, error_of, pid

BOUND_S = 30.0  # no wait of this program is longer
EVENTS: list[list[Any]] = []  # [kind, name, reason, time.monotonic()] as this worker heard
RECORDS: list[logging.LogRecord] = []
KEPT: list[Any] = []  # held to the world's end: torch reports them (a world that changed)


def record(event: Any) -> None:
    EVENTS.append([type(event).__name__, event.name, getattr(event, "reason", ""),
                   time.monotonic()])  # fmt: skip


def heard(at_least: int = 0) -> list[list[Any]]:
    """The events heard here, once there are `at_least` (or 5 s have passed).

    Each member hears a departure through its own side channel: a peer asked
    right after the caller heard it may still be reading the same news.
    """
    deadline = time.monotonic() + 5.0
    while len(EVENTS) < at_least and time.monotonic() < deadline:
        time.sleep(0.01)
    return [event[:3] for event in EVENTS]


def nap(seconds: float) -> str:
    time.sleep(seconds)
    return "slept"


def whoami() -> str:
    return asyncrpc.current_context().name


def kill(target: int) -> None:
    os.kill(target, signal.SIGKILL)


def wait_for(check: Any, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: waited {BOUND_S} s; heard {heard()}")
        time.sleep(0.005)


def left(name: str) -> list[Any] | None:
    return next((e for e in EVENTS if e[0] == "Left" and e[1] == name), None)


def die_during_a_call(victim: str) -> dict[str, Any]:
    """SIGKILL `victim` while this worker runs a call on it: the call's error, the Left."""
    running = asyncrpc.rpc_async(victim, nap, args=(BOUND_S,))
    target = asyncrpc.rpc_sync(victim, pid)
    killed_at = time.monotonic()
    kill(target)
    failed = error_of(running.wait)
    wait_for(lambda: left(victim) is not None, f"Left of {victim}")
    event = left(victim)
    assert event is not None
    return {"call": failed, "left": event[:3], "left_after_s": event[3] - killed_at}


def deaths(ctx: asyncrpc.Context) -> dict[str, Any]:
    if ctx.rank != 0:
        return {}
    added = asyncrpc.add_workers(1)[0]  # worker3
    out = {"added": die_during_a_call(added), "first": die_during_a_call("worker1")}
    out["members"] = list(asyncrpc.members())
    out["peer_heard"] = asyncrpc.rpc_sync("worker2", heard, args=(3,))
    out["call_after"] = error_of(lambda: asyncrpc.rpc_sync("worker1", whoami))
    # The world goes on: it grows again, and its members answer.
    grown = asyncrpc.add_workers(1)
    out["grown"] = [asyncrpc.rpc_sync(name, whoami) for name in ("worker2", *grown)]
    return out


def removals(ctx: asyncrpc.Context) -> dict[str, Any]:
    if ctx.rank != 0:
        return {}
    KEPT.append(asyncrpc.remote("worker1", Counter))  # an RRef
    first, second, third = asyncrpc.add_workers(3)
    held = [asyncrpc.rpc_async(name, nap, args=(BOUND_S,)) for name in (first, second)]
    finishing = asyncrpc.rpc_async(third, nap, args=(0.5,))
    time.sleep(0.3)  # they run
    cancelled = [fut.cancel() for fut in held]
    started = time.monotonic()
    asyncrpc.remove_workers(first)
    blocking_s = time.monotonic() - started
    started = time.monotonic()
    gone = asyncrpc.remove_workers(second, third, wait=False)
    returned_s = time.monotonic() - started
    done = threading.Event()
    seen: list[Any] = []

    def completed(fut: Any) -> None:  # on the events' thread: after the Lefts went out
        seen.extend([fut.value(), left(second) is not None, left(third) is not None])
        done.set()

    gone.add_done_callback(completed)
    names = gone.wait()
    waited_s = time.monotonic() - started
    done.wait(BOUND_S)
    return {
        "cancelled": cancelled,
        "blocking_s": blocking_s,
        "returned_s": returned_s,
        "waited_s": waited_s,
        "names": list(names),
        "seen": seen,
        "finished": finishing.wait(),
        "members": list(asyncrpc.members()),
        "again": error_of(lambda: asyncrpc.remove_workers(second, wait=False)),
    }


def bad_callback(event: Any) -> None:
    raise ValueError(f"cannot take {type(event).__name__}")


class _Keep(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        RECORDS.append(record)


def callbacks(ctx: asyncrpc.Context) -> dict[str, Any]:
    if ctx.rank != 0:
        return {}
    logging.getLogger("asyncrpc").addHandler(_Keep())
    asyncrpc.on_members(bad_callback)
    asyncrpc.on_members(record)  # registered after it: still hears every event
    added = asyncrpc.add_workers(2)
    asyncrpc.remove_workers(*added)
    wait_for(lambda: len(EVENTS) >= 4, "four events")
    time.sleep(0.2)  # a second log of one kind would come now
    return {
        "heard": heard(),
        "logged": [[r.levelname, r.name, r.getMessage(), r.exc_info is not None] for r in RECORDS],
    }


def rank0(ctx: asyncrpc.Context) -> None:
    if ctx.rank == 0:
        asyncrpc.rpc_sync("worker1", kill, args=(os.getpid(),))


def fixed(ctx: asyncrpc.Context) -> str:
    return f"{ctx.name} of {ctx.world_size}"


def unpicklable(ctx: asyncrpc.Context) -> Any:
    return threading.Lock()


def main(ctx: asyncrpc.Context, world: str) -> Any:
    if world in ("deaths", "removals"):
        asyncrpc.on_members(record)
    return globals()[world](ctx)


def emit(check: str, **values: Any) -> None:
    print(json.dumps({"check": check, **values}), flush=True)


def run(world: str, **options: Any) -> None:
    # Each world's stderr between two marks (its workers' is copied in before `run` returns).
    print(f"=== {world}", file=sys.stderr, flush=True)
    started = time.monotonic()
    try:
        returned = asyncrpc.run(main, args=(world,), **options)
    except Exception as exc:
        notes = getattr(exc, "__notes__", [])
        emit(world, raised=[type(exc).__name__, str(exc), notes], took=time.monotonic() - started)
        return
    emit(world, returned=returned, took=time.monotonic() - started)


if __name__ == "__main__":
    run("deaths", world_size=3, elastic=True)
    run("removals", world_size=2, elastic=True)
    os.environ["ASYNCRPC_TORCH_WARNINGS"] = "1"  # torch's own lines, for the test to read
    run("removals", world_size=2, elastic=True)
    del os.environ["ASYNCRPC_TORCH_WARNINGS"]
    run("callbacks", world_size=2, elastic=True)
    run("rank0", world_size=2, elastic=True)
    run("fixed", world_size=2)
    run("unpicklable", world_size=2, elastic=True)
    print("=== done", file=sys.stderr, flush=True)
