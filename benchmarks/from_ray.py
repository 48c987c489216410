"""Three programs as Ray's docs write them, beside their asyncrpc ports: time and results.

Each Ray program of benchmarks/from_ray/ and its port in examples/from_ray/
runs as a user runs it, `python file.py`, each time in a fresh process, the
two in turn round by round (the first of the two alternates), so drift on a
shared machine hits both alike::

    actor pool feeding a learner     actor_pool_ray.py        examples/from_ray/actor_pool.py
    synchronous parameter server     parameter_server_ray.py  .../parameter_server.py
    serving fleet scaling with load  serving_ray.py           .../serving.py

A row's figures are medians of wall time, from the process's start to its
exit (interpreter, imports, starting Ray or the world, the work, shutdown);
Ray/ours is Ray's time over asyncrpc's. `results` compares what each run
printed with the port's first run: `equal` when every line is the same,
`close` when lines differ only in numbers, each within TOLERANCE (relative),
and `DIFFER` otherwise, which shows both outputs and fails the run (exit 1).
`lines` counts each file's non-blank lines, the port's first.

Ray stays on loopback (benchmarks/ray_peer.py sets its switch for the
children). Ray is optional (`pip install 'asyncrpc[bench]'`); without it, or
with --no-ray, only the ports run, their rows say so, and their results are
compared round with round.

    python benchmarks/from_ray.py [--rounds 3] [--programs NAME ...] [--no-ray] [--json PATH]

--json PATH also writes every figure printed, with the run's date, machine,
versions and command line (benchmarks/run_record.py).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ray_peer  # before Ray runs anywhere: its children stay on loopback
import run_record

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = {  # name: (row, Ray's program, the port)
    "actor_pool": ("actor pool feeding a learner", "actor_pool_ray.py", "actor_pool.py"),
    "parameter_server": (
        "synchronous parameter server",
        "parameter_server_ray.py",
        "parameter_server.py",
    ),
    "serving": ("serving fleet scaling with load", "serving_ray.py", "serving.py"),
}
TOLERANCE = 0.01  # relative, for each number printed
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def paths(name: str) -> dict[str, Path]:
    """The files of a program: {"asyncrpc": the port, "ray": Ray's original}."""
    _, ray_file, port_file = PROGRAMS[name]
    return {
        "asyncrpc": ROOT / "examples" / "from_ray" / port_file,
        "ray": ROOT / "benchmarks" / "from_ray" / ray_file,
    }


def count_lines(path: Path) -> int:
    """Non-blank lines of a file."""
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def run_once(path: Path, timeout: float) -> tuple[float, list[str]]:
    """Run `python path` in a fresh process: its wall time and the lines it printed."""
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, str(path)], cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        sys.exit(f"{path.relative_to(ROOT)} did not end within {timeout:g} s (--timeout)")
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{path.relative_to(ROOT)} failed (exit {done.returncode}):\n"
                 f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}")  # fmt: skip
    # Ray forwards its processes' own lines as "(name pid=...) ...": not the program's.
    return seconds, [ln.rstrip() for ln in done.stdout.splitlines() if not ln.startswith("(")]


def compare(reference: list[str], other: list[str]) -> tuple[str, float | None]:
    """("equal" | "close" | "DIFFER", the largest relative difference of a number).

    The difference is None where the lines differ in more than numbers.
    """
    if other == reference:
        return "equal", 0.0
    if len(other) != len(reference):
        return "DIFFER", None
    worst = 0.0
    for ref, line in zip(reference, other, strict=True):
        if _NUMBER.sub("#", ref) != _NUMBER.sub("#", line):
            return "DIFFER", None
        for a, b in zip(_NUMBER.findall(ref), _NUMBER.findall(line), strict=True):
            x, y = float(a), float(b)
            if x != y:
                worst = max(worst, abs(x - y) / max(abs(x), abs(y)))
    return ("close" if worst <= TOLERANCE else "DIFFER"), worst


def measure(name: str, ways: list[str], rounds: int, timeout: float) -> dict[str, Any]:
    """Every way of one program, `rounds` times, alternating; medians and the comparison."""
    files = paths(name)
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    outputs: dict[str, list[list[str]]] = {way: [] for way in ways}
    for r in range(rounds):
        for way in ways[r % len(ways) :] + ways[: r % len(ways)]:
            took, printed = run_once(files[way], timeout)
            seconds[way].append(took)
            outputs[way].append(printed)
    reference = outputs["asyncrpc"][0]
    verdicts = [compare(reference, out) for way in ways for out in outputs[way]]
    order = ("equal", "close", "DIFFER")
    verdict = max(verdicts, key=lambda v: (order.index(v[0]), v[1] or 0.0))
    median = {way: statistics.median(s) for way, s in seconds.items()}
    return {
        "seconds": median,
        "ray_over_ours": median["ray"] / median["asyncrpc"] if "ray" in median else None,
        "results": verdict[0],
        "max_relative_difference": verdict[1],
        "lines": {way: count_lines(path) for way, path in files.items()},
        "outputs": {way: outs[0] for way, outs in outputs.items()},
        "differing": [(way, out) for way in ways for out in outputs[way] if out != reference],
    }


def report(rows: dict[str, dict[str, Any]], ray: bool) -> None:
    print(
        f"{'program':<34}{'asyncrpc':>10}{'Ray':>10}{'Ray/ours':>10}  {'results':<20}{'lines':>8}"
    )
    for name, row in rows.items():
        label = PROGRAMS[name][0]
        ours, theirs = row["seconds"]["asyncrpc"], row["seconds"].get("ray")
        ratio = "-" if row["ray_over_ours"] is None else f"{row['ray_over_ours']:.2f}x"
        results = row["results"]
        if row["results"] == "close":
            results += f" ({row['max_relative_difference']:.1e})"
        if not ray:
            results += ", Ray skipped"
        lines = f"{row['lines']['asyncrpc']}/{row['lines']['ray']}"
        ray_cell = "-" if theirs is None else f"{theirs:.2f} s"
        print(f"{label:<34}{ours:>8.2f} s{ray_cell:>10}{ratio:>10}  {results:<20}{lines:>8}")
    print("wall time from start to exit, median of rounds; Ray/ours: Ray's time / asyncrpc's; "
          "results: every run's printed lines against the port's first; lines: non-blank, "
          "port/Ray")  # fmt: skip
    for name, row in rows.items():
        if row["results"] == "DIFFER":
            print(f"\n{PROGRAMS[name][0]}: the outputs differ; the port's first run printed")
            print("\n".join(row["outputs"]["asyncrpc"]))
            for way, out in row["differing"]:
                print(f"-- a {way} run printed\n" + "\n".join(out))


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--programs", nargs="+", choices=list(PROGRAMS), default=list(PROGRAMS))
    parser.add_argument("--no-ray", action="store_true", help="run the ports only")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per program run")
    parser.add_argument("--json", metavar="PATH", help="also write this run's figures here")
    return parser.parse_args()


def main() -> None:
    opts = _parse()
    ray = not opts.no_ray and ray_peer.installed()
    if not ray:
        why = "--no-ray" if opts.no_ray else "Ray is not installed (pip install 'asyncrpc[bench]')"
        print(f"Ray rows skipped: {why}; the ports run alone")
    ways = ["ray", "asyncrpc"] if ray else ["asyncrpc"]
    rows = {name: measure(name, ways, opts.rounds, opts.timeout) for name in opts.programs}
    report(rows, ray)
    if opts.json:
        figures = {name: {k: v for k, v in row.items() if k != "differing"}
                   for name, row in rows.items()}  # fmt: skip
        run_record.write(opts.json, {"benchmark": "from_ray", "rounds": opts.rounds,
                                     "tolerance": TOLERANCE, "programs": figures})  # fmt: skip
    if any(row["results"] == "DIFFER" for row in rows.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
