"""Worlds that heal in place (`asyncrpc.run(..., restart="worker")`), embedded.

Real worker processes die (signals, exits, raising mains) and are replaced
under their names; tests/programs/heal_world.py drives each world and prints
JSON lines that these tests read.
"""

from __future__ import annotations

import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytest

import asyncrpc

from conftest import PROGRAMS, ROOT, run_program, start_program
from processes import assert_gone, descendants, kill_tree, stacks

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(120)]

HEAL = str(PROGRAMS / "heal_world.py")
QUICK_S = 1.0  # a call that fails "at once" fails within this


def _run(
    *args: str, timeout: float = 90, orders: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], list[Any]]:
    """Run heal_world.py; `orders`: files for its workers to obey (see the program)."""
    with tempfile.TemporaryDirectory() as shared:
        for name, text in (orders or {}).items():
            (pathlib.Path(shared) / name).write_text(text)
        done = run_program("python", HEAL, *args, timeout=timeout, env={"HEAL_DIR": shared})
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done, records


def _one(records: list[Any], check: str) -> Any:
    found = [r for r in records if r["check"] == check]
    assert len(found) == 1, records
    return found[0]


def test_a_killed_worker_is_replaced_and_the_survivors_keep_their_state() -> None:
    done, records = _run("basic")
    assert done.returncode == 0, done.stderr[-3000:]
    basic = _one(records, "basic")
    # Replaced under its name and rank; ctx.attempt 1 there, 0 elsewhere; it answers.
    assert basic["attempts"] == {"worker0": 0, "worker1": 0, "worker2": 1}
    assert basic["rank"] == 2 and basic["replaced"]
    # The survivors' state, objects and tensors; their calls to each other.
    assert basic["counter"] == 6 and basic["state"] and basic["tensor"] == 15.0
    assert basic["ping"]
    # on_replaced on every survivor; an unregistered callback hears nothing.
    # With the reason the dead process ended, as the supervisor saw it.
    assert basic["events"]["worker0"] == [["worker2", 2, 1, "was killed by SIGKILL"]]
    assert basic["events"]["worker1"] == [["worker2", 2, 1, "was killed by SIGKILL"]]
    assert basic["events"]["unregistered"] == []
    assert "replacing it in place (restart 1 of 1)" in done.stderr


def test_calls_at_a_death_fail_named_and_never_run_twice() -> None:
    done, records = _run("basic")
    assert done.returncode == 0, done.stderr[-3000:]
    basic = _one(records, "basic")
    for how, died in basic["died"].items():  # in flight at the death
        assert died["error"] == "WorkerUnreachableError", (how, died)
        assert died["name"] == "worker2" and died["s"] < 5.0, (how, died)
    # Made while the replacement started: failed at once, named, and not sent.
    replacing = [e for e in basic["errors"] if "being replaced" in e["message"]]
    assert replacing, basic["errors"][:3]
    assert all(e["name"] == "worker2" for e in basic["errors"])
    assert "nothing was sent" in replacing[0]["message"]
    # Ran once (the call in flight), and once more only when the replacement answered.
    assert basic["runs"] == {"inflight": 1, "during": 1}
    # The object on the dead process is lost for every verb, during the heal and after.
    for stage in ("lost_during", "lost_after"):
        verbs = basic[stage]
        assert verbs is not None, stage
        assert set(verbs) == {"call", "call_async", "call_remote", "stream", "to_here",
                              "rpc_sync_proxy", "owner", "rref_to_here",
                              "failed_to_here"}  # fmt: skip
        for verb, lost in verbs.items():
            assert lost["error"] == "ObjectLostError", (stage, verb, lost)
            assert lost["name"] == "worker2" and lost["s"] < QUICK_S, (stage, verb, lost)
            assert "(attempt 1) starts without it" in lost["message"], (stage, verb, lost)


def test_every_way_to_die_is_healed_rank_0_too() -> None:
    done, records = _run("deaths")
    assert done.returncode == 0, done.stderr[-3000:]
    deaths = [r for r in records if r["check"] == "death"]
    kinds = ["SIGKILL", "SIGTERM", "exit3", "raise", "exit0", "after-return", "SIGKILL"]
    assert [d["kind"] for d in deaths] == kinds
    for number, death in enumerate(deaths[:-1], start=1):
        assert (death["name"], death["attempt"], death["rank"]) == ("worker1", number, 1)
    assert (deaths[-1]["name"], deaths[-1]["attempt"], deaths[-1]["rank"]) == ("worker0", 1, 0)
    assert all(d["new_pid"] and d["s"] < 10 for d in deaths), deaths
    for how in [
        "'worker1' (rank 1) was killed by SIGKILL; replacing it in place (restart 1 of 7)",
        "'worker1' (rank 1) was killed by SIGTERM; replacing it in place (restart 2 of 7)",
        "'worker1' (rank 1) exited with code 3 before",
        "'worker1' (rank 1) raised RuntimeError: heal test: worker1 raised at attempt 3; "
        "replacing it in place (restart 4 of 7)",
        "'worker1' (rank 1) exited with code 0 while its world still ran (a normal exit, "
        "such as os._exit(0), not a return from main); replacing it in place (restart 5 of 7)",
        "'worker0' (rank 0) was killed by SIGKILL; replacing it in place (restart 7 of 7)",
    ]:
        assert how in done.stderr, how
    assert 'heal_world.py", line' in done.stderr  # the raising main's own traceback
    assert done.stdout.splitlines()[-1] == "world ended"


def test_deaths_during_a_heal_are_healed_within_bounds() -> None:
    done, records = _run("faults")
    assert done.returncode == 0, done.stderr[-3000:]
    faults = {r["fault"]: r for r in records if r["check"] == "fault"}
    assert set(faults) == {"second-death-during-heal", "two-at-once", "import", "kill",
                           "raise", "call-kill"}  # fmt: skip
    assert all(f["s"] < 10 for f in faults.values()), faults
    for how in ("import", "kill", "raise", "call-kill"):  # the replacement died, then one joined
        assert faults[how]["consumed"], faults[how]
    assert faults["import"]["attempt"] == 4 and faults["kill"]["attempt"] == 4
    end = _one(records, "faults-end")
    assert end["counter"] == 6
    assert end["attempts"] == {"worker0": 0, "worker1": 0, "worker2": 6, "worker3": 6}
    assert "exited with code 5 before" in done.stderr  # died before it joined
    assert "RuntimeError: heal test: worker2 failed at attempt 5" in done.stderr


def test_no_main_calls_a_peer_that_does_not_know_the_members_yet() -> None:
    # worker0's first calls reach peers whose start is slowed by a thread hogging the
    # GIL; each call needs the peer to know the members (on_replaced there).
    done, records = _run("start")
    assert done.returncode == 0, done.stderr[-3000:]
    first = _one(records, "start")["first"]
    assert first.keys() == {"worker1", "worker2", "worker3"}
    assert all(outcome["error"] is None for outcome in first.values()), first


@pytest.mark.parametrize(
    "orders",
    [{"die-import-worker1": ""}, {"kill-import-worker2": "0.0"},
     {"kill-import-worker1": "0.02"}, {"kill-import-worker3": "0.04"}],
    ids=["exit-at-import", "kill-at-import", "kill-at-20ms", "kill-at-40ms"],
)  # fmt: skip
def test_a_death_while_the_world_starts_starts_it_again(orders: dict[str, str]) -> None:
    # The others wait for the dead worker in the world's start: no main has run, so
    # the whole world starts again, once, counted against max_restarts.
    start = time.monotonic()
    done, records = _run("formed", "0", "2", orders=orders)
    assert done.returncode == 0 and time.monotonic() - start < 30, done.stderr[-3000:]
    mains = sorted((r["name"], r["attempt"]) for r in records if r["check"] == "formed")
    assert mains == [(f"worker{rank}", 0) for rank in range(4)], (mains, done.stderr[-3000:])
    # A kill that lands after the world formed is healed in place instead.
    again = "while the world was starting, before any main ran: worker 'worker"
    healed = "replacing it in place (restart 1 of 2)"
    assert (again in done.stderr) != (healed in done.stderr), done.stderr[-3000:]
    assert again not in done.stderr or "starting the world again (restart 1 of 2)" in done.stderr


def test_deaths_while_the_world_starts_past_max_restarts_end_it_named() -> None:
    done, records = _run("formed", "0", "1", orders={"die-import-worker1": "2"})
    assert done.returncode != 0 and records == [], done.stdout
    assert "WorkerFailedError: worker 'worker1' (rank 1) exited with code 5" in done.stderr
    assert "starting the world again (restart 1 of 1)" in done.stderr
    assert (
        "the world was started again 1 times as it started (max_restarts=1); this failure, "
        "while it started, ended it"
    ) in done.stderr, done.stderr[-3000:]


def test_a_start_again_and_a_heal_share_max_restarts() -> None:
    orders = {"die-import-worker1": "", "die-worker2-0": "kill"}  # at import; in main
    done, _ = _run("formed", "0", "1", orders=orders)
    assert done.returncode != 0
    assert "starting the world again (restart 1 of 1)" in done.stderr, done.stderr[-3000:]
    assert "WorkerFailedError: worker 'worker2' (rank 2) was killed by SIGKILL" in done.stderr
    assert (
        "the world was started again 1 times as it started and replaced workers 0 times "
        "(max_restarts=1); this failure ended it"
    ) in done.stderr, done.stderr[-3000:]


def test_kills_in_a_row_leak_nothing_and_max_restarts_ends_the_world() -> None:
    with tempfile.TemporaryDirectory() as shared:
        env = {**os.environ, "HEAL_DIR": shared}
        parent = subprocess.Popen(
            [sys.executable, HEAL, "churn", "11", "10"], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            records, tree = _read_until(parent, "final-kill")
            start = time.monotonic()
            _, stderr = parent.communicate(timeout=30)
            ended_s = time.monotonic() - start
            assert_gone(tree, within=8)
        finally:
            kill_tree(parent.pid)
    assert parent.returncode != 0
    assert ended_s < 15, ended_s
    assert "WorkerFailedError: worker 'worker2' (rank 2) was killed by SIGKILL" in stderr
    assert "the world replaced workers 10 times (max_restarts=10); this failure ended it" in stderr
    assert [r["attempt"] for r in records if r["check"] == "churn"] == [
        1, 2, 3, 4, 5, 6, 1, 7, 2, 8
    ]  # fmt: skip
    use = _one(records, "usage")
    assert use["counter"] == 6 and use["events"] == 10 and use["events1"] == 10
    for name in ("worker0", "worker1"):
        before, after = use["before"][name], use["after"][name]
        assert after["rss_kb"] - before["rss_kb"] <= 20 * 1024, (name, before, after)
        assert after["threads"] <= before["threads"] + 2, (name, before, after)
        assert after["fds"] <= before["fds"] + 8, (name, before, after)


def _read_until(
    parent: subprocess.Popen[str], check: str, err: Any = None
) -> tuple[list[Any], set[int]]:
    """The program's records up to the first `check`; its process tree then.

    Bounded: a program that stops printing fails the test within 60 s with the
    stacks of every process of its tree and its stderr (`processes.stacks`).
    """
    assert parent.stdout is not None
    fd, pending, records = parent.stdout.fileno(), b"", []
    deadline = time.monotonic() + 60
    while (left := deadline - time.monotonic()) > 0 and select.select([fd], [], [], left)[0]:
        chunk = os.read(fd, 65536)
        assert chunk, f"the program ended early: {records}"
        *lines, pending = (pending + chunk).split(b"\n")
        records += [json.loads(line) for line in lines if line.startswith(b"{")]
        if any(r["check"] == check for r in records):
            return records, descendants(parent.pid)
    raise AssertionError(f"no {check!r} within 60 s: {records}\n{stacks(parent, err)}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_parent_while_workers_are_replaced_leaves_no_process(sig: int) -> None:
    with tempfile.TemporaryDirectory() as shared, tempfile.TemporaryFile("w+") as err:
        env = {**os.environ, "HEAL_DIR": shared}
        parent = subprocess.Popen(
            [sys.executable, HEAL, "churn", "1000", "1000"], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=err, text=True,
        )  # fmt: skip
        try:
            _, tree = _read_until(parent, "churn", err)
            tree |= _read_until(parent, "churn", err)[1]  # a second heal
            os.kill(parent.pid, sig)
            _ends_or_says_where(parent, err, 30)
            assert_gone(tree, within=8)
        finally:
            kill_tree(parent.pid)
    assert parent.returncode != 0


def _ends_or_says_where(parent: subprocess.Popen[str], err: Any, within: float) -> None:
    """Wait for `parent` to end; else fail with its stderr and every stack of its tree."""
    try:
        parent.wait(within)
    except subprocess.TimeoutExpired:
        where = stacks(parent, err)
        raise AssertionError(
            f"the program did not end {within} s after the signal:\n{where}"
        ) from None


def test_restart_world_restarts_everything_and_has_no_on_replaced() -> None:
    done, records = _run("world")
    assert done.returncode == 0, done.stderr[-3000:]
    started = sorted((r["name"], r["attempt"]) for r in records if r["check"] == "world")
    assert started == [("worker0", 0), ("worker0", 1), ("worker1", 0), ("worker1", 1)]
    refused = _one(records, "on_replaced")["outcome"]
    assert refused["error"] == "AsyncRPCError" and "restart='worker'" in refused["message"]
    assert "restarting the world (restart 1 of 1)" in done.stderr


def _never_runs(ctx: asyncrpc.Context) -> None:
    raise AssertionError("no world starts with a wrong restart")


@pytest.mark.timeout(10)
def test_an_unknown_restart_is_refused_before_any_process_starts() -> None:
    with pytest.raises(ValueError, match=r"restart must be .*got 'bogus'"):
        asyncrpc.run(_never_runs, world_size=2, restart="bogus")
    with pytest.raises(ValueError, match=r"max_restarts=0; pass max_restarts=K with K >= 1"):
        asyncrpc.run(_never_runs, world_size=2, restart="worker")


def test_a_replacement_still_importing_stops_with_its_supervisor(tmp_path: pathlib.Path) -> None:
    # It dies with the warm interpreter it was forked from from its first instruction,
    # not from when its own code starts, after the script's import.
    proc = start_program(sys.executable, str(PROGRAMS / "heal_slow_import.py"),
                         env={"SLOW_DIR": str(tmp_path)})  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("importing-*")) and time.monotonic() < deadline:
            time.sleep(0.05)
        importing = [int(p.name.split("-")[1]) for p in tmp_path.glob("importing-*")]
        assert importing, "the replacement never started importing"
        tree = descendants(proc.pid) | set(importing)
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        assert_gone(tree, within=8)
    finally:
        kill_tree(proc.pid)
        proc.communicate(timeout=30)
