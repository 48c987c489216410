"""Streams from real workers: consumed, broken off, failing, paused, async, handles."""

from __future__ import annotations

import asyncio
import gc
import pathlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import torch

import asyncrpc
from asyncrpc._core import _stream

from conftest import ROOT, run_program, until

_log: dict[str, list[str]] = {}  # on the producer: tag -> events
_made: dict[str, int] = {}  # on the producer: tag -> items made so far
_lock = threading.Lock()


def note(tag: str, what: str) -> None:
    with _lock:
        _log.setdefault(tag, []).append(what)


def log(tag: str) -> list[str]:
    with _lock:
        return list(_log.get(tag, []))


def made(tag: str) -> int:
    with _lock:
        return _made.get(tag, 0)


def open_producers() -> int:
    return _stream.open_producers()


def count(tag: str, n: int) -> Iterator[int]:
    try:
        for i in range(n):
            with _lock:
                _made[tag] = i + 1
            yield i
        note(tag, "exhausted")
    finally:
        note(tag, "finally")


async def count_async(tag: str, n: int) -> AsyncIterator[torch.Tensor]:
    try:
        for i in range(n):
            await asyncrpc.rpc_async(asyncrpc.current_context().name, int, args=(i,))
            yield torch.full((2,), float(i))
    finally:
        note(tag, "finally")


def fails_after(tag: str, n: int) -> Iterator[int]:
    yield from range(n)
    raise KeyError(f"producer {tag} failed after {n} items")


def slow(seconds: float) -> Iterator[int]:
    yield 0
    time.sleep(seconds)
    yield 1


def not_a_generator() -> int:
    return 3


class Model:
    """A module stepped on its worker; its outputs streamed step by step."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.net = torch.nn.GRUCell(4, 4)

    def steps(self, n: int) -> Iterator[torch.Tensor]:
        state = torch.zeros(1, 4)
        with torch.no_grad():
            for _ in range(n):
                state = self.net(torch.ones(1, 4), state)
                yield state


def in_place(n: int, boxed: bool) -> Iterator[Any]:
    """One tensor updated in place and yielded after each update (an RNN state, a buffer)."""
    state = torch.zeros(3)
    for step in range(1, n + 1):
        state.fill_(step)
        yield {"step": step, "obs": state} if boxed else state


async def in_place_async(n: int, boxed: bool) -> AsyncIterator[Any]:
    state = torch.zeros(3)
    for step in range(1, n + 1):
        state.fill_(step)
        yield {"step": step, "obs": state} if boxed else state


def views(n: int) -> Iterator[dict[str, torch.Tensor]]:
    """A buffer and views of it (one sharing its storage, one small view of a big one)."""
    buf, big = torch.zeros(2, 3), torch.zeros(4096)
    for step in range(n):
        buf.fill_(step)
        big.fill_(step)
        yield {"buf": buf, "row": buf[1], "col": buf.t()[2], "tail": big[-3:]}


def learnt(n: int) -> Iterator[Any]:
    """A parameter that requires grad, and a sparse tensor, updated in place under no_grad."""
    weight, sparse = torch.zeros(3, requires_grad=True), torch.eye(3).to_sparse()
    for step in range(1, n + 1):
        with torch.no_grad():
            weight.fill_(step)
            sparse.values().fill_(step)
            yield {"weight": weight, "sparse": sparse}


def view_at(step: int) -> dict[str, torch.Tensor]:
    """The item `views` yields at `step`, returned by a call."""
    return list(views(step + 1))[-1]


def test_a_stream_is_consumed_in_order(world: asyncrpc.Context) -> None:
    assert list(asyncrpc.stream("worker1", count, args=("all", 100))) == list(range(100))
    assert log("all") == [] and asyncrpc.rpc_sync("worker1", log, args=("all",)) == [
        "exhausted",
        "finally",
    ]
    tensors = list(asyncrpc.stream("worker2", count_async, args=("async", 5), window=2))
    assert [t.tolist() for t in tensors] == [[float(i)] * 2 for i in range(5)]
    assert asyncrpc.rpc_sync("worker2", open_producers) == 0


def test_breaking_out_closes_the_remote_generator(world: asyncrpc.Context) -> None:
    for i in asyncrpc.stream("worker1", count, args=("broken", 10_000)):
        if i == 3:
            break
    gc.collect()
    finished = until(lambda: "finally" in asyncrpc.rpc_sync("worker1", log, args=("broken",)), 5)
    assert finished, "the remote generator's finally never ran"
    assert "exhausted" not in asyncrpc.rpc_sync("worker1", log, args=("broken",))
    with asyncrpc.stream("worker2", count_async, args=("closed", 100)) as items:
        assert next(items).tolist() == [0.0, 0.0]
    assert until(lambda: asyncrpc.rpc_sync("worker2", log, args=("closed",)) == ["finally"], 5)
    assert asyncrpc.rpc_sync("worker2", open_producers) == 0


def test_a_failing_producer_ends_the_stream_with_its_error(world: asyncrpc.Context) -> None:
    got: list[int] = []
    with pytest.raises(KeyError, match="producer mid failed after 7 items") as raised:
        for i in asyncrpc.stream("worker1", fails_after, args=("mid", 7)):
            got.append(i)
    assert got == list(range(7))
    assert isinstance(raised.value, (asyncrpc.RemoteError))
    assert isinstance(raised.value, RuntimeError)
    assert "On worker 'worker1'" in str(raised.value)
    with pytest.raises(TypeError, match=r"runs a generator function.*returned int"):
        list(asyncrpc.stream("worker1", not_a_generator))


def test_backpressure_pauses_the_producer(world: asyncrpc.Context) -> None:
    items = asyncrpc.stream("worker1", count, args=("paused", 100_000), window=8)
    assert [next(items) for _ in range(3)] == [0, 1, 2]
    time.sleep(0.3)
    before = asyncrpc.rpc_sync("worker1", made, args=("paused",))
    time.sleep(1.0)  # the consumer stops reading
    after = asyncrpc.rpc_sync("worker1", made, args=("paused",))
    assert before == after <= 3 + 8, (before, after)  # paused, at most a window ahead
    assert next(items) == 3
    items.close()


def test_async_for_and_a_per_item_timeout(world: asyncrpc.Context) -> None:
    async def consume() -> list[float]:
        got = []
        async for t in asyncrpc.stream("worker2", count_async, args=("asyncfor", 4)):
            got.append(t[0].item())
        return got

    assert asyncio.run(consume()) == [0.0, 1.0, 2.0, 3.0]
    items = asyncrpc.stream("worker1", slow, args=(2.0,), timeout=0.5)
    assert next(items) == 0
    with pytest.raises(asyncrpc.CallTimeoutError, match=r"slow\(\) on worker 'worker1'"):
        next(items)


def test_a_handle_streams_a_models_steps(world: asyncrpc.Context) -> None:
    model = asyncrpc.spawn("worker2", Model)
    steps = list(model.options(window=2).stream("steps", 5))
    local = list(Model().steps(5))
    assert len(steps) == 5 and all(torch.equal(a, b) for a, b in zip(steps, local, strict=True))
    with pytest.raises(AttributeError, match="did you mean 'steps'"):
        model.stream("step", 5)
    with pytest.raises(ValueError, match="window must be a positive int"):
        asyncrpc.stream("worker1", count, args=("x", 1), window=0)


def test_streams_leave_nothing_open(world: asyncrpc.Context) -> None:
    for _ in range(20):
        for i in asyncrpc.stream("worker1", count, args=("again", 50), window=4):
            if i == 2:
                break
    gc.collect()
    closed = until(lambda: not asyncrpc.rpc_sync("worker1", open_producers), 5)
    assert closed, "streams left open on the producer"


def consume_on(worker: str) -> list[int]:
    """An async def on a worker that consumes another worker's stream."""
    return list(asyncrpc.stream(worker, count, args=("nested", 3)))


async def consume_async_on(worker: str) -> list[int]:
    return [i async for i in asyncrpc.stream(worker, count, args=("nested-async", 3))]


def test_streams_consumed_by_remote_functions(world: asyncrpc.Context) -> None:
    assert asyncrpc.rpc_sync("worker1", consume_on, args=("worker2",)) == [0, 1, 2]
    assert asyncrpc.rpc_sync("worker1", consume_async_on, args=("worker2",)) == [0, 1, 2]


@pytest.mark.subprocess
def test_the_stream_example_reads_steps_and_closes_the_generator() -> None:
    done = run_program("python", str(ROOT / "examples" / "stream_steps.py"), timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:5]] == [f"step {i}" for i in range(5)]
    assert lines.count("worker1: generator closed") == 2, done.stdout
    assert any(line.startswith("6 steps read to the end") for line in lines), done.stdout


@pytest.mark.subprocess
def test_streams_left_open_are_closed_when_the_world_ends(tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "closed.txt"
    program = ROOT / "tests" / "programs" / "stream_left_open.py"
    done = run_program("python", str(program), str(marker), timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "worker0 holds 2 open streams" in done.stdout, done.stdout
    closed = sorted(marker.read_text().splitlines())
    assert closed == ["async generator closed on worker0", "def generator closed on worker0"]


@pytest.mark.parametrize("func", [in_place, in_place_async])
def test_each_item_arrives_as_it_was_at_its_yield(world: asyncrpc.Context, func: Any) -> None:
    got, expected = {}, {}
    for window in (1, 4, _stream.DEFAULT_WINDOW):
        tensors = asyncrpc.stream("worker1", func, args=(8, False), window=window)
        got["alone", window] = [t.tolist() for t in tensors]
        expected["alone", window] = [[float(i)] * 3 for i in range(1, 9)]
        boxed = asyncrpc.stream("worker2", func, args=(8, True), window=window)
        got["in a dict", window] = [(d["step"], d["obs"].tolist()) for d in boxed]
        expected["in a dict", window] = [(i, [float(i)] * 3) for i in range(1, 9)]
    assert got == expected


def test_an_items_views_arrive_as_a_call_returns_them(world: asyncrpc.Context) -> None:
    def shape(item: dict[str, torch.Tensor]) -> dict[str, object]:
        return {
            k: (t.tolist(), t.stride(), t.storage_offset(), t.untyped_storage().nbytes())
            for k, t in item.items()
        }

    for step, item in enumerate(asyncrpc.stream("worker1", views, args=(3,), window=3)):
        returned = asyncrpc.rpc_sync("worker1", view_at, args=(step,))
        assert shape(item) == shape(returned)  # torch's rule: the small view alone travels
        assert item["tail"].tolist() == [float(step)] * 3
        for got in (item, returned):  # the row and column are views of the buffer still
            assert got["row"].untyped_storage().data_ptr() == got["buf"].data_ptr()


def test_tensors_outside_the_exact_copy_arrive_cloned_as_yielded(world: asyncrpc.Context) -> None:
    got = [
        (d["weight"].tolist(), d["weight"].requires_grad, d["sparse"].to_dense().diag().tolist())
        for d in asyncrpc.stream("worker1", learnt, args=(4,), window=4)
    ]
    assert got == [([float(i)] * 3, True, [float(i)] * 3) for i in range(1, 5)]
