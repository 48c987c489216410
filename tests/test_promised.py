"""Futures passed as arguments: resolved on the callee, from the worker that made the value."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncrpc

from conftest import until

pytestmark = pytest.mark.timeout(120)

RAN: list[str] = []  # on each worker: the calls that ran there (for "it never ran")


def slow_add(x: torch.Tensor, y: float, seconds: float = 0.2) -> torch.Tensor:
    time.sleep(seconds)
    return x + y


def total(x: torch.Tensor, scale: float = 1.0) -> float:
    RAN.append("total")
    return float(x.sum()) * scale


def ran() -> list[str]:
    return list(RAN)


def forget() -> None:
    RAN.clear()


async def total_later(x: torch.Tensor) -> float:
    return float(x.sum())


def fail(message: str) -> float:
    raise KeyError(message)


def counted(x: torch.Tensor) -> Iterator[float]:
    yield float(x.sum())
    yield float(x.numel())


def lent_and_taking() -> tuple[int, int]:
    """On a worker: (Futures it lent and still keeps, calls someone waits to be handed)."""
    from asyncrpc._core import _cancel, _promised, _runtime

    lent = _runtime.part(_promised.Lent)
    with lent.lock:
        kept = len(lent.futures)
    return kept, sum(bool(state.takers) for state in _cancel.running_calls())


async def slow_async_add(x: float, y: float) -> float:
    import asyncio

    await asyncio.sleep(5)
    return x + y


def add(x: float, y: float) -> float:
    RAN.append("add")
    return x + y


def first_of(items: list[float]) -> Iterator[float]:
    yield from items


class Adder:
    def __init__(self) -> None:
        self.total = torch.zeros(3)

    def add(self, *parts: torch.Tensor) -> torch.Tensor:
        for part in parts:
            self.total = self.total + part
        return self.total

    def scaled(self, x: torch.Tensor, by: float) -> torch.Tensor:
        return x * by

    def counted(self, x: torch.Tensor, times: int = 2) -> Iterator[float]:
        for _ in range(times):
            yield float(x.sum())


def test_a_pending_future_arrives_as_its_value_on_every_verb(world: asyncrpc.Context) -> None:
    def pending() -> torch.futures.Future[torch.Tensor]:
        return asyncrpc.rpc_async("worker1", slow_add, args=(torch.ones(4), 1.0))

    assert asyncrpc.rpc_sync("worker2", total, args=(pending(),)) == 8.0
    scale = asyncrpc.rpc_async("worker1", slow_add, args=(1.0, 2.0))
    assert asyncrpc.rpc_sync("worker2", total, args=(pending(),), kwargs={"scale": scale}) == 24.0
    assert asyncrpc.rpc_async("worker2", total_later, args=(pending(),)).wait() == 8.0
    assert asyncrpc.remote("worker2", total, args=(pending(),)).to_here() == 8.0
    assert torch.equal(asyncrpc.rpc_sync("worker2", torch.add, args=(pending(), 1)),
                       torch.full((4,), 3.0))  # fmt: skip
    adder = asyncrpc.spawn("worker2", Adder)
    assert torch.equal(adder.call("scaled", pending(), by=2), torch.full((4,), 4.0))
    assert torch.equal(adder.call_async("scaled", pending(), pending()).wait(),
                       torch.full((4,), 4.0))  # fmt: skip
    with asyncrpc.Batch() as batch:
        in_batch = batch.rpc_async("worker2", total, args=(pending(),))
    assert in_batch.wait() == 8.0
    assert list(asyncrpc.stream("worker2", counted, args=(pending(),))) == [8.0, 4.0]
    # A Future done already goes as its value; here, the caller passes its own result on.
    done = pending()
    done.wait()
    assert asyncrpc.rpc_sync("worker1", total, args=(done,)) == 8.0
    # The callee's own Future passed back to it: taken there, without a message.
    assert asyncrpc.rpc_sync("worker1", total, args=(pending(),)) == 8.0
    others = ("worker1", "worker2")
    assert until(lambda: all(asyncrpc.rpc_sync(w, lent_and_taking) == (0, 0) for w in others))
    assert lent_and_taking() == (0, 0)  # nothing kept per call, here or there


def slow_started(x: torch.Tensor, y: float, seconds: float) -> torch.Tensor:
    RAN.append("slow_started")
    return slow_add(x, y, seconds)


def test_the_value_goes_from_the_worker_that_made_it(world: asyncrpc.Context) -> None:
    # The caller's own Future times out; the call goes on on worker1, and worker2 gets
    # its value from there: it never went through the caller.
    asyncrpc.rpc_sync("worker1", forget)
    x = asyncrpc.rpc_async("worker1", slow_started, args=(torch.ones(2), 1.0, 6.0), timeout=3)
    # Passed once it runs there (an ask that came first would go to the caller).
    assert until(lambda: "slow_started" in asyncrpc.rpc_sync("worker1", ran), 10)
    y = asyncrpc.rpc_async("worker2", total, args=(x,))
    with pytest.raises(asyncrpc.CallTimeoutError):
        x.wait()
    assert y.wait() == 4.0


def test_a_future_of_no_single_call_comes_through_the_caller(world: asyncrpc.Context) -> None:
    parts = [asyncrpc.rpc_async("worker1", slow_add, args=(torch.ones(2), float(i), 0.05))
             for i in range(3)]  # fmt: skip
    summed = asyncrpc.gather(parts).then(lambda f: sum(f.value()))
    assert asyncrpc.rpc_sync("worker2", total, args=(summed,)) == 2.0 + 4.0 + 6.0
    mine: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    later = threading.Timer(0.2, mine.set_result, args=(torch.full((3,), 2.0),))
    later.start()
    assert asyncrpc.rpc_sync("worker2", total, args=(mine,)) == 6.0
    later.join()


def test_a_failed_future_fails_the_call_that_took_it(world: asyncrpc.Context) -> None:
    asyncrpc.rpc_sync("worker2", forget)
    broken = asyncrpc.rpc_async("worker1", fail, args=("no such weights",))
    with pytest.raises(KeyError, match="no such weights"):
        asyncrpc.rpc_sync("worker2", total, args=(broken,))
    with pytest.raises(KeyError, match="no such weights"):  # failed already: the same
        asyncrpc.rpc_async("worker2", total, args=(broken,)).wait()
    assert asyncrpc.rpc_sync("worker2", ran) == []  # it never ran
    with pytest.raises(asyncrpc.SerializationError, match="top-level argument"):
        asyncrpc.rpc_sync("worker2", len, args=([broken],))


def test_a_parameter_server_as_ray_writes_it_matches_waiting_first(
    world: asyncrpc.Context,
) -> None:
    def train(passed: bool) -> torch.Tensor:
        ps = asyncrpc.spawn("worker1", Adder)
        workers = [asyncrpc.spawn(w, Adder) for w in ("worker1", "worker2")]
        weights = ps.call_async("add", torch.zeros(3))
        for step in range(5):
            grads = [w.call_async("scaled", weights, step + i) for i, w in enumerate(workers)]
            if not passed:
                grads = [g.wait() for g in grads]
            weights = ps.call_async("add", *grads)
        return weights.wait()

    assert torch.equal(train(passed=True), train(passed=False))


# ---- a property: passed on, or waited for first, every call gives the same value -------

OPS = st.lists(
    st.tuples(
        st.sampled_from(["worker0", "worker1", "worker2"]),
        st.sampled_from(["add", "mul", "fail"]),
        st.integers(0, 8),  # which earlier result (or a constant) is its first argument
        st.integers(0, 8),
        st.booleans(),  # sent at once with Futures, or with the values waited for
    ),
    min_size=1,
    max_size=8,
)


def apply(op: str, a: float, b: float) -> float:
    if op == "fail":
        raise ValueError("failed on purpose")
    return a + b if op == "add" else a * b


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=OPS)
def test_passing_futures_on_gives_what_waiting_first_gives(
    world: asyncrpc.Context, ops: list[tuple[str, str, int, int, bool]]
) -> None:
    futures: list[torch.futures.Future[float]] = []
    serial: list[float | None] = []  # None: failed
    for worker, op, i, j, at_once in ops:
        args: list[object] = []
        inputs: list[float | None] = []
        for pick in (i, j):
            if pick < len(futures):
                inputs.append(serial[pick])
                args.append(futures[pick] if at_once else _waited(futures[pick]))
            else:
                inputs.append(float(pick))
                args.append(float(pick))
        failed = any(x is None for x in inputs) or op == "fail"
        serial.append(None if failed else apply(op, *inputs))  # type: ignore[arg-type]
        if any(isinstance(a, BaseException) for a in args):
            futures.append(_failed(args))
            continue
        futures.append(asyncrpc.rpc_async(worker, apply, args=(op, *args)))
    for fut, expected in zip(futures, serial, strict=True):
        if expected is None:
            with pytest.raises(ValueError, match="failed on purpose"):
                fut.wait()
        else:
            assert fut.wait() == expected


def _waited(fut: torch.futures.Future[float]) -> object:
    try:
        return fut.wait()
    except ValueError as exc:
        return exc


def _failed(args: list[object]) -> torch.futures.Future[float]:
    out: torch.futures.Future[float] = torch.futures.Future()
    out.set_exception(next(a for a in args if isinstance(a, BaseException)))  # type: ignore[arg-type]
    return out


def test_a_future_that_fails_after_it_was_passed_fails_the_call(world: asyncrpc.Context) -> None:
    asyncrpc.rpc_sync("worker2", forget)
    x = asyncrpc.rpc_async("worker1", slow_async_add, args=(1.0, 1.0))
    y = asyncrpc.rpc_async("worker2", add, args=(x, 1.0), timeout=20)
    assert x.cancel()
    with pytest.raises(asyncrpc.CancelledError):
        y.wait()
    # A sync function runs on after a cancel; the call that took its Future fails now.
    x = asyncrpc.rpc_async("worker1", slow_add, args=(1.0, 1.0, 10.0))
    y = asyncrpc.rpc_async("worker2", add, args=(x, 1.0), timeout=20)
    time.sleep(0.3)  # the ask reached worker1 by now, or comes after the cancel: the same
    assert x.cancel()
    cancelled = time.monotonic()
    with pytest.raises(asyncrpc.CancelledError, match="the call that took its Future"):
        y.wait()
    assert time.monotonic() - cancelled < 5
    mine: torch.futures.Future[float] = torch.futures.Future()
    z = asyncrpc.rpc_async("worker2", add, args=(mine, 1.0), timeout=20)
    mine.set_exception(ValueError("no value after all"))
    with pytest.raises(ValueError, match="no value after all"):
        z.wait()
    # Failed before it was passed: that failure, whatever its call did next.
    late = asyncrpc.rpc_async("worker1", slow_add, args=(1.0, 1.0, 1.0), timeout=0.2)
    with pytest.raises(asyncrpc.CallTimeoutError):
        late.wait()
    with pytest.raises(asyncrpc.CallTimeoutError):
        asyncrpc.rpc_sync("worker2", add, args=(late, 1.0))
    assert asyncrpc.rpc_sync("worker2", ran) == []


def test_a_call_given_up_lets_go_of_the_futures_it_took(world: asyncrpc.Context) -> None:
    never: torch.futures.Future[float] = torch.futures.Future()
    for _ in range(20):
        taker = asyncrpc.rpc_async("worker2", add, args=(never, 1.0))
        assert taker.cancel()
    assert until(lambda: lent_and_taking() == (0, 0))
    never.set_result(1.0)


def test_a_batch_passes_a_future_of_its_own_calls_on(world: asyncrpc.Context) -> None:
    for second in ("worker1", "worker2"):
        with asyncrpc.Batch() as batch:
            x = batch.rpc_async("worker1", add, args=(1.0, 1.0))
            y = batch.rpc_async(second, add, args=(x, 1.0))
            bad = batch.rpc_async("worker1", fail, args=("in the batch",))
            z = batch.rpc_async("worker1", add, args=(bad, 1.0))
        assert (x.wait(), y.wait()) == (2.0, 3.0)
        with pytest.raises(KeyError, match="in the batch"):
            z.wait()


def test_a_handle_stream_takes_futures_and_refs_as_values(world: asyncrpc.Context) -> None:
    adder = asyncrpc.spawn("worker2", Adder)
    x = asyncrpc.rpc_async("worker1", slow_add, args=(torch.ones(2), 1.0))
    assert list(adder.stream("counted", x, times=3)) == [4.0, 4.0, 4.0]
    ref = asyncrpc.put(torch.ones(3))
    assert list(adder.stream("counted", ref)) == [3.0, 3.0]
    assert list(asyncrpc.stream("worker1", first_of, args=(asyncrpc.put([1.0, 2.0]),))) == [
        1.0,
        2.0,
    ]


def test_spawn_waits_for_a_future_among_its_arguments(world: asyncrpc.Context) -> None:
    start = asyncrpc.rpc_async("worker1", slow_add, args=(torch.ones(3), 1.0))
    adder = asyncrpc.spawn("worker2", Adder)
    assert torch.equal(adder.call("add", start), torch.full((3,), 2.0))
    scaled = asyncrpc.spawn(
        "worker2", Scaled, start, by=asyncrpc.rpc_async("worker1", abs, args=(-3,))
    )
    assert torch.equal(scaled.call("value"), torch.full((3,), 6.0))


class Scaled:
    def __init__(self, x: torch.Tensor, by: int) -> None:
        self.x = x * by

    def value(self) -> torch.Tensor:
        return self.x
