"""The suite's own report (tests/conftest.py): a feature whose tests skip is named at the end."""

from __future__ import annotations

import os
import pathlib
from types import SimpleNamespace
from typing import Any

import pytest

from conftest import not_run, run_program

ROOT_ONLY = "network namespaces need root: run the suite as root to test two hosts"


def _skipped(nodeid: str, reason: str) -> Any:
    return SimpleNamespace(nodeid=nodeid, longrepr=("tests/x.py", 68, f"Skipped: {reason}"))


def test_each_feature_not_run_is_one_line_with_its_reason_and_count() -> None:
    hosts = "tests/test_launch_hosts.py"
    reports = [_skipped(f"{hosts}::test_{i}", ROOT_ONLY) for i in range(11)]
    reports.append(_skipped(f"{hosts}::test_netem", "this kernel has neither netem nor tbf"))
    reports.append(_skipped("tests/test_docs.py::test_site", "the site needs mkdocs"))
    assert not_run(reports) == [
        f"NOT RUN: two-host tests ({hosts}): {ROOT_ONLY} (11 tests)",
        f"NOT RUN: two-host tests ({hosts}): this kernel has neither netem nor tbf (1 test)",
    ]
    assert not_run([]) == []


@pytest.mark.subprocess
def test_a_run_as_another_user_than_root_says_the_two_host_tests_were_not_run(
    tmp_path: pathlib.Path,
) -> None:
    # As the suite runs it (in xdist processes: one is enough) where os.geteuid() is a user's.
    (tmp_path / "as_a_user.py").write_text("import os\n\nos.geteuid = lambda: 1000\n")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    done = run_program(
        "python", "-m", "pytest", "tests/test_launch_hosts.py", "-n", "1", "-p", "as_a_user",
        env={"PYTHONPATH": path}, timeout=100,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    said = f"NOT RUN: two-host tests (tests/test_launch_hosts.py): {ROOT_ONLY} ("
    assert any(line.startswith(said) for line in done.stdout.splitlines()), done.stdout[-3000:]
    listed = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED [")]
    assert any(ROOT_ONLY in line for line in listed), done.stdout[-3000:]  # -rs: each reason
