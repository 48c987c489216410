"""asyncrpc.Batch: many calls in one message, each with its own result and error."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest
import torch
from torch.futures import Future

import asyncrpc

from conftest import until


def double(x: int) -> int:
    return 2 * x


def lookup(key: str) -> int:
    return {"a": 1}[key]


_naps_ended = [0]  # on the worker that napped: naps over (returned or not)
_naps_lock = threading.Lock()


def nap(seconds: float) -> float:
    try:
        time.sleep(seconds)
        return seconds
    finally:
        with _naps_lock:
            _naps_ended[0] += 1


def naps_ended() -> int:
    with _naps_lock:
        return _naps_ended[0]


@asyncrpc.async_execution
async def relayed(x: int) -> int:
    return await asyncrpc.rpc_async("worker2", double, args=(x,)) + 1


def test_each_call_gets_its_own_result_in_order(world: asyncrpc.Context) -> None:
    x = torch.ones(2)
    with asyncrpc.Batch() as batch:
        doubled = [batch.rpc_async("worker1", double, args=(i,)) for i in range(300)]
        added = batch.rpc_async("worker2", torch.add, args=(x, 1))
        relay = batch.rpc_async("worker1", relayed, kwargs={"x": 5})
        assert not doubled[0].done()  # nothing leaves before send
    assert torch.futures.wait_all(doubled) == [2 * i for i in range(300)]
    assert torch.equal(added.wait(), x + 1)
    assert relay.wait() == 11


def test_a_remote_error_fails_only_its_own_call(world: asyncrpc.Context) -> None:
    batch = asyncrpc.Batch()
    ok, bad = (
        batch.rpc_async("worker1", lookup, args=("a",)),
        batch.rpc_async("worker1", lookup, args=("b",)),
    )
    batch.send()
    assert ok.wait() == 1
    with pytest.raises(KeyError) as raised:
        bad.wait()
    assert isinstance(raised.value, asyncrpc.RemoteError)
    assert "worker1" in str(raised.value)


def test_calls_are_checked_as_they_are_added(world: asyncrpc.Context) -> None:
    batch = asyncrpc.Batch()
    with pytest.raises(asyncrpc.UnknownWorkerError, match="worker9"):
        batch.rpc_async("worker9", double, args=(1,))
    with pytest.raises(TypeError, match="callable"):
        batch.rpc_async("worker1", double(1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="args must be a tuple"):
        batch.rpc_async("worker1", double, args=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        asyncrpc.Batch(timeout=-5)


def test_a_timed_out_message_fails_every_call_named(world: asyncrpc.Context) -> None:
    ended = asyncrpc.rpc_sync("worker2", naps_ended)
    batch = asyncrpc.Batch(timeout=0.3)
    futs: list[Future[float]] = [batch.rpc_async("worker2", nap, args=(0.5,)) for _ in range(2)]
    batch.send()
    for fut in futs:
        with pytest.raises(asyncrpc.CallTimeoutError, match="worker2") as raised:
            fut.wait()
        assert isinstance(raised.value, RuntimeError)
    # worker2's naps outlive their timeout: the next test finds its threads free again.
    assert until(lambda: asyncrpc.rpc_sync("worker2", naps_ended) >= ended + 2), (
        f"worker2 still napping: {asyncrpc.rpc_sync('worker2', naps_ended) - ended} of 2 ended"
    )


def test_a_block_that_raises_sends_nothing(world: asyncrpc.Context) -> None:
    with pytest.raises(ZeroDivisionError):
        with asyncrpc.Batch() as batch:
            fut = batch.rpc_async("worker1", double, args=(1,))
            1 / 0  # noqa: B018
    with pytest.raises(asyncrpc.BatchNotSentError, match="not sent"):
        fut.wait()


def test_reading_a_future_before_its_batch_is_sent_fails_at_once(
    world: asyncrpc.Context,
) -> None:
    with asyncrpc.Batch() as batch:
        fut = batch.rpc_async("worker1", double, args=(4,))
        started = time.monotonic()
        for read in (fut.wait, fut.value):
            with pytest.raises(
                asyncrpc.BatchNotSentError, match=r"not been sent.*batch\.send\(\)"
            ):
                read()
        with pytest.raises(asyncrpc.BatchNotSentError):
            asyncio.run(_awaited(fut))
        assert time.monotonic() - started < 1.0
    assert fut.wait() == 8  # sent when the block ended


async def _awaited(fut: Future[int]) -> int:
    return await fut


def test_a_batch_dropped_unsent_fails_its_futures(world: asyncrpc.Context) -> None:
    batch = asyncrpc.Batch()
    futs = [batch.rpc_async("worker1", double, args=(i,)) for i in range(3)]
    del batch
    gc.collect()
    for fut in futs:
        assert fut.done()
        with pytest.raises(asyncrpc.BatchNotSentError, match="dropped before it was sent"):
            fut.wait()


def test_no_read_of_an_unsent_batch_blocks(world: asyncrpc.Context) -> None:
    with asyncrpc.Batch() as batch:
        futs = [batch.rpc_async("worker1", double, args=(i,)) for i in range(3)]
        for read in (
            lambda: torch.futures.wait_all(futs),
            lambda: asyncrpc.gather(futs).wait(),
            lambda: asyncrpc.with_timeout(futs[0], 30).wait(),
            lambda: next(asyncrpc.as_completed(futs)),
        ):
            with pytest.raises(asyncrpc.BatchNotSentError):
                read()
        combined = torch.futures.collect_all(futs)  # combining is no read: allowed
    assert [f.wait() for f in combined.wait()] == [0, 2, 4]


def test_wait_all_ends_at_the_first_failed_call_of_a_batch(world: asyncrpc.Context) -> None:
    with asyncrpc.Batch() as batch:
        slow = batch.rpc_async("worker1", nap, args=(1.5,))
    with asyncrpc.Batch() as other:
        bad = other.rpc_async("worker2", lookup, args=("b",))
    started = time.monotonic()
    with pytest.raises(KeyError):
        torch.futures.wait_all([slow, bad])
    assert time.monotonic() - started < 1.0
    assert slow.wait() == 1.5


def test_a_message_that_cannot_be_sent_fails_the_rest_of_the_batch(
    world: asyncrpc.Context,
) -> None:
    batch = asyncrpc.Batch()
    first = batch.rpc_async("worker1", double, args=(threading.Lock(),))  # cannot be pickled
    second = batch.rpc_async("worker2", double, args=(2,))
    with pytest.raises(asyncrpc.SerializationError):
        batch.send()
    with pytest.raises(asyncrpc.SerializationError):
        first.wait()
    with pytest.raises(asyncrpc.BatchNotSentError, match="another message"):
        second.wait()
