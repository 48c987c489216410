"""Load with real workers: many calls in flight from several callers, nothing lost.

A smaller run of benchmarks/load.py (10,000 calls and a 60 s soak there).
"""

from __future__ import annotations

import pytest

import asyncrpc

from conftest import ROOT, run_program


def _tag(i: int) -> int:
    return i


def _burst(first: int, count: int) -> list[int]:
    futs = [asyncrpc.rpc_async("worker1", _tag, args=(first + i,)) for i in range(count)]
    return [fut.wait() for fut in futs]


def test_calls_in_flight_from_two_callers_come_back_once_each(world: asyncrpc.Context) -> None:
    n = 1500
    remote_part = asyncrpc.rpc_async("worker2", _burst, args=(n, n))  # worker2 calls too
    local_part = _burst(0, n)
    tags = local_part + remote_part.wait()
    assert len(tags) == 2 * n
    assert sorted(tags) == list(range(2 * n))  # nothing lost, nothing duplicated
    assert sum(tags) == (2 * n) * (2 * n - 1) // 2


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_load_benchmark_reports_no_loss_and_memory_growth() -> None:
    result = run_program(
        "python",
        str(ROOT / "benchmarks" / "load.py"),
        "--calls", "2000", "--seconds", "4", "--workers", "3",
        timeout=110,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "load: 2000 calls from 2 callers" in result.stdout
    assert "lost or duplicated: 0; checksum ok" in result.stdout
    assert result.stdout.count(" MiB | ") == 6, result.stdout  # before and after, 3 workers
    assert "RSS within 5% of the start on every worker: yes" in result.stdout, result.stdout
