"""asyncrpc in worlds it did not start, and one error type per failure on every verb."""

from __future__ import annotations

import pathlib
import re

import pytest

from conftest import PROGRAMS, bin_path, free_port, run_program

CHECKS = [
    "context",
    "rpc_sync by keyword",
    "rpc_sync python",
    "rpc_async async def",
    "remote is torch's",
    "spawn call",
    "spawn call_async",
    "spawn call_remote",
    "spawn async def method",
    "proxy of an async def method",
    "wrap torch's rref",
    "call_all",
    "actor: one call at a time, in order",
    "actor: asyncio in an async method, interleaved",
    "wait",
    "ActorPool",
    "remote KeyError keeps its type",
    "the same error through rpc_sync and remote",
    "ensemble",
    "trace",
    "after asyncrpc.shutdown",
]


def _assert_all_checks(output: str) -> None:
    passed = re.findall(r"^ok: (.+)$", output, re.MULTILINE)
    assert passed == CHECKS, output[-3000:]


@pytest.mark.subprocess
@pytest.mark.timeout(150)
def test_every_verb_in_a_world_torch_started_with_mp_spawn(tmp_path: pathlib.Path) -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    program = str(PROGRAMS / "torch_world.py")
    result = run_program("python", program, "spawn", str(tmp_path), timeout=140, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    _assert_all_checks(result.stdout)


@pytest.mark.subprocess
@pytest.mark.timeout(150)
def test_every_verb_in_a_world_torch_started_under_torchrun(tmp_path: pathlib.Path) -> None:
    argv = [
        bin_path("torchrun"),
        "--nproc-per-node",
        "3",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(PROGRAMS / "torch_world.py"),
        "torchrun",
        str(tmp_path),
    ]
    result = run_program(*argv, timeout=140)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    _assert_all_checks(result.stdout)


@pytest.mark.subprocess
@pytest.mark.timeout(150)
def test_each_failure_gives_one_error_type_on_every_verb() -> None:
    result = run_program("python", str(PROGRAMS / "failure_table.py"), timeout=140)
    report = result.stdout + result.stderr[-3000:]
    assert result.returncode == 0, report
    assert "mismatches: 0" in result.stdout, report
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 14, report  # a header, then one row per failure
    for row in rows[1:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 15 and len(set(cells[1:])) == 1, row  # one type across verbs


@pytest.mark.subprocess
@pytest.mark.timeout(150)
def test_the_adoption_example_runs() -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    result = run_program("python", "examples/adopt.py", timeout=140, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = dict(line.split(":", 1) for line in result.stdout.splitlines() if ":" in line)
    assert lines["torch"].strip() == lines["asyncrpc"].strip() == "tensor([2., 2.])"
    assert "KeyError True On worker 'worker1' (rank 1), in lookup()" in lines["error"]
    assert lines["handle"].strip() == "11"
    assert lines["chained"].strip() == "tensor([3., 3.])"
