"""Every benchmark runs, at a small size, and prints its rows: none can rot unnoticed.

The figures themselves are not checked here (timings on shared machines swing):
the benchmarks print ratios measured side by side, and the README quotes them.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

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
}
# Rows without a peer when Ray is left out: they must print asyncrpc's figure.
FIGURES = {
    "ensemble": ["small: engine 'vmap' declined: member 0 holds an LSTM"],
    "peers": [
        "restart after a kill, to first call",
        "cancel: to the callee's coroutine",
        "cancel: to the caller's Future failing",
        "stream of small items (64 B)",
        "a loop of single calls, for scale",
        "stream of 1 MiB items",
        "items made ahead while the consumer stops 1 s",
    ],
}


@pytest.mark.subprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", sorted(CASES))
def test_benchmark_runs_small_and_prints_its_ratios(name: str) -> None:
    args, rows = CASES[name]
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
