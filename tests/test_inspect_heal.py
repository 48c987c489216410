"""asyncrpc-dump, asyncrpc-top and the trace in a world that heals: a replacement by name.

A replacement answers at its torch id, not at its rank (`_membership`); the
commands read each name's id and attempt from the world's store, and show
"attempt N" for a worker replaced N times. Its calls are named by its name
on the workers it calls, and the trace names its process with its attempt.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import pytest
from test_inspect import short_tmp

from asyncrpc._inspect import _dump, _top

from conftest import PROGRAMS, run_program


def _lines(out: str, tag: str) -> Any:
    for line in out.splitlines():
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1 :])
    raise AssertionError(f"no {tag} line in:\n{out}")


def _by_name(workers: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {worker["name"]: worker for worker in workers}


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_dump_top_and_trace_name_a_replacement_with_its_attempt(tmp_path: pathlib.Path) -> None:
    env = {"XDG_RUNTIME_DIR": str(tmp_path), "TMPDIR": str(short_tmp(tmp_path))}
    trace = tmp_path / "trace.json"
    done = run_program("python", str(PROGRAMS / "inspect_heal.py"), str(trace), env=env)
    out = done.stdout
    assert done.returncode == 0 and "WORLD ENDED" in out, out + done.stderr[-3000:]

    dumped = _by_name(_lines(out, "DUMP_JSON")["workers"])
    assert "error" not in dumped["worker1"], dumped["worker1"]
    assert (dumped["worker1"]["attempt"], dumped["worker0"]["attempt"]) == (1, 0)
    assert [c["call"] for c in dumped["worker1"]["in_flight"]] == ["hold()"], dumped
    # The replacement's torch id (3) is not its rank: worker0 still names its caller.
    assert [(c["call"], c["caller"]) for c in dumped["worker0"]["threads"]] == [
        ("hold()", "worker1")
    ], dumped["worker0"]

    text = _lines(out, "DUMP_TEXT")
    assert "worker1 (rank 1, attempt 1, pid " in text, text
    assert "worker0 (rank 0, pid " in text and "runs hold() for worker1" in text, text
    assert "no answer" not in text, text

    top = _by_name(_lines(out, "TOP_JSON")["workers"])
    assert "error" not in top["worker1"] and top["worker1"]["attempt"] == 1, top
    assert top["worker1"]["pid"] != dumped["worker0"]["pid"]

    events = json.loads(trace.read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert sorted(processes.values()) == ["worker0", "worker1 (attempt 1)", "worker2"], processes
    runs = [e for e in events if e.get("cat") == "asyncrpc" and e.get("ph") == "X"]
    assert {(processes[e["pid"]], e["name"]) for e in runs} == {
        ("worker0", "-> worker1: attempt()"),
        ("worker1 (attempt 1)", "attempt() <- worker0"),
    }, runs


def test_a_worker_first_under_its_name_is_shown_as_before() -> None:
    first = {"name": "worker2", "rank": 2, "attempt": 0, "pid": os.getpid(), "host": "h",
             "error": "no answer within 1.0 s"}  # fmt: skip
    replaced = {**first, "name": "worker1", "rank": 1, "attempt": 2}
    static = {key: value for key, value in first.items() if key != "attempt"}  # an older worker
    names = [row[0] for row in _top.rows([first, replaced, static])]
    assert names == ["worker2", "worker1 (attempt 2)", "worker2"]
    lines = [_dump._render_worker(worker)[0] for worker in (first, replaced, static)]
    assert lines[0] == lines[2] == f"worker2 (rank 2, pid {os.getpid()}): no answer within 1.0 s"
    assert lines[1].startswith("worker1 (rank 1, attempt 2, pid "), lines
