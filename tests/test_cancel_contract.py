"""`cancel()` says True only when the Future will fail with CancelledError, at once.

Races with completion, torch's builtin calls, then-chained async_execution
results, and the callee's bookkeeping after thousands of racing cancels,
between real workers. A hypothesis state machine drives random sequences of
calls, cancels and reads, and holds every Future to the contract.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import asyncrpc
from asyncrpc._core import _cancel, _execution, _torch

from conftest import until

pytestmark = pytest.mark.timeout(180)


def echo(value: int, seconds: float) -> int:
    time.sleep(seconds)
    return value


async def echo_async(value: int, seconds: float) -> int:
    if seconds:
        await asyncrpc.rpc_async("worker2", echo, args=(value, seconds))
    return value


_ran: dict[str, int] = {}
_ran_lock = threading.Lock()


def count(tag: str) -> int:
    with _ran_lock:
        _ran[tag] = _ran.get(tag, 0) + 1
        return _ran[tag]


def ran(tag: str) -> int:
    with _ran_lock:
        return _ran.get(tag, 0)


def sleep_then_count(tag: str, seconds: float) -> int:
    count(f"{tag}/started")
    time.sleep(seconds)
    return count(tag)


@asyncrpc.async_execution
def chained(tag: str) -> torch.futures.Future[int]:
    # One of the README's drop-in forms: a Future made with `then`, returned to torch.
    return asyncrpc.rpc_async("worker2", waits_for_cancel, args=(tag,)).then(lambda f: f.wait())


async def waits_for_cancel(tag: str) -> int:
    never: torch.futures.Future[int] = torch.futures.Future()
    try:
        count(f"{tag}/started")
        return await never
    finally:
        count(tag)  # reached when the cancel arrives


def bookkeeping() -> dict[str, int]:
    return _cancel.bookkeeping()


def still_running() -> list[str]:
    """What the callee runs now, named, for a failure's message (leaving out this call)."""
    asking = _cancel.current()
    return [
        f"{_execution.label_of(_execution._called(*state.call))} {state.call[1]!r:.200} "
        f"for {time.monotonic() - state.started:.1f} s"
        for state in _cancel.running_calls()
        if state is not asking and state.call
    ]


def _outcome(fut: torch.futures.Future[Any]) -> object:
    try:
        return fut.wait()
    except asyncrpc.CancelledError as exc:
        return exc


def test_a_cancel_racing_completion_never_says_true_and_delivers(world: asyncrpc.Context) -> None:
    outcomes = {"true-cancelled": 0, "false-value": 0}
    for i in range(2000):
        fut = asyncrpc.rpc_async("worker1", echo, args=(i, 0.0))
        if i % 3:
            time.sleep(0.0002 * (i % 5))
        said = fut.cancel()
        got = _outcome(fut)
        if said:
            assert isinstance(got, asyncrpc.CancelledError), (i, got)
            outcomes["true-cancelled"] += 1
        else:
            assert got == i, (i, got)
            outcomes["false-value"] += 1
    assert outcomes["true-cancelled"] and outcomes["false-value"], outcomes  # both sides raced
    assert until(lambda: asyncrpc.rpc_sync("worker1", bookkeeping)["running"] == 0)


def test_a_builtin_call_cancelled_fails_and_its_value_is_dropped(world: asyncrpc.Context) -> None:
    big = torch.rand(400, 400)
    fut = asyncrpc.rpc_async("worker1", torch.mm, args=(big, big))
    assert fut.cancel() is True
    started = time.monotonic()
    with pytest.raises(asyncrpc.CancelledError, match="mm"):
        fut.wait()
    assert time.monotonic() - started < 1.0
    time.sleep(0.3)  # the product arrives, and is dropped
    with pytest.raises(asyncrpc.CancelledError):
        fut.wait()
    # torch's operators run without a cancel key: nothing is left for one on the callee
    assert asyncrpc.rpc_sync("worker1", bookkeeping)["tombstones"] == 0


def test_a_then_chained_async_execution_result_is_cancelled_down_the_chain(
    world: asyncrpc.Context,
) -> None:
    fut = asyncrpc.rpc_async("worker1", chained, args=("then-chain",))
    # Started, not only arrived: a coroutine cancelled before it starts never runs
    # (nor its `finally`), which a loaded machine makes likely.
    assert until(lambda: asyncrpc.rpc_sync("worker2", ran, args=("then-chain/started",)) == 1)
    started = time.monotonic()
    assert fut.cancel() is True
    with pytest.raises(asyncrpc.CancelledError, match="chained"):
        fut.wait()
    assert time.monotonic() - started < 2.0  # bounded: it does not wait for worker2
    assert until(lambda: asyncrpc.rpc_sync("worker2", ran, args=("then-chain",)) == 1)
    for worker in ("worker1", "worker2"):  # nothing is left running on either callee
        assert until(lambda w=worker: asyncrpc.rpc_sync(w, bookkeeping)["running"] == 0), (
            worker,
            asyncrpc.rpc_sync(worker, still_running),
        )


def test_racing_cancels_leave_no_tombstones_on_the_callee(world: asyncrpc.Context) -> None:
    for i in range(3000):
        fut = asyncrpc.rpc_async("worker1", echo, args=(i, 0.0))
        if i % 2:
            fut.wait()  # the reply is in: the cancel says False and sends nothing
        fut.cancel()
    left = until(lambda: asyncrpc.rpc_sync("worker1", bookkeeping)["tombstones"] == 0)
    assert left, asyncrpc.rpc_sync("worker1", bookkeeping)


def test_a_sync_function_that_never_polls_runs_on_and_its_value_is_dropped(
    world: asyncrpc.Context,
) -> None:
    fut = asyncrpc.rpc_async("worker1", sleep_then_count, args=("runs-on", 0.5))
    # Running, not queued (a cancel stops a queued call before it starts).
    assert until(lambda: asyncrpc.rpc_sync("worker1", ran, args=("runs-on/started",)) == 1)
    assert fut.cancel() is True
    with pytest.raises(asyncrpc.CancelledError):
        fut.wait()  # at once, not after the function returns
    assert until(lambda: asyncrpc.rpc_sync("worker1", ran, args=("runs-on",)) == 1)


def fail(value: int, seconds: float) -> int:
    time.sleep(seconds)
    raise KeyError(f"no value {value}")


class Echo:
    def echo(self, value: int, seconds: float) -> int:
        return echo(value, seconds)


def fallback(fut: torch.futures.Future[Any]) -> Any:
    try:
        return fut.wait()
    except Exception:  # swallows every error, a cancel's too
        return -1


def _raise(fut: torch.futures.Future[Any]) -> Any:
    raise ValueError("the callback raised")


# What a then-callback does, and what it gives for each outcome of its source.
CALLBACKS: dict[str, Callable[[torch.futures.Future[Any]], Any]] = {
    "pass": lambda f: f.wait(),
    "add": lambda f: f.wait() + 1,
    "swallow": fallback,
    "raise": _raise,
}
CANCELLED: tuple[Any, ...] = ("cancelled",)
ERROR: tuple[Any, ...] = ("error",)


def _norm(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return int(value.item())
    if isinstance(value, list):
        return tuple(_norm(v) for v in value)
    if isinstance(value, _torch.FutureType):  # wait_first's: one of its inputs
        return id(value)
    return value


def _plus_one(value: Any) -> tuple[Any, ...]:
    try:
        return ("value", _norm(value + 1))
    except TypeError:  # a gather's list
        return ERROR


class Node:
    """A Future of the tree: what made it, from which others, and what its cancels said."""

    def __init__(self, fut: Any, how: str, parents: list[Node], expect: Any = None) -> None:
        self.fut, self.how, self.parents, self.expect = fut, how, parents, expect
        self.said: list[bool] = []
        self.reached = False  # a cancel of a Future made from it may have cancelled it
        self.got: Any = None  # its outcome, with its raw value

    def mark_reached(self) -> None:
        for parent in self.parents:
            parent.reached = True
            parent.mark_reached()

    def outcome(self) -> tuple[Any, ...]:
        try:
            value = self.fut.wait()
        except asyncrpc.CancelledError:
            return CANCELLED
        except Exception:
            return ERROR
        return ("value", value)


class CancelRace(RuleBasedStateMachine):
    """Random calls, then/chain/combinator trees, cancels and reads; all keep the contract.

    Sources are real calls (sync, async def, torch's operator, Batch, handle,
    failing); every other Future is made from earlier ones. Each cancel that
    says True must leave its Future failed with CancelledError at once and for
    good; at the end every Future has settled, and each one's outcome follows
    from its inputs' outcomes (or CancelledError, where a cancel reached it).
    """

    handle: Any = None  # a RemoteObject on worker1, made by the test

    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[Node] = []

    @rule(
        kind=st.sampled_from(["sync", "async", "builtin", "batch", "handle", "fail"]),
        value=st.integers(0, 1000),
        seconds=st.sampled_from([0.0, 0.001, 0.01, 0.05, 0.3]),
    )
    def start(self, kind: str, value: int, seconds: float) -> None:
        args = (value, seconds)
        if kind == "batch":
            with asyncrpc.Batch() as batch:
                fut = batch.rpc_async("worker1", echo, args=args)
        elif kind == "builtin":
            fut = asyncrpc.rpc_async("worker1", torch.add, args=(torch.tensor(value), 0))
        elif kind == "handle":
            fut = self.handle.call_async("echo", *args)
        else:
            func = {"sync": echo, "async": echo_async, "fail": fail}[kind]
            fut = asyncrpc.rpc_async("worker1", func, args=args)
        self.nodes.append(Node(fut, kind, [], ERROR if kind == "fail" else ("value", value)))

    def _pick(self, index: int) -> Node:
        inputs = [node for node in self.nodes if node.how != "wait_first"]  # its value: a Future
        return inputs[index % len(inputs)]

    @precondition(lambda self: self.nodes)
    @rule(
        index=st.integers(0, 100),
        callback=st.sampled_from(sorted(CALLBACKS)),
        cancel_now=st.booleans(),
    )
    def then(self, index: int, callback: str, cancel_now: bool) -> None:
        source = self._pick(index)
        self.nodes.append(Node(source.fut.then(CALLBACKS[callback]), callback, [source]))
        if cancel_now:  # while its source is likely still pending
            self._cancel(self.nodes[-1])

    @precondition(lambda self: self.nodes)
    @rule(index=st.integers(0, 100))
    def chain(self, index: int) -> None:
        source = self._pick(index)
        self.nodes.append(Node(asyncrpc.chain(source.fut, lambda v: v + 1), "chain", [source]))

    @precondition(lambda self: self.nodes)
    @rule(
        how=st.sampled_from(["gather", "wait_first", "with_timeout"]),
        first=st.integers(0, 100),
        second=st.integers(0, 100),
    )
    def combine(self, how: str, first: int, second: int) -> None:
        parts = [self._pick(first), self._pick(second)]
        futs = [part.fut for part in parts]
        if how == "gather":
            fut = asyncrpc.gather(futs)
        elif how == "wait_first":
            fut = asyncrpc.wait_first(futs)
        else:
            fut, parts = asyncrpc.with_timeout(futs[0], 60.0), parts[:1]
        self.nodes.append(Node(fut, how, parts))

    @precondition(lambda self: self.nodes)
    @rule(index=st.integers(0, 100), pause=st.sampled_from([0.0, 0.0005, 0.005]))
    def cancel(self, index: int, pause: float) -> None:
        time.sleep(pause)
        self._cancel(self.nodes[index % len(self.nodes)])

    def _cancel(self, node: Node) -> None:
        said = node.fut.cancel()
        node.said.append(said)
        if said:
            assert node.fut.done(), node.how  # at once
            assert node.outcome() == CANCELLED, node.how
            node.mark_reached()

    @precondition(lambda self: self.nodes)
    @rule(index=st.integers(0, 100))
    def read(self, index: int) -> None:
        node = self.nodes[index % len(self.nodes)]
        got = node.outcome()
        if True in node.said:
            assert got == CANCELLED, (node.how, got)

    @invariant()
    def at_most_one_true(self) -> None:
        for node in self.nodes:
            assert node.said.count(True) <= 1, node.said

    def teardown(self) -> None:
        for node in self.nodes:  # made after its inputs: they are checked first
            assert until(node.fut.done, 20.0), f"{node.how} never settled"
            node.got = node.outcome()
            assert node.outcome() == node.got, node.how  # settled once: every read agrees
            got = ("value", _norm(node.got[1])) if node.got[0] == "value" else node.got
            if True in node.said:
                assert got == CANCELLED, (node.how, got)
                continue
            allowed = self._expected(node)
            if node.reached:
                allowed.add(CANCELLED)
            assert got in allowed, (node.how, got, allowed, [p.got for p in node.parents])

    def _expected(self, node: Node) -> set[tuple[Any, ...]]:
        """The outcomes `node` may have, from its inputs' outcomes."""
        if not node.parents:
            return {node.expect}
        ins = [parent.got for parent in node.parents]
        if node.how == "wait_first":
            return {("value", id(parent.fut)) for parent in node.parents}
        if node.how == "gather":
            failed = {got for got in ins if got[0] != "value"}
            return failed or {("value", tuple(_norm(got[1]) for got in ins))}
        (source,) = ins
        if node.how == "with_timeout":
            return {("value", _norm(source[1])) if source[0] == "value" else source}
        if node.how == "swallow":
            return {("value", _norm(source[1]) if source[0] == "value" else -1)}
        if node.how == "raise" or (node.how != "chain" and source == ERROR):
            return {ERROR}  # torch's RuntimeError around the callback's error
        if source[0] != "value":
            return {source}  # a cancel is carried as it is; chain keeps every error's type
        return {("value", _norm(source[1]))} if node.how == "pass" else {_plus_one(source[1])}


@pytest.mark.usefixtures("world")
def test_random_trees_of_calls_cancels_and_reads_keep_the_contract() -> None:
    CancelRace.handle = asyncrpc.spawn("worker1", Echo)
    run = settings(
        max_examples=15,
        stateful_step_count=14,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )(CancelRace)
    run.TestCase().runTest()


def test_a_future_made_with_then_fails_with_cancelled_error_itself(
    world: asyncrpc.Context,
) -> None:
    chained = asyncrpc.rpc_async("worker1", echo, args=(1, 0.5)).then(lambda f: f.wait())
    assert chained.cancel() is True
    with pytest.raises(asyncrpc.CancelledError, match=r"echo\(\) on worker 'worker1'"):
        chained.wait()
    source = asyncrpc.rpc_async("worker1", echo, args=(2, 0.5))
    doubled = source.then(lambda f: f.wait() * 2)
    assert source.cancel() is True
    with pytest.raises(asyncrpc.CancelledError):
        doubled.wait()
    other = asyncrpc.rpc_async("worker1", echo, args=(3, 0.0)).then(lambda f: f.wait() + 1)
    assert other.wait() == 4  # uncancelled: the callback's value, as torch gives it
    failing = asyncrpc.rpc_async("worker1", echo, args=(4, 0.0)).then(lambda f: 1 / 0)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):  # torch's own wrapping
        failing.wait()


def test_a_then_future_cancelled_fails_whatever_its_callback_does(
    world: asyncrpc.Context,
) -> None:
    for callback in (fallback, _raise, lambda f: f.wait()):
        source = asyncrpc.rpc_async("worker1", echo, args=(1, 0.3))
        child = source.then(callback)
        assert child.cancel() is True
        assert child.done()  # at once
        with pytest.raises(asyncrpc.CancelledError, match=r"echo\(\) on worker 'worker1'"):
            child.wait()
        with pytest.raises(asyncrpc.CancelledError):  # the cancel went on to the source
            source.wait()
        time.sleep(0.4)  # the callback has run, its value dropped; the callee has finished
        with pytest.raises(asyncrpc.CancelledError):
            child.value()
        assert child.cancel() is False


def test_cancelling_the_source_leaves_a_then_future_to_its_callback(
    world: asyncrpc.Context,
) -> None:
    source = asyncrpc.rpc_async("worker1", echo, args=(1, 0.3))
    late = source.then(fallback)
    passed = source.then(lambda f: f.wait())
    assert source.cancel() is True
    assert late.wait() == -1 and late.cancel() is False  # never cancelled itself
    with pytest.raises(asyncrpc.CancelledError):
        passed.wait()


def test_a_then_future_is_cancelled_while_its_callback_runs_and_the_source_keeps_its_value(
    world: asyncrpc.Context,
) -> None:
    started, release = threading.Event(), threading.Event()

    def slow(f: torch.futures.Future[int]) -> int:
        started.set()
        release.wait(5)
        return f.wait() + 1

    # The source must still run when `then` is called: on a done source torch runs the
    # callback inline, in this thread, and the child is done before it can be cancelled.
    source = asyncrpc.rpc_async("worker1", echo, args=(1, 0.5))
    child = source.then(slow)
    assert started.wait(5)
    assert child.cancel() is True  # the source had finished: only the child is cancelled
    assert child.done()
    release.set()
    with pytest.raises(asyncrpc.CancelledError, match=r"made with then\(\)"):
        child.wait()
    assert source.wait() == 1
    done = asyncrpc.rpc_async("worker1", echo, args=(2, 0.0)).then(lambda f: f.wait() * 2)
    assert done.wait() == 4 and done.cancel() is False


def test_then_on_batch_calls_and_chains_of_then_keep_the_contract(
    world: asyncrpc.Context,
) -> None:
    with asyncrpc.Batch() as batch:
        call = batch.rpc_async("worker1", echo, args=(1, 0.0))
        child = call.then(fallback)
        assert child.cancel() is True  # before the send: the call never starts
    with pytest.raises(asyncrpc.CancelledError, match="before it started"):
        child.wait()
    source = asyncrpc.rpc_async("worker1", echo, args=(1, 0.3))
    end = source.then(fallback).then(lambda f: f.wait() + 1).then(fallback)
    assert end.cancel() is True
    with pytest.raises(asyncrpc.CancelledError):
        end.wait()
    with pytest.raises(asyncrpc.CancelledError):  # back to the call at its start
        source.wait()


def test_collect_all_over_asyncrpc_futures_is_cancelled_at_once(
    world: asyncrpc.Context,
) -> None:
    futs = [asyncrpc.rpc_async("worker1", echo, args=(i, 0.3)) for i in range(3)]
    collected = torch.futures.collect_all(futs)
    assert collected.cancel() is True
    assert collected.done()
    with pytest.raises(asyncrpc.CancelledError, match="collecting 3 others"):
        collected.wait()
    for fut in futs:  # and what it was made of
        with pytest.raises(asyncrpc.CancelledError):
            fut.wait()


def test_the_wait_first_idiom_holds_for_then_futures(world: asyncrpc.Context) -> None:
    paces = (0.02, 0.3, 2.0)
    futs = [
        asyncrpc.rpc_async("worker1", echo, args=(i, s)).then(fallback)
        for i, s in enumerate(paces)
    ]
    first = asyncrpc.wait_first(futs).wait()
    assert first is futs[0] and first.wait() == 0
    said = [fut.cancel() for fut in futs]
    assert said[0] is False and said[2] is True, said
    for i, fut in enumerate(futs):
        if said[i]:
            with pytest.raises(asyncrpc.CancelledError):
                fut.wait()
        else:
            assert fut.wait() == i  # finished: it keeps its value
