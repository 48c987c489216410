"""asyncrpc-launch: torchrun's arguments with asyncrpc's rendezvous defaults.

And what it must not change or hide: a user's OMP_NUM_THREADS, the program's
root cause; and what it must not leave: workers after it ends, tracebacks of
its own on Ctrl-C, a crash on a bad argument.
"""

import os
import signal
import time
from typing import Any

import pytest

from asyncrpc._launch import _cli as _launch

from conftest import PROGRAMS, ROOT, bin_path, run_program, start_program
from processes import assert_gone, descendants, kill_tree


def test_single_node_uses_a_loopback_store_on_a_free_port() -> None:
    args = _launch.build_args(["--nproc-per-node", "3", "train.py", "--lr", "0.1"])
    assert args.rdzv_backend == "asyncrpc"
    assert args.rdzv_endpoint == "127.0.0.1:0"
    assert args.rdzv_conf == "rank=0"
    assert args.training_script == "train.py"
    assert args.training_script_args == ["--lr", "0.1"]


def test_standalone_also_stays_on_loopback() -> None:
    args = _launch.build_args(["--standalone", "--nproc-per-node", "2", "x.py"])
    assert (args.rdzv_backend, args.rdzv_endpoint) == ("asyncrpc", "127.0.0.1:0")
    assert not args.standalone


def test_several_nodes_bind_the_master_address() -> None:
    args = _launch.build_args(
        [
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "10.23.0.1",
            "--master-port",
            "29555",
            "--nproc-per-node",
            "2",
            "--interface",
            "lo",
            "x.py",
        ]
    )
    assert args.rdzv_endpoint == "10.23.0.1:29555"
    assert args.rdzv_conf == "rank=1"
    assert args.interface == "lo"


def test_several_nodes_accept_a_rendezvous_endpoint(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "10.23.0.1:29500", "x.py"]
    args = _launch.build_args(argv)
    assert (args.rdzv_backend, args.rdzv_endpoint) == ("asyncrpc", "10.23.0.1:29500")
    assert args.rdzv_conf == "rank=1"
    assert args.node_rank == 0  # carried by rdzv_conf, so torchrun does not warn it is ignored
    assert capsys.readouterr().err == ""


def test_several_nodes_on_a_loopback_master_warn(capsys: pytest.CaptureFixture[str]) -> None:
    _launch.build_args(["--nnodes", "2", "--node-rank", "0", "x.py"])
    err = capsys.readouterr().err
    assert "rendezvous host '127.0.0.1' is a loopback address" in err
    assert "--rdzv-endpoint 10.0.0.1:29500" in err


def test_another_rendezvous_backend_passes_through() -> None:
    args = _launch.build_args(["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "x.py"])
    assert (args.rdzv_backend, args.rdzv_endpoint) == ("c10d", "h:1")


def test_handler_needs_a_node_rank() -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    params = RendezvousParameters("asyncrpc", "127.0.0.1:0", "run", 1, 1)
    with pytest.raises(ValueError, match="needs the node rank"):
        _launch.rendezvous_handler()(params)


def test_help_explains_the_launcher() -> None:
    done = run_program(bin_path("asyncrpc-launch"), "--help", timeout=60)
    assert done.returncode == 0
    assert "asyncrpc-launch" in done.stdout
    assert "127.0.0.1 only" in done.stdout
    assert "--interface" in done.stdout
    assert "--elastic" in done.stdout and "--join HOST:PORT" in done.stdout


@pytest.mark.subprocess
def test_max_restarts_forms_the_world_again_after_a_kill() -> None:
    program = str(PROGRAMS / "supervised.py")
    done = run_program(
        bin_path("asyncrpc-launch"),
        "--nproc-per-node",
        "3",
        "--max-restarts",
        "1",
        program,
        "--kill",
        "worker1",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert 'RESULT {"attempt": 1, "ranks": [0, 1, 2]}' in done.stdout
    # The launcher names the worker it saw die, not only its local rank.
    assert "asyncrpc: worker 'worker1' (rank 1, node " in done.stderr
    assert "was killed by SIGKILL" in done.stderr


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--nproc-per-node", "0"], "--nproc-per-node must be a whole number above 0"),
        (["--nproc-per-node", "-2"], "got '-2'"),
        (["--nproc-per-node", "three"], "got 'three'"),
        (["--nnodes", "0"], "--nnodes must be a whole number of machines above 0"),
        (["--nnodes", "3:2"], "got '3:2'"),
        (["--nnodes", "two"], "got 'two'"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank must be 0..1 for --nnodes 2, got 2"),
        (["--node-rank", "-1"], "--node-rank must be 0..0"),
        (["--node-rank", "one"], "invalid int value: 'one'"),
        (["--master-port", "65536"], "--master-port must be a port, 0..65535, got 65536"),
        (["--max-restarts", "-1"], "--max-restarts must be 0 or more, got -1"),
        (["--monitor-interval", "0"], "--monitor-interval must be a number of seconds above 0"),
        (["--interface", "no-such-if0"], "got 'no-such-if0'"),
        (["--rdzv-endpoint", "127.0.0.1:http"], "--rdzv-endpoint must be HOST:PORT"),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_2(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as ended:
        _launch.build_args([*argv, "x.py"])
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncrpc-launch: error: ") and err.count("\n") == 1, err
    assert named in err and "--help" in err


def test_torchruns_named_worker_counts_are_admitted() -> None:
    import torch

    for value in ("auto", "cpu", "1", "4"):
        assert _launch.build_args(["--nproc-per-node", value, "x.py"]).nproc_per_node == value
    assert _launch.local_workers("cpu") == os.cpu_count()
    if not torch.cuda.is_available():  # "gpu" names the devices there are: none here
        with pytest.raises(ValueError, match=r"got 'gpu' \(Cuda is not available"):
            _launch.local_workers("gpu")


@pytest.mark.subprocess
def test_a_bad_argument_from_the_command_line_starts_nothing() -> None:
    done = run_program(bin_path("asyncrpc-launch"), "--nproc-per-node", "0", "x.py", timeout=60)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "asyncrpc-launch: error: --nproc-per-node must be a whole number above 0, 'auto' or "
        "'cpu' (one worker per CPU), or 'gpu' or 'xpu' (one per device) on a machine that "
        "has them, got '0'; `asyncrpc-launch --help` lists every option"
    ]


@pytest.mark.subprocess
@pytest.mark.parametrize("restart", ["world", "worker"])
def test_a_script_that_is_not_a_file_starts_nothing(restart: str) -> None:
    argv = ["--nproc-per-node", "2", "--max-restarts", "2", "--restart", restart, "no_such.py"]
    done = run_program(bin_path("asyncrpc-launch"), *argv, timeout=60)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"asyncrpc-launch: error: the script 'no_such.py' is not a file (looked for from "
        f"{ROOT}); pass the path of a Python script, or -m MODULE; `asyncrpc-launch --help` "
        f"lists every option"
    ]


def _not_the_default(workers: int) -> str:
    """An OMP_NUM_THREADS that differs from asyncrpc's default, cores // workers."""
    return str(max(1, len(os.sched_getaffinity(0)) // workers) + 1)


def worker_lines(text: str) -> list[str]:
    """The `WORKER ...` lines in `text`, also where workers sharing a pipe wrote them into one.

    A print's text and its newline can be two writes: another worker's line may come between.
    """
    return [f"WORKER {part.partition(chr(10))[0]}".rstrip() for part in text.split("WORKER ")[1:]]


def _launch_and_wait(argv: list[str], env: dict[str, str], count: int) -> tuple[Any, list[str]]:
    """Start asyncrpc-launch; return it once `count` workers printed their WORKER line."""
    launcher = start_program(bin_path("asyncrpc-launch"), *argv, env=env)
    assert launcher.stdout is not None
    lines: list[str] = []
    while len(lines) < count:
        line = launcher.stdout.readline()
        assert line, f"the world ended before its workers started: {launcher.stderr.read()}"
        lines += worker_lines(line)
    return launcher, lines


@pytest.mark.subprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("sig", "hold"),
    [(signal.SIGINT, False), (signal.SIGKILL, True)],
    ids=["ctrl-c", "SIGKILL-a-worker-holds-the-GIL"],
)
def test_the_launcher_ending_by_a_signal_ends_its_workers(sig: int, hold: bool) -> None:
    threads = _not_the_default(2)  # a user's OMP_NUM_THREADS is kept
    argv = ["--nproc-per-node", "2", str(PROGRAMS / "launch_signals.py")]
    launcher, lines = _launch_and_wait(
        argv + (["--hold-gil"] if hold else []), {"OMP_NUM_THREADS": threads}, 2
    )
    try:
        assert all(line.split()[3] == f"threads={threads}" for line in lines), lines
        workers = {int(line.split()[2]) for line in lines}
        tree = descendants(launcher.pid)
        assert workers <= tree, (workers, tree)
        time.sleep(1.0)  # the holding workers are inside their C call
        os.kill(launcher.pid, sig)
        _, err = launcher.communicate(timeout=60)
        assert_gone(tree, within=10)
    finally:
        kill_tree(launcher.pid)
    if sig == signal.SIGINT:
        assert launcher.returncode == 130, err[-3000:]
        assert err.splitlines()[-1:] == [
            "asyncrpc-launch: interrupted (Ctrl-C); the workers were stopped"
        ], err[-3000:]
        for noise in ("Traceback", "SignalException", "KeyboardInterrupt", "death signal"):
            assert noise not in err, err[-3000:]


@pytest.mark.subprocess
def test_the_root_cause_is_the_worker_that_raised() -> None:
    argv = ["--nproc-per-node", "3", str(PROGRAMS / "launch_signals.py"), "--raise-rank", "1"]
    done = run_program(bin_path("asyncrpc-launch"), *argv)
    assert done.returncode == 1, done.stderr[-3000:]
    others, _, root = done.stderr.partition("Root Cause (first observed failure):")
    assert "rank      : 1 (local_rank: 1)" in root, done.stderr[-3000:]
    assert "ExampleFailure: worker1 could not load its shard" in root, done.stderr[-3000:]
    assert 'launch_signals.py", line' in root  # its traceback
    assert "rank      : 1 " not in others.rpartition("Failures:")[2]
    assert "torch/distributed/run.py" not in done.stderr  # no traceback of the launcher's own


@pytest.mark.subprocess
@pytest.mark.parametrize("launcher", ["embedded", "torchrun"])
def test_a_users_omp_num_threads_is_kept(launcher: str) -> None:
    program = [str(PROGRAMS / "launch_signals.py"), "--exit"]
    if launcher == "embedded":
        argv = ["python", *program, "--world", "2"]
    else:
        argv = [bin_path("torchrun"), "--nproc-per-node", "2", *program]
    threads = _not_the_default(2)
    done = run_program(*argv, env={"OMP_NUM_THREADS": threads})
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [line.split()[3] for line in worker_lines(done.stdout)]
    assert seen == [f"threads={threads}"] * 2, done.stdout
