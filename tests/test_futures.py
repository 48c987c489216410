"""Future composition on every engine that makes Futures: threads, jit.fork, RPC workers."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.futures import Future

import asyncrpc

Make = Callable[[Any, float], Future[Any]]


def delayed(value: Any, seconds: float) -> Any:
    time.sleep(seconds)
    if isinstance(value, BaseException):
        raise value
    return value


def _thread(value: Any, seconds: float) -> Future[Any]:
    fut: Future[Any] = Future()

    def finish() -> None:
        if isinstance(value, BaseException):
            fut.set_exception(value)
        else:
            fut.set_result(value)

    threading.Timer(seconds, finish).start()
    return fut


def _fork(value: Any, seconds: float) -> Future[Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jit.fork's deprecation warning
        return torch.jit.fork(delayed, value, seconds)


@pytest.fixture(params=["thread", "jit.fork", "rpc"])
def make(request: pytest.FixtureRequest) -> Make:
    if request.param == "thread":
        return _thread
    if request.param == "jit.fork":
        return _fork
    request.getfixturevalue("world")
    return lambda value, seconds: asyncrpc.rpc_async("worker1", delayed, args=(value, seconds))


class ShardMissing(KeyError):
    pass


def test_completed_and_failed_keep_value_and_type() -> None:
    assert asyncrpc.completed(3).wait() == 3
    with pytest.raises(ShardMissing):
        asyncrpc.failed(ShardMissing("s1")).wait()
    with pytest.raises(TypeError, match="exception instance"):
        asyncrpc.failed("boom")  # type: ignore[arg-type]


def test_chain_feeds_values_through(make: Make) -> None:
    out = asyncrpc.chain(make(torch.ones(2), 0.05), lambda x: x + 1, lambda x: x * 2)
    assert torch.equal(out.wait(), torch.full((2,), 4.0))


def test_chain_step_may_return_a_future(make: Make) -> None:
    out = asyncrpc.chain(make(1, 0.01), lambda x: make(x + 1, 0.01), lambda x: x * 10)
    assert out.wait() == 20


def test_chain_error_in_a_callback_keeps_its_type_and_skips_the_rest(make: Make) -> None:
    ran = []

    def explode(x: int) -> int:
        raise ShardMissing(f"shard {x}")

    out = asyncrpc.chain(make(7, 0.01), explode, ran.append)
    with pytest.raises(ShardMissing, match="shard 7"):
        out.wait()
    assert ran == []


def _skip_failing_fork(make: Make) -> None:
    if make is _fork:
        pytest.skip("eager jit.fork runs the function at the fork call: its error raises there")


def test_chain_input_failure_reaches_the_caller(make: Make) -> None:
    _skip_failing_fork(make)
    out = asyncrpc.chain(make(ValueError("bad input"), 0.01), lambda x: x)
    with pytest.raises(Exception, match="bad input"):
        out.wait()


def test_chain_rejects_a_called_function() -> None:
    with pytest.raises(TypeError, match=r"got a int where a callable.*chain\(fut, f\)"):
        asyncrpc.chain(asyncrpc.completed(1), 5)  # type: ignore[arg-type]


def test_gather_keeps_the_order(make: Make) -> None:
    out = asyncrpc.gather([make(i, 0.05 * (3 - i)) for i in range(4)])
    assert out.wait() == [0, 1, 2, 3]
    assert asyncrpc.gather([]).wait() == []


def test_gather_fails_fast(make: Make) -> None:
    _skip_failing_fork(make)
    slow = make(1, 3.0)
    start = time.monotonic()
    out = asyncrpc.gather([slow, make(ShardMissing("lost"), 0.05)])
    with pytest.raises(Exception, match="lost"):
        out.wait()
    assert time.monotonic() - start < 2.5
    assert not slow.done()  # out failed while an input was still running
    slow.wait()


def _is_async(fut: Future[Any]) -> bool:
    return not fut.done()


def test_gather_rejects_non_futures() -> None:
    with pytest.raises(TypeError, match=r"item 1 is a Tensor, not a Future.*completed\(value\)"):
        asyncrpc.gather([asyncrpc.completed(1), torch.ones(1)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="got one Future"):
        asyncrpc.gather(asyncrpc.completed(1))  # type: ignore[arg-type]


def test_wait_first_gives_the_first_done(make: Make) -> None:
    slow, fast = make("slow", 1.0), make("fast", 0.0)
    first = asyncrpc.wait_first([slow, fast]).wait()
    assert first.wait() in (("fast",) if _is_async(slow) else ("slow", "fast"))
    with pytest.raises(ValueError, match="at least one"):
        asyncrpc.wait_first([])
    slow.wait()


def test_as_completed_in_completion_order(world: asyncrpc.Context) -> None:
    futs = [
        asyncrpc.rpc_async(n, delayed, args=(n, d))
        for n, d in (("worker1", 0.6), ("worker2", 0.0))
    ]
    assert [f.wait() for f in asyncrpc.as_completed(futs, timeout=10)] == ["worker2", "worker1"]


def test_as_completed_times_out(world: asyncrpc.Context) -> None:
    fut = asyncrpc.rpc_async("worker2", delayed, args=(1, 1.0))
    with pytest.raises(TimeoutError, match=r"1 of 1 Futures still pending after 0\.1 s"):
        list(asyncrpc.as_completed([fut], timeout=0.1))
    fut.wait()


def test_with_timeout_fires_without_a_thread_per_future(world: asyncrpc.Context) -> None:
    before = threading.active_count()
    start = time.monotonic()
    slow = [asyncrpc.rpc_async("worker1", delayed, args=(i, 1.5)) for i in range(20)]
    guarded = [asyncrpc.with_timeout(f, 0.2) for f in slow]
    for fut in guarded:
        with pytest.raises(TimeoutError, match=r"did not complete within 0\.2 s"):
            fut.wait()
    assert time.monotonic() - start < 1.4
    assert threading.active_count() <= before + 1  # the one shared clock thread at most
    assert [f.wait() for f in slow] == list(range(20))  # the calls themselves went on


def test_with_timeout_passes_the_outcome_through(make: Make) -> None:
    assert asyncrpc.with_timeout(make(5, 0.01), 10).wait() == 5
    with pytest.raises(ShardMissing):
        asyncrpc.with_timeout(asyncrpc.failed(ShardMissing("x")), 10).wait()


@pytest.mark.parametrize(
    ("seconds", "error"), [(-1, ValueError), (float("nan"), ValueError), ("1", TypeError)]
)
def test_with_timeout_rejects_bad_delays(seconds: object, error: type) -> None:
    with pytest.raises(error, match="timeout must be"):
        asyncrpc.with_timeout(asyncrpc.completed(1), seconds)  # type: ignore[arg-type]


def test_timeout_zero_has_one_meaning_no_timeout(world: asyncrpc.Context) -> None:
    # As in torch, a call's timeout=0 means no timeout; helpers that only time out refuse it.
    assert asyncrpc.rpc_sync("worker1", sleepy, args=(0.2,), timeout=0) == 0.2
    with pytest.raises(ValueError, match=r"timeout=0 would mean no timeout.*seconds > 0"):
        asyncrpc.with_timeout(asyncrpc.completed(1), 0)
    with pytest.raises(ValueError, match=r"timeout=0 would mean no timeout"):
        list(asyncrpc.as_completed([asyncrpc.completed(1)], timeout=0))


def sleepy(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def test_futures_tour_example_prints_its_results() -> None:
    from conftest import ROOT, run_program

    done = run_program("python", str(ROOT / "examples" / "futures_tour.py"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "chain: tensor([4., 4.])",
        "gather: [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]",
        "wait_first: tensor([21., 21.])",
        "with_timeout: the Future did not complete within 0.1 s",
        "Batch: 10100.0",
    ]
    assert "a call nobody waited for failed: check_shard() on worker2 raised KeyError" in (
        done.stderr
    )
