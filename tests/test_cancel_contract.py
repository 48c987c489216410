"""`cancel()` says True only when the Future will fail with CancelledError, at once.

Races with completion, torch's builtin calls, then-chained async_execution
results, and the callee's bookkeeping after thousands of racing cancels,
between real workers. A hypothesis state machine drives random sequences of
calls, cancels and reads, and holds every Future to the contract.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import asyncrpc
from asyncrpc._core import _cancel

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
    time.sleep(seconds)
    return count(tag)


@asyncrpc.async_execution
def chained(tag: str) -> torch.futures.Future[int]:
    # One of the README's drop-in forms: a Future made with `then`, returned to torch.
    return asyncrpc.rpc_async("worker2", waits_for_cancel, args=(tag,)).then(lambda f: f.wait())


async def waits_for_cancel(tag: str) -> int:
    never: torch.futures.Future[int] = torch.futures.Future()
    try:
        return await never
    finally:
        count(tag)  # reached when the cancel arrives


def bookkeeping() -> dict[str, int]:
    return _cancel.bookkeeping()


def _until(predicate: Any, seconds: float = 10.0) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.02)


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
    assert _until(lambda: asyncrpc.rpc_sync("worker1", bookkeeping)["running"] == 0)


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
    assert _until(lambda: asyncrpc.rpc_sync("worker2", bookkeeping)["running"] >= 1)
    started = time.monotonic()
    assert fut.cancel() is True
    with pytest.raises(asyncrpc.CancelledError, match="chained"):
        fut.wait()
    assert time.monotonic() - started < 2.0  # bounded: it does not wait for worker2
    assert _until(lambda: asyncrpc.rpc_sync("worker2", ran, args=("then-chain",)) == 1)
    for worker in ("worker1", "worker2"):  # nothing is left running on either callee
        assert _until(lambda w=worker: asyncrpc.rpc_sync(w, bookkeeping)["running"] == 0)


def test_racing_cancels_leave_no_tombstones_on_the_callee(world: asyncrpc.Context) -> None:
    for i in range(3000):
        fut = asyncrpc.rpc_async("worker1", echo, args=(i, 0.0))
        if i % 2:
            fut.wait()  # the reply is in: the cancel says False and sends nothing
        fut.cancel()
    left = _until(lambda: asyncrpc.rpc_sync("worker1", bookkeeping)["tombstones"] == 0)
    assert left, asyncrpc.rpc_sync("worker1", bookkeeping)


def test_a_sync_function_that_never_polls_runs_on_and_its_value_is_dropped(
    world: asyncrpc.Context,
) -> None:
    fut = asyncrpc.rpc_async("worker1", sleep_then_count, args=("runs-on", 0.5))
    time.sleep(0.1)
    assert fut.cancel() is True
    with pytest.raises(asyncrpc.CancelledError):
        fut.wait()  # at once, not after the function returns
    assert _until(lambda: asyncrpc.rpc_sync("worker1", ran, args=("runs-on",)) == 1)


class CancelRace(RuleBasedStateMachine):
    """Random calls, cancels and reads; every Future keeps the contract."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []

    @rule(
        kind=st.sampled_from(["sync", "async", "builtin", "batch"]),
        value=st.integers(0, 1000),
        seconds=st.sampled_from([0.0, 0.0, 0.001, 0.01, 0.05]),
    )
    def start(self, kind: str, value: int, seconds: float) -> None:
        if kind == "sync":
            fut = asyncrpc.rpc_async("worker1", echo, args=(value, seconds))
        elif kind == "async":
            fut = asyncrpc.rpc_async("worker1", echo_async, args=(value, seconds))
        elif kind == "builtin":
            fut = asyncrpc.rpc_async("worker1", torch.add, args=(torch.tensor(value), 0))
        else:
            with asyncrpc.Batch() as batch:
                fut = batch.rpc_async("worker1", echo, args=(value, seconds))
        self.calls.append({"fut": fut, "value": value, "said": []})

    @precondition(lambda self: self.calls)
    @rule(index=st.integers(0, 100), pause=st.sampled_from([0.0, 0.0005, 0.005]))
    def cancel(self, index: int, pause: float) -> None:
        call = self.calls[index % len(self.calls)]
        time.sleep(pause)
        call["said"].append(call["fut"].cancel())

    @precondition(lambda self: self.calls)
    @rule(index=st.integers(0, 100))
    def read(self, index: int) -> None:
        self._check(self.calls[index % len(self.calls)])

    @invariant()
    def at_most_one_true(self) -> None:
        for call in self.calls:
            assert call["said"].count(True) <= 1, call["said"]

    def _check(self, call: dict[str, Any]) -> None:
        got = _outcome(call["fut"])
        if True in call["said"]:
            assert isinstance(got, asyncrpc.CancelledError), got
        else:
            value = got.item() if isinstance(got, torch.Tensor) else got
            assert value == call["value"], (got, call)

    def teardown(self) -> None:
        for call in self.calls:
            self._check(call)


@pytest.mark.usefixtures("world")
def test_random_calls_cancels_and_reads_keep_the_contract() -> None:
    run = settings(
        max_examples=15,
        stateful_step_count=12,
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
