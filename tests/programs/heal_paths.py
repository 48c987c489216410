"""Every path a death takes to a survivor, in a world that heals: named, on every verb.

    python tests/programs/heal_paths.py SCENARIO

SCENARIO:
  streams     a producer dies as it makes item 6: what the consumer got, and how it ended
              (a generator, an async generator and a handle's generator; windows 1, 4, 32)
  arguments   an object whose owner died, sent on after the heal: as a handle or an RRef,
              from worker0 and from a survivor that was lent the handle before the death
  returned    an RRef or handle returned by a call as its owner dies: named, the caller lives
  two-deaths  two workers killed together: every call to either fails named until its
              replacement joined, the calls each replacement makes to the other too
  listener    something connects to worker2's port and closes (torch then closes its
              listener for good) as worker3 dies: both are replaced once, and a later
              death still heals

worker0 drives and prints one line, `heal paths: {json}`.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
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
            "notes": getattr(exc, "__notes__", []),
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


# ---- an RRef returned as its owner dies ---------------------------------------------------


def make_then_kill_owner(owner_pid: int, how: str) -> Any:
    """On worker1: an RRef (or handle) to an object on worker2; worker2 killed; returned."""
    made = asyncrpc.remote("worker2", pid) if how == "rref" else asyncrpc.spawn("worker2", Counter)
    assert (made.to_here() if how == "rref" else made.call("add", 1)) > 0
    os.kill(owner_pid, signal.SIGKILL)
    return {"made": [made]}  # inside a value, as results are


def returned() -> dict[str, Any]:
    """worker1 returns an RRef whose owner it has just killed; worker0 must live on."""
    seen: dict[str, Any] = {}
    for how in ("rref", "handle"):
        before = asyncrpc.rpc_sync("worker2", attempt)
        victim = asyncrpc.rpc_sync("worker2", pid)
        call = functools.partial(asyncrpc.rpc_sync, "worker1", make_then_kill_owner,
                                 args=(victim, how))  # fmt: skip
        seen[how] = outcome(call)
        until_back("worker2", before + 1)
    time.sleep(RETRIES_S)  # torch's retried notices would have failed, and ended this process
    seen["alive"] = {"pid": os.getpid(), "attempt": asyncrpc.current_context().attempt}
    return seen


RETRIES_S = 16.0  # torch retries an RRef's fork notice for about 13 s


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


# ---- a Batch beside a worker being replaced -------------------------------------------------


def batch_beside() -> dict[str, Any]:
    """Batches of [worker2, worker3] right after worker2 died: worker3's calls run."""
    seen: dict[str, Any] = {"batches": 0, "refused": 0, "others": [], "failures": []}
    for _ in range(3):
        before = asyncrpc.rpc_sync("worker2", attempt)
        os.kill(asyncrpc.rpc_sync("worker2", pid), signal.SIGKILL)
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            with asyncrpc.Batch(timeout=10) as batch:
                dead = batch.rpc_async("worker2", attempt)
                other = batch.rpc_async("worker3", attempt)
            seen["batches"] += 1
            seen["others"].append(outcome(other.wait))
            got = outcome(dead.wait)
            if "error" in got:
                seen["failures"].append(got)
                seen["refused"] += "nothing was sent" in got["message"]
            elif got["value"] > before:
                break  # the replacement answers
    return seen


# ---- nested calls and then-callbacks that meet the death ----------------------------------


async def relay_to(name: str) -> int:
    """On worker1: call `name` (it dies as it runs the call) from an async def."""
    got: int = await asyncrpc.rpc_async(name, die_now, timeout=10)
    return got


def die_now() -> int:
    os.kill(os.getpid(), signal.SIGKILL)
    return 0


def nested() -> dict[str, Any]:
    before = asyncrpc.rpc_sync("worker2", attempt)
    relayed = outcome(lambda: asyncrpc.rpc_sync("worker1", relay_to, args=("worker2",)))
    until_back("worker2", before + 1)
    fut = asyncrpc.rpc_async("worker2", die_now).then(lambda f: f.wait() + 1)
    then_child = outcome(fut.wait)
    until_back("worker2", before + 2)
    return {"relayed": relayed, "then": then_child}


# ---- a consumer that dies: the producer's generator is closed --------------------------------


def produce_forever() -> Any:
    i = 0
    while True:
        yield i
        i += 1


def consume_then_die() -> None:
    """On worker1: take three items of worker3's stream, then die holding it open."""
    stream = asyncrpc.stream("worker3", produce_forever, window=2)
    for _ in range(3):
        next(stream)
    STATE["stream"] = stream
    os.kill(os.getpid(), signal.SIGKILL)


def producers() -> tuple[int, int]:
    """Open producers and threads here; not the one that waits for the world's end."""
    from asyncrpc._core import _stream

    waiting = sum(t.name == "asyncrpc-end-wait" for t in threading.enumerate())
    return _stream.open_producers(), threading.active_count() - waiting


def consumer_dies() -> dict[str, Any]:
    first = asyncrpc.rpc_sync("worker3", producers)
    seen = []
    for round_ in range(4):
        before = asyncrpc.rpc_sync("worker1", attempt)
        asyncrpc.rpc_async("worker1", consume_then_die)
        until_back("worker1", before + 1)
        deadline = time.monotonic() + BOUND_S
        while asyncrpc.rpc_sync("worker3", producers)[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.append(asyncrpc.rpc_sync("worker3", producers))
        del round_
    return {"first": first, "after": seen}


# ---- a listener torch closed ----------------------------------------------------------------


def closed_listener() -> dict[str, Any]:
    """Scan worker2's port (connect, close) as worker3 dies; then kill worker3 again."""
    from asyncrpc._core import _torch  # where torch publishes a worker's address

    survivor = asyncrpc.rpc_sync("worker1", pid)
    address = _torch.agent_store().get("addrs/worker2").decode()  # uv://host:port
    victim = asyncrpc.rpc_sync("worker3", pid)
    socket.create_connection(("127.0.0.1", int(address.rsplit(":", 1)[1]))).close()
    os.kill(victim, signal.SIGKILL)  # its replacement's join meets worker2's closed listener
    failures = until_back("worker2", 1) + until_back("worker3", 1)
    os.kill(asyncrpc.rpc_sync("worker3", pid), signal.SIGKILL)  # a later death still heals
    failures += until_back("worker3", 2)
    failures += asyncrpc.rpc_sync("worker3", calls_to, args=("worker2",), timeout=60)
    return {
        "attempts": {name: asyncrpc.rpc_sync(name, attempt) for name in ("worker2", "worker3")},
        "survivor_kept": asyncrpc.rpc_sync("worker1", pid) == survivor,
        "failures": failures,
    }


def main(ctx: asyncrpc.Context, scenario: str) -> None:
    if ctx.rank != 0:
        return
    run = {
        "streams": streams,
        "arguments": arguments,
        "two-deaths": two_deaths,
        "batch": batch_beside,
        "nested": nested,
        "consumer-dies": consumer_dies,
        "returned": returned,
        "listener": closed_listener,
    }[scenario]
    print("heal paths: " + json.dumps(run()), flush=True)


if __name__ == "__main__":
    threading.excepthook = lambda args: None  # a killed worker's threads say nothing here
    asyncrpc.run(main, world_size=4, args=(sys.argv[1],), max_restarts=100, restart="worker",
                 rpc_timeout=20)  # fmt: skip
