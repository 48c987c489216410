"""Call-path overhead: asyncrpc.rpc_sync / rpc_async vs raw torch.distributed.rpc.

Both paths run in the same world, alternated call by call (rpc_sync) or
burst by burst (rpc_async) so that drift hits both alike; the figure is the
ratio of medians over rounds (target: <= 1.05x).

    python benchmarks/call_overhead.py [--calls 2000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed.rpc as rpc

import asyncrpc


def echo(x: torch.Tensor) -> torch.Tensor:
    return x


def _paired_sync(n: int, x: torch.Tensor) -> tuple[float, float]:
    """Seconds per rpc_sync, raw and ours, alternating call by call so drift hits both."""
    spent = {rpc.rpc_sync: 0.0, asyncrpc.rpc_sync: 0.0}
    for i in range(n):
        pair = (rpc.rpc_sync, asyncrpc.rpc_sync) if i % 2 else (asyncrpc.rpc_sync, rpc.rpc_sync)
        for call in pair:  # who goes first alternates too
            start = time.perf_counter()
            call("worker1", echo, args=(x,))
            spent[call] += time.perf_counter() - start
    return spent[rpc.rpc_sync] / n, spent[asyncrpc.rpc_sync] / n


def _burst(call: Callable[..., torch.futures.Future[object]], n: int, x: torch.Tensor) -> float:
    start = time.perf_counter()
    torch.futures.wait_all([call("worker1", echo, args=(x,)) for _ in range(n)])
    return (time.perf_counter() - start) / n


def _paired_async(n: int, x: torch.Tensor) -> tuple[float, float]:
    """Seconds per call in bursts of 100 rpc_async, raw and ours alternating burst by burst."""
    raw, ours = [], []
    for _ in range(max(1, n // 100)):
        raw.append(_burst(rpc.rpc_async, 100, x))
        ours.append(_burst(asyncrpc.rpc_async, 100, x))
    return statistics.median(raw), statistics.median(ours)


def main(ctx: asyncrpc.Context, opts: argparse.Namespace) -> None:
    if ctx.rank != 0:
        return
    x = torch.ones(16)
    rows = []
    for label, paired in [
        ("rpc_sync", _paired_sync),
        ("rpc_async x 100, wait_all", _paired_async),
    ]:
        paired(200, x)  # warm-up
        runs = [paired(opts.calls, x) for _ in range(opts.rounds)]
        r = statistics.median(raw for raw, _ in runs)
        o = statistics.median(ours for _, ours in runs)
        rows.append((label, r * 1e6, o * 1e6, o / r))
    print(f"{'path':<26}{'raw torch (us)':>16}{'asyncrpc (us)':>16}{'ratio':>8}")
    for label, r, o, ratio in rows:
        print(f"{label:<26}{r:>16.1f}{o:>16.1f}{ratio:>7.3f}x")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    return parser.parse_args()


if __name__ == "__main__":
    asyncrpc.run(main, world_size=2, args=(_parse(),))
