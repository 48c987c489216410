"""What `asyncrpc.trace` costs while open: the same work traced and untraced.

Rounds alternate: untraced, then the same inside `asyncrpc.trace`; the
figure is the ratio of medians over rounds. Two workloads: a small rpc_sync
round trip (the per-call cost of marking a call) and the BiLSTM ensemble of
examples/trace_ensemble.py (4 members over 2 workers, 2 threads each).

    python benchmarks/trace_overhead.py [--calls 300] [--rounds 5]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

import asyncrpc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from bilstm_ensemble import BiLSTM


def echo(x: torch.Tensor) -> torch.Tensor:
    return x


def _per_call(fn: Callable[[], object], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def main(ctx: asyncrpc.Context, opts: argparse.Namespace) -> None:
    if ctx.rank != 0:
        return
    x = torch.ones(16)
    ensemble = asyncrpc.Ensemble(
        BiLSTM, 4, 256, workers=["worker1", "worker2"], engine="threads", threads=2, seed=0
    )
    seq = torch.rand(50, 8, 256)
    work = {
        "rpc_sync round trip": (lambda: asyncrpc.rpc_sync("worker1", echo, args=(x,)), opts.calls),
        "BiLSTM ensemble call": (lambda: ensemble(seq), max(1, opts.calls // 30)),
    }
    times: dict[str, dict[bool, list[float]]] = {k: {False: [], True: []} for k in work}
    with torch.no_grad(), tempfile.TemporaryDirectory() as folder:
        ensemble(seq)  # warm-up
        for _ in range(opts.rounds):
            for label, (fn, n) in work.items():
                times[label][False].append(_per_call(fn, n))
            with asyncrpc.trace(pathlib.Path(folder, "t.json")):
                for label, (fn, n) in work.items():
                    times[label][True].append(_per_call(fn, n))
    print(f"{'workload':24} {'untraced (ms)':>14} {'traced (ms)':>12} {'ratio':>7}")
    for label, by_mode in times.items():
        plain, traced = (statistics.median(by_mode[m]) * 1e3 for m in (False, True))
        print(f"{label:24} {plain:14.3f} {traced:12.3f} {traced / plain:6.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    asyncrpc.run(main, world_size=3, args=(parser.parse_args(),), intra_op_threads=2)
