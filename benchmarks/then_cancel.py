"""What a cancellable `then` costs: asyncrpc's then-Future vs torch's own child.

`then` on an asyncrpc Future hands out a Future of asyncrpc's own (which a
cancel can fail at once) in place of torch's child. Both ways run in the same
world, alternated round by round so that drift hits both alike; the figures
are medians over rounds and their ratio.

    python benchmarks/then_cancel.py [--calls 2000] [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import asyncrpc
from asyncrpc._core import _futures, _runtime
from asyncrpc._core._torch import _patches


def echo(x: int) -> int:
    return x


def _done_source(n: int) -> float:
    """Seconds per `then` on an asyncrpc Future that is already done, read at once."""
    source = asyncrpc.gather([])  # done, and asyncrpc's: its then is the cancellable one
    start = time.perf_counter()
    for _ in range(n):
        source.then(lambda f: 1).wait()
    return (time.perf_counter() - start) / n


def _calls(n: int) -> float:
    """Seconds per call in bursts of 100 `rpc_async(...).then(...)` to worker1."""
    start = time.perf_counter()
    for _ in range(max(1, n // 100)):
        futs = [
            asyncrpc.rpc_async("worker1", echo, args=(i,)).then(lambda f: 1) for i in range(100)
        ]
        torch.futures.wait_all(futs)
    return (time.perf_counter() - start) / n


def _then_child(make: Callable[[Any, Any], Any] | None) -> None:
    """`then` on an asyncrpc Future returns `make(torch's child, its source)` (None: the child)."""
    patches = _runtime.part(_patches.Patches)
    assert patches.hooks is not None, "a world installs the hooks"
    patches.hooks = patches.hooks._replace(then_child=make)


def _paired(measure: Callable[[int], float], n: int, rounds: int) -> tuple[float, float]:
    torchs, ours = [], []
    for r in range(rounds):
        for way in ("torch", "ours") if r % 2 else ("ours", "torch"):  # who goes first alternates
            _then_child(_futures.then_child if way == "ours" else None)
            (ours if way == "ours" else torchs).append(measure(n))
    _then_child(_futures.then_child)
    return statistics.median(torchs), statistics.median(ours)


def main(ctx: asyncrpc.Context, calls: int, rounds: int) -> None:
    if ctx.rank != 0:
        return
    for name, measure in (("then on a done Future", _done_source), ("rpc_async + then", _calls)):
        measure(calls // 4)  # warm-up
        raw, ours = _paired(measure, calls, rounds)
        print(f"{name:24s} torch's child {raw * 1e6:7.1f} us   asyncrpc's {ours * 1e6:7.1f} us   "
              f"ratio {ours / raw:.2f}x")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=9)
    options = parser.parse_args()
    asyncrpc.run(main, world_size=2, args=(options.calls, options.rounds))
