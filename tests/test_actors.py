"""Objects as actors: one call at a time by default, groups and limits, asyncio, order.

A property-based test drives random mixes of sync and async methods, groups
and limits through one handle, and checks on the owner what ran at once
and in which order the calls of each group started.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

import asyncrpc

from conftest import PROGRAMS, run_program, until

pytestmark = pytest.mark.timeout(240)


class Tally:
    """A counter whose update races when two calls overlap (read, sleep, write)."""

    def __init__(self) -> None:
        self.value = 0
        self.order: list[int] = []
        self.active = self.most = 0

    def add(self, tag: int) -> int:
        self.active += 1
        self.most = max(self.most, self.active)
        seen = self.value
        time.sleep(0.0005)
        self.value = seen + 1
        self.order.append(tag)
        self.active -= 1
        return self.value

    def state(self) -> tuple[int, list[int], int]:
        return self.value, self.order, self.most

    def slow(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def test_calls_on_one_object_run_one_at_a_time_in_the_order_sent(
    world: asyncrpc.Context,
) -> None:
    tally = asyncrpc.spawn("worker1", Tally)
    futs = [tally.call_async("add", i) for i in range(64)]
    torch.futures.wait_all(futs)
    value, order, most = tally.call("state")
    assert (value, most) == (64, 1)  # no update lost, never two at once
    assert order == list(range(64))  # as this thread sent them
    assert [f.wait() for f in futs] == list(range(1, 65))


class SlottedTally:
    """A Tally that cannot be weakly referenced: its mailbox is found by its RRef's id."""

    __slots__ = ("active", "most", "order", "value")

    def __init__(self) -> None:
        self.value = self.active = self.most = 0
        self.order: list[int] = []

    add = Tally.add
    state = Tally.state


def test_an_object_without_weak_references_keeps_the_rules_too(
    world: asyncrpc.Context,
) -> None:
    with pytest.raises(TypeError):
        weakref.ref(SlottedTally())
    tally = asyncrpc.spawn("worker1", SlottedTally)
    other = asyncrpc.spawn("worker1", SlottedTally)  # a mailbox of its own
    futs = [h.call_async("add", i) for i in range(24) for h in (tally, other)]
    torch.futures.wait_all(futs)
    for handle in (tally, other):
        assert handle.call("state") == (24, list(range(24)), 1)


def test_max_concurrency_lets_that_many_run(world: asyncrpc.Context) -> None:
    tally = asyncrpc.spawn("worker1", asyncrpc.actor(max_concurrency=4)(Tally))
    torch.futures.wait_all([tally.call_async("slow", 0.05) for _ in range(16)])
    torch.futures.wait_all([tally.call_async("add", i) for i in range(32)])
    assert 1 < tally.call("state")[2] <= 4
    assert tally.to_here().order  # the object comes back as its own class


@asyncrpc.actor(concurrency_groups={"admin": 1})
class Service:
    """`status` answers in its own group while `work` runs."""

    def work(self, seconds: float) -> str:
        time.sleep(seconds)
        return "worked"

    @asyncrpc.method(concurrency_group="admin")
    def status(self) -> str:
        return "up"


def test_a_concurrency_group_runs_beside_the_default_one(world: asyncrpc.Context) -> None:
    service = asyncrpc.spawn("worker2", Service)
    busy = service.call_async("work", 1.0)
    started = time.monotonic()
    assert service.call("status") == "up"
    assert time.monotonic() - started < 0.9  # did not wait for `work`
    assert busy.wait() == "worked"
    assert service.to_here().status() == "up"  # a decorated class pickles by its name


class Waiter:
    """Async methods: they interleave on the worker's event loop."""

    def __init__(self) -> None:
        self.active = self.most = 0
        self.queue: asyncio.Queue[int] | None = None

    async def nap(self, seconds: float) -> str:
        self.active += 1
        self.most = max(self.most, self.active)
        await asyncio.sleep(seconds)
        self.active -= 1
        return threading.current_thread().name

    async def put(self, item: int) -> None:
        if self.queue is None:
            self.queue = asyncio.Queue()
        await self.queue.put(item)

    async def get(self) -> int:
        if self.queue is None:
            self.queue = asyncio.Queue()
        return await asyncio.wait_for(self.queue.get(), 10)

    def most_at_once(self) -> int:
        return self.most


def test_async_methods_interleave_on_the_event_loop(world: asyncrpc.Context) -> None:
    waiter = asyncrpc.spawn("worker1", Waiter)
    futs = [waiter.call_async("nap", 0.3) for _ in range(100)]
    assert {f.wait() for f in futs} == {"asyncrpc-loop"}
    assert waiter.call("most_at_once") >= 50  # they overlapped (1000 may run at once)
    got = waiter.call_async("get")  # waits on an asyncio.Queue ...
    waiter.call("put", 7)  # ... which another call fills
    assert got.wait() == 7


def test_cancelling_a_call_that_waits_for_its_turn(world: asyncrpc.Context) -> None:
    tally = asyncrpc.spawn("worker2", Tally)
    busy = tally.call_async("slow", 0.5)
    waiting = tally.call_async("add", 0)
    later = tally.call_async("add", 1)
    assert asyncrpc.cancel(waiting) is True
    with pytest.raises(asyncrpc.CancelledError, match=r"Tally.add\(\) on worker 'worker2'"):
        waiting.wait()
    assert later.wait() == 1 and busy.wait() == 0.5  # its turn went to the next
    assert tally.call("state")[1] == [1]


def test_a_call_that_timed_out_waiting_for_its_turn_never_runs(
    world: asyncrpc.Context,
) -> None:
    tally = asyncrpc.spawn("worker2", Tally)
    busy = tally.call_async("slow", 1.0)
    impatient = tally.options(timeout=0.3)
    with pytest.raises(asyncrpc.CallTimeoutError, match=r"Tally.add\(\)"):
        impatient.call("add", 0)  # its caller gave up: it must not run later
    late = impatient.call_async("add", 1)
    patient = tally.call_async("add", 2)  # the default timeout: it runs, in its turn
    with pytest.raises(asyncrpc.CallTimeoutError):
        late.wait()
    assert busy.wait() == 1.0 and patient.wait() == 1
    assert tally.call("state")[1] == [2]  # only the call whose caller still waited ran


def cancel_before_the_mailbox_takes_charge() -> tuple[bool, bool]:
    """On the owner: a call whose cancel arrived between its start and the mailbox's claim."""
    from torch.distributed import rpc

    from asyncrpc._core import _cancel
    from asyncrpc._core._mailbox import Options, invoke

    key = _cancel.new_key(99)
    state = _cancel.begin(key, (invoke, ()))
    outer = _cancel.enter(state)
    try:
        _cancel.deliver(key)  # the cancel comes first
        out = invoke("add", (0,), {}, [0, -1, Options(), 0.0], rpc.RRef(Tally()))
    finally:
        _cancel.enter(outer)
    still = any(running.key == key for running in _cancel.running_calls())
    return out.done(), still


def test_a_cancel_before_the_mailbox_takes_charge_ends_the_call(world: asyncrpc.Context) -> None:
    assert asyncrpc.rpc_sync("worker2", cancel_before_the_mailbox_takes_charge) == (True, False)


class Blocked:
    async def until_cancelled(self) -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.seen = asyncrpc.cancelled()
            raise
        return "slept"

    def seen_cancel(self) -> bool:
        return bool(getattr(self, "seen", False))


def test_cancel_reaches_an_async_method_at_its_await(world: asyncrpc.Context) -> None:
    blocked = asyncrpc.spawn("worker1", Blocked)
    fut = blocked.call_async("until_cancelled")
    time.sleep(0.3)
    assert fut.cancel() is True
    with pytest.raises(asyncrpc.CancelledError):
        fut.wait()  # at once; the cancel reaches the owner through the store meanwhile
    assert until(lambda: blocked.call("seen_cancel")) is True


async def one() -> int:
    await asyncio.sleep(0)
    return 1


async def asks_its_own_worker(name: str) -> str:
    try:
        asyncrpc.rpc_sync(name, one, timeout=20)  # would wait for this coroutine's loop
    except asyncrpc.NestedCallError as exc:
        return f"refused: {exc}"
    return "ran"


async def reads_its_own_futures(name: str) -> list[str]:
    """Blocking reads on the loop of Futures of this worker's coroutines: refused."""
    seen = [str(await asyncrpc.rpc_async(name, one))]  # awaiting: fine
    reads = {
        "wait": lambda: asyncrpc.rpc_async(name, one).wait(),
        "gather": lambda: asyncrpc.gather([asyncrpc.rpc_async(name, one)]).wait(),
        "asyncrpc.wait": lambda: asyncrpc.wait([asyncrpc.rpc_async(name, one)], timeout=20),
    }
    for what, read in reads.items():
        try:
            read()
            seen.append(f"{what}: read")
        except asyncrpc.NestedCallError:
            seen.append(f"{what}: refused")
    return seen


class Loopy:
    async def inner(self) -> int:
        return 1

    def plain(self) -> int:
        return 2

    async def outer(self, me: asyncrpc.RemoteObject[Loopy]) -> list[object]:
        seen: list[object] = [await me.call_async("inner")]  # awaiting: fine
        seen.append(me.call("plain"))  # a sync method runs on a thread: no wait for the loop
        try:
            me.call("inner")
        except asyncrpc.NestedCallError as exc:
            seen.append(str(exc))
        return seen


def test_a_coroutine_may_not_block_on_a_coroutine_of_its_own_worker(
    world: asyncrpc.Context,
) -> None:
    started = time.monotonic()
    said = asyncrpc.rpc_sync("worker1", asks_its_own_worker, args=("worker1",))
    assert said.startswith("refused: a blocking call of ") and "await" in said, said
    assert asyncrpc.rpc_sync("worker1", asks_its_own_worker, args=("worker2",)) == "ran"
    assert asyncrpc.rpc_sync("worker1", reads_its_own_futures, args=("worker1",)) == [
        "1",
        "wait: refused",
        "gather: refused",
        "asyncrpc.wait: refused",
    ]
    loopy = asyncrpc.spawn("worker2", Loopy)
    seen = loopy.call("outer", loopy)
    assert seen[:2] == [1, 2] and "Loopy.inner()" in str(seen[2]), seen
    assert time.monotonic() - started < 10  # refused at once, not at a timeout


def test_actor_options_are_checked() -> None:
    with pytest.raises(ValueError, match=r"max_concurrency .* got 0"):
        asyncrpc.actor(max_concurrency=0)
    with pytest.raises(TypeError, match=r"concurrency_groups maps names"):
        asyncrpc.actor(concurrency_groups=["io"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_restarts .* got -2"):
        asyncrpc.actor(max_restarts=-2)
    with pytest.raises(TypeError, match=r"retry_exceptions must be .* got str"):
        asyncrpc.method(retry_exceptions="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"decorates a class, got function"):
        asyncrpc.actor()(test_actor_options_are_checked)

    class Undeclared:
        @asyncrpc.method(concurrency_group="io")
        def fetch(self) -> None: ...

    with pytest.raises(ValueError, match=r"Undeclared.fetch is in concurrency group 'io'"):
        asyncrpc.actor()(Undeclared)


# ---- the rules, for random mixes ------------------------------------------------------------


class Probe:
    """Records, per group, how many calls ran at once and the order calls started in."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: dict[str, int] = {}
        self.most: dict[str, int] = {}
        self.started: dict[str, list[int]] = {}

    def _enter(self, group: str, tag: int) -> None:
        with self.lock:
            self.active[group] = self.active.get(group, 0) + 1
            self.most[group] = max(self.most.get(group, 0), self.active[group])
            self.started.setdefault(group, []).append(tag)

    def _leave(self, group: str) -> None:
        with self.lock:
            self.active[group] -= 1

    def sync_a(self, tag: int, seconds: float) -> int:
        self._enter("sync", tag)
        time.sleep(seconds)
        self._leave("sync")
        return tag

    async def async_a(self, tag: int, seconds: float) -> int:
        self._enter("async", tag)
        await asyncio.sleep(seconds)
        self._leave("async")
        return tag

    @asyncrpc.method(concurrency_group="io")
    def sync_io(self, tag: int, seconds: float) -> int:
        self._enter("io", tag)
        time.sleep(seconds)
        self._leave("io")
        return tag

    @asyncrpc.method(concurrency_group="io")
    async def async_io(self, tag: int, seconds: float) -> int:
        self._enter("io", tag)
        await asyncio.sleep(seconds)
        self._leave("io")
        return tag

    def report(self) -> tuple[dict[str, int], dict[str, list[int]]]:
        return self.most, self.started


_METHODS = ("sync_a", "async_a", "sync_io", "async_io")
_GROUP = {"sync_a": "sync", "async_a": "async", "sync_io": "io", "async_io": "io"}


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    max_concurrency=st.sampled_from([None, 1, 2, 3]),
    io_limit=st.integers(1, 3),
    calls=st.lists(
        st.tuples(st.sampled_from(_METHODS), st.sampled_from([0.0, 0.002, 0.01])),
        min_size=1,
        max_size=24,
    ),
)
def test_random_mixes_keep_the_limits_and_the_order(
    world: asyncrpc.Context,
    max_concurrency: int | None,
    io_limit: int,
    calls: list[tuple[str, float]],
) -> None:
    made = asyncrpc.actor(max_concurrency=max_concurrency, concurrency_groups={"io": io_limit})
    probe = asyncrpc.spawn("worker1", made(Probe))
    futs = [probe.call_async(name, tag, seconds) for tag, (name, seconds) in enumerate(calls)]
    assert [f.wait() for f in futs] == list(range(len(calls)))
    most, started = probe.call("report")
    limits = {"sync": max_concurrency or 1, "async": max_concurrency or 1000, "io": io_limit}
    for group, seen in most.items():
        assert seen <= limits[group], (group, most, calls)
    for group, tags in started.items():
        sent = [tag for tag, (name, _) in enumerate(calls) if _GROUP[name] == group]
        if limits[group] == 1:  # one at a time: in the order this thread sent them
            assert tags == sent, (group, started, calls)
        else:  # several at once take their places in that order, and start as threads go
            assert sorted(tags) == sent, (group, started, calls)


# ---- placement -------------------------------------------------------------------------------


def test_spawn_without_a_worker_places_on_the_least_loaded(world: asyncrpc.Context) -> None:
    from asyncrpc._placement import _load

    kept = []
    for _ in range(4):
        loads = {n: asyncrpc.rpc_sync(n, _load)[0] for n in world.names}
        kept.append(asyncrpc.spawn(None, Tally))
        owner = kept[-1].owner
        assert loads[owner] == min(loads.values()), (owner, loads)
        assert asyncrpc.rpc_sync(owner, _load)[0] == loads[owner] + 1  # counted there
    assert all(h.call("add", 0) == 1 for h in kept)
    with pytest.raises(asyncrpc.UnknownWorkerError, match=r"no worker is named 'wrker1'"):
        asyncrpc.spawn("wrker1", Tally)


# ---- retries of exceptions the method raised -----------------------------------------------


class Flaky:
    """Fails its first `failures` calls of each method with the error named."""

    def __init__(self) -> None:
        self.attempts = 0

    @asyncrpc.method(max_retries=3, retry_exceptions=(ConnectionError,))
    def fetch(self, failures: int, error: str = "ConnectionError") -> int:
        self.attempts += 1
        if self.attempts <= failures:
            raise {"ConnectionError": ConnectionError, "KeyError": KeyError}[error](self.attempts)
        return self.attempts

    def plain(self, failures: int) -> int:
        return self.fetch(failures)

    def reset(self) -> None:
        self.attempts = 0

    def always(self, seconds: float) -> int:
        self.attempts += 1
        time.sleep(seconds)
        raise ConnectionError(self.attempts)


def test_a_method_is_retried_as_it_says(world: asyncrpc.Context) -> None:
    flaky = asyncrpc.spawn("worker2", Flaky)
    assert flaky.call("fetch", 2) == 3  # two failures, retried
    flaky.call("reset")
    assert flaky.call_async("fetch", 3).wait() == 4  # three retries: enough
    flaky.call("reset")
    with pytest.raises(ConnectionError, match="4"):
        flaky.call("fetch", 9)  # 1 + 3 attempts, then the last error
    flaky.call("reset")
    with pytest.raises(KeyError):
        flaky.call("fetch", 1, "KeyError")  # not a type it retries
    assert flaky.call("fetch", 0) == 2  # the KeyError call ran once


def test_options_override_the_methods_retries(world: asyncrpc.Context) -> None:
    flaky = asyncrpc.spawn("worker1", Flaky)
    with pytest.raises(ConnectionError):
        flaky.options(max_retries=0).call("fetch", 1)  # no retry
    flaky.call("reset")
    assert flaky.options(retry_exceptions=True).call("fetch", 2) == 3  # any error: retried
    flaky.call("reset")
    with pytest.raises(ConnectionError):
        flaky.options(retry_exceptions=True).call("plain", 1)  # keeps plain's 0 retries
    flaky.call("reset")
    assert flaky.options(max_retries=3, retry_exceptions=True).call("plain", 2) == 3
    flaky.call("reset")
    with pytest.raises(ConnectionError):
        flaky.call("plain", 1)  # `plain` itself retries nothing
    retrying = flaky.options(max_retries=-1, retry_exceptions=(ConnectionError,))
    flaky.call("reset")
    assert retrying.call_async("plain", 6).wait() == 7
    with pytest.raises(ValueError, match=r"max_retries must be .* got -3"):
        flaky.options(max_retries=-3)
    with pytest.raises(TypeError, match=r"retry_exceptions must be"):
        flaky.options(retry_exceptions=[1])  # type: ignore[list-item]


def test_the_timeout_bounds_all_the_attempts_of_a_call(world: asyncrpc.Context) -> None:
    flaky = asyncrpc.spawn("worker1", Flaky)
    forever = flaky.options(max_retries=-1, retry_exceptions=True, timeout=0.8)
    for wait in (
        lambda: forever.call("always", 0.1),
        lambda: forever.call_async("always", 0.1).wait(),
    ):
        flaky.call("reset")
        started = time.monotonic()
        with pytest.raises(asyncrpc.CallTimeoutError, match=r"within its timeout \(0.8 s\)") as e:
            wait()
        assert time.monotonic() - started < 3.0  # not forever, not a full timeout per attempt
        assert isinstance(e.value.__cause__, ConnectionError)  # the last attempt's error
        assert 2 <= flaky.to_here().attempts <= 9  # retried, while time was left


# ---- restarts and retries across deaths, in a world that heals ------------------------------


@pytest.mark.subprocess
@pytest.mark.timeout(200)
def test_objects_restart_and_calls_retry_across_deaths() -> None:
    result = run_program("python", str(PROGRAMS / "actor_restarts.py"), "12", timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    for line in (
        "rebuilt fresh: ok",
        "on the replacement: ok",
        "a copy elsewhere: ok",
        "on_replaced fired: ok",
        "past max_restarts: lost: ok",
        "no max_restarts: lost: ok",
        "retried on the replacement: ok",
        "not retried where not asked: ok",
        "a copy from its creator: ok",
        "outlives its creator: ok",
        "its creator gone: lost: ok",
        "hypothesis: 12 examples",
    ):
        assert line in result.stdout, result.stdout


def use_handle(handle: asyncrpc.RemoteObject[Any]) -> int:
    return int(handle.call("add", 0))


def test_options_given_where_an_object_is_made(world: asyncrpc.Context) -> None:
    wider = asyncrpc.spawn("worker1", asyncrpc.actor(max_concurrency=3)(Tally))
    assert asyncrpc.rpc_sync("worker2", use_handle, args=(wider,)) == 1  # the handle crosses
    service = asyncrpc.spawn("worker2", asyncrpc.actor(max_concurrency=2)(Service))
    assert service.call("status") == "up"  # its groups stay (left out here)
    with pytest.raises(TypeError, match=r"write @asyncrpc.actor\(\) \(with the parentheses\)"):
        asyncrpc.actor(Tally)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"write @asyncrpc.method\(\) \(with the parentheses\)"):
        asyncrpc.method(Tally.add)  # type: ignore[arg-type]


class Unruly:
    """Methods that fail in the ways an object must survive."""

    def __init__(self) -> None:
        self.count = 0
        self.started: list[int] = []

    @property
    def exploding(self) -> int:
        raise RuntimeError("the property's getter raised")

    def exit(self) -> None:
        raise SystemExit("leaving")

    async def exit_later(self) -> None:
        await asyncio.sleep(0)
        raise SystemExit("leaving later")

    def add(self) -> int:
        self.count += 1
        return self.count

    async def note(self, tag: int) -> None:
        self.started.append(tag)  # before its first await: the order calls started in
        await asyncio.sleep(0)

    def notes(self) -> list[int]:
        return self.started


def test_an_object_goes_on_after_any_failure_of_a_call(world: asyncrpc.Context) -> None:
    unruly = asyncrpc.spawn("worker1", Unruly)
    untyped = asyncrpc.RemoteObject(unruly.rref)  # no class here: the owner looks it up
    with pytest.raises(RuntimeError, match=r"the property's getter raised"):
        untyped.call("exploding")
    with pytest.raises(RuntimeError, match=r"Unruly.exit\(\) raised SystemExit: leaving"):
        unruly.call("exit")
    with pytest.raises(RuntimeError, match=r"raised SystemExit: leaving later"):
        unruly.call("exit_later")
    assert unruly.call("add") == 1  # its place was given back each time
    assert asyncrpc.rpc_sync("worker1", _loop_answers) == "yes"  # the event loop lives on


async def _loop_answers() -> str:
    await asyncio.sleep(0)
    return "yes"


def test_async_calls_start_in_the_order_sent(world: asyncrpc.Context) -> None:
    unruly = asyncrpc.spawn("worker2", Unruly)
    torch.futures.wait_all([unruly.call_async("note", i) for i in range(300)])
    assert unruly.call("notes") == list(range(300))


def _slow_rebuild(value: int) -> int:
    time.sleep(1.0)  # the owner unpickles this argument slowly
    return value


class SlowArgument:
    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self) -> tuple[object, ...]:
        return (_slow_rebuild, (self.value,))


def test_a_call_given_up_before_it_arrived_gives_its_turn_back_and_never_runs(
    world: asyncrpc.Context,
) -> None:
    tally = asyncrpc.spawn("worker1", Tally)
    with pytest.raises(asyncrpc.CallTimeoutError):
        tally.options(timeout=0.3).call("add", SlowArgument(7))
    started = time.monotonic()
    assert tally.call("add", 1) == 1  # the next call's turn came at once
    assert time.monotonic() - started < 0.9
    time.sleep(1.2)  # the slow call has arrived by now, after its turn went on
    assert tally.call("state")[1] == [1]  # it never ran
