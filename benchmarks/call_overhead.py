"""Call-path overhead: asyncrpc.rpc_sync / rpc_async vs raw torch.distributed.rpc.

Both paths run in the same world, interleaved in rounds so that drift hits
both alike; the figure is the ratio of medians (target: <= 1.05x).

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


def _time_sync(call: Callable[..., object], n: int, x: torch.Tensor) -> float:
    start = time.perf_counter()
    for _ in range(n):
        call("worker1", echo, args=(x,))
    return (time.perf_counter() - start) / n


def _time_async(
    call: Callable[..., torch.futures.Future[object]], n: int, x: torch.Tensor
) -> float:
    start = time.perf_counter()
    torch.futures.wait_all([call("worker1", echo, args=(x,)) for _ in range(n)])
    return (time.perf_counter() - start) / n


def main(ctx: asyncrpc.Context, opts: argparse.Namespace) -> None:
    if ctx.rank != 0:
        return
    x = torch.ones(16)
    rows = []
    for label, timer, ours, raw in [
        ("rpc_sync", _time_sync, asyncrpc.rpc_sync, rpc.rpc_sync),
        ("rpc_async x N, wait_all", _time_async, asyncrpc.rpc_async, rpc.rpc_async),
    ]:
        timer(raw, 200, x)  # warm-up
        timer(ours, 200, x)
        raw_t, ours_t = [], []
        for _ in range(opts.rounds):
            raw_t.append(timer(raw, opts.calls, x))
            ours_t.append(timer(ours, opts.calls, x))
        r, o = statistics.median(raw_t), statistics.median(ours_t)
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
