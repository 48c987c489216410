"""Who waits on whom, from workers' dumps: the cycles named, and which of them never end.

Pure functions of the dumps (`_core._waits`): the dumps here are made up. A
property-based test compares the calls named stuck with those a run of the
world, as torch's pool runs it, never ends.
"""

from __future__ import annotations

from typing import Any

import pytest

from asyncrpc._core import _waits

pytestmark = pytest.mark.timeout(120)


def test_cycles_are_found_once_from_the_dumps() -> None:
    def worker(name: str, threads: list[Any], in_flight: list[Any], total: int = 2) -> Any:
        return {"name": name, "total_threads": total, "threads": threads, "in_flight": in_flight}

    def call(key: int, label: str, thread: int | None = 1) -> Any:
        return {"key": key, "call": label, "thread": thread}

    def out(to: str, key: int, parent: int) -> Any:
        return {"to": to, "key": key, "parent": parent, "call": "?"}

    a = worker("a", [call(1, "f()"), call(2, "f()", 2)], [out("b", 10, 1), out("b", 11, 2)])
    b = worker("b", [call(10, "g()"), call(11, "g()", 2)], [out("a", 20, 10), out("a", 21, 11)])
    found = _waits.cycles([a, b])
    assert found == [[("a", "f()"), ("b", "g()"), ("a", "(queued: all 2 RPC threads busy)")]]
    assert _waits.describe(found[0]).startswith("cycle: a f() -> b g() -> a (queued")
    # One of a's threads is held by slow(), which waits on nothing: once it ends, g()'s
    # call starts on a; a wait, not a cycle.
    slow = worker("a", [call(1, "f()"), call(3, "slow()", 2)], [out("b", 10, 1)])
    served = worker("b", [call(10, "g()")], [out("a", 20, 10)], total=4)
    assert _waits.cycles([slow, served]) == [] and _waits.stuck([slow, served]) == set()
    queued = ("a", "(queued: all 2 RPC threads busy)")
    assert _waits.waits([slow, served]) == [
        ([("a", "f()"), ("b", "g()"), queued], [("a", "slow()")])
    ]
    assert _waits.describe_wait(_waits.waits([slow, served])[0]).endswith(
        "-> back to a f() (not a deadlock: it ends when a slow() ends)"
    )
    free = worker("a", [call(1, "f()")], [out("b", 10, 1)])  # a has a free RPC thread
    assert _waits.cycles([free, b]) == []
    waiting = worker("a", [call(1, "f()", None)], [out("b", 10, 1)], total=1)  # async: no thread
    assert _waits.cycles([waiting, worker("b", [call(10, "g()")], [out("a", 20, 10)])]) == []
    # f() holds the only RPC thread of a, waiting for a reply only that thread could deliver
    late = {**out("b", 10, 1), "age_s": 5.0}
    starved = _waits.cycles([worker("a", [call(1, "f()")], [late], total=1), worker("b", [], [])])
    assert starved == [[("a", "f()"), ("a", "(reply waits: all 1 RPC threads busy)")]]
    fresh = {**late, "age_s": 0.1}  # just sent: maybe still on the wire
    assert (
        _waits.cycles([worker("a", [call(1, "f()")], [fresh], total=1), worker("b", [], [])]) == []
    )


def _world_state(draw: Any) -> tuple[list[dict[str, Any]], set[tuple[str, int]]]:
    """Random dumps of a consistent world, and the calls that never end as torch runs it.

    Calls are made one by one from a running call (or a main thread); each
    starts on a free RPC thread of its callee (or at an `await`, holding
    none), or queues while all are busy. Then the world runs: a call that
    waits on no call ends, freeing its thread, and a queued call starts when
    a thread is free, and (having made no call yet) ends. What never ends is stuck.
    """
    import hypothesis.strategies as st

    workers = [f"w{i}" for i in range(draw(st.integers(1, 3)))]
    total = {w: draw(st.integers(1, 3)) for w in workers}
    running: dict[int, dict[str, Any]] = {}  # key -> {worker, thread}
    queued: dict[int, str] = {}  # key -> worker
    made: list[tuple[str, int, int, int]] = []  # (caller worker, parent key or -1, key, callee)
    for key in range(1, draw(st.integers(1, 9)) + 1):
        callee = draw(st.sampled_from(workers))
        parents = sorted(running)
        parent = draw(st.sampled_from([-1, *parents]))
        caller = running[parent]["worker"] if parent > 0 else draw(st.sampled_from(workers))
        made.append((caller, parent, key, callee))
        busy = sum(1 for c in running.values() if c["worker"] == callee and c["thread"])
        if draw(st.booleans()) and busy < total[callee]:
            running[key] = {"worker": callee, "thread": True}
        elif draw(st.booleans()) or busy >= total[callee]:
            queued[key] = callee
        else:
            running[key] = {"worker": callee, "thread": False}  # async: at an await
    reports = [
        {
            "name": w,
            "total_threads": total[w],
            "threads": [
                {"key": k, "call": f"c{k}()", "thread": k if c["thread"] else None}
                for k, c in running.items() if c["worker"] == w
            ],
            "in_flight": [
                {"to": to, "key": k, "parent": p, "call": f"c{k}()", "age_s": 0.0}
                for caller, p, k, to in made if caller == w
            ],
        }
        for w in workers
    ]  # fmt: skip
    return reports, _run_to_the_end(running, queued, made, total)


def _run_to_the_end(
    running: dict[int, dict[str, Any]], queued: dict[int, str],
    made: list[tuple[str, int, int, int]], total: dict[str, int],
) -> set[tuple[str, int]]:  # fmt: skip
    running, queued = {k: dict(c) for k, c in running.items()}, dict(queued)
    children = {k: {key for _, p, key, _ in made if p == k} for k in running}
    moved = True
    while moved:
        moved = False
        for key in [k for k in running if not children[k]]:
            del running[key]
            for waiting in children.values():
                waiting.discard(key)
            moved = True
        for key, worker in list(queued.items()):
            if (
                sum(1 for c in running.values() if c["worker"] == worker and c["thread"])
                < (total[worker])
            ):
                del queued[key]  # starts, and ends: it has made no call
                for waiting in children.values():
                    waiting.discard(key)
                moved = True
    return {(c["worker"], k) for k, c in running.items()}


def test_the_calls_named_stuck_are_those_that_never_end_as_the_world_runs() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=100, deadline=None)
    @given(st.data())
    def check(data: Any) -> None:
        reports, never_end = data.draw(st.composite(lambda draw: _world_state(draw))())
        assert _waits.stuck(reports) == never_end
        stuck_workers = {worker for worker, _ in never_end}
        for cycle in _waits.cycles(reports):  # a certain cycle is made of stuck calls
            assert {worker for worker, _ in cycle} <= stuck_workers
        certain = _waits.cycles(reports)
        for steps, frees in _waits.waits(reports):  # a wait can end: something frees it
            assert frees and steps not in certain

    check()
