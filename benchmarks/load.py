"""Load and soak: many calls in flight from several callers to one callee.

Load: every caller (all workers but worker1) starts its share of `--calls`
rpc_async calls to worker1 at once, each tagged with a unique id; the echoed
ids must come back exactly once each (checked by set and checksum).
Soak: the same callers keep calling for `--seconds`; each worker's resident
memory is sampled after a warm-up and at the end, and the growth printed
with whether every worker stayed within 5% of its start (the bound
tests/test_leaks.py holds failed calls to).

    python benchmarks/load.py [--calls 10000] [--seconds 60] [--workers 4]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import asyncrpc

RSS_BOUND = 0.05


def echo(tag: int, payload: torch.Tensor) -> tuple[int, float]:
    return tag, float(payload.sum())


def burst(first: int, count: int) -> tuple[int, int, int]:
    """Start `count` calls at once; return (received, distinct, checksum) of the ids."""
    payload = torch.ones(8)
    futs = [asyncrpc.rpc_async("worker1", echo, args=(first + i, payload)) for i in range(count)]
    tags = [fut.wait()[0] for fut in futs]
    return len(tags), len(set(tags)), sum(tags)


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def keep_calling(seconds: float) -> int:
    deadline, calls = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        calls += burst(0, 100)[0]
    return calls


def main(ctx: asyncrpc.Context, calls: int, seconds: float) -> None:
    if ctx.rank != 0:
        return
    callers = [n for n in ctx.names if n != "worker1"]
    base, extra = divmod(calls, len(callers))
    shares = [base + (i < extra) for i in range(len(callers))]
    firsts = [sum(shares[:i]) for i in range(len(callers))]
    start = time.perf_counter()
    futs = [
        asyncrpc.rpc_async(n, burst, args=(first, share))
        for n, first, share in zip(callers, firsts, shares, strict=True)
    ]
    results = [f.wait() for f in futs]
    took = time.perf_counter() - start
    got, distinct, checksum = (sum(r[k] for r in results) for k in range(3))
    expected = calls
    ok = got == distinct == expected and checksum == expected * (expected - 1) // 2
    print(
        f"load: {got} calls from {len(callers)} callers to worker1 in {took:.2f} s "
        f"({got / took:.0f}/s); lost or duplicated: {expected - distinct + got - distinct}; "
        f"checksum {'ok' if ok else 'WRONG'}"
    )
    warm = min(10.0, seconds / 6)
    [asyncrpc.rpc_async(n, keep_calling, args=(warm,)) for n in callers][-1].wait()
    before = {n: asyncrpc.rpc_sync(n, rss_kib) for n in ctx.names}
    soak = [
        asyncrpc.rpc_async(n, keep_calling, args=(seconds,), timeout=seconds + 60) for n in callers
    ]
    total = sum(f.wait() for f in soak)
    after = {n: asyncrpc.rpc_sync(n, rss_kib) for n in ctx.names}
    print(f"soak: {total} calls in {seconds:.0f} s after {warm:.0f} s of warm-up")
    print("| worker | RSS after warm-up | RSS at the end | growth |\n| --- | --- | --- | --- |")
    growths = {n: (after[n] - before[n]) / before[n] for n in ctx.names}
    for n in ctx.names:
        print(
            f"| {n} | {before[n] / 1024:.1f} MiB | {after[n] / 1024:.1f} MiB | {growths[n]:+.1%} |"
        )
    within = all(growth <= RSS_BOUND for growth in growths.values())
    print(f"RSS within {RSS_BOUND:.0%} of the start on every worker: {'yes' if within else 'NO'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=4)
    opts = parser.parse_args()
    os.environ.setdefault("ASYNCRPC_INTRA_OP_THREADS", "1")
    asyncrpc.run(main, world_size=opts.workers, args=(opts.calls, opts.seconds), rpc_timeout=120)
