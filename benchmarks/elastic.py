"""Adding and removing workers while a world runs: asyncrpc beside Ray's actors.

Each way runs in a fresh process, in turn, round by round, so drift on a
shared machine hits all of them alike; every figure is a median::

    asyncrpc (embedded, elastic=True, 2 workers; worker0 measures)
      add 1        add_workers(1) to the new worker's first answer (rpc_sync)
      add 8        add_workers(8) to the first answer of all 8
      remove 1     remove_workers(name) of an idle worker, to its return (it has left)
    asyncrpc (asyncrpc-launch --elastic, 2 workers): add 1 and remove 1 the same way; each
      added worker is a new interpreter, the launcher's spare (started ahead, torch
      imported: given SPARE_WARM_S before each add, as Ray's idle workers are started
      ahead); no add 8 (8 interpreters: all but the first start cold); a removed
      worker's time includes its interpreter's exit
    Ray 2.60 (local, loopback)
      add 1        creating an actor (`Actor.remote()`) to its first answer
      add 8        creating 8 actors to the first answer of all 8
      remove 1     `ray.kill(actor)` to the first call that fails with RayActorError

Targets on a 2-core machine: an add within 0.1 s embedded and within 2 s
under asyncrpc-launch, each at least 10x faster than Ray's actor creation.
Ray is optional (`pip install 'asyncrpc[bench]'`); without it, or with
--no-ray, its rows are left out (--no-launch leaves asyncrpc-launch out).

    python benchmarks/elastic.py [--rounds 5] [--repeats 3] [--no-ray] [--json PATH]

--json PATH also writes every figure printed, with the run's date, machine,
versions and command line (benchmarks/run_record.py), for benchmarks/charts.py.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import asyncrpc

import ray_peer  # before anything imports Ray: it keeps Ray on loopback
import run_record

TARGET_ADD_S = 0.1
TARGET_LAUNCH_ADD_S = 2.0
SPARE_WARM_S = 4.0  # how long a launcher's spare interpreter takes to import torch, and more
TARGET_VS_RAY = 10.0
_PROBE_TIMEOUT_S = 240
ROWS = {"add1": "add 1 worker, to its first answer", "add8": "add 8 workers, to every first "
        "answer", "remove1": "remove 1 idle worker"}  # fmt: skip
WAYS = {
    "asyncrpc": "asyncrpc (embedded)",
    "launch": "asyncrpc (asyncrpc-launch)",
    "ray": "Ray (actors)",
}


def identity() -> int:
    return os.getpid()


class Actor:
    """Ray's actor: it answers with its pid."""

    def pid(self) -> int:
        return os.getpid()


def _timed(fn: Callable[..., object], *args: Any) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


# ---- asyncrpc ---------------------------------------------------------------------------


def elastic_main(ctx: asyncrpc.Context, repeats: int) -> None:
    if ctx.name != "worker0":
        return
    for _ in range(repeats):
        _add_one_then_remove()
        start = time.perf_counter()
        added = asyncrpc.add_workers(8)
        for fut in [asyncrpc.rpc_async(name, identity) for name in added]:
            fut.wait()
        print(f"add8 {time.perf_counter() - start:.6f}", flush=True)
        asyncrpc.remove_workers(*added)


def _probe_asyncrpc(repeats: int) -> None:
    asyncrpc.run(elastic_main, world_size=2, args=(repeats,), elastic=True, max_world_size=16)


def launched_main(ctx: asyncrpc.Context, repeats: int) -> None:
    if ctx.name != "worker0":
        return
    for _ in range(repeats):
        time.sleep(SPARE_WARM_S)
        _add_one_then_remove()


def _add_one_then_remove() -> None:
    """Rows add1 (to the new worker's first answer) and remove1, printed."""
    start = time.perf_counter()
    added = asyncrpc.add_workers(1)
    asyncrpc.rpc_sync(added[0], identity)
    print(f"add1 {time.perf_counter() - start:.6f}", flush=True)
    print(f"remove1 {_timed(asyncrpc.remove_workers, *added):.6f}", flush=True)


def _probe_launch(repeats: int) -> None:
    """asyncrpc-launch --elastic with 2 workers, which run `_probe_launched`."""
    command = [sys.executable, "-m", "asyncrpc._launch._cli", "--elastic", "--nproc-per-node",
               "2", __file__, "--probe", "launched", "--repeats", str(repeats)]  # fmt: skip
    sys.exit(subprocess.run(command, timeout=_PROBE_TIMEOUT_S).returncode)


def _probe_launched(repeats: int) -> None:
    asyncrpc.run(launched_main, args=(repeats,))


# ---- Ray --------------------------------------------------------------------------------


def _probe_ray(repeats: int) -> None:
    import ray

    if not ray_peer.start():
        sys.exit("Ray is not installed: pip install 'asyncrpc[bench]'")
    actor: Any = ray.remote(num_cpus=0)(Actor)
    ray.get(actor.remote().pid.remote())  # the first actor pays Ray's own start-up
    for _ in range(repeats):
        start = time.perf_counter()
        one = actor.remote()
        ray.get(one.pid.remote())
        print(f"add1 {time.perf_counter() - start:.6f}", flush=True)
        print(f"remove1 {_timed(_ray_kill, one):.6f}", flush=True)
        start = time.perf_counter()
        eight = [actor.remote() for _ in range(8)]
        ray.get([a.pid.remote() for a in eight])
        print(f"add8 {time.perf_counter() - start:.6f}", flush=True)
        for a in eight:
            ray.kill(a)
    ray.shutdown()


def _ray_kill(actor: Any) -> None:
    """`ray.kill`, then calls until one fails: the actor is gone."""
    import ray
    from ray.exceptions import RayActorError

    ray.kill(actor)
    while True:
        try:
            ray.get(actor.pid.remote())
        except RayActorError:
            return
        time.sleep(0.001)


_PROBES: dict[str, Callable[[int], None]] = {
    "asyncrpc": _probe_asyncrpc,
    "launch": _probe_launch,
    "launched": _probe_launched,
    "ray": _probe_ray,
}


# ---- the rounds and the report ----------------------------------------------------------


def _probe_output(way: str, repeats: int) -> str:
    """The stdout of `way`'s probe; a failure or a hang ends the run with its output."""
    command = [sys.executable, __file__, "--probe", way, "--repeats", str(repeats)]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as probe:
        try:
            out, err = probe.communicate(timeout=_PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(probe.pid, signal.SIGKILL)  # the probe and the workers it started
            out, err = probe.communicate()
            sys.exit(f"{WAYS[way]} hung: no end within {_PROBE_TIMEOUT_S} s:\n{err[-4000:]}")
    if probe.returncode != 0:
        sys.exit(f"{WAYS[way]} failed (exit {probe.returncode}):\n{out[-2000:]}\n{err[-4000:]}")
    return out


def measure(ways: list[str], rounds: int, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Every way's samples per row, ways alternated round by round, each in a fresh process."""
    found: dict[str, dict[str, list[float]]] = {w: {r: [] for r in ROWS} for w in ways}
    for r in range(rounds):
        for way in ways[r % len(ways) :] + ways[: r % len(ways)]:
            for line in _probe_output(way, repeats).splitlines():
                row, _, value = line.partition(" ")
                if row in ROWS:
                    found[way][row].append(float(value))
    return found


def figures(found: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Each row's medians, Ray's over asyncrpc's, and whether the target was met."""
    rows: dict[str, Any] = {}
    for row, label in ROWS.items():
        got = {WAYS[w]: statistics.median(found[w][row]) for w in found if found[w][row]}
        ours = got[WAYS["asyncrpc"]]
        samples = {WAYS[w]: found[w][row] for w in found if found[w][row]}
        entry: dict[str, Any] = {"seconds": got, "samples": samples}
        if WAYS["ray"] in got:
            entry["ray_over_ours"] = got[WAYS["ray"]] / ours
            if WAYS["launch"] in got:
                entry["ray_over_launch"] = got[WAYS["ray"]] / got[WAYS["launch"]]
        rows[label] = entry
    add = rows[ROWS["add1"]]
    ratio = add.get("ray_over_ours")
    met = add["seconds"][WAYS["asyncrpc"]] <= TARGET_ADD_S and (ratio is None or ratio >= 10)
    launch = add["seconds"].get(WAYS["launch"])
    launch_ratio = add.get("ray_over_launch")
    launch_met = None
    if launch is not None:
        launch_met = launch <= TARGET_LAUNCH_ADD_S and (launch_ratio is None or launch_ratio >= 10)
    return {"rows": rows, "target": {"add_s": TARGET_ADD_S, "vs_ray": TARGET_VS_RAY,
                                     "met": met, "ray_checked": ratio is not None,
                                     "launch_add_s": TARGET_LAUNCH_ADD_S,
                                     "launch_met": launch_met}}  # fmt: skip


def report(results: dict[str, Any]) -> None:
    print(f"\n{'row':<40}{'asyncrpc':>12}{'launched':>12}{'Ray':>12}{'Ray/ours':>10}"
          f"{'Ray/launched':>14}")  # fmt: skip
    for label, entry in results["rows"].items():
        ours = entry["seconds"][WAYS["asyncrpc"]]
        launch = entry["seconds"].get(WAYS["launch"])
        ray = entry["seconds"].get(WAYS["ray"])
        ratio = entry.get("ray_over_ours")
        ours_over_ours = "1.00x" if ratio is None else f"{ratio:.2f}x"
        vs_launch = entry.get("ray_over_launch")
        over_launch = "-" if vs_launch is None else f"{vs_launch:.2f}x"
        print(f"{label:<40}{_seconds(ours):>12}{_seconds(launch):>12}{_seconds(ray):>12}"
              f"{ours_over_ours:>10}{over_launch:>14}")  # fmt: skip
    print(
        "medians of every sample; launched: under asyncrpc-launch --elastic (a new "
        "interpreter per added worker, started ahead); Ray/ours: Ray's time over asyncrpc's "
        "embedded (1.00x: Ray left out)"
    )
    target = results["target"]
    verdict = "met" if target["met"] else "NOT met"
    unchecked = "" if target["ray_checked"] else " (Ray left out: its ratio was not checked)"
    print(f"target: an add within {TARGET_ADD_S} s on this {os.cpu_count()}-CPU machine, at "
          f"least {TARGET_VS_RAY:.0f}x faster than Ray's actor creation: {verdict}"
          f"{unchecked}")  # fmt: skip
    if target["launch_met"] is not None:
        verdict = "met" if target["launch_met"] else "NOT met"
        print(f"target: an add within {TARGET_LAUNCH_ADD_S:.0f} s under asyncrpc-launch, at "
              f"least {TARGET_VS_RAY:.0f}x faster than Ray's actor creation: {verdict}"
              f"{unchecked}")  # fmt: skip


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="fresh processes per way")
    parser.add_argument("--repeats", type=int, default=3, help="adds and removes per process")
    parser.add_argument("--no-ray", action="store_true", help="leave Ray out")
    parser.add_argument("--no-launch", action="store_true", help="leave asyncrpc-launch out")
    parser.add_argument("--json", metavar="PATH", help="also write this run's figures here")
    parser.add_argument("--probe", choices=sorted(_PROBES), help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.rounds < 1 or opts.repeats < 1:
        parser.error(f"--rounds and --repeats must be >= 1, got {opts.rounds}, {opts.repeats}")
    return opts


def _run(opts: argparse.Namespace) -> None:
    ray = not opts.no_ray and ray_peer.installed()
    if not opts.no_ray and not ray:
        print("Ray rows skipped: Ray is not installed (pip install 'asyncrpc[bench]')")
    ways = ["asyncrpc"] + ([] if opts.no_launch else ["launch"]) + (["ray"] if ray else [])
    results = figures(measure(ways, opts.rounds, opts.repeats))
    report(results)
    if opts.json:
        options = {k: v for k, v in vars(opts).items() if k not in ("probe", "json")}
        run_record.write(opts.json, {"benchmark": "elastic", "options": options, **results})


if __name__ == "__main__":
    options = _parse()
    if options.probe:
        _PROBES[options.probe](options.repeats)
    else:
        _run(options)
