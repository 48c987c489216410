"""`asyncrpc.wait` and `asyncrpc.ActorPool`, in Ray's shapes, over real workers."""

from __future__ import annotations

import time

import pytest
import torch

import asyncrpc

pytestmark = pytest.mark.timeout(120)


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


class Doubler:
    def __init__(self) -> None:
        self.calls = 0

    def double(self, x: int) -> int:
        self.calls += 1
        time.sleep(0.01 * (x % 3))
        if x < 0:
            raise ValueError(f"negative: {x}")
        return 2 * x

    def count(self) -> int:
        return self.calls


def test_wait_returns_the_first_done_in_the_order_given(world: asyncrpc.Context) -> None:
    slow = asyncrpc.rpc_async("worker1", nap, args=(1.5,))
    quick = [asyncrpc.rpc_async("worker2", nap, args=(0.01 * i,)) for i in range(3)]
    done, pending = asyncrpc.wait([slow, *quick], num_returns=2)
    assert len(done) == 2 and all(f in quick for f in done)
    assert pending[0] is slow and len(pending) == 2
    done, pending = asyncrpc.wait([slow], timeout=0.05)  # runs out: nothing done
    assert (done, pending) == ([], [slow])
    done, pending = asyncrpc.wait([slow, *quick], num_returns=4)
    assert done == [slow, *quick] and pending == []
    assert asyncrpc.wait([]) == ([], [])


def test_wait_with_timeout_zero_polls_as_in_ray(world: asyncrpc.Context) -> None:
    slow = asyncrpc.rpc_async("worker1", nap, args=(0.5,))
    started = time.monotonic()
    assert asyncrpc.wait([slow], timeout=0) == ([], [slow])
    assert time.monotonic() - started < 0.3
    slow.wait()


def test_wait_refuses_what_ray_refuses(world: asyncrpc.Context) -> None:
    fut = asyncrpc.completed(1)
    with pytest.raises(ValueError, match=r"num_returns must be between 1 and .* \(1\), got 2"):
        asyncrpc.wait([fut], num_returns=2)
    with pytest.raises(ValueError, match=r"same Future was given twice"):
        asyncrpc.wait([fut, fut])
    with pytest.raises(TypeError, match=r"item 0 is a int, not a Future"):
        asyncrpc.wait([1])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"timeout must be .* >= 0, got -1"):
        asyncrpc.wait([fut], timeout=-1)


def _double(h: asyncrpc.RemoteObject[Doubler], x: int) -> torch.futures.Future[int]:
    return h.call_async("double", x)


def test_actor_pool_maps_in_order_and_unordered(world: asyncrpc.Context) -> None:
    handles = [asyncrpc.spawn(w, Doubler) for w in ("worker1", "worker2")]
    pool = asyncrpc.ActorPool(handles)
    assert list(pool.map(_double, range(10))) == [2 * x for x in range(10)]
    assert sorted(pool.map_unordered(_double, range(10))) == [2 * x for x in range(10)]
    assert sum(h.call("count") for h in handles) == 20
    assert all(h.call("count") > 0 for h in handles)  # both took work


def test_actor_pool_by_hand(world: asyncrpc.Context) -> None:
    handles = [asyncrpc.spawn("worker1", Doubler), asyncrpc.spawn("worker2", Doubler)]
    pool = asyncrpc.ActorPool(handles)
    assert pool.has_free() and not pool.has_next()
    for x in (1, -1, 3):  # three works, two handles: one waits for a free handle
        pool.submit(_double, x)
    assert not pool.has_free()
    assert pool.get_next() == 2
    with pytest.raises(ValueError, match="negative: -1"):
        pool.get_next()  # the error of the work, in its turn
    assert pool.get_next(timeout=30) == 6
    assert not pool.has_next()
    with pytest.raises(StopIteration, match="no submitted work is left"):
        pool.get_next()
    idle = pool.pop_idle()
    assert idle is not None
    pool.submit(_double, 5)
    assert pool.get_next_unordered() == 10
    pool.push(idle)
    with pytest.raises(TypeError, match=r"fn must return the Future of one call"):
        pool.submit(lambda h, x: x, 1)
        pool.get_next()
    with pytest.raises(TypeError, match=r"ActorPool takes handles"):
        asyncrpc.ActorPool([1])  # type: ignore[list-item]


def test_actor_pool_map_starts_over_as_rays_does(world: asyncrpc.Context) -> None:
    pool = asyncrpc.ActorPool([asyncrpc.spawn("worker1", Doubler) for _ in range(2)])
    with pytest.raises(ValueError, match="negative"):
        list(pool.map(_double, [1, -2, 3, 4, 5]))
    assert list(pool.map(_double, [100, 101])) == [200, 202]  # nothing of the last map
    started = pool.map(_double, [10, 11, 12])
    assert next(started) == 20
    assert list(pool.map_unordered(_double, [7])) == [14]
    with pytest.raises(AttributeError, match="has no method 'triple'"):
        list(pool.map(lambda h, x: h.call_async("triple", x), [1]))
    assert list(pool.map(_double, [2])) == [4]  # the bad map left nothing behind
    empty: asyncrpc.ActorPool[asyncrpc.RemoteObject[Doubler]] = asyncrpc.ActorPool([])
    with pytest.raises(ValueError, match="the pool has no handles"):
        empty.submit(_double, 1)


def test_wait_on_a_call_of_an_unsent_batch_raises_at_once(world: asyncrpc.Context) -> None:
    with asyncrpc.Batch() as batch:
        unsent = batch.rpc_async("worker1", nap, args=(0.0,))
        started = time.monotonic()
        with pytest.raises(asyncrpc.BatchNotSentError):
            asyncrpc.wait([unsent], timeout=5)  # it could never complete: not a 5 s wait
        assert time.monotonic() - started < 2.0
        assert asyncrpc.wait([unsent], timeout=0) == ([], [unsent])  # a poll does not raise
    assert asyncrpc.wait([unsent]) == ([unsent], []) and unsent.wait() == 0.0  # sent now
