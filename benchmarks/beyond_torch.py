"""What torch RPC cannot do, beside Ray: cancel a call, stream a generator, bound a stream.

Rows (imported by benchmarks/peers.py, which prints them with its others;
runnable alone too):

- cancel: from `cancel()` to the callee's coroutine seeing CancelledError,
  and to the caller's Future failing (Ray: `ray.cancel` on an async actor
  method; `ray.get` raising TaskCancelledError); asyncrpc's Future fails at
  `cancel()` itself, before the callee hears of it;
- stream throughput: items/s of small items (64 B tensors) and MiB/s of
  1 MiB tensors from a remote generator (Ray: a streaming generator actor
  method), and a loop of single calls for scale;
- backpressure: items a producer makes while its consumer stops reading
  for 1 s, with each system's default (Ray: none unless
  `_generator_backpressure_num_objects` is set).

Rounds alternate the systems; figures are medians.

    python benchmarks/beyond_torch.py [--rounds 20] [--items 2000] [--no-ray]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import torch
from torch.futures import Future

import asyncrpc

import ray_peer  # before anything imports Ray: it keeps Ray on loopback

_state: dict[str, float] = {}  # on the callee: what its calls saw, and when
_state_lock = threading.Lock()
PAUSE_S = 1.0


def _set(key: str, value: float) -> None:
    with _state_lock:
        _state[key] = value


def read(key: str) -> float:
    with _state_lock:
        return _state.get(key, 0.0)


async def wait_to_be_cancelled(tag: str) -> None:
    never: Future[None] = Future()
    _set(f"{tag}/started", time.time())
    try:
        await never
    except BaseException:
        _set(f"{tag}/seen", time.time())
        raise


def items(n: int, size: int) -> Iterator[torch.Tensor]:
    for i in range(n):
        yield torch.full((size,), float(i))  # a new tensor each: none is sent twice


def counted(tag: str) -> Iterator[int]:
    for i in range(10_000_000):
        _set(tag, i + 1)
        yield i


def one_item(size: int) -> torch.Tensor:
    return torch.ones(size)


# ---- asyncrpc's ways -----------------------------------------------------------------------


def asyncrpc_cancel(tag: str) -> tuple[float, float]:
    """(seconds to the callee seeing it, seconds to the caller's Future failing)."""
    fut = asyncrpc.rpc_async("worker1", wait_to_be_cancelled, args=(tag,))
    while not asyncrpc.rpc_sync("worker1", read, args=(f"{tag}/started",)):
        time.sleep(0.005)
    start = time.time()
    fut.cancel()
    try:
        fut.wait()
    except asyncrpc.CancelledError:
        failed = time.time()
    # The caller's Future fails at once; the callee hears of it through the store.
    seen = 0.0
    while not seen:
        seen = asyncrpc.rpc_sync("worker1", read, args=(f"{tag}/seen",))
    return seen - start, failed - start


def asyncrpc_stream(n: int, size: int) -> float:
    """Seconds to receive `n` items of `size` floats."""
    start = time.perf_counter()
    for _ in asyncrpc.stream("worker1", items, args=(n, size)):
        pass
    return time.perf_counter() - start


def asyncrpc_single_calls(n: int, size: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        asyncrpc.rpc_sync("worker1", one_item, args=(size,))
    return time.perf_counter() - start


def asyncrpc_backpressure(tag: str) -> float:
    """Items the producer made while the consumer did not read for PAUSE_S."""
    stream = asyncrpc.stream("worker1", counted, args=(tag,))
    next(stream)
    time.sleep(0.2)  # what it made at once
    before = asyncrpc.rpc_sync("worker1", read, args=(tag,))
    time.sleep(PAUSE_S)
    made = asyncrpc.rpc_sync("worker1", read, args=(tag,)) - before
    stream.close()
    return made + before - 1  # ahead of the consumer, in all


# ---- Ray's ways ------------------------------------------------------------------------------


def ray_ways() -> dict[str, Callable[..., Any]]:
    import asyncio

    import ray

    @ray.remote
    class Service:
        def __init__(self) -> None:
            self.state: dict[str, float] = {}

        async def wait_to_be_cancelled(self, tag: str) -> None:
            self.state[f"{tag}/started"] = time.time()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.state[f"{tag}/seen"] = time.time()
                raise

        async def read(self, key: str) -> float:
            return self.state.get(key, 0.0)

        async def items(self, n: int, size: int) -> AsyncIterator[torch.Tensor]:
            for i in range(n):
                yield torch.full((size,), float(i))

        async def counted(self, tag: str) -> AsyncIterator[int]:
            for i in range(10_000_000):
                self.state[tag] = i + 1
                yield i

        async def one_item(self, size: int) -> torch.Tensor:
            return torch.ones(size)

    service = Service.remote()  # type: ignore[attr-defined]
    ray.get(service.read.remote("warm"))

    def cancel(tag: str) -> tuple[float, float]:
        ref = service.wait_to_be_cancelled.remote(tag)
        while not ray.get(service.read.remote(f"{tag}/started")):
            time.sleep(0.005)
        start = time.time()
        ray.cancel(ref)
        try:
            ray.get(ref)
        except (ray.exceptions.TaskCancelledError, asyncio.CancelledError):
            failed = time.time()
        seen = float(ray.get(service.read.remote(f"{tag}/seen")))
        return seen - start, failed - start

    def stream(n: int, size: int) -> float:
        start = time.perf_counter()
        for ref in service.items.options(num_returns="streaming").remote(n, size):
            ray.get(ref)
        return time.perf_counter() - start

    def single_calls(n: int, size: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            ray.get(service.one_item.remote(size))
        return time.perf_counter() - start

    def backpressure(tag: str) -> float:
        refs = service.counted.options(num_returns="streaming").remote(tag)
        ray.get(next(refs))
        time.sleep(0.2)
        before = ray.get(service.read.remote(tag))
        time.sleep(PAUSE_S)
        made = ray.get(service.read.remote(tag)) - before
        ray.cancel(refs)
        return float(made + before - 1)

    return {
        "cancel": cancel,
        "stream": stream,
        "single_calls": single_calls,
        "backpressure": backpressure,
    }


# ---- measuring --------------------------------------------------------------------------------


def measure(
    rounds: int, n: int, ray: dict[str, Callable[..., Any]] | None
) -> dict[str, dict[str, Any]]:
    """Figures per row (`figures`), asyncrpc and Ray alternated round by round."""
    ours: dict[str, Callable[..., Any]] = {
        "cancel": asyncrpc_cancel,
        "stream": asyncrpc_stream,
        "single_calls": asyncrpc_single_calls,
        "backpressure": asyncrpc_backpressure,
    }
    ways: dict[str, dict[str, Callable[..., Any]]] = {"asyncrpc": ours}
    if ray:
        ways["ray"] = ray
    samples: dict[str, dict[str, list[float]]] = {w: {} for w in ways}
    small, big = 16, 256 * 1024  # floats: 64 B, 1 MiB
    few = max(1, n // 10)  # 1 MiB items and single calls: fewer per sample
    for r in range(rounds):
        for way in list(ways)[r % len(ways) :] + list(ways)[: r % len(ways)]:
            run = ways[way]
            seen, failed = run["cancel"](f"{way}-{r}")
            _add(samples[way], "cancel seen", seen)
            _add(samples[way], "cancel failed", failed)
            if r < max(3, rounds // 4):  # throughput rows: fewer, longer samples
                _add(samples[way], "small items/s", n / run["stream"](n, small))
                _add(samples[way], "MiB/s", few / run["stream"](few, big))
                _add(samples[way], "single calls/s", few / run["single_calls"](few, small))
            if r < 2:
                _add(samples[way], "backpressure", run["backpressure"](f"{way}-bp-{r}"))
    return figures(samples)


def _add(into: dict[str, list[float]], key: str, value: float) -> None:
    into.setdefault(key, []).append(value)


_ROWS = (  # sample key, row, unit (seconds for "ms" rows), higher is better
    ("cancel seen", "cancel: to the callee's coroutine", "ms", False),
    ("cancel failed", "cancel: to the caller's Future failing", "ms", False),
    ("small items/s", "stream of small items (64 B)", "items/s", True),
    ("single calls/s", "  a loop of single calls, for scale", "items/s", True),
    ("MiB/s", "stream of 1 MiB items", "MiB/s", True),
    ("backpressure", f"items made ahead while the consumer stops {PAUSE_S:g} s", "", False),
)


def figures(samples: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, Any]]:
    """Row -> unit, each way's median (seconds for "ms" rows) and Ray/ours (or None)."""
    rows = {}
    for key, label, unit, higher in _ROWS:
        row: dict[str, Any] = {"unit": "s" if unit == "ms" else unit, "higher_is_better": higher}
        for way in ("asyncrpc", "ray"):
            values = samples.get(way, {}).get(key)
            row[way] = statistics.median(values) if values else None
        ours, theirs = row["asyncrpc"], row["ray"]
        row["ray_over_ours"] = None
        if ours and theirs:
            row["ray_over_ours"] = ours / theirs if higher else theirs / ours
        rows[label] = row
    return rows


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return f"{value * 1e3:.2f} ms"
    return f"{value:,.0f} {unit}".strip()


def print_rows(rows: dict[str, dict[str, Any]]) -> None:
    print(f"{'row':<56}{'asyncrpc':>16}{'Ray':>16}{'Ray/ours':>10}")
    for label, row in rows.items():
        ours, theirs = (_fmt(row[way], row["unit"]) for way in ("asyncrpc", "ray"))
        ratio = "-" if row["ray_over_ours"] is None else f"{row['ray_over_ours']:.1f}x"
        print(f"{label:<56}{ours:>16}{theirs:>16}{ratio:>10}")
    print("Ray/ours: how many times better asyncrpc is (shorter time, more items/s; "
          "for backpressure, fewer items made ahead)")  # fmt: skip


def main(ctx: asyncrpc.Context, opts: argparse.Namespace) -> None:
    if ctx.rank != 0:
        return
    ray = None
    if not opts.no_ray:
        if ray_peer.start():
            ray = ray_ways()
    print_rows(measure(opts.rounds, opts.items, ray))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--items", type=int, default=2000, help="items per stream sample")
    parser.add_argument("--no-ray", action="store_true", help="leave Ray out")
    asyncrpc.run(main, 3, args=(parser.parse_args(),))
