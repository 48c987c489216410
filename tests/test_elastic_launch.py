"""Elastic worlds under `asyncrpc-launch --elastic`: workers added as new interpreters.

The two-host case (a node that joins with --join, one preempted by SIGTERM)
is in test_launch_hosts.py, on network namespaces.
"""

from __future__ import annotations

import json
import socket

import pytest
import torch.distributed as dist

from asyncrpc._launch import _cli as _launch

from conftest import PROGRAMS, run_program

pytestmark = pytest.mark.subprocess

LAUNCH = ("python", "-m", "asyncrpc._launch._cli")


def _result(stdout: str) -> dict[str, object]:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, stdout
    found: dict[str, object] = json.loads(lines[0].removeprefix("RESULT "))
    return found


def test_an_elastic_launch_adds_and_removes_workers_in_new_interpreters() -> None:
    proc = run_program(
        *LAUNCH, "--elastic", "--nproc-per-node", "2",
        str(PROGRAMS / "elastic_launch.py"), "grow", timeout=110,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = _result(proc.stdout)
    assert result["added"] == ["worker2", "worker3"]
    who = result["who"]
    assert isinstance(who, dict)
    # Ranks never used before; each knows the world as it started; started by node 0.
    assert [who[n][:4] for n in ("worker2", "worker3")] == [
        ["worker2", 2, 4, "0"],
        ["worker3", 3, 4, "0"],
    ]
    assert len({who[n][4] for n in who}) == 2  # two processes of their own
    assert result["handle"] == 5 and result["stream"] == [0, 1, 2]
    assert result["running"] == "finished"  # removed while it ran: its call delivered
    after = result["after"]
    assert isinstance(after, list)
    assert after[0] == "WorkerLeftError" and "removed by worker0" in after[1]
    assert result["members"] == ["worker0", "worker1", "worker2"]
    full = result["full"]
    assert isinstance(full, list)
    assert full[0] == "ValueError" and "node=7" in full[1] and "[0]" in full[1]
    events = result["events"]
    assert isinstance(events, list)
    assert sorted(e[1] for e in events if e[0] == "Joined") == ["worker2", "worker3", "worker4"]
    assert ["Left", "worker3", "removed by worker0"] in events
    killed = result["killed"]
    assert isinstance(killed, list) and killed[1] == "worker4"
    assert "ended unasked" in killed[2] and "SIGKILL" in killed[2], killed
    after_kill = result["after_kill"]
    assert isinstance(after_kill, list) and after_kill[0] == "WorkerLeftError", after_kill
    assert result["members_after_kill"] == ["worker0", "worker1", "worker2"]
    # A first worker other than rank 0 that dies leaves too (no --max-restarts).
    first = result["first_killed"]
    assert isinstance(first, list) and first[:2] == ["Left", "worker1"], first
    assert "ended unasked" in first[2] and "SIGKILL" in first[2], first
    assert result["members_after_first"] == ["worker0", "worker2"]
    assert "worker 'worker1' (rank 1, node" in proc.stderr and "it left the world" in proc.stderr
    # Under a launcher each worker's run returns what its own main returned (worker3 was
    # removed: its main returned; worker1 and worker4 were killed).
    ran = sorted(line[len("RAN the result of ") :] for line in proc.stdout.splitlines()
                 if line.startswith("RAN "))  # fmt: skip
    assert ran == ["worker0", "worker2", "worker3"], proc.stdout[-2000:]


def test_join_refuses_a_world_launched_without_elastic() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    proc = run_program(
        *LAUNCH, "--join", f"127.0.0.1:{store.port}", "--nproc-per-node", "1",
        str(PROGRAMS / "elastic_launch.py"), "grow", timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "was not launched with --elastic" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--max-world-size", "8"], "--max-world-size bounds an elastic world"),
        (["--elastic", "--max-world-size", "0"], "as a count of workers >= 1, got 0"),
        (["--join", "10.0.0.1:29500", "--nnodes", "2"], "--join gives this node its number"),
    ],
)
def test_launcher_arguments_of_elastic_worlds_are_checked(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        _launch.build_args([*argv, "--nproc-per-node", "2", "x.py"])
    assert exit_.value.code == 2
    assert said in capsys.readouterr().err


def test_elastic_implies_the_launchers_own_supervision() -> None:
    args = _launch.build_args(["--elastic", "--nproc-per-node", "2", "x.py"])
    assert args.restart == "worker" and args.max_restarts == 0
    assert args.rdzv_endpoint == "127.0.0.1:0"  # one node: loopback, a free port
    joined = _launch.build_args(["--join", "10.0.0.1:29500", "--nproc-per-node", "2", "x.py"])
    assert joined.elastic and joined.rdzv_endpoint == "10.0.0.1:29500"
    assert socket.gethostname()  # the launcher names its node by it in Left reasons
