"""BiLSTM ensemble: serial vs jit.fork vs threads vs spread over 2 workers; transports.

One run prints, for the reference size (T=50, B=50, C=1024) and the small one
(T=50, B=8, C=256): the median time of each way of running the 4 members,
its speedup over serial, and its efficiency against the GEMM floor (the
ensemble's FLOPs at the GEMM rate measured in this run, 2048^3 on all
intra-op threads). Local engines alternate round by round. Then, for
TensorPipe's default transports and asyncrpc's choice: the CPU each idle
worker burns and the median round trip of a small and a 10 MB call.

    python benchmarks/ensemble.py [--rounds 5] [--sizes small reference]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed.rpc as rpc

import asyncrpc

# The example's model, so that the benchmark measures exactly what it runs.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from bilstm_ensemble import BiLSTM

SIZES = {"reference": (50, 50, 1024), "small": (50, 8, 256)}
MEMBERS = 4


def gflop(t: int, b: int, c: int) -> float:
    """4 members x 2 LSTMs x T steps x (input + hidden GEMM, 2*B*C*4C flops each)."""
    return MEMBERS * 2 * t * 2 * (2 * b * c * 4 * c) / 1e9


def gemm_rate() -> float:
    a, b = torch.rand(2048, 2048), torch.rand(2048, 2048)
    a @ b
    best = min(_seconds(lambda: a @ b) for _ in range(5))
    return 2 * 2048**3 / best / 1e9


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def local_engines(t: int, b: int, c: int, rounds: int) -> dict[str, float]:
    x = torch.rand(t, b, c)
    ways = {
        engine: asyncrpc.Ensemble(BiLSTM, MEMBERS, c, seed=0, engine=engine)  # type: ignore[arg-type]
        for engine in ("serial", "fork", "threads")
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    with torch.no_grad():
        reference = ways["serial"](x)
        for name, ens in ways.items():
            assert torch.allclose(ens(x), reference, atol=1e-5), name
        for _ in range(rounds):
            for name, ens in ways.items():
                times[name].append(_seconds(lambda ens=ens: ens(x)))
    return {name: statistics.median(ts) for name, ts in times.items()}


def spread(ctx: asyncrpc.Context, sizes: list[str], rounds: int, out: str) -> None:
    """On worker0: time the ensemble spread over worker1 and worker2; append to `out`."""
    if ctx.rank != 0:
        return
    for size in sizes:
        t, b, c = SIZES[size]
        x = torch.rand(t, b, c)
        ens = asyncrpc.Ensemble(BiLSTM, MEMBERS, c, seed=0, workers=["worker1", "worker2"])
        with torch.no_grad():
            ens(x)
            times = [_seconds(lambda ens=ens, x=x: ens(x)) for _ in range(rounds)]
        _append(out, {"size": size, "seconds": statistics.median(times)})


def _append(path: str, row: dict[str, object]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _rows(path: str) -> list[dict[str, object]]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def echo(x: torch.Tensor) -> torch.Tensor:
    return x


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _round_trip(x: torch.Tensor, n: int) -> float:
    times = [_seconds(lambda: rpc.rpc_sync("worker1", echo, args=(x,))) for _ in range(n)]
    return statistics.median(times)


def transport(ctx: asyncrpc.Context, label: str, out: str) -> None:
    """On worker0: idle CPU of the other workers, then round trips to worker1."""
    if ctx.rank != 0:
        return
    pids = [rpc.rpc_sync(name, os.getpid) for name in ctx.names[1:]]
    time.sleep(0.5)
    before = [_cpu_seconds(p) for p in pids]
    time.sleep(3.0)
    idle = max((_cpu_seconds(p) - b) / 3.0 for p, b in zip(pids, before, strict=True))
    small, big = torch.ones(16), torch.ones(50, 50, 1024)
    _round_trip(small, 200)
    row = {"label": label, "idle": idle, "small": _round_trip(small, 2000)}
    _append(out, {**row, "big": _round_trip(big, 40)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", nargs="+", choices=SIZES, default=list(SIZES))
    parser.add_argument("--transport-rounds", type=int, default=2)
    opts = parser.parse_args()
    rate = gemm_rate()
    results = {size: local_engines(*SIZES[size], opts.rounds) for size in opts.sizes}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.jsonl")
        asyncrpc.run(spread, world_size=3, args=(opts.sizes, opts.rounds, out))
        for row in _rows(out):
            results[str(row["size"])]["spread over 2 workers"] = float(row["seconds"])  # type: ignore[arg-type]
        for _ in range(opts.transport_rounds):  # alternate: torch's default first, then ours
            asyncrpc.run(transport, world_size=3, args=("torch default", out), **_TORCH_DEFAULT)
            asyncrpc.run(transport, world_size=3, args=("asyncrpc default", out))
        transports = [row for row in _rows(out) if "label" in row]
    print(f"GEMM rate (2048^3, {torch.get_num_threads()} threads): {rate:.0f} GFLOP/s")
    print("| size | way | ms | vs serial | of GEMM floor |\n| --- | --- | --- | --- | --- |")
    for size in opts.sizes:
        floor = gflop(*SIZES[size]) / rate
        serial = results[size]["serial"]
        for way, seconds in results[size].items():
            print(
                f"| {size} | {way} | {seconds * 1e3:.1f} | {serial / seconds:.2f}x "
                f"| {floor / seconds:.0%} |"
            )
    print("\n| transports | idle CPU per worker | small call RTT | 10 MB call RTT |")
    print("| --- | --- | --- | --- |")
    for label in ("torch default", "asyncrpc default"):
        mine = [r for r in transports if r["label"] == label]
        idle = max(float(r["idle"]) for r in mine)  # type: ignore[arg-type]
        small = statistics.median(float(r["small"]) for r in mine)  # type: ignore[arg-type]
        big = statistics.median(float(r["big"]) for r in mine)  # type: ignore[arg-type]
        print(f"| {label} | {idle:.1%} | {small * 1e6:.0f} us | {big * 1e3:.1f} ms |")


# TensorPipe's own defaults: shared-memory transport first, every CPU channel.
_TORCH_DEFAULT: dict[str, object] = {"transports": None, "channels": None}


if __name__ == "__main__":
    main()
