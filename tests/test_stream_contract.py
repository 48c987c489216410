"""Streams keep the README's promises: break closes, items before a bad one arrive, errors
name the generator, close() wakes a waiting reader, a generator's finally sees its world.

A hypothesis state machine opens streams from real workers and breaks, closes,
reads, fails and sends unpicklable items at random; every stream must give
the items in order, each as it was at its yield (its tensor, updated in place
after the yield, too), end as its generator ended, and leave no generator open.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

import asyncrpc
from asyncrpc._core import _stream

from conftest import until

pytestmark = pytest.mark.timeout(180)

_closed: dict[str, int] = {}  # on the producer: tag -> how often its finally ran
_lock = threading.Lock()
_tags = itertools.count()  # on the caller: one tag per stream in this session


def closed(tag: str) -> int:
    with _lock:
        return _closed.get(tag, 0)


def open_producers() -> int:
    return _stream.open_producers()


def numbers(
    tag: str, n: int, bad_at: int = -1, fail_at: int = -1, shape: str = "int"
) -> Iterator[Any]:
    """0..n-1; an unpicklable item at `bad_at`, a KeyError at `fail_at`.

    `shape` "tensor" yields i as one tensor filled with it, "dict" as {"step": i,
    "obs": that tensor}: the same tensor each time, updated in place after its yield.
    """
    state = torch.zeros(3)
    try:
        for i in range(n):
            if i == fail_at:
                raise KeyError(f"{tag} failed at {i}")
            if i == bad_at:
                yield threading.Lock()
                continue
            state.fill_(i)
            yield {"int": i, "tensor": state, "dict": {"step": i, "obs": state}}[shape]
    finally:
        with _lock:
            _closed[tag] = _closed.get(tag, 0) + 1


_go_on = threading.Event()  # on the producer: `stuck` sleeps until it is set (30 s at most)


def go_on() -> None:
    _go_on.set()


def stuck(tag: str) -> Iterator[int]:
    try:
        yield 0
        _go_on.wait(30)
        yield 1
    finally:
        with _lock:
            _closed[tag] = _closed.get(tag, 0) + 1


def plain() -> list[int]:
    return [1, 2]


class Plain:
    def plain(self) -> list[int]:
        return [1, 2]


def test_breaking_out_of_a_for_loop_closes_the_stream(world: asyncrpc.Context) -> None:
    s = asyncrpc.stream("worker1", numbers, args=("broken", 1000))
    for item in s:
        assert item == 0
        break
    # `s` is still alive here: the loop's end closed it, not its collection
    assert until(lambda: asyncrpc.rpc_sync("worker1", closed, args=("broken",)) == 1)
    assert list(s) == []  # closed: it yields nothing more
    del s


def test_items_before_an_unpicklable_one_arrive_then_the_error_names_the_generator(
    world: asyncrpc.Context,
) -> None:
    got: list[int] = []
    s = asyncrpc.stream("worker1", numbers, args=("unpicklable", 10, 2), window=32)
    with pytest.raises(asyncrpc.SerializationError, match=r"numbers\(\) yielded an item") as err:
        for item in s:
            got.append(item)
    assert got == [0, 1]
    assert "item 3, a lock" in str(err.value)
    assert until(lambda: asyncrpc.rpc_sync("worker1", closed, args=("unpicklable",)) == 1)


def test_a_handles_stream_of_a_method_that_is_no_generator_names_the_method(
    world: asyncrpc.Context,
) -> None:
    handle = asyncrpc.spawn("worker1", Plain)
    with pytest.raises(TypeError, match=r"Plain\.plain\(\) returned list"):
        list(handle.stream("plain"))
    with pytest.raises(TypeError, match=r"plain\(\) returned list"):
        list(asyncrpc.stream("worker1", plain))


def test_close_from_another_thread_wakes_a_blocked_reader(world: asyncrpc.Context) -> None:
    s = asyncrpc.stream("worker1", stuck, args=("woken",), window=1)
    assert next(s) == 0
    outcome: list[object] = []

    def read() -> None:
        try:
            outcome.append(next(s))  # the generator sleeps: this blocks
        except StopIteration:
            outcome.append("ended")

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.3)
    started = time.monotonic()
    s.close()
    reader.join(5)
    took = time.monotonic() - started
    asyncrpc.rpc_sync("worker1", go_on)  # the generator, still asleep, ends: its thread is free
    assert outcome == ["ended"] and took < 2.0


def _as_yielded(item: Any) -> Any:
    """The number an item of `numbers` stands for, checked whole: every element of its
    tensor (and its dict's step) holds the value it had at its yield."""
    if isinstance(item, dict):
        assert _as_yielded(item["obs"]) == item["step"], item
        return item["step"]
    if isinstance(item, torch.Tensor):
        assert item.tolist() == [item[0].item()] * 3, item
        return int(item[0].item())
    return item


class StreamRace(RuleBasedStateMachine):
    """Random streams, reads, breaks, closes and failures; each keeps its promises."""

    def __init__(self) -> None:
        super().__init__()
        self.streams: list[dict[str, Any]] = []

    @rule(
        n=st.integers(0, 40),
        window=st.integers(1, 8),
        trouble=st.sampled_from(["none", "none", "bad", "fail"]),
        at=st.integers(0, 40),
        shape=st.sampled_from(["int", "tensor", "dict"]),
    )
    def open(self, n: int, window: int, trouble: str, at: int, shape: str) -> None:
        tag = f"race-{next(_tags)}"  # unique across examples: id(self) is reused
        bad, fail = (at if trouble == "bad" else -1), (at if trouble == "fail" else -1)
        args = (tag, n, bad, fail, shape)
        s = asyncrpc.stream("worker2", numbers, args=args, window=window)
        self.streams.append(
            {"s": s, "tag": tag, "n": n, "bad": bad, "fail": fail, "next": 0, "done": False}
        )

    @precondition(lambda self: any(not x["done"] for x in self.streams))
    @rule(index=st.integers(0, 50), k=st.integers(1, 12))
    def read(self, index: int, k: int) -> None:
        entry = self._pick(index)
        for _ in range(k):
            if not self._next(entry):
                return

    @precondition(lambda self: any(not x["done"] for x in self.streams))
    @rule(index=st.integers(0, 50))
    def break_loop(self, index: int) -> None:
        entry = self._pick(index)
        loop = iter(entry["s"])  # what a `for` loop holds
        self._next(entry, loop)  # its first turn: an item, the end, or the stream's error
        del loop  # the loop ends: the stream closes
        entry["done"] = True

    @precondition(lambda self: any(not x["done"] for x in self.streams))
    @rule(index=st.integers(0, 50))
    def close(self, index: int) -> None:
        entry = self._pick(index)
        entry["s"].close()
        entry["done"] = True

    def _pick(self, index: int) -> dict[str, Any]:
        live = [x for x in self.streams if not x["done"]]
        return live[index % len(live)]

    def _next(self, entry: dict[str, Any], source: Any = None) -> bool:
        expected = entry["next"]
        ends = [e for e in (entry["n"], entry["bad"], entry["fail"]) if e >= 0]
        try:
            item = next(entry["s"] if source is None else source)
        except StopIteration:
            assert expected == entry["n"] and min(ends) == entry["n"], entry
            entry["done"] = True
            return False
        except asyncrpc.SerializationError:
            assert expected == entry["bad"] == min(ends), entry
            entry["done"] = True
            return False
        except KeyError:
            assert expected == entry["fail"] == min(ends), entry
            entry["done"] = True
            return False
        assert _as_yielded(item) == expected, (item, entry)
        entry["next"] += 1
        return True

    def teardown(self) -> None:
        for entry in self.streams:
            entry["s"].close()
        for entry in self.streams:  # every generator that started ran its finally
            tag = entry["tag"]
            assert until(lambda t=tag: asyncrpc.rpc_sync("worker2", closed, args=(t,)) <= 1)
        assert until(lambda: asyncrpc.rpc_sync("worker2", open_producers) == 0)


@pytest.mark.usefixtures("world")
def test_random_reads_breaks_closes_and_failures_keep_every_streams_promises() -> None:
    run = settings(
        max_examples=12,
        stateful_step_count=10,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )(StreamRace)
    run.TestCase().runTest()


class Foreign:
    """A class only worker1 can import (its module is made there, at run time)."""


def foreign_items(folder: str) -> Iterator[Any]:
    import sys as _sys

    with open(f"{folder}/only_here.py", "w") as module:
        module.write("class OnlyHere:\n    pass\n")
    _sys.path.insert(0, folder)
    import only_here  # type: ignore[import-not-found]

    yield from range(5)
    yield only_here.OnlyHere()
    yield 99


def test_items_before_one_the_consumer_cannot_unpickle_arrive(
    world: asyncrpc.Context, tmp_path: Any
) -> None:
    folder = tmp_path / "worker1-only"
    folder.mkdir()
    got: list[int] = []
    with pytest.raises(
        asyncrpc.SerializationError, match=r"foreign_items\(\) on 'worker1'"
    ) as err:
        for item in asyncrpc.stream("worker1", foreign_items, args=(str(folder),)):
            got.append(item)
    assert got == [0, 1, 2, 3, 4]
    assert "item 6" in str(err.value) and str(err.value).count("foreign_items") == 1


def ticks(tag: str) -> Iterator[int]:
    try:
        while True:
            time.sleep(0.1)  # running, not paused: it is closed at its next yield
            yield 1
    finally:
        with _lock:
            _closed[tag] = _closed.get(tag, 0) + 1


def test_close_from_another_thread_closes_the_generator_of_a_for_loop(
    world: asyncrpc.Context,
) -> None:
    s = asyncrpc.stream("worker1", ticks, args=("loop-closed",), window=1)
    reader = threading.Thread(target=lambda: [None for _ in s])
    reader.start()
    time.sleep(0.5)
    s.close()
    reader.join(5)
    assert not reader.is_alive()
    assert until(lambda: asyncrpc.rpc_sync("worker1", closed, args=("loop-closed",)) == 1)
