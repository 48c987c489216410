"""Worlds that grow and shrink while they run (`asyncrpc.run(..., elastic=True)`), embedded.

tests/programs/elastic_world.py drives each world from worker0 and prints
JSON lines that these tests read; real worker processes join and leave.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from typing import Any

import pytest

import asyncrpc

from conftest import PROGRAMS, ROOT, run_program

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(120)]

ELASTIC = str(PROGRAMS / "elastic_world.py")


def _run(scenario: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    with tempfile.TemporaryDirectory() as shared:
        done = run_program("python", ELASTIC, scenario, timeout=90, env={"ELASTIC_DIR": shared})
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done, {r["check"]: r for r in records}


@pytest.fixture(scope="module")
def basic() -> dict[str, Any]:
    return _run("basic")[1]


def test_added_workers_join_with_fresh_ranks_and_every_member_sees_them(
    basic: dict[str, Any],
) -> None:
    add = basic["add"]
    assert add["before"] == ["worker0", "worker1"]
    assert add["added"] == ["worker2", "worker3"]
    everyone = ["worker0", "worker1", "worker2", "worker3"]
    assert add["after"] == everyone and add["peer"] == everyone
    # Their context: the world as each started; they call and are called (relays too).
    assert [c[:4] for c in add["contexts"]] == [
        ["worker2", 2, 4, everyone],
        ["worker3", 3, 4, everyone],
    ]
    assert add["relay"][0] == "worker3"


def test_every_kind_of_traffic_reaches_added_workers(basic: dict[str, Any]) -> None:
    traffic = basic["traffic"]
    assert traffic["step"] == 2 and traffic["rref"] == [1.0, 1.0, 1.0]
    assert traffic["stream"] == [0, 1, 2, 3, 4]
    assert traffic["batch"] == [[2.0, 2.0], [2.0, 2.0]]


def test_a_removed_worker_fails_named_on_every_verb(basic: dict[str, Any]) -> None:
    remove = basic["remove"]
    assert remove["after"] == remove["peer"] == ["worker0", "worker1", "worker3"]
    assert remove["call"][0] == "WorkerLeftError" and "removed by worker0" in remove["call"][1]
    assert remove["nested"][0] == "WorkerLeftError"  # raised on worker1, as it relayed
    assert remove["handle"][0] == "ObjectLostError" and "left the world" in remove["handle"][1]
    assert remove["rref"][0] == "ObjectLostError"
    assert remove["again"][0] == "UnknownWorkerError"


def test_a_removed_worker_finishes_the_calls_and_streams_it_runs(basic: dict[str, Any]) -> None:
    busy = basic["busy"]
    assert busy["result"] == "done" and busy["after"] == ["worker0", "worker1"]
    assert busy["streamed"] == list(range(10))  # every item, though it was removed mid-way


def test_edges_a_short_timeout_the_supervisors_fds_and_a_worker_that_stays() -> None:
    started = time.monotonic()
    done, records = _run("edges")
    # The removed worker never returned from main: the world ended without it, well
    # before its removal's timeout (rpc_timeout, 60 s) would have stopped it.
    assert time.monotonic() - started < 40, done.stderr[-3000:]
    edges = records["edges"]
    assert edges["tiny"][0] == "JoinTimeoutError", edges["tiny"]
    assert edges["after_tiny"] == ["worker0", "worker1"]  # nothing stayed behind
    assert edges["grown"] <= 2, edges  # 12 adds and removes: nothing kept per worker
    assert edges["members"] == ["worker0", "worker1"]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_roles_bounds_and_bad_input(basic: dict[str, Any]) -> None:
    role = basic["role"]
    assert role["added"] == ["actor0"]
    # A rank never used before (2 and 3 left), the role's numbering, ctx.role.
    assert role["context"][:3] == ["actor0", 4, 5] and role["context"][4] == "actor"
    assert role["full"][0] == "WorldFullError" and "max_world_size=4" in role["full"][1]
    assert role["bad"][0] == "ValueError"
    assert role["unknown"][0] == "UnknownWorkerError"


def test_every_member_hears_each_change_in_one_order(basic: dict[str, Any]) -> None:
    events = basic["events"]
    expected = [
        ["Joined", "worker2", 2],
        ["Joined", "worker3", 3],
        ["Left", "worker2", 2, "removed by worker0"],
        ["Left", "worker3", 3, "removed by worker0"],
        ["Joined", "actor0", 4],
        ["Left", "actor0", 4, "removed by actor0"],  # it removed itself
    ]
    # The two workers of one add_workers call join in either order.
    for seen in (events["mine"], events["peer"]):
        assert sorted(seen[:2]) == expected[:2] and seen[2:] == expected[2:], seen
    assert events["after"] == ["worker0", "worker1"]


def test_a_worker_that_fails_to_join_leaves_nothing_behind() -> None:
    failjoin = _run("failjoin")[1]["failjoin"]
    assert failjoin["error"][0] == "RendezvousError"
    assert "exited with code 5" in failjoin["error"][1]
    assert failjoin["after"] == ["worker0", "worker1"]
    assert failjoin["added"] == ["worker3"] and failjoin["answer"] == "worker3"


def test_a_worker_that_joins_too_late_is_stopped() -> None:
    timeout = _run("timeout")[1]["timeout"]
    assert timeout["error"][0] == "JoinTimeoutError"
    assert 2.0 <= timeout["took"] < 10.0
    assert timeout["after"] == ["worker0", "worker1"] and not timeout["alive"]


def test_a_worker_that_does_not_leave_is_stopped_at_the_timeout() -> None:
    stuck = _run("stuck")[1]["stuck"]
    assert 1.0 <= stuck["took"] < 10.0
    assert stuck["call"][0] == "WorkerLeftError"
    assert stuck["after"] == ["worker0", "worker1"]


def test_an_added_worker_that_dies_is_healed_in_place() -> None:
    records = _run("heal")[1]
    heal = records["heal"]
    assert heal["events"] == [
        ["Joined", "worker2", 2],
        ["Replaced", "worker2", 2, 1, "was killed by SIGKILL"],
    ]
    assert heal["answer"][:2] == ["worker2", 2]
    assert heal["after"] == ["worker0", "worker1", "worker2"]


def test_a_fixed_world_says_it_does_not_grow() -> None:
    fixed = _run("fixed")[1]["fixed"]
    assert fixed["members"] == ["worker0", "worker1"]
    for verb in ("add", "remove", "watch"):
        assert fixed[verb][0] == "NotElasticError" and "elastic=True" in fixed[verb][1]
        assert "asyncrpc-launch --elastic" in fixed[verb][1]


def _main(ctx: asyncrpc.Context) -> None:
    """Never runs: every call below fails before a worker starts."""


@pytest.mark.parametrize(
    ("options", "error", "says"),
    [
        ({"elastic": "yes"}, TypeError, "elastic must be True or False"),
        ({"elastic": True, "max_world_size": 0}, ValueError, "positive int"),
        ({"max_world_size": 4}, ValueError, "pass elastic=True"),
        ({"elastic": True, "max_restarts": 2}, ValueError, "restart='worker'"),
        ({"elastic": True, "max_world_size": 1}, ValueError, "above max_world_size=1"),
    ],
)
def test_bad_options_fail_before_anything_starts(
    options: dict[str, Any], error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match=says):
        asyncrpc.run(_main, world_size=2, **options)


OUTSIDE = """
import asyncrpc
calls = [asyncrpc.members, asyncrpc.add_workers, asyncrpc.stopping,
         lambda: asyncrpc.remove_workers("worker1"), lambda: asyncrpc.on_members(print)]
for call in calls:
    try:
        call()
    except asyncrpc.NotInitializedError as error:
        print("named:", str(error)[:60])
"""


def test_the_verbs_outside_a_world_say_so() -> None:
    # A process of its own: this one may belong to the session's world.
    done = run_program("python", "-c", OUTSIDE, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("named:") == 5, done.stdout


@pytest.mark.parametrize("launched", [False, True], ids=["embedded", "asyncrpc-launch"])
def test_the_example_grows_and_shrinks_its_pool_and_loses_no_task(launched: bool) -> None:
    example = str(ROOT / "examples" / "elastic.py")
    # Under the launcher each added actor is a new interpreter its launcher starts.
    launch = ("python", "-m", "asyncrpc._launch._cli", "--elastic", "--nproc-per-node", "2")
    command = (*launch, example) if launched else ("python", example)
    done = run_program(*command, timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "pool grew to 3 actors" in lines[0] and "pool grew to 5 actors" in lines[1]
    assert "pool shrank to 1 actor(s)" in lines[2]
    assert lines[3].startswith("24 tasks played, each once")


def test_random_adds_removes_kills_and_calls_keep_the_model() -> None:
    """tests/programs/elastic_model.py: a hypothesis state machine inside worker0."""
    done = run_program("python", str(PROGRAMS / "elastic_model.py"), "4", "10", timeout=110)
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-3000:]}"
    assert "every example kept the model" in done.stdout, done.stdout[-3000:]


def test_a_trace_open_while_members_change_marks_the_joins_and_leaves() -> None:
    traced = _run("traced")[1]["traced"]
    assert traced["workers"] == ["worker0", "worker1"]  # the members as it opened
    # worker1 left while it recorded: its recording left with it, and says so.
    assert traced["processes"] == ["worker0", "worker1 (left during the trace: not recorded)"]
    assert traced["marks"] == [
        ["worker0", "worker1 left (removed by worker0)"],
        ["worker0", "worker2 joined"],
    ]
    assert traced["again"] == ["worker0", "worker2"]  # a later trace: the members now


def test_a_dump_lists_the_members_now_with_joins_and_leaves() -> None:
    dump = _run("dump")[1]["dump"]
    assert dump["code"] == 0, dump["err"][-2000:]
    workers = {w["name"]: w for w in dump["dump"]["workers"]}
    assert sorted(workers) == ["worker0", "worker1", "worker3"]
    assert workers["worker3"]["rank"] == 3 and workers["worker3"]["joined_at"] > 0
    assert "joined_at" not in workers["worker0"]
    (left,) = dump["dump"]["left"]
    assert left["name"] == "worker2" and left["rank"] == 2 and left["why"] == "removed by worker0"
