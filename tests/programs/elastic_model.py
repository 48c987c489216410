"""An elastic world that also heals, held to a model by a hypothesis state machine.

    python tests/programs/elastic_model.py [max_examples] [steps]

Starts `asyncrpc.run(main, world_size=2, elastic=True, restart="worker")`.
worker0 runs the machine: random adds and removes of workers, SIGKILLs of
added ones (healed in place), calls to members and to removed workers,
spawns and handle calls; worker0 and worker1 stay. After every step:

- `asyncrpc.members()` is the model's members, on worker0 and on worker1;
- a call to a removed worker fails with `WorkerLeftError` and runs nowhere;
- a handle whose owner left or died raises `ObjectLostError`, others count on;
- every event `on_members` delivered matches the changes made, in order.

At the end: no call ran twice (each appends its id to its process's file),
and worker1's fds and threads are where they were after the first example.
Exits 0 and prints "every example kept the model", or 1 with the example.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any

import asyncrpc

from helpers import Counter, pid

DIR_VARIABLE = "ELASTIC_MODEL_DIR"
MAX_LIVE = 6  # members at once, worker0 and worker1 included
BOUND_S = 30.0

faulthandler.register(signal.SIGUSR1)
_ran_lock = threading.Lock()
EVENTS: list[Any] = []  # what on_members delivered here
STEPS: dict[str, int] = {}  # how often each rule ran


def record(call_id: int) -> tuple[str, int]:
    """Run the call `call_id` here: its id appended to this process's file."""
    path = os.path.join(os.environ[DIR_VARIABLE], f"{os.getpid()}.ids")
    with _ran_lock:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{call_id}\n".encode())
        finally:
            os.close(fd)
    return asyncrpc.current_context().name, os.getpid()


def seen_members() -> tuple[str, ...]:
    return asyncrpc.members()


ACTOR_THREADS = 32  # the bound of the pool that runs sync calls which waited their turn


def usage() -> tuple[int, int, float, list[str]]:
    """This process's open descriptors, threads and resident memory (MiB).

    Threads of the mailboxes' pool (`asyncrpc-actor`, started as calls wait for
    their turn, at most ACTOR_THREADS) and torch's own threads that Python saw
    are bounded by design, not growth: checked against their bounds, left out.
    """
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    names = [t.name for t in threading.enumerate()]
    pool = sum(name.startswith("asyncrpc-actor") for name in names)
    assert pool <= ACTOR_THREADS, names
    # torch's own pool threads that ran Python which asked for its thread (Python
    # names them Dummy-N, and keeps them while they live): bounded by torch's pools.
    foreign = sum(name.startswith("Dummy-") for name in names)
    assert foreign <= 64, names
    named = sorted(n for n in names if not n.startswith(("asyncrpc-actor", "Dummy-")))
    return len(os.listdir("/proc/self/fd")), len(named), round(rss, 1), named


def _machine(max_examples: int, steps: int) -> None:
    from hypothesis import HealthCheck, settings
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

    ids = iter(range(1, 10**9))
    STEPS.clear()

    class ElasticWorld(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.live = ["worker0", "worker1"]
            self.removed: list[str] = []
            self.handles: list[list[Any]] = []  # [handle, owner, count, lost]
            self.expected: list[tuple[str, str]] = []  # the events on_members must deliver
            self.never: set[int] = set()  # ids of calls that must not run anywhere
            EVENTS.clear()

        def _added(self) -> list[str]:
            return [n for n in self.live if n not in ("worker0", "worker1")]

        def _objects_lost(self, name: str) -> None:
            for entry in self.handles:
                if entry[1] == name:
                    entry[3] = True

        @precondition(lambda self: len(self.live) < MAX_LIVE)
        @rule(count=st.integers(1, 2))
        def add(self, count: int) -> None:
            STEPS["add"] = STEPS.get("add", 0) + 1
            count = min(count, MAX_LIVE - len(self.live))
            names = asyncrpc.add_workers(count, timeout=BOUND_S)
            assert len(names) == count and not set(names) & set(self.live + self.removed)
            self.live += names
            self.expected += [("Joined", n) for n in names]

        @precondition(lambda self: self._added())
        @rule(data=st.data())
        def remove(self, data: Any) -> None:
            STEPS["remove"] = STEPS.get("remove", 0) + 1
            name = data.draw(st.sampled_from(self._added()))
            asyncrpc.remove_workers(name, timeout=BOUND_S)
            self.live.remove(name)
            self.removed.append(name)
            self._objects_lost(name)
            self.expected.append(("Left", name))

        @precondition(lambda self: self._added())
        @rule(data=st.data())
        def kill(self, data: Any) -> None:
            STEPS["kill"] = STEPS.get("kill", 0) + 1
            name = data.draw(st.sampled_from(self._added()))
            before = len(EVENTS)
            os.kill(asyncrpc.rpc_sync(name, pid), signal.SIGKILL)
            deadline = time.monotonic() + BOUND_S
            while not any(
                (type(e).__name__, e.name) == ("Replaced", name) for e in EVENTS[before:]
            ):
                assert time.monotonic() < deadline, f"{name} was not replaced"
                time.sleep(0.01)
            self._objects_lost(name)
            self.expected.append(("Replaced", name))

        @rule(data=st.data())
        def call(self, data: Any) -> None:
            STEPS["call"] = STEPS.get("call", 0) + 1
            name = data.draw(st.sampled_from(self.live))
            assert asyncrpc.rpc_sync(name, record, args=(next(ids),))[0] == name

        @precondition(lambda self: self.removed)
        @rule(data=st.data())
        def call_removed(self, data: Any) -> None:
            STEPS["call_removed"] = STEPS.get("call_removed", 0) + 1
            name = data.draw(st.sampled_from(self.removed))
            call_id = next(ids)
            self.never.add(call_id)
            try:
                asyncrpc.rpc_sync(name, record, args=(call_id,))
            except asyncrpc.WorkerLeftError as error:
                assert error.name == name
            else:
                raise AssertionError(f"a call to {name}, which left, ran")

        @precondition(lambda self: len(self.handles) < 8)
        @rule(data=st.data())
        def spawn(self, data: Any) -> None:
            STEPS["spawn"] = STEPS.get("spawn", 0) + 1
            name = data.draw(st.sampled_from(self.live))
            self.handles.append([asyncrpc.spawn(name, Counter), name, 0, False])

        @precondition(lambda self: self.handles)
        @rule(data=st.data())
        def use(self, data: Any) -> None:
            STEPS["use"] = STEPS.get("use", 0) + 1
            entry = self.handles[data.draw(st.integers(0, len(self.handles) - 1))]
            handle, owner, count, lost = entry
            if lost:
                try:
                    handle.call("add")
                except asyncrpc.ObjectLostError as error:
                    assert error.name == owner
                    return
                raise AssertionError(f"a handle to an object on {owner}, lost, answered")
            assert handle.call("add") == count + 1
            entry[2] = count + 1

        @invariant()
        def members_and_events_agree(self) -> None:
            assert asyncrpc.members() == tuple(self.live), (asyncrpc.members(), self.live)
            assert asyncrpc.rpc_sync("worker1", seen_members) == tuple(self.live)
            # Events arrive on a thread of their own; adds of two join in either order.
            deadline = time.monotonic() + 5.0
            while len(EVENTS) < len(self.expected) and time.monotonic() < deadline:
                time.sleep(0.01)
            got = sorted((type(e).__name__, e.name) for e in EVENTS)
            assert got == sorted(self.expected), (got, self.expected)

        def teardown(self) -> None:
            if self._added():
                asyncrpc.remove_workers(*self._added(), timeout=BOUND_S)
            ran = _ran_ids()
            assert not ran & self.never, f"calls to removed workers ran: {ran & self.never}"

    ElasticWorld.TestCase.settings = settings(
        max_examples=max_examples, stateful_step_count=steps, deadline=None,
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    ElasticWorld.TestCase().runTest()


def _ran_ids() -> set[int]:
    """Every call id any process ran; raises if one ran twice."""
    seen: list[int] = []
    folder = os.environ[DIR_VARIABLE]
    for name in os.listdir(folder):
        if name.endswith(".ids"):
            with open(os.path.join(folder, name)) as f:
                seen += [int(line) for line in f if line.strip()]
    twice = {i for i in seen if seen.count(i) > 1}
    assert not twice, f"calls ran twice: {sorted(twice)[:10]}"
    return set(seen)


def main(ctx: asyncrpc.Context, max_examples: int, steps: int) -> None:
    asyncrpc.on_members(EVENTS.append)
    if ctx.name != "worker0":
        return
    _machine(1, 4)  # what a first change starts (threads, connections) is not growth
    before = asyncrpc.rpc_sync("worker1", usage)
    try:
        _machine(max_examples, steps)
    except BaseException:
        import traceback

        traceback.print_exc()
        print("the model was broken", flush=True)
        raise
    after = asyncrpc.rpc_sync("worker1", usage)
    print(f"elastic model steps: {dict(sorted(STEPS.items()))}", flush=True)
    print(f"worker1 (fds, threads, RSS MiB): {before[:3]} before, {after[:3]} after", flush=True)
    print(f"worker1 threads: {before[3]} before, {after[3]} after", flush=True)
    assert after[0] <= before[0] + 4 and after[1] <= before[1] + 1, (before, after)
    assert after[2] <= before[2] + 24, (before, after)
    print("every example kept the model", flush=True)


if __name__ == "__main__":
    examples, count = (int(a) for a in (sys.argv[1:] or ["5", "12"]))
    folder = tempfile.mkdtemp(prefix="elastic-model-")
    os.environ[DIR_VARIABLE] = folder
    try:
        asyncrpc.run(main, world_size=2, args=(examples, count), elastic=True,
                     restart="worker", max_restarts=100_000, max_world_size=MAX_LIVE)  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)
