"""Where a world's state lives (`_core/_runtime.py`): one runtime per world, ended as one.

Each module keeps what a world needs in a part of the world's runtime; the
world's end closes every part and drops the runtime. Checked in a process
of its own (this one already runs the session's world) by
tests/programs/two_worlds.py, and here for the runtime itself.
"""

from __future__ import annotations

import threading

import pytest

from asyncrpc._core import _runtime

from conftest import PROGRAMS, run_program


class _Part:
    made = 0

    def __init__(self) -> None:
        type(self).made += 1
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_a_part_is_made_once_per_runtime_even_when_threads_race() -> None:
    runtime = _runtime.Runtime()
    found: list[_Part] = []
    barrier = threading.Barrier(8)

    def take() -> None:
        barrier.wait()
        found.append(runtime.make(_Part))

    threads = [threading.Thread(target=take, name=f"take-{i}") for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert len(found) == 8 and all(part is found[0] for part in found)


def test_closing_a_runtime_closes_every_part_once_newest_first() -> None:
    order: list[str] = []

    class First:
        def close(self) -> None:
            order.append("first")

    class Second:
        def close(self) -> None:
            order.append("second")

    class Plain:  # no close: kept as is
        pass

    runtime = _runtime.Runtime()
    runtime.make(First)
    runtime.make(Plain)
    runtime.make(Second)
    runtime.close()
    runtime.close()
    assert order == ["second", "first"]


def test_ending_a_runtime_that_is_not_current_only_closes_it() -> None:
    other = _runtime.Runtime()
    part = other.make(_Part)
    current = _runtime.SLOT.runtime
    _runtime.end(other)
    assert part.closed == 1 and _runtime.SLOT.runtime is current


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_two_worlds_in_a_row_share_nothing_and_leave_nothing_behind() -> None:
    result = run_program("python", str(PROGRAMS / "two_worlds.py"), timeout=100)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    for line in (
        "no module-level name refers to the ended world",
        "nothing of the first world is alive",
        "the second world made its own",
        "two worlds OK",
    ):
        assert line in result.stdout, result.stdout


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_a_world_started_right_after_torch_ended_an_adopted_one_makes_its_own() -> None:
    result = run_program("python", str(PROGRAMS / "adopted_then_init.py"), timeout=100)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "adopted then init OK" in result.stdout, result.stdout
