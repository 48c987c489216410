"""Profile small rpc_sync calls on both sides at once with `perf` (native frames, kernel too).

worker0 calls worker1's `echo` in a loop while `perf record` samples both
processes (cpu-clock, 999 Hz, no pausing) for the same seconds. For each
worker it prints the CPU used per call, split by thread (the caller's Python
thread, TensorPipe's event loop, the RPC agent's thread pool) and by the
library the sample landed in (the kernel, libpython, libtorch, libc...),
then the hottest symbols.

With --count it counts instead, through uprobes (root only), for a builtin
call, a Python function through torch and through asyncrpc, in a world that
keeps each RPC thread's Python state (the default) and one that does not:
Python thread states made (PyThreadState_New), Python allocations
(PyObject_Malloc) and C allocations (malloc) per call, both workers
together, with the threads that made the states.

    python benchmarks/profile_small_call.py [--seconds 6] [--out profile]
    sudo python benchmarks/profile_small_call.py --count [--calls 1000]

Needs Linux `perf` and perf_event_paranoid <= 2 (the script says so if not).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.rpc as torch_rpc

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
            found.append((int(pid), thread_role(comm), sym or "?", Path(dso).name))
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


def thread_role(comm: str, main: bool | None = None) -> str:
    """What a worker's thread does, from its name (comm).

    `main` says whether it is the process's main thread, where that is known;
    perf's samples carry no thread id, so there a thread named python counts.
    """
    if comm.startswith("TP_"):
        return "TensorPipe loop"
    if comm.startswith("pt_thread_pool"):
        return "RPC agent pool"
    if main is None:
        return "main thread" if comm.startswith("python") else comm
    return "main thread" if main else "other"


# uprobe event name -> (library, symbol)
def _probes() -> dict[str, tuple[str, str]]:
    libdir, ldlib = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("LDLIBRARY")
    python = Path(libdir or "", ldlib or "")
    python_lib = str(python) if python.suffix != ".a" and python.exists() else sys.executable
    libc = next(
        line.split()[-1]
        for line in Path("/proc/self/maps").read_text().splitlines()
        if re.search(r"/libc[.-][^/]*so", line)
    )
    return {
        "thread states made": (python_lib, "PyThreadState_New"),
        "Python allocations": (python_lib, "PyObject_Malloc"),
        "malloc calls": (libc, "malloc"),
    }


def _add_probes() -> tuple[list[str], list[str]]:
    """Create the uprobes (root only): their perf event names, and those made here."""
    listed = subprocess.run(["perf", "probe", "-l"], capture_output=True, text=True).stdout
    events, made = [], []
    for lib, symbol in _probes().values():
        found = re.search(rf"(\S+:{symbol})\s", listed)
        if found is None:
            added = subprocess.run(
                ["perf", "probe", "-x", lib, symbol], capture_output=True, text=True
            )
            found = re.search(rf"(\S+:{symbol})\s", added.stdout + added.stderr)
            if found is None:
                _remove_probes(made)
                sys.exit(
                    f"could not add a uprobe on {symbol} in {lib} (root?): {added.stderr[-300:]}"
                )
            made.append(found.group(1))
        events.append(found.group(1))
    return events, made


def _remove_probes(events: list[str]) -> None:
    for event in events:
        subprocess.run(["perf", "probe", "-d", event], capture_output=True)


def _count(pids: list[int], events: list[str], way: Callable[[], object], calls: int) -> dict:
    """Events per call while `way` runs `calls` times, by process and thread role."""
    command = ["perf", "stat", "--per-thread", "-x,", "-e", ",".join(events)]
    perf = subprocess.Popen(
        [*command, "-p", ",".join(map(str, pids))], stderr=subprocess.PIPE, text=True
    )
    time.sleep(0.5)  # perf attaches
    for _ in range(calls):
        way()
    time.sleep(0.1)
    perf.send_signal(signal.SIGINT)
    text = perf.communicate(timeout=30)[1]
    found: dict[str, dict[str, float]] = collections.defaultdict(
        lambda: collections.defaultdict(float)
    )
    for line in text.splitlines():
        fields = line.split(",")
        if len(fields) > 3 and fields[1].isdigit():
            comm = fields[0].rpartition("-")[0]
            found[fields[3]][thread_role(comm)] += int(fields[1]) / calls
    return {event: dict(roles) for event, roles in found.items()}


def count_while_calling(ctx: asyncrpc.Context, world: str, calls: int, out: str) -> None:
    """On worker0: count thread states and allocations per call for each way of calling."""
    if ctx.rank != 0:
        return
    pids = [os.getpid(), asyncrpc.rpc_sync("worker1", os.getpid)]
    events = Path(out, "events.txt").read_text().split()
    x = torch.ones(16)
    ways = {
        "builtin torch.add": lambda: torch_rpc.rpc_sync("worker1", torch.add, args=(x, 1)),
        "torch, Python function": lambda: torch_rpc.rpc_sync("worker1", echo, args=(x,)),
        "asyncrpc, Python function": lambda: asyncrpc.rpc_sync("worker1", echo, args=(x,)),
    }
    with Path(out, "counts.txt").open("a") as file:
        for name, way in ways.items():
            for _ in range(50):
                way()
            counts = _count(pids, events, way, calls)
            for event, label in zip(events, _probes(), strict=True):
                roles = counts.get(event, {})
                top = ", ".join(
                    f"{r} {n:.1f}"
                    for r, n in sorted(roles.items(), key=lambda i: -i[1])
                    if n >= 0.05
                )
                file.write(f"{world:<24}{name:<27}{label:<20}{sum(roles.values()):>7.1f}  {top}\n")


def count_main(calls: int, out: Path) -> None:
    events, made = _add_probes()
    (out / "events.txt").write_text(" ".join(events))
    (out / "counts.txt").write_text(
        f"{'world':<24}{'call':<27}{'per call':<20}{'both':>7}  by thread\n"
    )
    try:
        for world, keep in (("thread states kept", True), ("thread states not kept", False)):
            asyncrpc.run(
                count_while_calling,
                world_size=2,
                args=(world, calls, str(out)),
                keep_thread_states=keep,
            )
    finally:
        _remove_probes(made)  # the probes this run added; others' are left
    print((out / "counts.txt").read_text(), end="")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--out", default="profile")
    parser.add_argument("--count", action="store_true", help="count with uprobes (root)")
    parser.add_argument("--calls", type=int, default=1000, help="calls per way with --count")
    opts = parser.parse_args()
    if shutil.which("perf") is None:
        sys.exit("Linux perf is not installed (apt install linux-tools-common, or your distro's)")
    if opts.count:
        Path(opts.out).mkdir(exist_ok=True)
        count_main(opts.calls, Path(opts.out))
        return
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
