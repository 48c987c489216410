"""Objects that restart, and calls retried across deaths, in a world that heals.

    python tests/programs/actor_restarts.py [EXAMPLES]

worker0 drives; the objects live on worker1 (their handles are copied to
worker2 too). Every attempt of a method notes itself on worker0
(`next_outcome`), which also tells it what to do: return, raise, or die
(`os._exit`, a death the world heals). Prints one line per check and, last,
"hypothesis: N examples" for the property: never more attempts than asked,
never a retry where not asked.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

import asyncrpc

PLANS: dict[int, list[str]] = {}  # on worker0: plan id -> outcomes of its attempts, in turn
ATTEMPTS: dict[int, int] = {}
LOCK = threading.Lock()
REPLACED: list[asyncrpc.Replaced] = []


def next_outcome(plan: int) -> str:
    """On worker0: note an attempt of `plan`; what that attempt does."""
    with LOCK:
        ATTEMPTS[plan] = ATTEMPTS.get(plan, 0) + 1
        outcomes = PLANS[plan]
        return outcomes[min(ATTEMPTS[plan], len(outcomes)) - 1]


def act(outcome: str) -> str:
    if outcome == "die":
        os._exit(3)
    if outcome in ("ValueError", "KeyError"):
        raise {"ValueError": ValueError, "KeyError": KeyError}[outcome](outcome)
    return outcome


@asyncrpc.actor(max_restarts=-1)
class Keeper:
    def __init__(self, start: int) -> None:
        self.value = start

    def add(self, k: int) -> int:
        self.value += k
        return self.value

    def pid(self) -> int:
        return os.getpid()

    def die(self) -> None:
        os._exit(3)

    def step(self, plan: int) -> str:
        return act(asyncrpc.rpc_sync("worker0", next_outcome, args=(plan,)))

    @asyncrpc.method(max_retries=1)
    def step_once_more(self, plan: int) -> str:
        return self.step(plan)


@asyncrpc.actor(max_restarts=1)
class Fragile(Keeper):
    pass


def through_copy(keeper: asyncrpc.RemoteObject[Keeper], k: int) -> int:
    """On worker2: a copy of the handle (its object restarted by worker0, the creator)."""
    return int(keeper.call("add", k))


def up(name: str) -> None:
    """Wait until `name` answers (a replacement may be joining)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            asyncrpc.rpc_sync(name, os.getpid)
            return
        except asyncrpc.WorkerUnreachableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def check(label: str, ok: bool, detail: object = "") -> None:
    print(f"{label}: {'ok' if ok else 'FAILED'} {detail}", flush=True)
    if not ok:
        sys.exit(1)


def restarts() -> None:
    keeper = asyncrpc.spawn("worker1", Keeper, 10)
    check("starts", keeper.call("add", 5) == 15)
    first = keeper.call("pid")
    died = keeper.call_async("die")
    try:
        died.wait()
        check("death fails the call", False)
    except asyncrpc.WorkerUnreachableError as exc:
        check("death fails the call", True, type(exc).__name__)
    check("rebuilt fresh", keeper.call("add", 1) == 11)
    check("on the replacement", keeper.call("pid") != first and keeper.owner == "worker1")
    check("a copy elsewhere", asyncrpc.rpc_sync("worker2", through_copy, args=(keeper, 2)) == 13)
    check("on_replaced fired", any(r.name == "worker1" for r in REPLACED), REPLACED)
    fragile = asyncrpc.spawn("worker1", Fragile, 0)
    plain = asyncrpc.spawn("worker1", dict)
    outcomes = []
    for _ in range(2):  # max_restarts=1: one restart, then lost
        try:
            fragile.call("die")
        except asyncrpc.WorkerUnreachableError:
            pass
        try:
            outcomes.append(fragile.call("add", 1))
        except asyncrpc.ObjectLostError as exc:
            outcomes.append(type(exc).__name__)
    check("past max_restarts: lost", outcomes == [1, "ObjectLostError"], outcomes)
    try:
        plain.call("__len__")
        check("no max_restarts: lost", False)
    except asyncrpc.ObjectLostError:
        check("no max_restarts: lost", True)
    up("worker1")


def death_retried() -> None:
    keeper = asyncrpc.spawn("worker1", Keeper, 0)
    PLANS[1] = ["die", "done"]
    check("retried on the replacement", keeper.call("step_once_more", 1) == "done")
    check("twice", ATTEMPTS[1] == 2, ATTEMPTS)
    PLANS[2] = ["die", "done"]
    try:
        keeper.call("step", 2)
        check("not retried where not asked", False)
    except asyncrpc.WorkerUnreachableError:
        check("not retried where not asked", ATTEMPTS[2] == 1, ATTEMPTS)
    up("worker1")


def spawn_here() -> asyncrpc.RemoteObject[Keeper]:
    """On worker2: create an object on worker1; its handle goes back to worker0."""
    return asyncrpc.spawn("worker1", Keeper, 100)


def die_here() -> None:
    os._exit(3)


def creator_dies() -> None:
    """The creator keeps the recipe, as a Ray actor's owner: past its death, no restart."""
    keeper = asyncrpc.rpc_sync("worker2", spawn_here)
    check("a copy from its creator", keeper.call("add", 1) == 101)
    try:
        asyncrpc.rpc_sync("worker2", die_here)
    except asyncrpc.WorkerUnreachableError:
        pass
    up("worker2")
    check("outlives its creator", keeper.call("add", 1) == 102)
    try:
        keeper.call("die")
    except asyncrpc.WorkerUnreachableError:
        pass
    try:
        keeper.call("add", 1)
        check("its creator gone: lost", False)
    except asyncrpc.ObjectLostError as exc:
        check("its creator gone: lost", True, type(exc).__name__)
    up("worker1")


OUTCOME = st.sampled_from(["done", "ValueError", "KeyError", "die"])
RETRY_ON: list[Any] = [False, True, (ValueError,)]


def expected(outcomes: list[str], retries: int, retry_on: Any) -> tuple[int, str]:
    """(attempts, the last outcome) by the rules of asyncrpc/_retry.py."""
    for attempt, outcome in enumerate(outcomes, 1):
        retry = {
            "done": False,
            "die": True,
            "KeyError": retry_on is True,
            "ValueError": retry_on is True or retry_on == (ValueError,),
        }[outcome]
        if not retry or attempt > retries:
            return attempt, outcome
    return len(outcomes), outcomes[-1]


def prove(examples: int, keeper: asyncrpc.RemoteObject[Keeper]) -> None:
    plans = iter(range(100, 100_000))

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        outcomes=st.lists(OUTCOME, min_size=1, max_size=3).map(lambda o: [*o, "done"]),
        retries=st.integers(0, 2),
        retry_on=st.sampled_from(RETRY_ON),
        sync=st.booleans(),
    )
    def attempts_as_asked(outcomes: list[str], retries: int, retry_on: Any, sync: bool) -> None:
        if outcomes.count("die") > 1:
            outcomes = [o for o in outcomes if o != "die"] or ["done"]  # one death at most
        plan = next(plans)
        PLANS[plan] = outcomes
        handle = keeper.options(max_retries=retries, retry_exceptions=retry_on)
        try:
            if sync:
                got = handle.call("step", plan)
            else:
                got = handle.call_async("step", plan).wait()
        except asyncrpc.WorkerUnreachableError:
            got = "die"
        except (ValueError, KeyError) as exc:
            got = type(exc).__name__
        want = expected(outcomes, retries, retry_on)
        assert (ATTEMPTS.get(plan, 0), got) == want, (outcomes, retries, retry_on, ATTEMPTS[plan])

    attempts_as_asked()
    print(f"hypothesis: {examples} examples", flush=True)


def main(ctx: asyncrpc.Context, examples: int) -> None:
    if ctx.rank != 0:
        return
    asyncrpc.on_replaced(REPLACED.append)
    restarts()
    death_retried()
    creator_dies()
    prove(examples, asyncrpc.spawn("worker1", Keeper, 0))


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    asyncrpc.run(main, world_size=3, restart="worker", max_restarts=100, args=(count,))
