"""Profile small rpc_sync calls on both sides at once with `perf` (native frames, kernel too).

worker0 calls worker1's `echo` in a loop while `perf record` samples both
processes (cpu-clock, 999 Hz, no pausing) for the same seconds. For each
worker it prints the CPU used per call, split by thread (the caller's Python
thread, TensorPipe's event loop, the RPC agent's thread pool) and by the
library the sample landed in (the kernel, libpython, libtorch, libc...),
then the hottest symbols.

    python benchmarks/profile_small_call.py [--seconds 6] [--out profile]

Needs Linux `perf` and perf_event_paranoid <= 2 (the script says so if not).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

import asyncrpc

HZ = 999


def echo(x: torch.Tensor) -> torch.Tensor:
    return x


def call_while_sampled(ctx: asyncrpc.Context, seconds: float, out: str) -> None:
    """On worker0: sample both workers with perf while calling worker1 in a loop."""
    if ctx.rank != 0:
        return
    pids = [os.getpid(), asyncrpc.rpc_sync("worker1", os.getpid)]
    x = torch.ones(16)
    for _ in range(200):  # warm-up
        asyncrpc.rpc_sync("worker1", echo, args=(x,))
    perfs = [_perf(pid, seconds, Path(out) / f"worker{rank}") for rank, pid in enumerate(pids)]
    time.sleep(0.2)  # perf attaches
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds - 0.4:
        asyncrpc.rpc_sync("worker1", echo, args=(x,))
        calls += 1
    elapsed = time.perf_counter() - start
    for perf in perfs:
        perf.wait()
    (Path(out) / "calls.txt").write_text(f"{calls} {elapsed}\n")


def _perf(pid: int, seconds: float, stem: Path) -> subprocess.Popen[bytes]:
    command = ["perf", "record", "-e", "cpu-clock", "-F", str(HZ), "-g", "-p", str(pid)]
    command += ["-o", f"{stem}.data", "--", "sleep", str(seconds)]
    log = stem.with_suffix(".log").open("w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def report(data: Path, sort: str) -> list[tuple[float, list[str]]]:
    """`perf report` rows as (percent, keys), self time only."""
    command = ["perf", "report", "-i", str(data), "--stdio", "--no-children", "-g", "none"]
    command += ["--sort", sort, "--percent-limit", "0.3"]
    text = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    rows = []
    for line in text.splitlines():
        if line.strip() and not line.startswith("#") and line.strip()[0].isdigit():
            percent, *keys = line.split(maxsplit=len(sort.split(",")))
            rows.append((float(percent.rstrip("%")), [k.strip() for k in keys]))
    return rows


def samples(data: Path) -> int:
    command = ["perf", "script", "-i", str(data), "-F", "tid"]
    return len(subprocess.run(command, capture_output=True, text=True).stdout.splitlines())


def summarize(name: str, data: Path, calls: int) -> list[str]:
    total = samples(data)
    lines = [f"{name}: {total / HZ / calls * 1e6:.0f} us of CPU per call ({total} samples)"]
    threads: collections.Counter[str] = collections.Counter()
    for percent, (comm, dso) in report(data, "comm,dso"):
        threads[_role(comm)] += percent
        lines.append(f"  {percent:5.1f}%  {_role(comm):28} {dso}")
    lines.insert(1, "  by thread: " + ", ".join(f"{r} {p:.0f}%" for r, p in threads.most_common()))
    lines.append("  hottest symbols:")
    for percent, (comm, sym) in report(data, "comm,sym")[:10]:
        lines.append(f"  {percent:5.1f}%  {_role(comm):28} {sym[:70]}")
    return lines


def _role(comm: str) -> str:
    if comm.startswith("TP_"):
        return "TensorPipe loop"
    if comm.startswith("pt_thread_pool"):
        return "RPC agent pool"
    return "main thread" if comm.startswith("python") else comm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--out", default="profile")
    opts = parser.parse_args()
    if shutil.which("perf") is None:
        sys.exit("Linux perf is not installed (apt install linux-tools-common, or your distro's)")
    out = Path(opts.out)
    out.mkdir(exist_ok=True)
    asyncrpc.run(call_while_sampled, world_size=2, args=(opts.seconds, str(out)))
    for rank in (0, 1):
        if not (out / f"worker{rank}.data").exists():
            log = (out / f"worker{rank}.log").read_text()[-400:]
            sys.exit(f"perf recorded nothing for worker{rank} (perf_event_paranoid?): {log}")
    calls, elapsed = (out / "calls.txt").read_text().split()
    per_call = float(elapsed) / int(calls) * 1e6
    print(f"{calls} rpc_sync calls in {float(elapsed):.1f} s: {per_call:.0f} us each, sampled")
    for rank in (0, 1):
        print("\n".join(summarize(f"worker{rank}", out / f"worker{rank}.data", int(calls))))


if __name__ == "__main__":
    main()
