"""Members that come and go as actors do: deaths as departures, removals, callbacks, results.

tests/programs/departures.py runs each world (embedded, real worker processes
over loopback) and prints what `asyncrpc.run` returned there as JSON; these
tests read it, and its stderr, where each world's lines follow `=== <world>`.
"""

from __future__ import annotations

import json
import os
import re
import time
from multiprocessing.connection import Connection
from typing import Any

import pytest

from asyncrpc._core import _torch
from asyncrpc._launch import _quiet

from conftest import PROGRAMS, run_program

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(150)]

# A warning of torch 2.13's TensorPipe agent, as a survivor logged it when worker2 died.
EOF_LINE = (
    "[W1129 09:41:30.047559835 tensorpipe_agent.cpp:723] RPC agent for worker1 encountered "
    "error when reading incoming request from worker2:2: EOF: end of file (this error "
    "originated at tensorpipe/transport/uv/connection_impl.cc:132)"
)


@pytest.fixture(scope="module")
def ran() -> tuple[dict[str, Any], dict[str, str]]:
    done = run_program("python", str(PROGRAMS / "departures.py"), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    worlds: dict[str, Any] = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            worlds.setdefault(record["check"], []).append(record)
    return worlds, _by_run(done.stderr)


def _by_run(stderr: str) -> dict[str, str]:
    """Each world's stderr; a world run twice gets `name` and `name 2`."""
    found: dict[str, str] = {}
    for part in stderr.split("=== ")[1:]:
        world, _, text = part.partition("\n")
        key = world if world not in found else f"{world} 2"
        found[key] = text
    return found


def test_a_worker_that_dies_leaves_an_elastic_world_which_goes_on(ran: Any) -> None:
    worlds, stderr = ran
    (deaths,) = worlds["deaths"]
    out = deaths["returned"]  # what worker0's main returned: the world went on to its end
    for victim, case in (("worker3", out["added"]), ("worker1", out["first"])):
        # The call running on it failed, named; every member heard Left with the signal.
        assert case["call"][0] == "WorkerUnreachableError" and victim in case["call"][1]
        assert case["left"] == ["Left", victim, "it ended unasked (was killed by SIGKILL)"]
        assert case["left_after_s"] < 5.0, case  # about 0.015 s here: the supervisor sees it
        said = f"asyncrpc: worker {victim!r} (rank {victim[-1]}) was killed by SIGKILL; it left"
        assert said in stderr["deaths"], stderr["deaths"]
    assert out["members"] == ["worker0", "worker2"]
    assert [e[:2] for e in out["peer_heard"]] == [
        ["Joined", "worker3"],
        ["Left", "worker3"],
        ["Left", "worker1"],
    ]
    assert out["call_after"][0] == "WorkerLeftError" and "SIGKILL" in out["call_after"][1]
    assert out["grown"] == ["worker2", "worker4"]


def test_rank_0_dying_still_ends_the_world(ran: Any) -> None:
    worlds, _ = ran
    (rank0,) = worlds["rank0"]
    kind, text, notes = rank0["raised"]
    assert (
        kind == "WorkerFailedError" and text == "worker 'worker0' (rank 0) was killed by SIGKILL"
    )
    assert any("rank 0 runs the program's driver" in note for note in notes), notes


def test_cancelled_calls_do_not_hold_a_removal_and_one_can_wait_later(ran: Any) -> None:
    worlds, _ = ran
    for run in worlds["removals"]:
        out = run["returned"]
        assert out["cancelled"] == [True, True]
        # Each removed worker still ran a call of 30 s that its caller had cancelled.
        assert out["blocking_s"] < 5.0, out
        assert out["returned_s"] < 1.0 and out["returned_s"] < out["waited_s"], out
        # worker4 ran a call of 0.5 s not cancelled: it finished, then the Future completed,
        # after this worker's callbacks had heard both workers leave.
        assert out["finished"] == "slept"
        assert 0.1 < out["waited_s"] < 5.0, out
        assert out["names"] == ["worker3", "worker4"]
        assert out["seen"] == [["worker3", "worker4"], True, True]
        assert out["members"] == ["worker0", "worker1"]
        assert out["again"][0] == "UnknownWorkerError"


def test_a_raising_callback_is_logged_once_per_kind_and_the_others_run(ran: Any) -> None:
    worlds, stderr = ran
    (callbacks,) = worlds["callbacks"]
    out = callbacks["returned"]
    heard = [e[:2] for e in out["heard"]]  # the workers of one add (or removal): any order
    assert sorted(heard[:2]) == [["Joined", "worker2"], ["Joined", "worker3"]], heard
    assert sorted(heard[2:]) == [["Left", "worker2"], ["Left", "worker3"]], heard
    logged = out["logged"]
    assert [(level, logger) for level, logger, _, _ in logged] == [("ERROR", "asyncrpc")] * 2
    joined, left = (message for _, _, message, _ in logged)
    for message, event in ((joined, "Joined(name='worker"), (left, "Left(name='worker")):
        # The script's module: __main__ in a worker forked from the caller's own copy,
        # __mp_main__ where a forkserver imported the script (`_forkserver`).
        named = re.search(r"on_members callback __(mp_)?main__\.bad_callback, given (.*)", message)
        assert named is not None and named.group(2).startswith(event), message
        assert "on worker 'worker0', raised ValueError: cannot take" in message
    assert all(traced for _, _, _, traced in logged)  # the traceback rides on the record
    assert "Traceback" not in stderr["callbacks"], stderr["callbacks"]  # no bare print


def test_run_returns_what_rank_0s_main_returned(ran: Any) -> None:
    worlds, _ = ran
    assert worlds["fixed"][0]["returned"] == "worker0 of 2"
    assert worlds["deaths"][0]["returned"]["grown"] == ["worker2", "worker4"]
    kind, text, _ = worlds["unpicklable"][0]["raised"]
    assert kind == "TypeError" and "worker0's main returned a _thread.lock" in text
    assert "cannot be pickled" in text


def test_expected_departures_print_nothing_from_torch(ran: Any) -> None:
    _, stderr = ran
    # (Not the fixed world: its workers write to stderr themselves, as torch has them.)
    for world in ("deaths", "removals", "callbacks", "rank0", "unpicklable"):
        assert "tensorpipe_agent.cpp" not in stderr[world], (world, stderr[world][-3000:])
        assert "RRef" not in stderr[world], (world, stderr[world][-3000:])
    # With ASYNCRPC_TORCH_WARNINGS=1 the same removals print torch's own warnings and its
    # report of the RRef held to the end, in the forms the supervisor recognises (this
    # torch's texts).
    lines = stderr["removals 2"].splitlines()
    kept = [line for line in lines if "tensorpipe_agent" in line]
    assert kept and all(_torch.pipe_warning(line) is not None for line in kept), lines
    leaks = [line for line in lines if "RRef" in line]
    assert len(leaks) >= 2 and all(_torch.rref_leak(line) for line in leaks), lines


def _quiet_world(gone: set[str]) -> tuple[_quiet.Quiet, int, Connection]:
    reader, writer = os.pipe()
    output = Connection(writer, readable=False)
    return _quiet.Quiet(output, lambda name: name in gone), reader, output


def _read_all(fd: int) -> str:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks).decode()


@pytest.mark.timeout(20)
def test_the_quiet_pipe_drops_only_warnings_about_processes_gone() -> None:
    gone = {"worker2:2"}
    quiet, reader, output = _quiet_world(gone)
    about_live = EOF_LINE.replace("worker2:2", "worker3")
    started = time.monotonic()
    os.write(quiet.writer.fileno(), f"before\n{EOF_LINE}\n{about_live}\nafter\n".encode())
    os.write(quiet.writer.fileno(), b"[W progress 10%")  # no newline yet: held
    time.sleep(_quiet.HOLD_S + 0.5)
    quiet.close()
    output.close()
    text = _read_all(reader)
    # The warning about a process gone is dropped; one about a live one is written once its
    # hold ends (after what came later); other lines as they come; an unfinished one at the end.
    assert text == f"before\nafter\n{about_live}\n[W progress 10%", text
    assert time.monotonic() - started < _quiet.HOLD_S + 4.0
    assert _torch.pipe_warning(EOF_LINE) == ("worker1", "worker2:2")
    assert _torch.pipe_warning("before") is None
