"""A world's start that fails at any step puts back all it did (`_world._build`'s stack).

Each test runs tests/programs/rollback.py in a process of its own (this one
already runs the session's world): the named step runs, then raises; the
program checks that torch's agent, asyncrpc's threads, torch's patches, the
environment and the registration are as before, and that a world started
next answers a call and shuts down cleanly.
"""

from __future__ import annotations

import pytest

from conftest import PROGRAMS, run_program

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(120)]

STEPS = ("hooks", "agent", "threadstates", "watch", "join", "liveness", "freeze")
CHECKS = (
    "after the failed start: agent stopped",
    "after the failed start: no asyncrpc thread",
    "after the failed start: torch unpatched",
    "after the failed start: environment restored",
    "after the failed start: no registration, no world",
    "next world: call answered",
    "after the next world: no registration, no world",
)


def _run(*args: str) -> str:
    result = run_program("python", str(PROGRAMS / "rollback.py"), *args, timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize("step", STEPS)
def test_a_start_failing_at_a_step_puts_everything_back(step: str) -> None:
    out = _run(step)
    assert f"start failed at {step}: Injected" in out, out
    for check in CHECKS:
        assert check in out, out


@pytest.mark.parametrize("step", ["agent", "liveness"])
def test_a_start_interrupted_at_a_step_puts_everything_back(step: str) -> None:
    out = _run(step, "interrupt")
    assert f"start failed at {step}: KeyboardInterrupt" in out, out
    for check in CHECKS:
        assert check in out, out
