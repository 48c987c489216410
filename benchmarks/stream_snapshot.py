"""What capturing each stream item at its `yield` costs: tensors copied, or sent uncopied.

A stream's producer copies each item's tensors at the yield, so that a
generator may update a tensor in place after yielding it. This compares,
round by round in alternating order, the same streams with that copy and
without it (the producer's copy switched off, as before the copy existed;
every item here is a new tensor, so both deliver the same items):

- small items: 64 B tensors, items/s;
- 1 MiB items: MiB/s;
- one 1 MiB tensor copied on the producer alone (the copy's own time).

Figures are medians over rounds; the ratio is uncopied over copied (> 1: the
copy costs that much).

    python benchmarks/stream_snapshot.py [--rounds 7] [--items 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator

import torch

import asyncrpc
from asyncrpc._core import _stream_items

_SNAPSHOT = _stream_items.snapshot
SMALL, BIG = 16, 256 * 1024  # floats: 64 B, 1 MiB


def items(n: int, size: int) -> Iterator[torch.Tensor]:
    for i in range(n):
        yield torch.full((size,), float(i))  # a new tensor each: correct either way


def copying(on: bool) -> None:
    """On the producer: capture items at their yield (on), or send tensors uncopied."""
    _stream_items.snapshot = _SNAPSHOT if on else list  # type: ignore[assignment]


def copy_seconds(size: int, repeat: int) -> float:
    """On the producer: seconds to snapshot one tensor of `size` floats."""
    t = torch.ones(size)
    start = time.perf_counter()
    for _ in range(repeat):
        _SNAPSHOT([t])
    return (time.perf_counter() - start) / repeat


def stream_seconds(n: int, size: int) -> float:
    start = time.perf_counter()
    for _ in asyncrpc.stream("worker1", items, args=(n, size)):
        pass
    return time.perf_counter() - start


def measure(rounds: int, n: int) -> dict[str, dict[str, float]]:
    few = max(1, n // 10)
    ways = {"copied": True, "uncopied": False}
    samples: dict[str, dict[str, list[float]]] = {w: {"small": [], "big": []} for w in ways}
    for r in range(rounds):
        order = list(ways)[r % 2 :] + list(ways)[: r % 2]
        for way in order:
            asyncrpc.rpc_sync("worker1", copying, args=(ways[way],))
            samples[way]["small"].append(n / stream_seconds(n, SMALL))
            samples[way]["big"].append(few / stream_seconds(few, BIG))
    asyncrpc.rpc_sync("worker1", copying, args=(True,))
    return {w: {k: statistics.median(v) for k, v in s.items()} for w, s in samples.items()}


def main(ctx: asyncrpc.Context, opts: argparse.Namespace) -> None:
    if ctx.rank != 0:
        return
    stream_seconds(opts.items, SMALL)  # warm both ends
    got = measure(opts.rounds, opts.items)
    copy_us = asyncrpc.rpc_sync("worker1", copy_seconds, args=(BIG, 200)) * 1e6
    small_us = asyncrpc.rpc_sync("worker1", copy_seconds, args=(SMALL, 2000)) * 1e6
    print(f"{'row':<40}{'copied':>14}{'uncopied':>14}{'uncopied/copied':>17}")
    for key, label, unit in (("small", "stream of small items (64 B)", "items/s"),
                             ("big", "stream of 1 MiB items", "MiB/s")):  # fmt: skip
        copied, uncopied = got["copied"][key], got["uncopied"][key]
        print(f"{label:<40}{copied:>8,.0f} {unit:<5}{uncopied:>8,.0f} {unit:<5}"
              f"{uncopied / copied:>16.2f}x")  # fmt: skip
    print(f"the copy alone, on the producer: {small_us:.1f} us per 64 B tensor, "
          f"{copy_us:.1f} us per 1 MiB tensor")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--items", type=int, default=2000, help="small items per sample")
    asyncrpc.run(main, 2, args=(parser.parse_args(),))
