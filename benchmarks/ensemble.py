"""Ensembles: BiLSTM engines and spread over 2 workers; transports; an MLP on "vmap".

One run prints, for the reference size (T=50, B=50, C=1024) and the small one
(T=50, B=8, C=256): the median time of each way of running the 4 members,
its speedup over serial, and its efficiency against the GEMM floor (the
ensemble's FLOPs at the GEMM rate measured in this run, 2048^3 on all
intra-op threads). Local engines alternate round by round. Then, for
TensorPipe's default transports and asyncrpc's choice: the CPU each idle
worker burns and the median round trip of a small and a 10 MB call. Last,
an MLP ensemble of one architecture at batch 1, 8 and 64: serial, the
"vmap" engine, auto and the floor (`stacked_mlp.py`, which runs it alone).

    python benchmarks/ensemble.py [--rounds 5] [--sizes small reference] [--mlp-batches 1 8 64]
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
from bilstm_ensemble import BiLSTM, seeded_members

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import stacked_mlp

import timing

SIZES = {"reference": (50, 50, 1024), "small": (50, 8, 256)}
MEMBERS = 4


def gflop(t: int, b: int, c: int) -> float:
    """4 members x 2 LSTMs x T steps x (input + hidden GEMM, 2*B*C*4C flops each)."""
    return MEMBERS * 2 * t * 2 * (2 * b * c * 4 * c) / 1e9


def gemm_rate() -> tuple[float, str]:
    """The faster of torch.mm and oneDNN's linear at 2048^3 on all intra-op threads."""
    a, b = torch.rand(2048, 2048), torch.rand(2048, 2048)
    rates = {"torch.mm": _gflops(lambda: a @ b, 2 * 2048**3)}
    if torch.backends.mkldnn.is_available():
        from torch.utils import mkldnn

        linear = mkldnn.to_mkldnn(torch.nn.Linear(2048, 2048, bias=False))
        dense = a.to_mkldnn()
        with torch.no_grad():
            rates["oneDNN linear"] = _gflops(lambda: linear(dense), 2 * 2048**3)
    best = max(rates, key=rates.__getitem__)
    return rates[best], best


def shape_rate(t: int, b: int, c: int) -> float:
    """GFLOP/s of an LSTM's own GEMMs: the input one (T*B rows) and the recurrent one (B rows)."""
    w = torch.rand(4 * c, c)
    x, h = torch.rand(t * b, c), torch.rand(b, c)
    step = 2 * b * c * 4 * c  # one time step's GEMM; the input GEMM does T of them at once
    seconds = t * step / _gflops(lambda: torch.nn.functional.linear(x, w), t * step)
    seconds += t * step / _gflops(lambda: torch.nn.functional.linear(h, w), step)
    return 2 * t * step / seconds


def _gflops(fn: Callable[[], object], flops: float) -> float:
    fn()
    return flops / min(timing.seconds(fn) for _ in range(5)) / 1e9


def local_engines(
    t: int, b: int, c: int, rounds: int, sample: float
) -> tuple[dict[str, float], str]:
    """Median seconds of each local way, alternated round by round; auto's plan."""
    x = torch.rand(t, b, c)
    members = seeded_members(c)
    auto = asyncrpc.Fanout(members)
    ways: dict[str, Callable[[], object]] = {
        "serial, 1 intra-op thread": lambda: _one_thread(members, x),
        "serial": _summed(asyncrpc.Fanout(members, engine="serial"), x),
    }
    try:
        ways["fork"] = _summed(asyncrpc.Fanout(members, engine="fork"), x)
    except TypeError as error:  # TorchScript is deprecated and may be missing or fail
        print(f"fork row left out: {error}", file=sys.stderr)
    ways["threads"] = _summed(asyncrpc.Fanout(members, engine="threads"), x)
    ways["auto"] = _summed(auto, x)
    times: dict[str, list[float]] = {name: [] for name in ways}
    with torch.no_grad():
        reference = ways["serial"]()
        trial = 0
        while auto.plan is None:  # auto's timed calls, before the rounds
            assert torch.allclose(_summed(auto, x)(), reference, atol=1e-4)  # type: ignore[arg-type]
            trial += 1
        for name, way in ways.items():
            assert torch.allclose(way(), reference, atol=1e-4), name  # type: ignore[arg-type]
        repeat = timing.repeats(ways["serial"], sample)
        for _ in range(rounds):
            for name, way in ways.items():
                times[name].append(timing.mean_seconds(way, repeat))
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    scaling = medians["serial, 1 intra-op thread"] / medians["serial"]
    budget = torch.get_num_threads()
    declined = asyncrpc.Fanout(members, engine="vmap").declined.get("vmap", "not declined")
    return medians, (
        f"engine 'vmap' declined: {declined}\n"
        f"auto chose {auto.plan} after {trial} timed calls; serial's own intra-op "
        f"scaling S = {scaling:.2f} on {budget} threads, so {budget} one-thread lanes "
        f"gain at most {budget / scaling:.2f}x over serial"
    )


def _summed(fan: asyncrpc.Fanout, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: torch.stack(fan(x)).sum(dim=0)


def _one_thread(members: list[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return torch.stack([m(x) for m in members]).sum(dim=0)
    finally:
        torch.set_num_threads(before)


def spread(ctx: asyncrpc.Context, sizes: list[str], rounds: int, sample: float, out: str) -> None:
    """On worker0: time the ensemble spread over worker1 and worker2; append to `out`.

    Also times, alternated with it, the members' compute alone on both workers
    at once (no input or output crosses) and the traffic alone (the input out
    to both, a zero tensor the size of a partial sum back).
    """
    if ctx.rank != 0:
        return
    workers = ["worker1", "worker2"]
    for size in sizes:
        t, b, c = SIZES[size]
        x = torch.rand(t, b, c)
        ens = asyncrpc.Ensemble(BiLSTM, MEMBERS, c, seed=0, workers=workers)
        halves = [list(range(0, MEMBERS // 2)), list(range(MEMBERS // 2, MEMBERS))]
        with torch.no_grad():
            ens(x)
            _compute_on(workers, size, halves)
            whole = _spread_call(ens, x)
            repeat = timing.repeats(whole, sample)
            moved = _transfer(workers, x)
            times, compute, transfer = [], [], []
            for _ in range(rounds):  # alternated: whole call, compute alone, transfer alone
                times.append(timing.mean_seconds(whole, repeat))
                compute.append(
                    sum(_compute_on(workers, size, halves) for _ in range(repeat)) / repeat
                )
                transfer.append(timing.mean_seconds(moved, repeat))
        row = {"size": size, "seconds": statistics.median(times)}
        row["transfer"] = statistics.median(transfer)
        _append(out, {**row, "compute": statistics.median(compute)})


def _spread_call(ens: asyncrpc.Ensemble, x: torch.Tensor) -> Callable[[], object]:
    return lambda: ens(x)


def _transfer(workers: list[str], x: torch.Tensor) -> Callable[[], object]:
    """The spread call's traffic without its compute: x out, one partial sum back each."""

    def both() -> object:
        futs = [rpc.rpc_async(w, partial_sum_shape, args=(x,)) for w in workers]
        return [fut.wait() for fut in futs]

    return both


def partial_sum_shape(x: torch.Tensor) -> torch.Tensor:
    """On a worker: a tensor the size of a BiLSTM output for `x` (T, B, 2C)."""
    return torch.zeros(x.shape[0], x.shape[1], 2 * x.shape[2])


def _compute_on(workers: list[str], size: str, halves: list[list[int]]) -> float:
    futs = [
        rpc.rpc_async(w, compute_seconds, args=(size, half))
        for w, half in zip(workers, halves, strict=True)
    ]
    return max(fut.wait() for fut in futs)


_held: dict[tuple[str, tuple[int, ...]], tuple[asyncrpc.Fanout, torch.Tensor]] = {}


def compute_seconds(size: str, indices: list[int]) -> float:
    """On a worker: seconds its members take on an input made there (built once)."""
    key = (size, tuple(indices))
    if key not in _held:
        t, b, c = SIZES[size]
        _held[key] = asyncrpc.Fanout(seeded_members(c, indices)), torch.rand(t, b, c)
    fan, x = _held[key]
    with torch.no_grad():
        return timing.seconds(_summed(fan, x))


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
    times = [timing.seconds(lambda: rpc.rpc_sync("worker1", echo, args=(x,))) for _ in range(n)]
    return statistics.median(times)


def transport(ctx: asyncrpc.Context, label: str, calls: int, out: str) -> None:
    """On worker0: idle CPU of the other workers, then round trips to worker1."""
    if ctx.rank != 0:
        return
    pids = [rpc.rpc_sync(name, os.getpid) for name in ctx.names[1:]]
    idle_s = min(3.0, calls / 500)
    time.sleep(0.5)
    before = [_cpu_seconds(p) for p in pids]
    time.sleep(idle_s)
    idle = max((_cpu_seconds(p) - b) / idle_s for p, b in zip(pids, before, strict=True))
    small, big = torch.ones(16), torch.ones(50, 50, 1024)
    _round_trip(small, calls // 10)
    row = {"label": label, "idle": idle, "small": _round_trip(small, calls)}
    _append(out, {**row, "big": _round_trip(big, max(5, calls // 50))})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", nargs="+", choices=SIZES, default=list(SIZES))
    parser.add_argument("--transport-rounds", type=int, default=2)
    parser.add_argument("--sample-seconds", type=float, default=0.5, help="per timed sample")
    parser.add_argument(
        "--transport-calls", type=int, default=2000, help="small round trips per transport round"
    )
    parser.add_argument("--mlp-batches", type=int, nargs="*", default=[1, 8, 64])
    opts = parser.parse_args()
    rate, kernel = gemm_rate()
    shapes = {size: shape_rate(*SIZES[size]) for size in opts.sizes}
    results, notes = {}, {}
    for size in opts.sizes:
        results[size], notes[size] = local_engines(*SIZES[size], opts.rounds, opts.sample_seconds)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.jsonl")
        spread_args = (opts.sizes, opts.rounds, opts.sample_seconds, out)
        asyncrpc.run(spread, world_size=3, args=spread_args)
        transfers = {}
        for row in _rows(out):
            size = str(row["size"])
            results[size]["spread over 2 workers"] = float(row["seconds"])  # type: ignore[arg-type]
            results[size]["spread, members' compute only"] = float(row["compute"])  # type: ignore[arg-type]
            transfers[size] = float(row["transfer"])  # type: ignore[arg-type]
        calls = opts.transport_calls
        for _ in range(opts.transport_rounds):  # alternate: torch's default first, then ours
            theirs, ours = ("torch default", calls, out), ("asyncrpc default", calls, out)
            asyncrpc.run(transport, world_size=3, args=theirs, **_TORCH_DEFAULT)
            asyncrpc.run(transport, world_size=3, args=ours)
        transports = [row for row in _rows(out) if "label" in row]
    print_engines(results, rate, kernel)
    for size in opts.sizes:
        for note in notes[size].splitlines():
            print(f"{size}: {note}")
        print(f"{size}: {against_shapes(results[size], SIZES[size], shapes[size], rate)}")
        print(f"{size}: {where_spread_goes(results[size], transfers[size])}")
    if transports:
        print_transports(transports)
    if opts.mlp_batches:
        stacked_mlp.run(opts.mlp_batches, opts.rounds, opts.sample_seconds)


def print_engines(results: dict[str, dict[str, float]], rate: float, kernel: str) -> None:
    threads = torch.get_num_threads()
    print(f"GEMM floor rate (2048^3, {threads} threads, {kernel}): {rate:.0f} GFLOP/s")
    print("| size | way | ms | vs serial | of GEMM floor |\n| --- | --- | --- | --- | --- |")
    for size, ways in results.items():
        floor = gflop(*SIZES[size]) / rate
        for way, seconds in ways.items():
            print(
                f"| {size} | {way} | {seconds * 1e3:.1f} | {ways['serial'] / seconds:.2f}x "
                f"| {floor / seconds:.0%} |"
            )


def against_shapes(
    ways: dict[str, float], size: tuple[int, int, int], shapes: float, rate: float
) -> str:
    """The LSTM's GEMM shapes timed alone, against the share of the floor the ways reached."""
    best = max(gflop(*size) / seconds for seconds in ways.values())
    said = (
        f"the LSTM's own GEMM shapes run at {shapes:.0f} GFLOP/s alone, "
        f"{shapes / rate:.0%} of the floor's rate; the best way reached {best / rate:.0%}"
    )
    if best > shapes:  # the fused kernel does better than its GEMMs one by one
        return f"{said}: torch's fused LSTM beats its GEMM shapes run alone, so they bound nothing"
    return f"{said}: no way can pass the shapes' share"


def where_spread_goes(ways: dict[str, float], transfer: float) -> str:
    """The spread call split into compute, traffic and the rest, against the best local way."""
    whole, compute = ways["spread over 2 workers"], ways["spread, members' compute only"]
    local = {w: s for w, s in ways.items() if not w.startswith("spread")}
    best = min(local, key=local.__getitem__)
    return (
        f"spread over 2 workers {whole * 1e3:.1f} ms = members' compute {compute * 1e3:.1f} ms "
        f"({compute / ways['threads']:.2f}x the threads engine) + transfer "
        f"{transfer * 1e3:.1f} ms + the rest {(whole - compute - transfer) * 1e3:.1f} ms; "
        f"{whole / local[best]:.2f}x the best local way ({best})"
    )


def print_transports(transports: list[dict[str, object]]) -> None:
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
