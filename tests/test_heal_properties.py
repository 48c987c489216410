"""A world that heals in place keeps its model under random calls, spawns and kills.

tests/programs/heal_model.py runs a hypothesis state machine inside worker0
of a world started with `restart="worker"` (a world of its own: this
process already belongs to the session's world). It SIGKILLs worker1..3,
their replacements too at times, while calls and handle calls are made or
in flight, and holds every outcome to the model: the right value and
attempt, or `WorkerUnreachableError` / `ObjectLostError` where a death
allows it; no call runs twice; live objects keep their counts; nothing
hangs, the world's end included.
"""

from __future__ import annotations

import re

import pytest

from conftest import PROGRAMS, run_program

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(240)]


def test_random_calls_spawns_and_kills_keep_the_model_of_a_healing_world() -> None:
    result = run_program("python", str(PROGRAMS / "heal_model.py"), "10", "12", timeout=200)
    out = result.stdout
    assert result.returncode == 0, _why(out, result.stderr)
    assert "every example kept the model" in out, out[-3000:]
    steps = re.search(r"heal model steps: (\{.*\})", out)
    assert steps is not None, out[-3000:]
    # Not vacuous: processes died and calls met the replacement under way.
    assert "'processes killed'" in steps.group(1), steps.group(1)


def _why(out: str, err: str) -> str:
    """A failed run's account: what worker0 found (its head: the error; its tail: the
    last steps), and the supervisor's stderr less TensorPipe's warnings of each death."""
    start = out.find("heal model: worker0 found")
    found = out[start:] if start >= 0 else ""
    said = [line for line in err.splitlines() if "tensorpipe_agent.cpp" not in line]
    return f"{found[:5000]}\n...\n{out[-3000:]}\n{chr(10).join(said)[-4000:]}"
