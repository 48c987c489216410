"""`asyncrpc-launch --restart worker`: a dead worker is replaced in place under the launcher.

One node here (two hosts: tests/test_launch_hosts.py). The launcher is its
own supervisor (`_launch._nodes`): it replaces the worker that died, the
others keep their processes and state, and past --max-restarts it ends
naming the worker. torchrun, whose agent restarts the whole world, and
`--restart world` refuse `run(restart="worker")`.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import select
import signal
import subprocess
import sys
import time

import pytest
from test_launch import worker_lines

import asyncrpc
from asyncrpc._core import _healing, _rendezvous
from asyncrpc._core._errors import JOIN_REFUSED_EXIT, describe_exit
from asyncrpc._core._membership import Joining
from asyncrpc._launch import _cli, _signals

from conftest import PROGRAMS, bin_path, free_port, run_program, start_program, until
from processes import assert_gone, descendants, kill_tree

HEAL = str(PROGRAMS / "launch_heal.py")
WORKER_RESTART = ("--restart", "worker")


def _launcher_line(err: str) -> str:
    """The launcher's own last line (torch's workers may log after it as they stop)."""
    lines = [line for line in err.splitlines() if line.startswith("asyncrpc-launch:")]
    assert lines, err[-3000:]
    return lines[-1]


def _launch(*argv: str, timeout: float = 90) -> tuple[int, str, str]:
    done = run_program(bin_path("asyncrpc-launch"), *argv, timeout=timeout)
    return done.returncode, done.stdout, done.stderr


def test_restart_worker_keeps_the_node_rank_and_places_the_store() -> None:
    args = _cli.build_args(
        ["--nproc-per-node", "3", "--max-restarts", "1", *WORKER_RESTART, "train.py", "--lr", "1"]
    )
    assert (args.restart, args.rdzv_endpoint, args.node_rank) == ("worker", "127.0.0.1:0", 0)
    argv = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.23.0.1"]
    args = _cli.build_args([*argv, "--max-restarts", "1", *WORKER_RESTART, "x.py"])
    assert (args.rdzv_endpoint, args.node_rank) == ("10.23.0.1:29500", 1)
    assert _cli.build_args(["x.py"]).restart == "world"


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--restart", "process"], "argument --restart: invalid choice: 'process'"),
        (["--restart", "worker", "--nnodes", "1:2"], "needs a fixed number of machines"),
        (["--restart", "worker", "--rdzv-backend", "c10d"], "got 'c10d'"),
        (["--restart", "worker", "--run-path"], "--run-path is an option of torch's agent"),
        (["--restart", "worker", "--tee", "3"], "got --tee '3'"),
        (["--restart", "worker", "--max-restarts", "-1"], "--max-restarts must be 0 or more"),
        (["--restart", "worker"], "pass --max-restarts K with K >= 1"),
    ],
)
def test_a_bad_restart_argument_is_one_line_and_exit_2(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as ended:
        _cli.build_args([*argv, "x.py"])
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncrpc-launch: error: ") and err.count("\n") == 1, err
    assert named in err and "--help" in err


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_a_killed_worker_is_replaced_in_place_and_the_launcher_exits_0() -> None:
    argv = ["--nproc-per-node", "4", "--max-restarts", "2", *WORKER_RESTART]
    code, out, err = _launch(*argv, HEAL, "--victim", "worker2")
    assert code == 0, err[-3000:]
    results = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(results) == 1, out
    assert json.loads(results[0].removeprefix("RESULT ")) == {
        "replaced": [["worker2", 2, 1]],
        "victim_attempt": 1,
        "victim_pid_changed": True,
        "survivors_same": True,
        "counter": 6,
        "tensor": 6.0,
    }
    assert "WORKER worker2 attempt=1 pid=" in out, out
    healed = [line for line in err.splitlines() if "replacing it in place" in line]
    assert len(healed) == 1, err[-3000:]
    assert healed[0].startswith("asyncrpc: worker 'worker2' (rank 2, node "), healed
    assert healed[0].endswith("was killed by SIGKILL; replacing it in place (restart 1 of 2)")


@pytest.mark.timeout(60)
def test_a_worker_whose_launcher_ended_before_it_started_ends_too() -> None:
    # A launcher killed while its worker still imports torch: the kernel's parent-death
    # signal was never asked for, and the worker's parent is no longer the launcher it
    # names. It ends as it imports asyncrpc, saying why; a process with a live launcher
    # that is not its parent (one a worker starts) goes on.
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process has now
    code = "import time, asyncrpc; time.sleep(20); print('still here')"
    env = {**os.environ, "ASYNCRPC_LAUNCHER_PID": str(gone.pid)}
    start = time.monotonic()
    orphan = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=50)  # fmt: skip
    assert orphan.returncode == -signal.SIGTERM, (orphan.returncode, orphan.stderr[-2000:])
    assert "launcher (pid" in orphan.stderr and "ended before it started" in orphan.stderr
    assert time.monotonic() - start < 15 and "still here" not in orphan.stdout
    env["ASYNCRPC_LAUNCHER_PID"] = str(os.getppid())  # alive, not its parent
    code = "import asyncrpc; print('goes on')"
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=50)  # fmt: skip
    assert child.returncode == 0 and "goes on" in child.stdout, child.stderr[-2000:]


def test_a_signal_inside_a_held_section_stops_the_launcher_as_the_section_ends() -> None:
    # A worker is started and listed inside `held`: Stopped raised between the two would
    # leave a worker nobody stops (seen: a Ctrl-C as the launcher started its workers).
    with _signals.stop_on_signals() as signals:
        with pytest.raises(_signals.Stopped) as stopped:
            with signals.held():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)  # the handler runs here: held, not raised
                listed = True
        assert listed and stopped.value.number == signal.SIGTERM
        signals.take(signal.SIGINT, None)  # a later one is held while the launcher stops


@pytest.mark.timeout(60)
def test_a_store_that_does_not_listen_is_named_within_its_bound() -> None:
    port = free_port()
    start = time.monotonic()
    with pytest.raises(asyncrpc.StoreTimeoutError, match=f"127.0.0.1:{port} did not answer"):
        _rendezvous.client_store("127.0.0.1", port, 30.0, reach=1.0)
    assert time.monotonic() - start < 5  # its own bound, not torch's (about twice 30 s)
    # `--join` to a port where nothing runs takes a signal while it waits.
    argv = ["--join", f"127.0.0.1:{port}", "--nproc-per-node", "1", str(PROGRAMS / "idle.py")]
    launcher = start_program(bin_path("asyncrpc-launch"), *argv, env={})
    assert until(lambda: _catches(launcher.pid, signal.SIGTERM), seconds=60)  # started
    time.sleep(0.5)  # waiting for the store now
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=20)
    assert launcher.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "asyncrpc-launch: ended by SIGTERM" in err, err[-2000:]


def _catches(pid: int, number: int) -> bool:
    """Whether process `pid` has a handler for signal `number` now (/proc's SigCgt)."""
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt"))
    return bool(int(caught, 16) & (1 << (number - 1)))


def test_a_start_refused_by_a_member_is_exit_77_only_for_a_replacement() -> None:
    text = (
        "RuntimeError: ECONNREFUSED: connection refused (this error originated at "
        "tensorpipe/transport/uv/connection_impl.cc:132)"
    )
    replacement, first = Joining(5, "0", replacement=True), Joining(1, "0", replacement=False)
    assert _healing.start_failed_exit(replacement, text) == JOIN_REFUSED_EXIT == 77
    assert _healing.start_failed_exit(first, text) == 1  # a first start: the world starts again
    assert _healing.start_failed_exit(None, text) == 1
    assert _healing.start_failed_exit(replacement, "RuntimeError: boom") == 1
    assert "refused" in describe_exit(JOIN_REFUSED_EXIT)


@pytest.mark.subprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("launched", [False, True], ids=["embedded", "asyncrpc-launch"])
def test_a_replacement_a_member_refused_starts_again_uncounted_under_either_supervisor(
    launched: bool, tmp_path: pathlib.Path
) -> None:
    # One heal algorithm (`_launch/_replacing`) for both supervisors: a replacement
    # that ends as one whose join a member refused (exit code 77) is started again
    # 0.25 s later, neither a restart nor an attempt of its own, embedded and launched.
    program = str(PROGRAMS / "refused_join.py")
    if launched:
        argv = ["--nproc-per-node", "3", "--max-restarts", "2", *WORKER_RESTART]
        done = run_program(bin_path("asyncrpc-launch"), *argv, program, str(tmp_path),
                           timeout=90)  # fmt: skip
    else:
        done = run_program("python", program, str(tmp_path), timeout=90)
    assert done.returncode == 0, done.stderr[-5000:]
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == 1, done.stdout[-3000:]
    assert json.loads(results[0].removeprefix("RESULT ")) == {
        "attempt": 1,
        "new_pid": True,
        "refused": 2,
    }
    refused = "the replacement of worker 'worker2' (rank 2) could not join: another member "
    assert done.stderr.count(refused) == 2, done.stderr[-5000:]
    assert "replacing it in place (restart 1 of 2)" in done.stderr, done.stderr[-5000:]
    assert "restart 2 of 2" not in done.stderr, done.stderr[-5000:]


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_past_max_restarts_the_launcher_ends_naming_the_worker() -> None:
    launcher = start_program(
        bin_path("asyncrpc-launch"), "--nproc-per-node", "3", "--max-restarts", "1",
        *WORKER_RESTART, HEAL, "--victim", "worker2", "--kills", "2", env={},
    )  # fmt: skip
    try:
        tree: set[int] = set()
        while launcher.poll() is None:  # every process it ever started, to check none is left
            tree |= descendants(launcher.pid)
            time.sleep(0.05)
        _, err = launcher.communicate(timeout=60)
        assert_gone(tree, within=10)
    finally:
        kill_tree(launcher.pid)
    assert launcher.returncode == 1, err[-3000:]
    last = _launcher_line(err)
    assert last.startswith("asyncrpc-launch: worker 'worker2' (rank 2, node "), err[-3000:]
    assert last.endswith(
        "was killed by SIGKILL; the world replaced workers 1 times (--max-restarts 1), "
        "so this failure ends it"
    ), last
    assert "(restart 1 of 1)" in err and "Traceback" not in err, err[-3000:]


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_a_death_while_the_world_starts_ends_the_launcher_naming_it() -> None:
    # The others wait for it in the world's start: it cannot be replaced in place.
    argv = ["--nproc-per-node", "3", "--max-restarts", "2", *WORKER_RESTART]
    start = time.monotonic()
    code, out, err = _launch(*argv, HEAL, "--exit-at-start", "1")
    assert code == 1 and time.monotonic() - start < 30, err[-3000:]
    last = _launcher_line(err)  # the names are known once a worker has joined
    who = r"(worker 'worker1' \(rank 1, |the worker of rank 1 \()"
    assert re.match(rf"asyncrpc-launch: {who}node ", last), err[-3000:]
    assert last.endswith(
        "exited with code 3 while the world was starting (before every worker was ready), "
        "which cannot replace it; start the run again"
    ), last
    assert "WORKER" not in out and "Traceback" not in err, (out, err[-3000:])


@pytest.mark.subprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["ctrl-c", "SIGTERM", "SIGKILL"]
)
def test_a_signal_to_the_launcher_stops_every_worker(sig: signal.Signals) -> None:
    argv = ["--nproc-per-node", "3", "--max-restarts", "1", *WORKER_RESTART, HEAL, "--hold", "60"]
    launcher = start_program(bin_path("asyncrpc-launch"), *argv, env={})
    try:
        workers = _worker_pids(launcher, 3)
        tree = descendants(launcher.pid)
        assert workers <= tree, (workers, tree)
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=30)
        assert_gone(tree, within=10)
    finally:
        kill_tree(launcher.pid)
    if sig == signal.SIGKILL:  # nothing to say: the workers end with it all the same
        assert launcher.returncode == -sig
        return
    what = "interrupted (Ctrl-C)" if sig == signal.SIGINT else "ended by SIGTERM"
    assert launcher.returncode == 128 + sig, err[-3000:]
    assert err.splitlines()[-1:] == [f"asyncrpc-launch: {what}; the workers were stopped"], err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]


def _worker_pids(launcher: subprocess.Popen[str], count: int) -> set[int]:
    """The pids of the first `count` WORKER lines the launcher's workers print (within 60 s).

    Read with a deadline; other lines (a library's own) are passed over.
    """
    assert launcher.stdout is not None
    fd, pending, lines = launcher.stdout.fileno(), b"", []
    deadline = time.monotonic() + 60
    while (left := deadline - time.monotonic()) > 0 and select.select([fd], [], [], left)[0]:
        chunk = os.read(fd, 65536)
        assert chunk, f"the launcher ended before {count} workers started: {lines}"
        *done, pending = (pending + chunk).split(b"\n")
        lines += [line.decode() for line in done]
        pids = {int(line.split("pid=")[1]) for line in worker_lines("\n".join(lines))}
        if len(pids) >= count:
            return pids
    raise AssertionError(f"{count} workers did not start within 60 s: {lines}")


@pytest.mark.subprocess
def test_torchrun_refuses_restart_worker_naming_asyncrpc_launch() -> None:
    done = run_program("python", "-m", "torch.distributed.run", "--nproc-per-node", "2", HEAL)
    assert done.returncode != 0
    assert "asyncrpc.run(restart='worker') was called under torchrun" in done.stderr
    assert "launch with asyncrpc-launch --max-restarts K --restart worker" in done.stderr


@pytest.mark.subprocess
def test_restart_world_refuses_run_restart_worker() -> None:
    code, _, err = _launch("--nproc-per-node", "2", "--restart", "world", HEAL)
    assert code != 0
    assert (
        "asyncrpc.run(restart='worker') disagrees with its launcher, started with "
        "asyncrpc-launch --restart world" in err
    ), err[-3000:]
