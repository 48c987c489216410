"""Embedded worlds fork their workers from a warm interpreter (multiprocessing's forkserver)."""

from __future__ import annotations

import re

import pytest

import asyncrpc

from conftest import ROOT, run_program

pytestmark = pytest.mark.xdist_group("warm_start")  # one run of the three worlds

LINE = re.compile(
    r"(?P<world>\w+) (?P<name>worker\d) parent=(?P<parent>\d+) warm=(?P<warm>\w+) "
    r"intra=(?P<intra>\d+) interop=(?P<interop>\d+) env=(?P<env>\w+)"
)


PROGRAM = ROOT / "tests" / "programs" / "warm_start.py"


@pytest.fixture(scope="module")
def three_worlds(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """One run of the program (three worlds), its stdout moved to a file after the first.

    What the caller's stdout got, and what the file got: both tests read this run.
    """
    moved = tmp_path_factory.mktemp("warm_start") / "moved.txt"
    done = run_program("python", str(PROGRAM), str(moved), timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, moved.read_text()


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_workers_fork_from_one_warm_interpreter_with_working_threads(
    three_worlds: tuple[str, str],
) -> None:
    output = "".join(three_worlds)  # every line, wherever the caller's stdout was then
    rows = [m.groupdict() for m in map(LINE.match, output.splitlines()) if m]
    caller = re.search(r"caller=(\d+)", output)
    assert caller is not None and len(rows) == 6, output
    worlds = {w: [r for r in rows if r["world"] == w] for w in ("first", "second", "third")}
    assert all(len(found) == 2 for found in worlds.values()), output
    warm = worlds["first"] + worlds["second"]
    # One warm interpreter, not the caller, is the parent of every forked worker,
    # across worlds; it had imported torch and the script before any of them.
    assert len({r["parent"] for r in warm}) == 1, warm
    assert warm[0]["parent"] != caller.group(1)
    assert all(r["warm"] == "True" for r in warm), warm
    # A spawned worker is the caller's child and imports torch itself.
    assert {r["parent"] for r in worlds["third"]} == {caller.group(1)}
    assert all(r["warm"] == "False" for r in worlds["third"]), worlds["third"]
    # Threads work in forked workers; each world sees the caller's environment of its time.
    assert all(r["intra"] == "2" and int(r["interop"]) >= 1 for r in rows), rows
    assert all(r["env"] == r["world"] for r in rows), rows


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_forked_workers_write_where_the_caller_writes_now(three_worlds: tuple[str, str]) -> None:
    """The caller moves its stdout to a file between worlds, after the warm
    interpreter started: the next worlds' workers write into that file, and
    share its offset with the caller (nothing overwritten), as with spawn."""
    stdout, moved = three_worlds
    before = [m["world"] for m in map(LINE.match, stdout.splitlines()) if m]
    after = moved.splitlines()
    assert before == ["first", "first"], stdout
    assert sorted(m["world"] for m in map(LINE.match, after) if m) == [
        "second", "second", "third", "third"
    ], after  # fmt: skip
    assert after[-1].startswith("caller="), after


def test_start_method_is_checked() -> None:
    expected = "start_method must be 'forkserver' or 'spawn', got 'fork'"
    with pytest.raises(ValueError, match=expected):
        asyncrpc.run(print, world_size=1, start_method="fork")


HERE = re.compile(
    r"(?P<world>\w+) worker\d parent=(?P<parent>\d+) kind=(?P<kind>\w+) mark=(?P<mark>\w+) "
    r"frozen=(?P<frozen>\w+) threads=(?P<threads>\d+)"
)
WARM = re.compile(r"(?P<world>\w+) warm=(?P<warm>\d+) alive=(?P<alive>\w+) caller=(?P<caller>\d+)")


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_a_caller_without_threads_is_the_warm_interpreter_itself() -> None:
    """No torch op before `run`: the workers fork from a fork of the caller, one per
    world, gone once `run` returns; each still imports the script (the caller's
    guard does not run there). After a parallel op in the caller (OpenMP's pool
    started), a fork of it would hang at its first parallel op: that world forks
    from multiprocessing's forkserver. Every worker's heap was frozen at its fork,
    and runs parallel ops."""
    done = run_program("python", str(ROOT / "tests" / "programs" / "warm_here.py"), timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [m.groupdict() for m in map(HERE.match, done.stdout.splitlines()) if m]
    warm = {m["world"]: m.groupdict() for m in map(WARM.match, done.stdout.splitlines()) if m}
    assert len(rows) == 6 and len(warm) == 3, done.stdout
    assert all(r["frozen"] == "True" and r["threads"] == "2" for r in rows), rows
    assert {r["mark"] for r in rows} == {"unset"}, rows
    for world in ("first", "second", "third"):
        found = [r for r in rows if r["world"] == world]
        assert {r["parent"] for r in found} == {warm[world]["warm"]}, (world, rows)
        assert warm[world]["warm"] != warm[world]["caller"]
        kind = "forkserver" if world == "third" else "copy"
        assert {r["kind"] for r in found} == {kind}, (world, rows)
    assert warm["first"]["warm"] != warm["second"]["warm"]  # one fork per world
    assert warm["first"]["alive"] == warm["second"]["alive"] == "False", warm


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_a_script_with_its_stdout_closed_runs_a_world() -> None:
    """`python script.py >&-` leaves Python no stdout (None): nothing flushes it."""
    import subprocess
    import sys

    program = ROOT / "tests" / "programs" / "closed_stdout.py"
    done = subprocess.run(
        ["bash", "-c", f'"{sys.executable}" "{program}" >&-'],
        cwd=ROOT, stderr=subprocess.PIPE, text=True, timeout=110,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "result=42" in done.stderr, done.stderr[-3000:]
