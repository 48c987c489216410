"""Failed calls leave nothing behind, on either side (weakrefs and resident memory).

An exception kept by a torch Future would hold its traceback, the traceback
its frames, and a frame the Future: a cycle through C++ that Python's gc
cannot collect. Here 4,000 `async def` calls raise after an await, each
holding a 1 MiB local, and 4,000 handle-method calls do the same; nothing
they made may stay alive, and the callee's memory must not grow.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import time
import weakref
from typing import Any

import pytest
import torch

import asyncrpc

CALLS = 4_000
IN_FLIGHT = 200
_alive: weakref.WeakSet[Any] = weakref.WeakSet()  # on the callee: what the calls made


class Payload:
    """A 1 MiB local of a call; a weakref tells whether anything still holds it."""

    def __init__(self) -> None:
        self.data = bytearray(1 << 20)
        _alive.add(self)


def noop() -> None:
    return None


async def fails_after_await(to: str, tag: int) -> None:
    local = Payload()
    await asyncrpc.rpc_async(to, noop)
    raise ValueError(f"call {tag} failed after an await, holding {len(local.data)} bytes")


class Service:
    def __init__(self) -> None:
        _alive.add(self)

    async def fail(self, to: str, tag: int) -> None:
        local = Payload()
        await asyncrpc.rpc_async(to, noop)
        raise KeyError(f"method call {tag} failed holding {len(local.data)} bytes")

    def fail_now(self, tag: int) -> None:
        local = Payload()
        raise KeyError(f"sync method call {tag} failed holding {len(local.data)} bytes")


def _method_call(service: asyncrpc.RemoteObject[Service], i: int) -> torch.futures.Future[None]:
    if i % 4 == 0:
        return service.call_async("fail_now", i)
    return service.call_async("fail", "worker2", i)


def callee_state() -> tuple[int, int]:
    """(objects the calls made that are still alive, resident KiB) on this worker.

    Memory malloc keeps for reuse is handed back first (glibc's malloc_trim), so
    RSS counts what is held, not how the agent's threads' arenas are cut up.
    """
    gc.collect()
    _trim()
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return len(_alive), rss


def _trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS as it is
        pass


def _fail_many(start: Any, count: int, error: type[BaseException]) -> list[Any]:
    """Start `count` failing calls, IN_FLIGHT at a time; weakrefs to a sample of Futures."""
    sample = []
    for first in range(0, count, IN_FLIGHT):
        futs = [start(i) for i in range(first, min(count, first + IN_FLIGHT))]
        for fut in futs:
            with pytest.raises(error):
                fut.wait()
        sample.append(weakref.ref(futs[0]))
    return sample


def _settle(expected: int, seconds: float = 10.0) -> tuple[int, int]:
    """The callee's state once `expected` objects are alive there (or after `seconds`)."""
    deadline = time.monotonic() + seconds
    while True:
        alive, rss = asyncrpc.rpc_sync("worker1", callee_state)
        if alive <= expected or time.monotonic() > deadline:
            return alive, rss
        time.sleep(0.1)


@pytest.mark.timeout(300)
def test_failing_async_calls_and_methods_leave_nothing_alive(world: asyncrpc.Context) -> None:
    service = asyncrpc.spawn("worker1", Service)
    owner_ref = weakref.ref(service)
    warm = 500  # the allocator and torch's pools settle before the start is measured

    def async_call(i: int) -> torch.futures.Future[None]:
        return asyncrpc.rpc_async("worker1", fails_after_await, args=("worker2", i))

    _fail_many(async_call, warm, ValueError)
    _fail_many(functools.partial(_method_call, service), warm, KeyError)
    _, start_rss = _settle(expected=1)  # the Service itself
    samples = _fail_many(async_call, CALLS, ValueError)
    samples += _fail_many(functools.partial(_method_call, service), CALLS, KeyError)
    alive, end_rss = _settle(expected=1)
    gc.collect()
    assert alive == 1, f"{alive - 1} objects made by failed calls are alive on the callee"
    assert end_rss <= start_rss * 1.05, (start_rss, end_rss)  # within 5% of its start
    assert sum(ref() is not None for ref in samples) == 0, "the caller keeps failed Futures"
    # The object behind the handle goes with its last handle, whatever its methods did.
    del service
    gc.collect()
    assert owner_ref() is None, "the caller keeps a handle whose calls failed"
    alive, _ = _settle(expected=0)
    assert alive == 0, "the owner keeps the object of a handle that is gone"
    print(f"callee RSS {start_rss} KiB -> {end_rss} KiB after {2 * CALLS} failed calls")


def _reads_its_source(fut: torch.futures.Future[Any]) -> Any:
    return fut.wait()  # raises the source's CancelledError inside the callback


def test_cancelled_then_children_and_failed_batches_free_their_futures(
    world: asyncrpc.Context,
) -> None:
    # A failure kept in a Future kept the frames it was raised through, and through
    # their f_back the frames that called them: a then-callback's (or a Batch's reply
    # callback's) holding the very Future the failure was kept in, a cycle through
    # torch's C++ Future that gc cannot see into.
    refs = []
    for _ in range(100):
        source = asyncrpc.rpc_async("worker1", time.sleep, args=(5,))
        child = source.then(_reads_its_source)
        assert child.cancel()
        with pytest.raises(asyncrpc.CancelledError):
            child.wait()
        refs += [weakref.ref(source), weakref.ref(child)]
        with asyncrpc.Batch(timeout=0.05) as batch:  # every call of it fails: a timeout
            calls = [batch.rpc_async("worker1", time.sleep, args=(0.3,)) for _ in range(3)]
        for call in calls:
            with pytest.raises(asyncrpc.CallTimeoutError):
                call.wait()
        refs += [weakref.ref(call) for call in calls]
        del source, child, calls, call
    deadline = time.monotonic() + 10  # a callback still running on torch's threads lets go
    while True:
        gc.collect()
        alive = sum(ref() is not None for ref in refs)
        if alive == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert alive == 0, f"{alive} of {len(refs)} failed or cancelled Futures are still alive"
