"""A killed worker brought back: asyncrpc healing it in place, restarting the world, Ray.

Four workers (Ray: four actors); one of them, worker3, is killed with SIGKILL,
and the figure is the time from the kill to the first answer of its
replacement. Every way runs in a fresh process, in turn, round by round, so
drift on a shared machine hits all of them alike; the figure is the median::

    asyncrpc, heal one worker    run(main, 4, max_restarts=K, restart="worker"):
        worker0 holds a tensor and a Counter on worker1, kills worker3 K times,
        retries rpc_sync("worker3", ...) on WorkerUnreachableError until the
        replacement answers, then checks the survivors' state
    asyncrpc, restart the world  run(main, 4, max_restarts=1): attempt 0 stamps
        the kill, attempt 1's worker0 times its first answer from worker3; the
        world's state (the Counter, worker0's tensor) is gone with it
    Ray, restart one actor       4 actors, worker3's with max_restarts=K, killed
        K times; calls retried on RayActorError until it answers again

The report gives each way's median, its ratio to healing, and whether the
survivors' state was kept; the target is a heal within 0.3 s, about 5 times
faster than Ray. A survivor whose state changed stops the run with the reason.

Ray stays on loopback (benchmarks/ray_peer.py) and is optional
(`pip install 'asyncrpc[bench]'`); without it, or with --no-ray, its row is left out.

    python benchmarks/heal.py [--rounds 5] [--kills 2] [--no-ray] [--json PATH]

--json PATH also writes every figure printed, with the run's date, machine,
versions and command line (benchmarks/run_record.py), for benchmarks/charts.py.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import asyncrpc

import ray_peer  # before anything imports Ray: it keeps Ray on loopback
import run_record

WORLD_SIZE = 4
VICTIM = "worker3"
TARGET_S = 0.3  # a heal within this long ...
TARGET_VS_RAY = 5.0  # ... and about this many times faster than Ray's actor restart
_WITHIN_S = 60.0  # how long a replacement may take before the run gives up on it
_PROBE_TIMEOUT_S = 240  # one way's fresh process, from its start to its end
_START = 5  # what the Counters hold before the first kill

WAYS = {
    "heal": "asyncrpc, heal one worker",
    "world": "asyncrpc, restart the whole world",
    "ray": "Ray, restart one actor",
}


class Counter:
    def __init__(self) -> None:
        self.total = 0

    def add(self, n: int) -> int:
        self.total += n
        return self.total


def identity() -> tuple[int, int]:
    """(pid, ctx.attempt) of the worker that runs it."""
    return os.getpid(), asyncrpc.current_context().attempt


class StateLost(RuntimeError):
    """A survivor's state changed across a restart of another worker (actor)."""


# ---- asyncrpc, healing one worker -----------------------------------------------------


def heal_main(ctx: asyncrpc.Context, kills: int) -> None:
    """worker0 kills worker3 `kills` times; every other worker only serves calls."""
    if ctx.rank != 0:
        return
    counter = asyncrpc.spawn("worker1", Counter)
    counter.call("add", _START)
    kept = torch.randn(1000)
    kept_copy = kept.clone()
    survivors = {n: asyncrpc.rpc_sync(n, identity) for n in ctx.names if n != VICTIM}
    events = _watch_replacements()
    for kill in range(1, kills + 1):
        pid, _ = asyncrpc.rpc_sync(VICTIM, identity)
        start = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        (new_pid, attempt), tries = _first_answer(VICTIM)
        took = time.perf_counter() - start
        if new_pid == pid or attempt != kill:
            raise RuntimeError(
                f"after kill {kill} of {VICTIM} (pid {pid}) the answer came from pid "
                f"{new_pid} with ctx.attempt {attempt}; expected a new pid and attempt {kill}"
            )
        _check_survivors(counter, _START + kill, kept, kept_copy, survivors)
        print(f"KILL_TO_ANSWER {took:.6f} after {tries} tries", flush=True)
        _report_event(events, start, kill)
    print("STATE kept: the Counter on worker1, worker0's tensor, every survivor's pid")


def _watch_replacements() -> queue.Queue[tuple[float, Any]] | None:
    """A queue of (perf_counter, event) from asyncrpc.on_replaced; None without it."""
    on_replaced = getattr(asyncrpc, "on_replaced", None)
    if on_replaced is None:
        return None
    events: queue.Queue[tuple[float, Any]] = queue.Queue()
    on_replaced(lambda event: events.put((time.perf_counter(), event)))
    return events


def _report_event(events: queue.Queue[tuple[float, Any]] | None, start: float, kill: int) -> None:
    if events is None:
        print("REPLACED none: asyncrpc.on_replaced is not there", flush=True)
        return
    try:
        at, event = events.get(timeout=5)
    except queue.Empty:
        print(f"REPLACED none: no on_replaced event within 5 s of kill {kill}", flush=True)
        return
    got = (event.name, event.rank, event.attempt)
    if got != (VICTIM, WORLD_SIZE - 1, kill):
        raise RuntimeError(
            f"on_replaced gave (name, rank, attempt) {got} after kill {kill}; "
            f"expected {(VICTIM, WORLD_SIZE - 1, kill)}"
        )
    print(f"REPLACED {at - start:.6f}", flush=True)


def _first_answer(to: str) -> tuple[Any, int]:
    """identity() from `to`, retried every ~1 ms while it is unreachable; and the tries."""
    deadline = time.perf_counter() + _WITHIN_S
    tries = 0
    while True:
        tries += 1
        try:
            return asyncrpc.rpc_sync(to, identity, timeout=_WITHIN_S), tries
        except asyncrpc.WorkerUnreachableError:
            if time.perf_counter() > deadline:
                raise
            time.sleep(0.001)


def _check_survivors(
    counter: Any, expected: int, kept: torch.Tensor, copy: torch.Tensor, before: dict[str, Any]
) -> None:
    value = counter.call("add", 1)
    now = {n: asyncrpc.rpc_sync(n, identity) for n in before}
    lost = []
    if value != expected:
        lost.append(f"the Counter on worker1 answered {value}, expected {expected}")
    if not torch.equal(kept, copy):
        lost.append("worker0's tensor changed")
    lost += [f"{n} is now (pid, attempt) {now[n]}, was {was}" for n, was in before.items()
             if now[n] != was]  # fmt: skip
    if lost:
        print(f"STATE LOST: {'; '.join(lost)}", flush=True)
        raise StateLost(f"healing {VICTIM} changed the survivors: {'; '.join(lost)}")


def _probe_heal(kills: int) -> None:
    asyncrpc.run(heal_main, WORLD_SIZE, args=(kills,), max_restarts=kills, restart="worker")


# ---- asyncrpc, restarting the whole world ---------------------------------------------


def world_main(ctx: asyncrpc.Context, stamp: str) -> None:
    """Attempt 0: worker0 stamps the time and kills worker3; attempt 1 times the answer."""
    if ctx.attempt == 0:
        if ctx.rank == 0:
            asyncrpc.spawn("worker1", Counter).call("add", _START)
            pid, _ = asyncrpc.rpc_sync(VICTIM, identity)
            with open(stamp, "w") as f:
                f.write(f"{time.time()}\n")
            os.kill(pid, signal.SIGKILL)
        time.sleep(60)  # until the supervisor stops this world
    elif ctx.rank == 0:
        _first_answer(VICTIM)
        took = time.time() - float(open(stamp).read())
        value = asyncrpc.spawn("worker1", Counter).call("add", 1)
        print(f"KILL_TO_ANSWER {took:.6f}", flush=True)
        print(f"STATE lost: the Counter held {_START} before the kill; a new one answers "
              f"{value}, and worker0's own tensors went with its process")  # fmt: skip


def _probe_world(kills: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        stamp = os.path.join(folder, "killed_at")
        asyncrpc.run(world_main, WORLD_SIZE, args=(stamp,), max_restarts=1)


# ---- Ray, restarting one actor ----------------------------------------------------------


class Holder:
    """A Ray actor's state: a counter and a tensor."""

    def __init__(self) -> None:
        self.total = 0
        self.tensor = torch.randn(1000)

    def add(self, n: int) -> int:
        self.total += n
        return self.total

    def checksum(self) -> float:
        return float(self.tensor.sum())

    def pid(self) -> int:
        return os.getpid()


def _probe_ray(kills: int) -> None:
    import ray

    if not ray_peer.start():
        sys.exit("Ray is not installed: pip install 'asyncrpc[bench]'")
    actor: Any = ray.remote(Holder)
    others: list[Any] = [actor.remote() for _ in range(WORLD_SIZE - 1)]
    victim: Any = actor.options(max_restarts=kills).remote()
    ray.get([a.add.remote(_START) for a in [*others, victim]])
    sums = ray.get([a.checksum.remote() for a in others])
    for kill in range(1, kills + 1):
        pid: int = ray.get(victim.pid.remote())
        start = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        new_pid, tries = _ray_first_answer(victim.pid.remote)
        took = time.perf_counter() - start
        if new_pid == pid:
            raise RuntimeError(f"Ray's actor answered from the killed pid {pid} after kill {kill}")
        values = ray.get([a.add.remote(1) for a in others])
        if (
            values != [_START + kill] * len(others)
            or ray.get([a.checksum.remote() for a in others]) != sums
        ):
            raise StateLost(f"Ray's other actors changed: counters {values}, expected "
                            f"{_START + kill} each, or their tensors changed")  # fmt: skip
        print(f"KILL_TO_ANSWER {took:.6f} after {tries} tries", flush=True)
    restarted = ray.get(victim.add.remote(1))
    print(f"STATE kept: the other 3 actors' counters and tensors (the restarted one "
          f"starts again: its counter answers {restarted})")  # fmt: skip
    ray.shutdown()


def _ray_first_answer(call: Callable[[], Any]) -> tuple[Any, int]:
    import ray
    from ray.exceptions import ActorUnavailableError, RayActorError

    deadline = time.perf_counter() + _WITHIN_S
    tries = 0
    while True:
        tries += 1
        try:
            return ray.get(call(), timeout=_WITHIN_S), tries
        except (RayActorError, ActorUnavailableError):
            if time.perf_counter() > deadline:
                raise
            time.sleep(0.001)


_PROBES: dict[str, Callable[[int], None]] = {
    "heal": _probe_heal,
    "world": _probe_world,
    "ray": _probe_ray,
}


# ---- the rounds and the report -----------------------------------------------------------


def _run_probe(way: str, kills: int) -> tuple[list[float], list[float], str]:
    """One fresh process of `way`: its kill-to-answer seconds, callback seconds, state line."""
    out = _probe_output(way, kills)
    lines = out.splitlines()
    seconds = [float(ln.split()[1]) for ln in lines if ln.startswith("KILL_TO_ANSWER ")]
    replaced = [float(ln.split()[1]) for ln in lines
                if ln.startswith("REPLACED ") and ln.split()[1] != "none:"]  # fmt: skip
    state = next((ln for ln in lines if ln.startswith("STATE ")), "STATE unknown")
    if not seconds:
        sys.exit(f"{WAYS[way]} printed no KILL_TO_ANSWER line:\n{out[-2000:]}")
    for line in lines:
        if line.startswith("REPLACED none:") or line.startswith("Ray's listening sockets"):
            print(f"{WAYS[way]}: {line.removeprefix('REPLACED ')}", flush=True)
    return seconds, replaced, state.removeprefix("STATE ")


def _probe_output(way: str, kills: int) -> str:
    """The stdout of `way`'s probe; a failure or a hang ends the run with its output."""
    command = [sys.executable, __file__, "--probe", way, "--kills", str(kills)]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as probe:
        try:
            out, err = probe.communicate(timeout=_PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(probe.pid, signal.SIGKILL)  # the probe and the workers it started
            out, err = probe.communicate()
            sys.exit(f"{WAYS[way]} hung: no end within {_PROBE_TIMEOUT_S} s; its output:\n"
                     f"{out[-2000:]}\n{err[-4000:]}")  # fmt: skip
    if probe.returncode != 0:
        sys.exit(f"{WAYS[way]} failed (exit {probe.returncode}):\n{out[-2000:]}\n{err[-4000:]}")
    return out


def measure(ways: list[str], rounds: int, kills: int) -> dict[str, dict[str, Any]]:
    """Every way's samples, ways alternated round by round, each in a fresh process."""
    found: dict[str, dict[str, Any]] = {w: {"samples": [], "replaced": []} for w in ways}
    for r in range(rounds):
        for way in ways[r % len(ways) :] + ways[: r % len(ways)]:
            seconds, replaced, state = _run_probe(way, kills)
            found[way]["samples"] += seconds
            found[way]["replaced"] += replaced
            found[way]["state"] = state
    return found


def figures(found: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Medians, ratios to healing, state kept, and whether the target was met."""
    heal = statistics.median(found["heal"]["samples"])
    ways = {}
    for way, got in found.items():
        median = statistics.median(got["samples"])
        ways[WAYS[way]] = {
            "seconds": median,
            "samples": got["samples"],
            "vs_heal": median / heal,
            "state_kept": got["state"].startswith("kept"),
            "state": got["state"],
        }
    if found["heal"]["replaced"]:
        ways[WAYS["heal"]]["on_replaced_seconds"] = statistics.median(found["heal"]["replaced"])
    ray = ways.get(WAYS["ray"])
    ray_ratio = None if ray is None else ray["vs_heal"]
    met = heal <= TARGET_S and (ray_ratio is None or ray_ratio >= TARGET_VS_RAY)
    target = {"heal_s": TARGET_S, "vs_ray": TARGET_VS_RAY, "met": met, "ray_checked": ray_ratio
              is not None}  # fmt: skip
    return {"ways": ways, "target": target}


def report(results: dict[str, Any]) -> None:
    print(f"\n{'way (' + str(WORLD_SIZE) + ' workers, worker3 killed)':<40}"
          f"{'kill to answer':>16}{'vs heal':>10}{'state kept':>12}")  # fmt: skip
    for way, got in results["ways"].items():
        kept = "yes" if got["state_kept"] else "no"
        print(f"{way:<40}{_seconds(got['seconds']):>16}{got['vs_heal']:>9.2f}x{kept:>12}")
    print(
        "kill to answer: median seconds from the SIGKILL to the replacement's first answer; "
        "vs heal: that / healing's; state kept: the survivors' (the killed one's is lost)"
    )
    for way, got in results["ways"].items():
        print(f"  {way}: state {got['state']}")
        if "on_replaced_seconds" in got:
            print(f"  {way}: on_replaced called {_seconds(got['on_replaced_seconds'])} "
                  "after the kill (median)")  # fmt: skip
    _report_target(results)


def _report_target(results: dict[str, Any]) -> None:
    heal = results["ways"][WAYS["heal"]]["seconds"]
    ray = results["ways"].get(WAYS["ray"])
    target = results["target"]
    against = "" if ray is None else f", Ray / heal {ray['vs_heal']:.2f}x"
    unchecked = "" if ray is not None else " (Ray left out: its ratio was not checked)"
    verdict = "met" if target["met"] else "NOT met"
    print(f"target: a heal within {TARGET_S} s with {WORLD_SIZE} workers on this "
          f"{os.cpu_count()}-CPU machine, about {TARGET_VS_RAY:.0f}x faster than Ray: "
          f"{verdict} (heal {_seconds(heal)}{against}){unchecked}")  # fmt: skip


def _seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="fresh processes per way")
    kills = "kills per healed world and per Ray cluster (a world restart: 1)"
    parser.add_argument("--kills", type=int, default=2, help=kills)
    parser.add_argument("--no-ray", action="store_true", help="leave Ray out")
    parser.add_argument("--json", metavar="PATH", help="also write this run's figures here")
    parser.add_argument("--probe", choices=sorted(_PROBES), help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.rounds < 1 or opts.kills < 1:
        parser.error(f"--rounds and --kills must be >= 1, got {opts.rounds} and {opts.kills}")
    return opts


def _run(opts: argparse.Namespace) -> None:
    ray = not opts.no_ray and ray_peer.installed()
    if not opts.no_ray and not ray:
        print("Ray row skipped: Ray is not installed (pip install 'asyncrpc[bench]')")
    ways = ["heal", "world"] + (["ray"] if ray else [])
    results = figures(measure(ways, opts.rounds, opts.kills))
    report(results)
    if opts.json:
        options = {k: v for k, v in vars(opts).items() if k not in ("probe", "json")}
        run_record.write(opts.json, {
            "benchmark": "heal", "options": options, "world_size": WORLD_SIZE, **results,
        })  # fmt: skip


if __name__ == "__main__":
    options = _parse()
    if options.probe:
        _PROBES[options.probe](options.kills)
    else:
        _run(options)
