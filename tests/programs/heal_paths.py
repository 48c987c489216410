"""Every path a death takes to a survivor, in a world that heals: named, on every verb.

    python tests/programs/heal_paths.py SCENARIO

SCENARIO:
  streams     a producer dies as it makes item 6: what the consumer got, and how it ended
              (a generator, an async generator and a handle's generator; windows 1, 4, 32)
  arguments   an object whose owner died, sent on after the heal: as a handle or an RRef,
              from worker0 and from a survivor that was lent the handle before the death
  two-deaths  two workers killed together: every call to either fails named until its
              replacement joined, the calls each replacement makes to the other too

worker0 drives and prints one line, `heal paths: {json}`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

import asyncrpc

BOUND_S = 30.0
STATE: dict[str, Any] = {}


def pid() -> int:
    return os.getpid()


def attempt() -> int:
    return asyncrpc.current_context().attempt


def countdown(n: int, die_at: int) -> Any:
    """A generator whose process dies (SIGKILL) as it makes item `die_at`."""
    for i in range(n):
        if i == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        yield i


async def countdown_async(n: int, die_at: int) -> Any:
    for i in range(n):
        if i == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        yield i


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def add(self, k: int) -> int:
        self.n += k
        return self.n

    def countdown(self, n: int, die_at: int) -> Any:
        yield from countdown(n, die_at)


def outcome(run: Any) -> dict[str, Any]:
    try:
        value = run()
    except Exception as exc:
        return {
            "error": type(exc).__name__,
            "named": isinstance(exc, asyncrpc.WorkerUnreachableError),
            "name": getattr(exc, "name", None),
            "message": str(exc)[:400],
        }
    return {"value": value}


def until_back(name: str, want: int) -> list[dict[str, Any]]:
    """Call `name` until its process is attempt `want`; the failures meanwhile."""
    seen = []
    deadline = time.monotonic() + BOUND_S
    while True:
        got = outcome(lambda: asyncrpc.rpc_sync(name, attempt, timeout=10))
        if got.get("value", -1) >= want:
            return seen
        if "error" in got:
            seen.append(got)
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} was not back at attempt {want} within {BOUND_S} s")
        time.sleep(0.002)


# ---- streams: a dying producer ---------------------------------------------------------


def _consume(make: Any) -> dict[str, Any]:
    got: list[int] = []

    def run() -> None:
        for item in make():
            got.append(item)

    return {"got": got, **outcome(run)}


def streams() -> dict[str, Any]:
    seen: dict[str, Any] = {}
    n = 0
    for window in (1, 4, 32):
        for kind in ("generator", "async", "handle"):
            before = asyncrpc.rpc_sync("worker1", attempt)
            if kind == "handle":
                counter = asyncrpc.spawn("worker1", Counter).options(window=window)
                result = _consume(lambda c=counter: c.stream("countdown", 10, 6))
            else:
                func = countdown if kind == "generator" else countdown_async
                result = _consume(lambda f=func, w=window: asyncrpc.stream(
                    "worker1", f, args=(10, 6), window=w))  # fmt: skip
            seen[f"{kind}/{window}"] = result
            until_back("worker1", before + 1)
            n += 1
    return seen


# ---- arguments: objects of a dead process, sent on --------------------------------------


def use(handle: asyncrpc.RemoteObject[Counter]) -> int:
    return int(handle.call("add", 1))


def use_rref(rref: Any) -> int:
    return int(rref.to_here())


def keep(handle: asyncrpc.RemoteObject[Counter]) -> int:
    STATE["kept"] = handle
    return int(handle.call("add", 1))


def pass_kept_on(to: str) -> int:
    """On a survivor: send the handle it kept (its owner died since) to another worker."""
    return int(asyncrpc.rpc_sync(to, use, args=(STATE["kept"],)))


def call_kept() -> int:
    return int(STATE["kept"].call("add", 1))


def arguments() -> dict[str, Any]:
    counter = asyncrpc.spawn("worker2", Counter)
    value = asyncrpc.remote("worker2", pid)
    assert value.to_here() > 0
    assert asyncrpc.rpc_sync("worker1", keep, args=(counter,)) == 1  # lent before the death
    before = asyncrpc.rpc_sync("worker2", attempt)
    os.kill(asyncrpc.rpc_sync("worker2", pid), signal.SIGKILL)
    until_back("worker2", before + 1)
    return {
        "handle": outcome(lambda: asyncrpc.rpc_sync("worker1", use, args=(counter,))),
        "handle_async": outcome(
            lambda: asyncrpc.rpc_async("worker1", use, args=(counter,)).wait()
        ),
        "handle_remote": outcome(
            lambda: asyncrpc.remote("worker1", use, args=(counter,)).to_here()
        ),
        "rref": outcome(lambda: asyncrpc.rpc_sync("worker1", use_rref, args=(value,))),
        "kept_call": outcome(lambda: asyncrpc.rpc_sync("worker1", call_kept)),
        "kept_passed_on": outcome(
            lambda: asyncrpc.rpc_sync("worker1", pass_kept_on, args=("worker3",))
        ),
        "own_call": outcome(lambda: counter.call("add", 1)),
    }


# ---- two deaths at once -------------------------------------------------------------------


def calls_to(name: str) -> list[dict[str, Any]]:
    """On a replacement: call `name` until it answers; the failures meanwhile."""
    seen = []
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        got = outcome(lambda: asyncrpc.rpc_sync(name, attempt, timeout=10))
        if "value" in got:
            return seen
        seen.append(got)
        time.sleep(0.002)
    raise AssertionError(f"{name} did not answer within {BOUND_S} s")


def two_deaths() -> dict[str, Any]:
    failures: list[dict[str, Any]] = []
    for _ in range(5):
        pids = {name: asyncrpc.rpc_sync(name, pid) for name in ("worker2", "worker3")}
        attempts = {name: asyncrpc.rpc_sync(name, attempt) for name in pids}
        for victim in pids.values():
            os.kill(victim, signal.SIGKILL)
        for name in pids:
            failures += until_back(name, attempts[name] + 1)
        # Each replacement calls the other (it may have joined while the other was replaced).
        failures += asyncrpc.rpc_sync("worker3", calls_to, args=("worker2",), timeout=60)
        failures += asyncrpc.rpc_sync("worker2", calls_to, args=("worker3",), timeout=60)
    return {"failures": failures, "rounds": 5}


def main(ctx: asyncrpc.Context, scenario: str) -> None:
    if ctx.rank != 0:
        return
    run = {"streams": streams, "arguments": arguments, "two-deaths": two_deaths}[scenario]
    print("heal paths: " + json.dumps(run()), flush=True)


if __name__ == "__main__":
    threading.excepthook = lambda args: None  # a killed worker's threads say nothing here
    asyncrpc.run(main, world_size=4, args=(sys.argv[1],), max_restarts=100, restart="worker",
                 rpc_timeout=20)  # fmt: skip
