"""Every benchmark runs, at a small size, and prints its rows: none can rot unnoticed.

The figures themselves are not checked here (timings on shared machines swing):
the benchmarks print ratios measured side by side, and the README quotes them.
Those that take `--json PATH` write it in the same small run, and
benchmarks/charts.py draws its chart from that file.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, run_program

# script, its small-size arguments, and the rows its report must hold
CASES = {
    "call_overhead": (
        ["--calls", "100", "--rounds", "1"],
        ["rpc_sync", "rpc_async x 100, wait_all"],
    ),
    "inspect_costs": (
        "--rounds 1 --calls 100 --dump-workers 3 --top-workers 4 --idle-seconds 1".split(),
        ["| rpc_sync |", "| rpc_async x 100, wait_all |"],
    ),
    "cancel_bookkeeping": (
        ["--blocks", "2", "--per-block", "300"],
        ["CPU per block, last / first"],
    ),
    "async_execution": (
        ["--calls", "20", "--rounds", "1", "--nested", "40", "--work-ms", "0"],
        ["1. chained add call path", "2. then-chain vs async def"],
    ),
    "parameter_server": (
        ["--trainers", "2", "--rounds", "5", "--repeats", "1"],
        ["batched / immediate updates/s"],
    ),
    "ensemble": (
        "--rounds 1 --sizes small --transport-rounds 1 --sample-seconds 0.05 "
        "--transport-calls 200 --mlp-batches 1".split(),
        [
            "| 1 | vmap engine |",
            "| 1 | floor (baddbmm chain) |",
            "batch 1: auto chose",
            "| small | serial |",
            "| small | threads |",
            "| small | auto |",
            "| small | spread over 2 workers |",
            "| small | spread, members' compute only |",
            "small: spread over 2 workers",
            "small: auto chose",
        ],
    ),
    "small_call": (
        ["--calls", "20", "--rounds", "1"],
        [
            "thread states kept (default)",
            "thread states not kept",
            "switch interval 0.1 ms",
            "switch interval 50 ms",
            "4 RPC threads",
        ],
    ),
    "objects": (
        "--rounds 1 --repeat 1 --mib 4 --get-mib 1 --workers 2 --no-ray".split(),
        ["broadcast 4 MiB to 2 workers", "parameter server, 10 steps"],
    ),
    "ensemble_training": (
        "--rounds 1 --batches 8 --sample 0.02 --agree-steps 3 --auto-batches 1".split(),
        ["  vmap ", "  auto ", "  floor "],
    ),
    "stacked_mlp": (
        ["--rounds", "1", "--batches", "1", "--sample-seconds", "0.02"],
        ["| 1 | vmap engine |", "| 1 | floor (baddbmm chain) |", "batch 1: auto chose"],
    ),
    "grow": (
        ["--to", "10"],
        ["add 8, to 10 workers", "add 1, to 11 workers"],
    ),
    "scale": (
        ["--sizes", "2", "3", "--rounds", "1", "--no-ray"],
        [
            "start-up to every answer, 2 workers",
            "start-up to every answer, 3 workers",
            "end: every answer to the world's end, 3 workers",
            "memory (PSS, summed), 2 workers",
            "memory (PSS, summed), 3 workers",
            "memory (RSS, summed), 3 workers",
        ],
    ),
    "peers": (
        "--calls 3 --rounds 1 --startups 1 --no-ray --beyond-rounds 2 --stream-items 200".split(),
        [
            "small call round trip",
            "1 MiB argument round trip",
            "1000 calls in flight",
            "1000 calls in flight, in one Batch",
            "chained hop A -> B -> C (async)",
            "method call on a remote object",
            "world start-up to first call",
            "start-up, first call and shutdown",
            "second world, same process, first call",
        ],
    ),
    "stream_snapshot": (
        ["--rounds", "1", "--items", "100"],
        ["stream of small items (64 B)", "stream of 1 MiB items"],
    ),
    "heal": (
        ["--rounds", "1", "--kills", "1", "--no-ray"],
        ["asyncrpc, heal one worker", "asyncrpc, restart the whole world"],
    ),
    "gpu": (
        "--rounds 1 --sizes-mib 1 --batches 1 --sample-seconds 0.02".split(),
        [
            "| 1 MiB | asyncrpc |",
            "| 1 MiB | torch |",
            "| 1 MiB | CPU detour |",
            "| 1 | ",
        ],
    ),
    "elastic": (
        ["--rounds", "1", "--repeats", "1", "--no-ray"],
        [
            "add 1 worker, to its first answer",
            "add 8 workers, to every first answer",
            "remove 1 idle worker",
        ],
    ),
}
# Rows without a peer when Ray is left out: they must print asyncrpc's figure.
FIGURES = {
    "ensemble": ["small: engine 'vmap' declined: member 0 holds an LSTM"],
    "scale": ["processes, 2 workers", "processes, 3 workers"],
    "peers": [
        "100 async def calls in flight on one object",
        "restart after a kill, to first call",
        "cancel: to the callee's coroutine",
        "cancel: to the caller's Future failing",
        "stream of small items (64 B)",
        "a loop of single calls, for scale",
        "stream of 1 MiB items",
        "items made ahead while the consumer stops 1 s",
    ],
}


# Benchmarks that take --json: figures (key paths) that must be numbers in the file.
JSON_FIGURES = {
    "peers": [
        ("calls", "small call round trip", "seconds", "asyncrpc"),
        ("calls", "1000 calls in flight", "calls_per_s", "torch"),
        ("calls", "1000 calls in flight, in one Batch", "vs_torch"),
        ("startup", "world start-up to first call", "seconds", "torch"),
        ("startup", "restart after a kill, to first call", "seconds", "asyncrpc"),
        ("beyond", "stream of 1 MiB items", "asyncrpc"),
    ],
    "scale": [
        ("results", "asyncrpc", "2", "startup_s"),
        ("results", "torch", "2", "end_s"),
        ("results", "torch", "3", "pss_mib"),
        ("results", "torch", "3", "rss_mib"),
        ("results", "asyncrpc", "3", "processes"),
        ("ratios", "3", "startup_s", "vs_torch"),
    ],
    "stacked_mlp": [
        ("batches", "1", "ways", "vmap engine", "us"),
        ("batches", "1", "ways", "floor, members' layout", "vs_floor"),
        ("batches", "1", "engine_over_floor_by_round"),
        ("batches", "1", "auto_over_best"),
    ],
    "ensemble_training": [
        ("steps", "8", "ways", "vmap", "vs_floor"),
        ("steps", "8", "ways", "auto", "vs_loop"),
        ("acting", "ways", "vmap", "ms"),
        ("loss_difference", "3", "vmap"),
    ],
    "small_call": [
        ("layers", "1. TCP ping-pong, 40 B (floor)", "us"),
        ("layers", "4. asyncrpc.rpc_sync, Python function", "of_step_4"),
        ("worlds", "4 RPC threads", "asyncrpc_over_builtin"),
    ],
    "heal": [
        ("ways", "asyncrpc, heal one worker", "seconds"),
        ("ways", "asyncrpc, restart the whole world", "vs_heal"),
    ],
    "gpu": [
        ("transfers", "1", "asyncrpc", "gb_s"),
        ("transfers", "1", "CPU detour", "vs_torch"),
        ("ensemble", "1", "speedup"),
    ],
    "elastic": [
        ("rows", "add 1 worker, to its first answer", "seconds", "asyncrpc (embedded)"),
        ("rows", "remove 1 idle worker", "seconds", "asyncrpc (embedded)"),
    ],
}
CHARTS = {
    "peers": "peers.png",
    "scale": "scale.png",
    "stacked_mlp": "vmap.png",
    "heal": "heal.png",
    "elastic": "elastic.png",
    "ensemble_training": "training.png",
}


@pytest.mark.subprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", sorted(CASES))
def test_benchmark_runs_small_and_prints_its_ratios(name: str, tmp_path: Path) -> None:
    args, rows = CASES[name]
    if name in JSON_FIGURES:
        args = [*args, "--json", str(tmp_path / f"{name}.json")]
    result = run_program("python", str(ROOT / "benchmarks" / f"{name}.py"), *args, timeout=140)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    for row in rows:
        line = next((ln for ln in result.stdout.splitlines() if row in ln), None)
        assert line is not None, f"no {row!r} row in:\n{result.stdout}"
        assert re.search(r"\d+\.\d+x", line), f"no ratio in {line!r}"
    for row in FIGURES.get(name, []):
        line = next((ln for ln in result.stdout.splitlines() if row in ln), None)
        assert line is not None, f"no {row!r} row in:\n{result.stdout}"
        assert re.search(r"\d", line.replace(row, "")), f"no figure in {line!r}"
    if name in JSON_FIGURES:
        _check_json(name, json.loads((tmp_path / f"{name}.json").read_text()))
    if name in CHARTS:
        _check_chart(CHARTS[name], tmp_path)


def _check_json(name: str, found: dict[str, Any]) -> None:
    """The run's date, machine, versions and command line, and its figures, as numbers."""
    datetime.datetime.fromisoformat(found["date"])
    assert set(found["machine"]) == {"cpus", "cpu_model", "memory_gib"}, found["machine"]
    assert found["machine"]["cpus"] >= 1 and found["machine"]["memory_gib"] > 0
    assert found["torch"] and found["python"] and "ray" in found
    assert f"{name}.py" in found["command"] and "--json" in found["command"], found["command"]
    for path in JSON_FIGURES[name]:
        value: Any = found
        for key in path:
            assert key in value, f"no {key!r} of {path} in {name}.json: {list(value)}"
            value = value[key]
        assert isinstance(value, int | float), f"{path}: {value!r}"
    if name == "peers":  # every row printed is in the file
        labels = {*found["calls"], *found["startup"], *(r.strip() for r in found["beyond"])}
        assert set(CASES[name][1]) | set(FIGURES[name]) <= labels, labels
    if name == "heal":  # the survivors kept their state when healed, and lost it in a restart
        ways = found["ways"]
        assert ways["asyncrpc, heal one worker"]["state_kept"] is True, ways
        assert ways["asyncrpc, restart the whole world"]["state_kept"] is False, ways


def _check_chart(chart: str, results: Path) -> None:
    """charts.py draws this benchmark's chart from its small JSON; the others it skips."""
    out = results / "charts"
    script = ROOT / "benchmarks" / "charts.py"
    done = run_program(
        "python", str(script), "--results", str(results), "--out", str(out), timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert (out / chart).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for other in set(CHARTS.values()) - {chart}:
        assert f"{other} skipped: no " in done.stdout, done.stdout
        assert not (out / other).exists()


@pytest.mark.subprocess
@pytest.mark.timeout(60)
def test_scale_reports_a_world_that_does_not_fit_and_goes_on() -> None:
    script = ROOT / "benchmarks" / "scale.py"
    args = ["--sizes", "2", "3", "--rounds", "2", "--no-ray", "--timeout", "0.5"]
    result = run_program("python", str(script), *args, timeout=50)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    for system in ("asyncrpc", "torch"):
        why = f"{system} at 2 workers did not fit: no answer from every worker within 0.5 s"
        assert why in result.stdout, result.stdout
        assert f"{system} at 3 workers" not in result.stdout, result.stdout  # not tried
    line = next(ln for ln in result.stdout.splitlines() if "start-up to every answer, 3" in ln)
    assert line.split()[-5:-3] == ["n/f", "n/f"], line


@pytest.mark.subprocess
@pytest.mark.timeout(90)
def test_the_small_call_profile_splits_each_workers_cpu_by_thread(tmp_path: Path) -> None:
    if shutil.which("perf") is None:
        pytest.skip("Linux perf is not installed here")
    script = ROOT / "benchmarks" / "profile_small_call.py"
    result = run_program(
        "python", str(script), "--seconds", "2", "--out", str(tmp_path), timeout=80
    )
    if "perf recorded nothing" in result.stderr:
        pytest.skip(f"perf may not sample here: {result.stderr[-300:]}")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    for worker in ("worker0", "worker1"):
        line = next(ln for ln in result.stdout.splitlines() if ln.startswith(f"{worker}: "))
        assert re.search(r": \d+ us of CPU per call \([1-9]\d* samples\)", line), line
    assert result.stdout.count("by thread: ") == 2, result.stdout
    assert "TensorPipe loop" in result.stdout, result.stdout


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_the_small_call_count_shows_thread_states_kept(tmp_path: Path) -> None:
    if shutil.which("perf") is None or os.geteuid() != 0:
        pytest.skip("counting with uprobes needs Linux perf and root")
    script = ROOT / "benchmarks" / "profile_small_call.py"
    result = run_program(
        "python", str(script), "--count", "--calls", "50", "--out", str(tmp_path), timeout=110
    )
    if "could not add a uprobe" in result.stderr:
        pytest.skip(f"uprobes unavailable here: {result.stderr[-300:]}")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    made = {}
    for line in result.stdout.splitlines():
        found = re.match(
            r"(thread states (?:not )?kept)\s+(.+?)\s+thread states made\s+([\d.]+)", line
        )
        if found:
            made[found[1], found[2].strip()] = float(found[3])
    assert len(made) == 6, result.stdout
    python_call = "torch, Python function"
    # torch's pool makes states per call; kept, only TensorPipe's loop still does
    assert made["thread states not kept", python_call] >= 4, result.stdout
    assert made["thread states kept", python_call] <= 2.5, result.stdout
