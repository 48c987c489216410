"""How a world's cost grows with its size: start-up time and memory, asyncrpc vs torch vs Ray.

For each world size (2 to 128 workers by default) and each system, a fresh
process (this script again, with --probe) starts one world::

    asyncrpc  asyncrpc.run(main, N): its default embedded start, a forkserver
              with torch preloaded, N workers forked from it
    torch     torch.multiprocessing.spawn of N processes, each rpc.init_rpc
              (TensorPipe over loopback, as benchmarks/peers.py sets it up)
    Ray       ray.init on 127.0.0.1 with benchmarks/ray_peer.py's settings
              (2 CPUs, no dashboard), then N actors

and measures, in that world:

(a) start-up: from the start call (each library already imported) to every
    worker having answered one call: worker0 (Ray: the driver) sends every
    worker, itself included, a 64 B tensor at once and waits for all the
    answers; every worker of every system thus holds torch;
(b) end: from the moment every worker has answered (and the memory below
    was read) to the start call's return, every worker gone: main returns
    on every worker, the world shuts down (asyncrpc.run returns;
    mp.spawn joins every process; ray.shutdown());
(c) memory, at the moment every worker has answered: every process of the world, read from /proc,
    the process that started it and all that descend from it (the workers
    and the helpers: asyncrpc's forkserver, multiprocessing's resource
    tracker; Ray's GCS, raylet, agents and worker processes). PSS (each
    shared page split between the processes sharing it: the sum is what the
    world takes) and RSS (each process's resident pages in full: forked
    workers' shared pages counted once per worker), summed; and how many
    processes.

Rounds alternate the systems (each round in a new order); figures are
medians over rounds. A world that fails to start or runs past --timeout is
reported as not fitting, and that system is not tried at larger sizes.

    python benchmarks/scale.py [--sizes 2 4 ... 128] [--rounds 3] [--no-ray] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed.rpc as rpc

import asyncrpc

import ray_peer  # before anything imports Ray: it keeps Ray on loopback
import run_record

SYSTEMS = ("asyncrpc", "torch", "ray")
METRICS = {  # key: (row, unit)
    "startup_s": ("start-up to every answer", "s"),
    "end_s": ("end: every answer to the world's end", "s"),
    "pss_mib": ("memory (PSS, summed)", "MiB"),
    "rss_mib": ("memory (RSS, summed)", "MiB"),
    "processes": ("processes", ""),
}


def echo(x: Any) -> Any:
    return x


# ---- the world's memory, from /proc --------------------------------------------------


def world_memory(root: int) -> tuple[float, float, int]:
    """(PSS MiB, RSS MiB, processes) of `root` and every process descending from it."""
    pss = rss = 0
    tree = _descendants(root)
    for pid in tree:
        fields = _rollup(pid)
        pss += fields.get("Pss", 0)
        rss += fields.get("Rss", 0)
    return pss / 1024, rss / 1024, len(tree)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # ended meanwhile
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _rollup(pid: int) -> dict[str, int]:
    """kB figures of /proc/PID/smaps_rollup (Rss, Pss, ...); {} if the process ended."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return {}
    return {ln.split(":")[0]: int(ln.split()[1]) for ln in lines if ln.endswith(" kB")}


def _stamp_world(root: int) -> None:
    """Printed once every worker has answered: the time, the world's memory, the time again."""
    print(f"FIRST {time.time()}", flush=True)
    pss, rss, count = world_memory(root)
    print(f"MEMORY {pss} {rss} {count}", flush=True)
    print(f"READ {time.time()}", flush=True)


# ---- the three ways to start a world (each run in a fresh process) --------------------


def _asyncrpc_main(ctx: asyncrpc.Context, root: int) -> None:
    if ctx.rank == 0:
        x = torch.ones(16)
        torch.futures.wait_all([asyncrpc.rpc_async(name, echo, args=(x,)) for name in ctx.names])
        _stamp_world(root)


def _probe_asyncrpc(size: int) -> None:
    root = os.getpid()
    print(f"START {time.time()}", flush=True)
    asyncrpc.run(_asyncrpc_main, size, args=(root,))
    print(f"END {time.time()}", flush=True)


def _torch_worker(rank: int, size: int, port: int, root: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    options = rpc.TensorPipeRpcBackendOptions(_transports=["uv"], _channels=["basic"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=size, rpc_backend_options=options)
    if rank == 0:
        x = torch.ones(16)
        torch.futures.wait_all([rpc.rpc_async(f"worker{r}", echo, args=(x,)) for r in range(size)])
        _stamp_world(root)
    rpc.shutdown()


def _probe_torch(size: int) -> None:
    import torch.multiprocessing as mp

    root = os.getpid()
    print(f"START {time.time()}", flush=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_torch_worker, args=(size, port, root), nprocs=size)
    print(f"END {time.time()}", flush=True)


def _probe_ray(size: int) -> None:
    import ray

    @ray.remote
    class Echo:
        def echo(self, x: Any) -> Any:
            return x

    x = torch.ones(16)
    print(f"START {time.time()}", flush=True)
    ray_peer.start()
    actors = [Echo.remote() for _ in range(size)]  # type: ignore[attr-defined]
    ray.get([a.echo.remote(x) for a in actors])
    _stamp_world(os.getpid())
    ray.shutdown()
    print(f"END {time.time()}", flush=True)


_PROBES = {"asyncrpc": _probe_asyncrpc, "torch": _probe_torch, "ray": _probe_ray}


# ---- measuring: one fresh process per world --------------------------------------------


def measure_one(system: str, size: int, timeout: float) -> dict[str, float] | str:
    """One world's figures (METRICS), or why it did not start."""
    command = [sys.executable, __file__, "--probe", system, "--size", str(size)]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # something it started still holds its output
            pass
        return f"no answer from every worker within {timeout:g} s"
    lines = dict(ln.split(maxsplit=1) for ln in out.splitlines() if ln.startswith(_STAMPS))
    if proc.returncode != 0 or "END" not in lines:
        last = (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        return f"failed (exit status {proc.returncode}): {last[:200]}"
    pss, rss, count = map(float, lines["MEMORY"].split())
    startup = float(lines["FIRST"]) - float(lines["START"])
    end = float(lines["END"]) - float(lines["READ"])
    return {"startup_s": startup, "end_s": end, "pss_mib": pss, "rss_mib": rss,
            "processes": count}  # fmt: skip


_STAMPS = ("START ", "FIRST ", "MEMORY ", "READ ", "END ")


def _kill_tree(root: int) -> None:
    """SIGKILL a probe, its process group and everything descending from it."""
    tree = _descendants(root)  # before any dies: orphans leave the tree
    try:
        os.killpg(root, signal.SIGKILL)  # the probe leads its own session
    except ProcessLookupError:
        pass
    for pid in reversed(tree):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def measure(
    systems: list[str], sizes: list[int], rounds: int, timeout: float
) -> tuple[dict[str, dict[int, dict[str, float]]], dict[str, dict[int, str]]]:
    """Medians per system and size; why a system did not fit at a size."""
    samples: dict[str, dict[int, list[dict[str, float]]]] = {s: {} for s in systems}
    failed: dict[str, dict[int, str]] = {s: {} for s in systems}
    for r in range(rounds):
        order = systems[r % len(systems) :] + systems[: r % len(systems)]
        for size in sizes:
            for system in order:
                if failed[system] and min(failed[system]) <= size:
                    continue  # it did not fit at this size or a smaller one
                found = measure_one(system, size, timeout)
                if isinstance(found, str):
                    failed[system][size] = found
                    print(f"{system} at {size} workers: did not fit: {found}", flush=True)
                else:
                    samples[system].setdefault(size, []).append(found)
    medians = {
        system: {size: _medians(found) for size, found in by_size.items()}
        for system, by_size in samples.items()
    }
    return medians, failed


def _medians(found: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(f[key] for f in found) for key in METRICS}


# ---- the report --------------------------------------------------------------------------


def ratios(medians: dict[str, dict[int, dict[str, float]]], size: int, key: str) -> dict[str, Any]:
    """asyncrpc's figure over torch's ("vs_torch"), Ray's over asyncrpc's ("ray_over_ours")."""
    ours = medians.get("asyncrpc", {}).get(size, {}).get(key)
    torch_ = medians.get("torch", {}).get(size, {}).get(key)
    ray = medians.get("ray", {}).get(size, {}).get(key)
    return {
        "vs_torch": ours / torch_ if ours and torch_ else None,
        "ray_over_ours": ray / ours if ours and ray else None,
    }


def report(
    medians: dict[str, dict[int, dict[str, float]]],
    failed: dict[str, dict[int, str]],
    sizes: list[int],
) -> None:
    print(f"{'row':<44}{'asyncrpc':>12}{'torch':>12}{'Ray':>12}{'vs torch':>10}{'Ray/ours':>10}")
    for key, (label, unit) in METRICS.items():
        for size in sizes:
            cells = [_cell(medians, failed, system, size, key, unit) for system in SYSTEMS]
            found = ratios(medians, size, key) if unit else {}
            vs_torch, vs_ray = (
                "-" if found.get(k) is None else f"{found[k]:.2f}x"
                for k in ("vs_torch", "ray_over_ours")
            )
            row = f"{label}, {size} workers"
            print(f"{row:<44}{cells[0]:>12}{cells[1]:>12}{cells[2]:>12}{vs_torch:>10}{vs_ray:>10}")
    print("vs torch: asyncrpc's figure / torch's (< 1: asyncrpc starts faster, takes less); "
          "Ray/ours: Ray's / asyncrpc's; n/f: did not fit (below)")  # fmt: skip
    for system, sizes_failed in failed.items():
        for size, why in sizes_failed.items():
            print(f"{system} at {size} workers did not fit: {why}; larger sizes not tried")


def _cell(
    medians: dict[str, dict[int, dict[str, float]]],
    failed: dict[str, dict[int, str]],
    system: str,
    size: int,
    key: str,
    unit: str,
) -> str:
    value = medians.get(system, {}).get(size, {}).get(key)
    if value is None:
        return "n/f" if failed.get(system) else "-"
    if unit == "s":
        return f"{value:.2f} s"
    return f"{value:,.0f} {unit}".strip()


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 96, 128])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-ray", action="store_true", help="leave Ray out")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per world, at most")
    parser.add_argument("--json", metavar="PATH", help="also write this run's figures here")
    parser.add_argument("--probe", choices=sorted(_PROBES), help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    opts = _parse()
    if opts.probe:
        _PROBES[opts.probe](opts.size)
        return
    ray = not opts.no_ray and ray_peer.installed()
    if not opts.no_ray and not ray:
        print("Ray rows skipped: Ray is not installed (pip install 'asyncrpc[bench]')")
    systems = ["asyncrpc", "torch"] + (["ray"] if ray else [])
    medians, failed = measure(systems, opts.sizes, opts.rounds, opts.timeout)
    report(medians, failed, opts.sizes)
    if opts.json:
        _write(opts, systems, medians, failed)


def _write(
    opts: argparse.Namespace,
    systems: list[str],
    medians: dict[str, dict[int, dict[str, float]]],
    failed: dict[str, dict[int, str]],
) -> None:
    options = {k: v for k, v in vars(opts).items() if k not in ("json", "probe", "size")}
    run_record.write(opts.json, {
        "benchmark": "scale", "options": options, "sizes": opts.sizes, "systems": systems,
        "metrics": {key: {"row": row, "unit": unit} for key, (row, unit) in METRICS.items()},
        "results": {s: {str(n): m for n, m in by.items()} for s, by in medians.items()},
        "ratios": {
            str(n): {key: ratios(medians, n, key) for key in METRICS} for n in opts.sizes
        },
        "failures": {s: {str(n): why for n, why in by.items()} for s, by in failed.items()},
    })  # fmt: skip


if __name__ == "__main__":
    main()
