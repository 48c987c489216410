"""async_execution: asyncrpc vs raw torch, measured side by side in one world.

Three figures, each a ratio of medians over interleaved rounds:

1. call path: worker0 -> worker1 -> worker2 chained add written with
   then(); torch's decorator + raw rpc vs asyncrpc's decorator + asyncrpc
   calls (target <= 1.05x);
2. then-chain (torch decorator) vs the same flow as `async def` (<= 1.10x);
3. nested capacity: N concurrent calls into worker1, which has 4 RPC
   threads, each awaiting a call to worker2: errors (target 0) and
   throughput against N flat rpc_async calls straight to worker2 (>= 0.8x).

    python benchmarks/async_execution.py [--calls 1000] [--rounds 5] [--nested 1000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import Tensor
from torch.futures import Future

import asyncrpc


@rpc.functions.async_execution
def torch_chained(to: str, x: Tensor, y: int, z: int) -> Future[Tensor]:
    return rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)


@asyncrpc.async_execution
def ours_chained(to: str, x: Tensor, y: int, z: int) -> Future[Tensor]:
    return asyncrpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)


@asyncrpc.async_execution
async def ours_awaiting(to: str, x: Tensor, y: int, z: int) -> Tensor:
    return await asyncrpc.rpc_async(to, torch.add, args=(x, y)) + z


def work(x: int, seconds: float) -> int:
    if seconds:
        time.sleep(seconds)
    return x + 1


@asyncrpc.async_execution
async def relay(to: str, x: int, seconds: float) -> int:
    return await asyncrpc.rpc_async(to, work, args=(x, seconds))


@rpc.functions.async_execution  # type: ignore[untyped-decorator]
def torch_relay(to: str, x: int, seconds: float) -> Future[int]:
    return rpc.rpc_async(to, work, args=(x, seconds))  # type: ignore[no-any-return]


Call = tuple[Callable[..., Any], Callable[..., Any]]  # (rpc_sync flavour, function)


def _paired(a: Call, b: Call, n: int, rounds: int) -> tuple[float, float]:
    """Median seconds per call of a and b, alternating call by call so drift hits both."""
    args = ("worker2", torch.ones(2), 1, 1)
    ta, tb = [], []
    for r in range(rounds + 1):
        sa = sb = 0.0
        for _ in range(n):
            t0 = time.perf_counter()
            a[0]("worker1", a[1], args=args)
            t1 = time.perf_counter()
            b[0]("worker1", b[1], args=args)
            sa, sb = sa + t1 - t0, sb + time.perf_counter() - t1
        if r:  # round 0 warms up
            ta.append(sa / n)
            tb.append(sb / n)
    return statistics.median(ta), statistics.median(tb)


def _burst(to: str, fn: Callable[..., Any], n: int, seconds: float) -> tuple[float, int, bool]:
    """N calls in flight at once: (calls per second, errors, results all correct)."""
    extra: tuple[Any, ...] = ("worker2",) if fn in (relay, torch_relay) else ()
    start = time.perf_counter()
    futs = [asyncrpc.rpc_async(to, fn, args=(*extra, i, seconds)) for i in range(n)]
    errors, total = 0, 0
    for fut in futs:
        try:
            total += fut.wait()
        except Exception:
            errors += 1
    elapsed = time.perf_counter() - start
    return n / elapsed, errors, total == n * (n + 1) // 2


def main(ctx: asyncrpc.Context, opts: argparse.Namespace) -> None:
    if ctx.rank != 0:
        return
    n, rounds = opts.calls, opts.rounds
    raw, ours = _paired(
        (rpc.rpc_sync, torch_chained), (asyncrpc.rpc_sync, ours_chained), n, rounds
    )
    then_t, await_t = _paired(
        (rpc.rpc_sync, torch_chained), (asyncrpc.rpc_sync, ours_awaiting), n, rounds
    )
    print(f"{'figure':<44}{'torch (us)':>12}{'asyncrpc (us)':>15}{'ratio':>8}  target")
    print(
        f"{'1. chained add call path':<44}{raw * 1e6:>12.1f}{ours * 1e6:>15.1f}"
        f"{ours / raw:>7.3f}x  <= 1.05x"
    )
    print(
        f"{'2. then-chain vs async def':<44}{then_t * 1e6:>12.1f}{await_t * 1e6:>15.1f}"
        f"{await_t / then_t:>7.3f}x  <= 1.10x"
    )
    print(f"\n3. {opts.nested} calls in flight; worker1 has 4 RPC threads; calls per second")
    print(
        f"{'work per call':<16}{'flat':>8}{'torch then':>12}{'async def':>11}"
        f"{'vs flat':>9}{'vs torch':>10}  errors (target: 0, >= 0.8x flat)"
    )
    for ms in opts.work_ms:
        rates: dict[Any, list[float]] = {work: [], torch_relay: [], relay: []}
        errors = 0
        for _ in range(rounds):
            for fn, runs in rates.items():
                to = "worker2" if fn is work else "worker1"
                rate, errs, ok = _burst(to, fn, opts.nested, ms / 1000)
                runs.append(rate if ok else 0.0)
                errors += errs
        f, t, a = (statistics.median(v) for v in rates.values())
        print(
            f"{f'{ms:g} ms':<16}{f:>8.0f}{t:>12.0f}{a:>11.0f}{a / f:>8.2f}x{a / t:>9.2f}x  "
            f"{errors} of {rounds * 3 * opts.nested}"
        )


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nested", type=int, default=1000)
    parser.add_argument("--work-ms", type=float, nargs="+", default=[0.0, 1.0, 5.0])
    return parser.parse_args()


if __name__ == "__main__":
    asyncrpc.run(main, world_size=3, args=(_parse(),), num_worker_threads=4, rpc_timeout=60)
