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
import re
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
    perf = _perf(pids, seconds, Path(out) / "perf")
    time.sleep(0.2)  # perf attaches
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds - 0.4:
        asyncrpc.rpc_sync("worker1", echo, args=(x,))
        calls += 1
    elapsed = time.perf_counter() - start
    perf.wait(timeout=seconds + 60)  # perf ends with its `sleep`; bounded all the same
    (Path(out) / "calls.txt").write_text(f"{calls} {elapsed} {pids[0]} {pids[1]}\n")


def _perf(pids: list[int], seconds: float, stem: Path) -> subprocess.Popen[bytes]:
    command = ["perf", "record", "-e", "cpu-clock", "-F", str(HZ), "-p", ",".join(map(str, pids))]
    command += ["-o", f"{stem}.data", "--", "sleep", str(seconds)]
    log = stem.with_suffix(".log").open("w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


_SAMPLE = re.compile(r"^\s*(.+?)\s+(\d+)\s+[0-9a-f]+\s+(.*?)\s+\((.*)\)\s*$")


def read_samples(data: Path) -> list[tuple[int, str, str, str]]:
    """(pid, thread role, symbol, library) of every sample perf took."""
    command = ["perf", "script", "-i", str(data), "-F", "comm,pid,ip,sym,dso"]
    text = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    found = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            comm, pid, sym, dso = match.groups()
            found.append((int(pid), _role(comm), sym or "?", Path(dso).name))
    return found


def summarize(name: str, mine: list[tuple[int, str, str, str]], calls: int) -> list[str]:
    """The worker's CPU per call, by thread and library, then its hottest symbols."""
    total = max(1, len(mine))
    threads = collections.Counter(role for _, role, _, _ in mine)
    places = collections.Counter((role, dso) for _, role, _, dso in mine)
    symbols = collections.Counter((role, sym) for _, role, sym, _ in mine)
    lines = [
        f"{name}: {len(mine) / HZ / calls * 1e6:.0f} us of CPU per call ({len(mine)} samples)"
    ]
    lines.append(
        "  by thread: " + ", ".join(f"{r} {n / total:.0%}" for r, n in threads.most_common())
    )
    lines += [f"  {n / total:6.1%}  {r:16} {dso}" for (r, dso), n in places.most_common(12)]
    lines.append("  hottest symbols:")
    lines += [f"  {n / total:6.1%}  {r:16} {sym[:70]}" for (r, sym), n in symbols.most_common(10)]
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
    if not (out / "perf.data").exists():
        log = (out / "perf.log").read_text()[-400:]
        sys.exit(f"perf recorded nothing (perf_event_paranoid?): {log}")
    calls, elapsed, *pids = (out / "calls.txt").read_text().split()
    per_call = float(elapsed) / int(calls) * 1e6
    print(f"{calls} rpc_sync calls in {float(elapsed):.1f} s: {per_call:.0f} us each, sampled")
    found = read_samples(out / "perf.data")
    for rank, pid in enumerate(pids):
        mine = [sample for sample in found if sample[0] == int(pid)]
        print("\n".join(summarize(f"worker{rank}", mine, int(calls))))


if __name__ == "__main__":
    main()
