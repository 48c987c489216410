"""Shared fixtures: one RPC world for the whole session, and helpers to run programs.

The `world` fixture makes this pytest process `worker0` of a 3-worker world
over loopback; `worker1` and `worker2` are helper processes that only serve
calls until the session ends. Tests that need their own world (failures,
launchers) run a program from tests/programs in a subprocess instead.
"""

from __future__ import annotations

import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
import torch

import asyncrpc

# tests/programs/helpers.py: what the programs share, for the tests too (`from conftest
# import free_port` as before); a world's helper processes inherit this path.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "programs"))
from helpers import free_port as free_port
from helpers import start_world
from processes import kill_tree, stacks

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROGRAMS = pathlib.Path(__file__).resolve().parent / "programs"
WORLD_SIZE = 3

T = TypeVar("T")


@pytest.fixture
def two_threads() -> Iterator[None]:
    """An intra-op budget of 2 whatever this machine has, so "auto" has plans to time."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def world() -> Iterator[asyncrpc.Context]:
    ctx, helpers = start_world(WORLD_SIZE, rpc_timeout=30)
    yield ctx
    asyncrpc.shutdown()
    for proc in helpers:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def until(predicate: Callable[[], T], seconds: float = 10.0, every: float = 0.02) -> T:
    """`predicate()` once it is true, or its last value when `seconds` have passed.

    For what another thread or worker does soon but not at once (a remote
    `finally` that runs, a count that drops): `assert until(lambda: ...)`.
    """
    deadline = time.monotonic() + seconds
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every)


def _program_env(extra: dict[str, str] | None) -> dict[str, str]:
    env = {**os.environ, **(extra or {})}
    for key in ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        env.pop(key, None)  # set by this process's own world
    return env


def run_program(
    *argv: str,
    timeout: float = 90,
    env: dict[str, str] | None = None,
    cwd: pathlib.Path = ROOT,
) -> subprocess.CompletedProcess[str]:
    """Run a command (from the repository root by default) with this interpreter's environment.

    One that has not ended within `timeout` s fails the test with what every process
    of its tree was doing then (`processes.stacks`) and the end of its output. It
    returns when the program itself ends: what its descendants print later is not read.
    """
    command = [sys.executable, *argv[1:]] if argv[0] == "python" else list(argv)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        # Files, not pipes: a tree that does not end is asked for its stacks, and what it
        # printed before is kept (a pipe's reader would wait for the last writer).
        child = subprocess.Popen(
            command, cwd=cwd, env=_program_env(env), stdout=out, stderr=err, text=True
        )
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            where = stacks(child, err)  # and the tree is ended
            child.wait()
            out.seek(0)
            raise AssertionError(
                f"{shlex.join(command)} did not end within {timeout} s; it printed\n"
                f"{out.read()[-4000:]}\nand its tree was doing this:\n{where}"
            ) from None
        except BaseException:  # the test's own timeout, Ctrl-C: no process is left behind
            kill_tree(child.pid)
            child.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command, code, out.read(), err.read())


def start_program(*argv: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """Start a command from the repository root in the background, capturing its output."""
    return subprocess.Popen(
        list(argv),
        cwd=ROOT,
        env=_program_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def bin_path(name: str) -> str:
    """A console script installed beside this interpreter (asyncrpc-launch, torchrun)."""
    return str(pathlib.Path(sys.executable).parent / name)


# A feature whose tests skip where the suite runs (the two-host tests need root for their
# network namespaces) is named at the end of the run, with the reason: `NOT RUN: ...`.
FEATURES = {"test_launch_hosts.py": "two-host tests"}


def not_run(skipped: list[pytest.TestReport | pytest.CollectReport]) -> list[str]:
    """`NOT RUN: feature (file): reason (N tests)`, one line per feature and reason skipped."""
    counts: dict[tuple[str, str], int] = {}
    for report in skipped:
        path = report.nodeid.split("::")[0]
        feature = FEATURES.get(pathlib.PurePosixPath(path).name)
        if feature is None:
            continue
        longrepr = report.longrepr  # (file, line, "Skipped: reason") for a skip
        reason = longrepr[2] if isinstance(longrepr, (tuple, list)) else str(longrepr)
        key = (f"{feature} ({path})", str(reason).removeprefix("Skipped: "))
        counts[key] = counts.get(key, 0) + 1
    return [
        f"NOT RUN: {what}: {reason} ({n} test{'s' * (n != 1)})"
        for (what, reason), n in counts.items()
    ]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    lines = not_run(terminalreporter.stats.get("skipped", []))
    if lines:
        terminalreporter.write_sep("=", "features not run", yellow=True)
    for line in lines:
        terminalreporter.write_line(line, yellow=True, bold=True)
