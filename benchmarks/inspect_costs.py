"""What seeing inside a world costs: per-call bookkeeping, dumps, top, idle workers.

Rows, each measured in one run:

- bookkeeping: `call_overhead.py`'s two paths (rpc_sync, rpc_async x 100 and
  wait_all) against raw torch, with asyncrpc's per-call bookkeeping of calls
  in flight (what asyncrpc-dump and asyncrpc-top read) on and swapped out,
  the four ways alternated round by round; the rows print each ratio to
  torch and the difference the bookkeeping makes (target: at most 2%);
- hang_report_after off: what the setting costs a call when off (the one
  read per call), timed alone;
- a dump of a 16-worker world and `top` of a 32-worker world: the world's
  answers through its side channel, asked from inside it (the command adds
  its own start-up: importing torch), and the commands themselves, run;
- idle workers: the CPU each worker of an idle world uses over 10 s
  (target: at most 2% of a core).

    python benchmarks/inspect_costs.py [--rounds 5] [--calls 400] [--dump-workers 16]
        [--top-workers 32] [--idle-seconds 10]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import torch
import torch.distributed.rpc as rpc

import asyncrpc
from asyncrpc._core import _activity, _registry, _side

_ORIGINAL = (_activity.sent, _activity.ended)


def echo(x: torch.Tensor) -> torch.Tensor:
    return x


def set_bookkeeping(on: bool) -> None:
    """Swap this worker's per-call bookkeeping in or out."""
    if on:
        _activity.sent, _activity.ended = _ORIGINAL
    else:
        _activity.sent = lambda worker, label, key: None  # type: ignore[assignment,return-value]
        _activity.ended = lambda call, failed: None  # type: ignore[assignment]


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _everywhere(ctx: asyncrpc.Context, on: bool) -> None:
    set_bookkeeping(on)
    for name in ctx.names[1:]:
        asyncrpc.rpc_sync(name, set_bookkeeping, args=(on,))


def _sync(call: Any, n: int, x: torch.Tensor) -> float:
    start = time.perf_counter()
    for _ in range(n):
        call("worker1", echo, args=(x,))
    return (time.perf_counter() - start) / n


def _burst(call: Any, n: int, x: torch.Tensor) -> float:
    start = time.perf_counter()
    for _ in range(n // 100):
        torch.futures.wait_all([call("worker1", echo, args=(x,)) for _ in range(100)])
    return (time.perf_counter() - start) / n


def bookkeeping(ctx: asyncrpc.Context, rounds: int, calls: int) -> None:
    """Each sample is `calls` calls of one way; the ways take turns sample by sample."""
    x = torch.ones(16)
    ways = {
        "torch": (rpc.rpc_sync, rpc.rpc_async, True),
        "on": (asyncrpc.rpc_sync, asyncrpc.rpc_async, True),
        "out": (asyncrpc.rpc_sync, asyncrpc.rpc_async, False),
    }
    times: dict[str, dict[str, list[float]]] = {w: {"sync": [], "async": []} for w in ways}
    samples = rounds * 10
    for r in range(samples + 3):
        order = list(ways.items())
        for name, (sync, burst, on) in order[r % 3 :] + order[: r % 3]:
            _everywhere(ctx, on)
            took = (_sync(sync, max(1, calls // 10), x), _burst(burst, max(100, calls // 4), x))
            if r >= 3:  # the first turns warm up
                times[name]["sync"].append(took[0])
                times[name]["async"].append(took[1])
    _everywhere(ctx, True)
    print(f"bookkeeping: {samples} samples per way, ways alternated sample by sample, medians")
    print("| path | torch | asyncrpc, bookkeeping on | bookkeeping out | on/torch | out/torch "
          "| bookkeeping adds |\n| --- | --- | --- | --- | --- | --- | --- |")  # fmt: skip
    for path, label in (("sync", "rpc_sync"), ("async", "rpc_async x 100, wait_all")):
        raw = statistics.median(times["torch"][path])
        on = statistics.median(times["on"][path])
        out = statistics.median(times["out"][path])
        adds = 100 * (on / out - 1)
        print(f"| {label} | {raw * 1e6:.0f} us | {on * 1e6:.0f} us | {out * 1e6:.0f} us "
              f"| {on / raw:.3f}x | {out / raw:.3f}x | {adds:+.1f}% |")  # fmt: skip


def hang_check_cost() -> None:
    world = asyncrpc._core._runtime.running_world()
    n = 1_000_000
    start = time.perf_counter()
    for _ in range(n):
        if world is not None and world.settings is not None and world.settings.hang_report_after:
            pass
    per = (time.perf_counter() - start) / n
    print(f"hang_report_after off: {per * 1e9:.0f} ns per call (the one read)")


def ask_timing(ctx: asyncrpc.Context, kind: str, repeats: int = 5) -> float:
    """Median seconds for every worker's answer to `kind`, asked from this worker."""
    store = _side.connect(*_address_and_prefix())
    took = []
    for _ in range(repeats):
        start = time.perf_counter()
        answers = _side.ask(store, range(ctx.world_size), kind)
        took.append(time.perf_counter() - start)
        assert all(a is not None for a in answers.values()), answers
    return statistics.median(took)


def _address_and_prefix() -> tuple[str, str]:
    (address, entries), *_ = _registry.worlds().items()
    return address, entries[0]["prefix"]


def command_timing(name: str, *args: str) -> float:
    start = time.perf_counter()
    done = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), name), *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return time.perf_counter() - start


def big_world(ctx: asyncrpc.Context, opts: argparse.Namespace) -> None:
    if ctx.rank != 0:
        return
    kind = "dump" if ctx.world_size == opts.dump_workers else "top"
    seconds = ask_timing(ctx, kind)
    flags = ["--json"] if kind == "dump" else ["--once", "--json"]
    command = command_timing(f"asyncrpc-{kind}", *flags)
    print(f"{kind} of a {ctx.world_size}-worker world: every answer in {seconds * 1e3:.0f} ms "
          f"(median of 5); the command asyncrpc-{kind} {' '.join(flags)}: "
          f"{command:.2f} s with its start-up")  # fmt: skip


def idle_world(ctx: asyncrpc.Context, seconds: float) -> None:
    before = cpu_seconds()
    time.sleep(seconds)
    _idle[0] = (cpu_seconds() - before) / seconds
    _measured.set()
    if ctx.rank == 0:  # the others serve these calls in their graceful shutdown
        shares = [asyncrpc.rpc_sync(name, idle_share) for name in ctx.names]
        print(f"idle workers over {seconds:g} s: " + ", ".join(f"{100 * s:.2f}%" for s in shares)
              + " of a core")  # fmt: skip


_idle = [0.0]
_measured = threading.Event()


def idle_share() -> float:
    """This worker's CPU share while idle, once measured."""
    _measured.wait()
    return _idle[0]


def small_world(ctx: asyncrpc.Context, opts: argparse.Namespace) -> None:
    if ctx.rank == 0:
        bookkeeping(ctx, opts.rounds, opts.calls)
        hang_check_cost()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--dump-workers", type=int, default=16)
    parser.add_argument("--top-workers", type=int, default=32)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as runtime:
        os.environ["XDG_RUNTIME_DIR"] = runtime  # the registrations of this run only
        asyncrpc.run(small_world, world_size=2, args=(opts,))
        for size in (opts.dump_workers, opts.top_workers):
            asyncrpc.run(big_world, world_size=size, args=(opts,), num_worker_threads=4)
        asyncrpc.run(idle_world, world_size=3, args=(opts.idle_seconds,))


if __name__ == "__main__":
    main()
