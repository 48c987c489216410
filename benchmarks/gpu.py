"""CUDA tensors between two workers on GPUs, and the vmap engine on a GPU.

1. The round trip of a CUDA tensor (1 MiB and 64 MiB) from worker0 to worker1
   and back, three ways, alternating round by round in one world started
   with `devices="cuda"` (on a machine with one GPU both workers share cuda:0;
   with two or more, each has its own):
   - asyncrpc: `asyncrpc.rpc_sync`, the tensor moved along the device maps;
   - torch: `torch.distributed.rpc.rpc_sync`, same world, same maps;
   - CPU detour: what users do without maps: `.cpu()` before the call, the
     callee's `.cuda()`, its `.cpu()` back, the caller's `.cuda()`.
   GB/s counts both directions (2 x the tensor's bytes per round trip).
2. 16 MLP members (3 Linear of 512), the vmap engine against one by one, at
   batch 1 and 64, on the GPU (synchronized after each call).

    python benchmarks/gpu.py [--rounds 7] [--sizes-mib 1 64] [--json PATH]

Without CUDA it runs the same code on CPU tensors, says so, and its figures
say nothing about GPUs (the detour row is then the plain path twice).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.rpc as rpc

import asyncrpc

import run_record
import timing

MEMBERS, WIDTH = 16, 512
WAYS = ("asyncrpc", "torch", "CPU detour")


def on_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else (
        torch.device("cpu"))  # fmt: skip


def echo(t: torch.Tensor) -> torch.Tensor:
    return t


def echo_detour(t: torch.Tensor) -> torch.Tensor:
    """The callee's side of the detour: onto its GPU, and back to the CPU to reply."""
    return t.to(on_device()).cpu()


def _synced(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return out

    return run


def round_trips(size_mib: int, rounds: int, per_sample: int) -> dict[str, list[float]]:
    """Seconds per round trip of a `size_mib` tensor, a sample per way per round."""
    device = on_device()
    t = torch.rand(size_mib * 1024 * 1024 // 4, device=device)
    ways: dict[str, Callable[[], object]] = {
        "asyncrpc": _synced(lambda: asyncrpc.rpc_sync("worker1", echo, args=(t,))),
        "torch": _synced(lambda: rpc.rpc_sync("worker1", echo, args=(t,))),
        "CPU detour": _synced(
            lambda: asyncrpc.rpc_sync("worker1", echo_detour, args=(t.cpu(),)).to(device)
        ),
    }
    for way in ways.values():
        way()  # warm: channels open, buffers allocated
    samples: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(rounds):
        order = list(ways) if r % 2 == 0 else list(reversed(ways))
        for name in order:
            samples[name].append(timing.mean_seconds(ways[name], per_sample))
    return samples


def members() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    device = on_device()
    return [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTH, WIDTH)).to(device).eval()
            for _ in range(MEMBERS)]  # fmt: skip


def ensemble(batch: int, rounds: int, sample: float) -> dict[str, Any]:
    """Seconds per call: the vmap engine and one by one, alternating; and the engine's plan."""
    group = members()
    x = torch.randn(batch, WIDTH, device=on_device())
    fan = asyncrpc.Fanout(group, engine="vmap")
    with torch.no_grad():
        ways = {"vmap engine": _synced(lambda: fan(x)),
                "one by one": _synced(lambda: [m(x) for m in group])}  # fmt: skip
        for way in ways.values():
            way()
        per = {name: timing.repeats(way, sample) for name, way in ways.items()}
        samples: dict[str, list[float]] = {name: [] for name in ways}
        for r in range(rounds):
            for name in list(ways) if r % 2 == 0 else list(reversed(ways)):
                samples[name].append(timing.mean_seconds(ways[name], per[name]))
    return {"samples": samples, "declined": fan.declined.get("vmap")}


def main(ctx: asyncrpc.Context, opts: argparse.Namespace) -> None:
    if ctx.rank != 0:
        return
    started = time.perf_counter()
    transfers = {}
    for size in opts.sizes_mib:
        per_sample = max(1, 64 // size) if torch.cuda.is_available() else 1
        samples = round_trips(size, opts.rounds, per_sample)
        medians = {name: statistics.median(s) for name, s in samples.items()}
        transfers[str(size)] = {
            name: {"ms": medians[name] * 1e3,
                   "gb_s": 2 * size * 2**20 / medians[name] / 1e9,
                   "vs_torch": medians[name] / medians["torch"]}
            for name in WAYS
        }  # fmt: skip
    engine = {}
    for batch in opts.batches:
        found = ensemble(batch, opts.rounds, opts.sample_seconds)
        medians = {name: statistics.median(s) for name, s in found["samples"].items()}
        engine[str(batch)] = {"us": {n: m * 1e6 for n, m in medians.items()},
                              "speedup": medians["one by one"] / medians["vmap engine"],
                              "declined": found["declined"]}  # fmt: skip
    where = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    results = {"transfers": transfers, "ensemble": engine}
    report(results, where)
    print(f"\n(took {time.perf_counter() - started:.0f} s)")
    if opts.json:  # the parent writes the record: its command line is the run's
        with open(opts.json + ".part", "w") as part:
            json.dump({"card": where, **results}, part)


def report(results: dict[str, Any], where: str) -> None:
    kind = "CUDA tensors" if torch.cuda.is_available() else "CPU tensors (no CUDA here)"
    print(f"{kind} between two workers on {where} (median of rounds; GB/s both ways)")
    print("| size | way | ms per round trip | GB/s | vs torch |")
    print("|---|---|---|---|---|")
    for size, rows in results["transfers"].items():
        for name in WAYS:
            row = rows[name]
            print(f"| {size} MiB | {name} | {row['ms']:.3f} | {row['gb_s']:.2f} | "
                  f"{row['vs_torch']:.2f}x |")  # fmt: skip
    print(f"\n{MEMBERS} MLP members on {where}: the vmap engine against one by one")
    print("| batch | vmap engine (us) | one by one (us) | speed-up |")
    print("|---|---|---|---|")
    for batch, row in results["ensemble"].items():
        us = row["us"]
        note = f" (declined: {row['declined']})" if row["declined"] else ""
        print(f"| {batch} | {us['vmap engine']:.0f} | {us['one by one']:.0f} | "
              f"{row['speedup']:.2f}x{note} |")  # fmt: skip


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--sample-seconds", type=float, default=0.2)
    parser.add_argument("--json", default=None)
    return parser.parse_args()


if __name__ == "__main__":
    options = _parse()
    cuda = torch.cuda.is_available()
    if not cuda:
        print("gpu.py: no CUDA here: the same code on CPU tensors; these figures say nothing "
              "about GPUs", file=sys.stderr)  # fmt: skip
    asyncrpc.run(main, world_size=2, args=(options,), devices="cuda" if cuda else None)
    if options.json:
        part = pathlib.Path(options.json + ".part")
        found = json.loads(part.read_text())
        part.unlink()
        run_record.write(options.json, {"benchmark": "gpu", "options": vars(options), **found})
