"""Survivors never pay for a dead peer: a learner's mixed traffic while actors die 100 times.

tests/programs/heal_load.py runs a world that heals: two survivors, four
threads each, call two victims with every verb asyncrpc has (`rpc_async`,
`remote` + `to_here`, handles and their streams, `stream`, `Batch`, nested
`async def` relays, handles lent to the other survivor, a victim calling a
survivor's object back) while worker0 SIGKILLs a victim 100 times, every
fourth time with no call in flight. What the docs promise is held here: the
survivors stay in their first process, every failure is a
`WorkerUnreachableError` (`ObjectLostError` included), their calls to each
other all arrive, and their descriptors, sockets (none left in CLOSE-WAIT),
threads and memory stay flat.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from conftest import PROGRAMS, run_program

pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.timeout(480),  # about 60 s alone; several times that on a loaded machine
    pytest.mark.xdist_group("heal_load"),  # one run of the module's program, not one per process
]

KILLS = 100
RSS_SLACK_KB = 8 * 1024  # the second half of the heals: what the heap may still settle by


def _summary(out: str) -> dict[str, Any]:
    found = re.search(r"^heal load: (\{.*\})$", out, re.MULTILINE)
    assert found is not None, out[-4000:]
    summary: dict[str, Any] = json.loads(found.group(1))
    return summary


def test_a_learner_survives_its_actors_killed_100_times() -> None:
    # One test over one run of the program (about a minute): separate tests over a
    # shared fixture ran it once per xdist worker that picked one up.
    result = run_program("python", str(PROGRAMS / "heal_load.py"), str(KILLS), "4", "1",
                         timeout=460)  # fmt: skip
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    load = _summary(result.stdout)
    _every_kill_was_healed_and_every_survivor_kept_its_first_process(load, result.stderr)
    _every_failure_the_deaths_caused_is_named(load)
    _calls_between_survivors_all_arrive(load)
    _descriptors_sockets_and_threads_stay_flat(load)
    _memory_settles(load)


def _every_kill_was_healed_and_every_survivor_kept_its_first_process(
    load: dict[str, Any], stderr: str
) -> None:
    # The program stops at the first round a survivor was replaced in: `replaced` names it,
    # and the supervisor's lines say how it ended (an exit code, a signal).
    said = [line for line in stderr.splitlines() if line.startswith("asyncrpc:")]
    assert load["kills"] == KILLS and len(load["rounds"]) == KILLS, (
        load["replaced"],
        load["rounds"][-1:],
        [line for line in said if "worker1" in line or "worker2" in line][-10:] or said[-10:],
    )
    assert load["replaced"] == ["worker3", "worker4"]  # the victims only
    for name, first in load["first"].items():
        seen = {(r[name]["pid"], r[name]["attempt"]) for r in load["rounds"]}
        assert seen == {(first["pid"], 0)}, (name, seen)
        assert "died" not in load["tallies"][name], load["tallies"][name]


def _every_failure_the_deaths_caused_is_named(load: dict[str, Any]) -> None:
    for name, tally in load["tallies"].items():
        assert tally["bare"] == [], (name, tally["bare"])
        # Not vacuous: the deaths were met, on objects too, and every kind of call ran.
        assert tally["named"].get("WorkerUnreachableError", 0) > KILLS, tally["named"]
        assert tally["named"].get("ObjectLostError", 0) > 0, tally["named"]
        assert len(tally["ok"]) == 13 and min(tally["ok"].values()) > 0, tally["ok"]


def _calls_between_survivors_all_arrive(load: dict[str, Any]) -> None:
    made = {name: tally["peer_calls"] for name, tally in load["tallies"].items()}
    assert made["worker1"] == load["served"]["worker2"] > 0
    assert made["worker2"] == load["served"]["worker1"] > 0


def _descriptors_sockets_and_threads_stay_flat(load: dict[str, Any]) -> None:
    for name in load["first"]:
        rounds = [r[name] for r in load["rounds"]]
        assert max(r["close_wait"] for r in rounds) == 0, [r["close_wait"] for r in rounds]
        for key, slack in (("fds", 4), ("sockets", 4), ("threads", 2)):
            values = [r[key] for r in rounds]
            # After the first heals (the replacements' pipes are opened): no growth.
            assert max(values[10:]) - min(values[:10]) <= slack, (name, key, values)


def _memory_settles(load: dict[str, Any]) -> None:
    for name in load["first"]:
        rss = [r[name]["rss_kb"] for r in load["rounds"]]
        half = len(rss) // 2
        assert max(rss[half:]) - rss[half] <= RSS_SLACK_KB, (name, rss[::10])


def test_the_docs_learner_loop_runs_unchanged_while_its_actors_die() -> None:
    # docs/launching.md's learner block, as written, on worker0; its actors are killed
    # 20 times while four threads of the mixed traffic above call them too.
    result = run_program("python", str(PROGRAMS / "heal_learner.py"), "20", "1000",
                         timeout=200)  # fmt: skip
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    assert "FAILED" not in result.stdout, result.stdout[-3000:]
    found = re.search(r"^heal learner: (\{.*\})$", result.stdout, re.MULTILINE)
    assert found is not None, result.stdout[-3000:]
    learner = json.loads(found.group(1))
    assert learner["kills"] == 20, learner
    assert learner["last_step"] == learner["steps"] - 1, learner  # the loop ran to its end
    assert learner["steps"] < learner["learned"] < 3 * learner["steps"], learner
    assert learner["traffic"]["bare"] == [], learner["traffic"]["bare"]
    assert learner["traffic"]["named"], learner["traffic"]  # the deaths were met
