"""Cancelling calls between real workers: pending, queued, running, chained, and many.

worker0 (this process) calls; worker1 and worker2 run. What the callees saw
is kept in `_seen` on each of them and read back with `seen()`.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import Any

import pytest
import torch
from torch.futures import Future

import asyncrpc
from asyncrpc._core import _cancel

from conftest import ROOT, run_program, until

_seen: dict[str, list[str]] = {}  # on each callee: tag -> what happened, in order
_seen_lock = threading.Lock()
_alive: weakref.WeakSet[Any] = weakref.WeakSet()  # on each callee: locals of calls


class Local:
    """A local of a call; a weakref says whether anything still holds it."""

    def __init__(self) -> None:
        _alive.add(self)


def note(tag: str, what: str) -> None:
    with _seen_lock:
        _seen.setdefault(tag, []).append(what)


def seen(tag: str) -> list[str]:
    with _seen_lock:
        return list(_seen.get(tag, []))


def callee_leftovers() -> tuple[int, int, int]:
    """(other calls running, tombstones, locals alive) on this worker."""
    gc.collect()
    held = _cancel.bookkeeping()  # leaves out this very call
    return held["running"], held["tombstones"], len(_alive)


async def hop(tag: str, to: str) -> str:
    """Awaits the next hop; notes what happens to it."""
    local = Local()
    note(tag, f"{asyncrpc.current_context().name} started")
    try:
        return await asyncrpc.rpc_async(to, wait_forever, args=(tag,))
    except BaseException as exc:
        note(tag, f"{asyncrpc.current_context().name} got {type(exc).__name__}")
        raise
    finally:
        del local


async def wait_forever(tag: str) -> str:
    never: Future[str] = Future()  # nothing ever completes it
    local = Local()
    note(tag, f"{asyncrpc.current_context().name} started")
    try:
        return await never
    except BaseException as exc:
        note(tag, f"{asyncrpc.current_context().name} got {type(exc).__name__}")
        raise
    finally:
        del local


def mark(tag: str) -> str:
    note(tag, "ran")
    return "ran"


def sleepy(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def polls(tag: str, seconds: float) -> str:
    note(tag, "started")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if asyncrpc.cancelled():
            note(tag, "saw cancelled()")
            return "stopped early"
        time.sleep(0.01)
    return "ran to the end"


def _started(worker: str, tag: str) -> None:
    assert until(lambda: asyncrpc.rpc_sync(worker, seen, args=(tag,))), f"{tag} never started"


def test_a_running_async_def_and_the_call_it_awaits_stop(world: asyncrpc.Context) -> None:
    # worker0 -> worker1 (awaits) -> worker2 (awaits forever): all three stop.
    fut = asyncrpc.rpc_async("worker1", hop, args=("chain", "worker2"))
    _started("worker2", "chain")
    started = time.monotonic()
    assert fut.cancel() is True
    with pytest.raises(asyncrpc.CancelledError, match=r"hop\(\) on worker 'worker1'") as raised:
        fut.wait()
    assert time.monotonic() - started < 2.0
    assert isinstance(raised.value, __import__("concurrent.futures").futures.CancelledError)
    assert raised.value.name == "worker1"
    last = ["worker2 got CancelledError"]
    assert until(lambda: asyncrpc.rpc_sync("worker2", seen, args=("chain",))[-1:] == last)
    assert asyncrpc.rpc_sync("worker1", seen, args=("chain",)) == [
        "worker1 started",
        "worker1 got CancelledError",
    ]
    assert asyncrpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1)).item() == 2


def test_a_queued_call_never_starts(world: asyncrpc.Context) -> None:
    # Every RPC thread of worker2 sleeps; the marked call waits in torch's queue.
    busy = [asyncrpc.rpc_async("worker2", sleepy, args=(1.0,)) for _ in range(16)]
    time.sleep(0.2)
    queued = asyncrpc.rpc_async("worker2", mark, args=("queued",))
    assert asyncrpc.cancel(queued) is True
    with pytest.raises(asyncrpc.CancelledError, match=r"mark\(\) on worker 'worker2' was cancel"):
        queued.wait()  # at once, though worker2's threads are all busy
    torch.futures.wait_all(busy)
    assert asyncrpc.rpc_sync("worker2", seen, args=("queued",)) == []


def test_a_sync_function_can_poll_cancelled(world: asyncrpc.Context) -> None:
    fut = asyncrpc.rpc_async("worker1", polls, args=("polled", 10.0))
    _started("worker1", "polled")
    started = time.monotonic()
    assert fut.cancel()
    with pytest.raises(asyncrpc.CancelledError, match=r"polls\(\) on worker 'worker1'"):
        fut.wait()  # whatever it returned
    assert time.monotonic() - started < 2.0
    polled = ["started", "saw cancelled()"]  # the cancel reaches the callee soon after
    assert until(lambda: asyncrpc.rpc_sync("worker1", seen, args=("polled",)) == polled)
    assert not asyncrpc.cancelled()  # outside a call


def test_cancelling_a_finished_call_is_a_no_op(world: asyncrpc.Context) -> None:
    fut = asyncrpc.rpc_async("worker1", mark, args=("finished",))
    assert fut.wait() == "ran"
    assert fut.cancel() is False and asyncrpc.cancel(fut) is False
    assert fut.wait() == "ran"
    assert asyncrpc.cancel(torch.futures.Future()) is False  # not asyncrpc's to cancel
    with pytest.raises(TypeError, match="takes a Future"):
        asyncrpc.cancel("not a future")  # type: ignore[arg-type]


def test_handles_call_all_batch_and_with_timeout_cancel(world: asyncrpc.Context) -> None:
    handle = asyncrpc.spawn("worker1", Waiter)
    fut = handle.call_async("wait", "handle")
    _started("worker1", "handle")
    assert fut.cancel()
    with pytest.raises(asyncrpc.CancelledError, match=r"Waiter\.wait\(\)"):
        fut.wait()
    both = asyncrpc.call_all([handle, asyncrpc.spawn("worker2", Waiter)], "wait", "all")
    assert until(lambda: len(asyncrpc.rpc_sync("worker2", seen, args=("all",))) >= 1), (
        "worker2's Waiter.wait('all') never started"
    )
    assert both.cancel()
    with pytest.raises(asyncrpc.CancelledError):
        both.wait()
    timed = asyncrpc.with_timeout(
        asyncrpc.rpc_async("worker1", wait_forever, args=("timed",)), 0.3, cancel=True
    )
    with pytest.raises(TimeoutError):
        timed.wait()
    assert until(lambda: "worker1 got CancelledError" in asyncrpc.rpc_sync(
        "worker1", seen, args=("timed",)))  # fmt: skip
    with asyncrpc.Batch() as batch:
        unsent = batch.rpc_async("worker1", mark, args=("batched",))
        assert unsent.cancel()  # before the send: it never starts on the callee
    with pytest.raises(asyncrpc.CancelledError, match="before it started"):
        unsent.wait()
    with asyncrpc.Batch() as batch:
        sent = batch.rpc_async("worker1", wait_forever, args=("batch-sent",))
    _started("worker1", "batch-sent")
    assert sent.cancel()
    with pytest.raises(asyncrpc.CancelledError):
        sent.wait()
    assert asyncrpc.rpc_sync("worker1", seen, args=("batched",)) == []


class Waiter:
    async def wait(self, tag: str) -> str:
        return await wait_forever(tag)


@pytest.mark.timeout(120)
def test_1000_cancels_leave_nothing_behind(world: asyncrpc.Context) -> None:
    futs = [asyncrpc.rpc_async("worker1", wait_forever, args=(f"many-{i}",)) for i in range(1000)]
    assert until(lambda: asyncrpc.rpc_sync("worker1", callee_leftovers)[0] >= 1000, 30.0), (
        asyncrpc.rpc_sync("worker1", callee_leftovers)
    )
    assert all([fut.cancel() for fut in futs])
    for fut in futs:
        with pytest.raises(asyncrpc.CancelledError):
            fut.wait()
    caller_side = [weakref.ref(fut) for fut in futs[::50]]
    del futs, fut
    gc.collect()
    assert sum(ref() is not None for ref in caller_side) == 0
    assert until(lambda: asyncrpc.rpc_sync("worker1", callee_leftovers) == (0, 0, 0)), (
        asyncrpc.rpc_sync("worker1", callee_leftovers)
    )
    assert asyncrpc.rpc_sync("worker1", mark, args=("after the 1000",)) == "ran"  # still serving


@pytest.mark.timeout(60)
def test_cancelled_then_chains_stop_their_calls_and_leave_nothing_on_the_callee(
    world: asyncrpc.Context,
) -> None:
    sources = [asyncrpc.rpc_async("worker1", wait_forever, args=(f"t{i}",)) for i in range(100)]
    futs = [source.then(lambda f: f.wait()).then(lambda f: "swallowed") for source in sources]
    assert until(lambda: asyncrpc.rpc_sync("worker1", callee_leftovers)[0] >= 100, 30.0), (
        asyncrpc.rpc_sync("worker1", callee_leftovers)
    )
    assert all([fut.cancel() for fut in futs])  # each one back to its call
    for fut in futs + sources:
        with pytest.raises(asyncrpc.CancelledError):
            fut.wait()
    assert until(lambda: asyncrpc.rpc_sync("worker1", callee_leftovers) == (0, 0, 0)), (
        asyncrpc.rpc_sync("worker1", callee_leftovers)
    )


def test_a_cancelled_calls_spans_end_with_its_cause(
    world: asyncrpc.Context, tmp_path: Any
) -> None:
    with asyncrpc.trace(tmp_path / "cancelled.json", workers=["worker1"]) as trace:
        fut = asyncrpc.rpc_async("worker1", wait_forever, args=("traced",))
        _started("worker1", "traced")
        fut.cancel()
        with pytest.raises(asyncrpc.CancelledError):
            fut.wait()  # fails at once; the callee stops a moment later
        # Its run span ends when it has stopped: the trace keeps what ended inside it.
        assert until(lambda: asyncrpc.rpc_sync("worker1", callee_leftovers)[0] == 0)
    spans = [e for e in trace.events if e.get("cat") == "asyncrpc" and "wait_forever" in e["name"]]
    outcomes = {e["args"]["kind"]: e["args"].get("outcome", "") for e in spans}
    assert outcomes["call"].startswith("cancelled: the call to wait_forever()"), outcomes
    assert outcomes["run"].startswith("cancelled"), outcomes


@pytest.mark.subprocess
def test_the_cancel_example_stops_the_losers_and_the_late() -> None:
    done = run_program("python", str(ROOT / "examples" / "cancel.py"), timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "first: worker1 found 'k'" in out, out
    assert out.count("cancelled: the call to search() on worker") == 2, out
    assert out.count(": cancelled, stopping") == 3, out  # two losers, then the late one
    assert "deadline: the Future did not complete within 0.3 s" in out, out
    assert "worker3: scan saw it was cancelled" in out and "scan: cancelled" in out, out
