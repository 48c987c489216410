"""asyncrpc-launch: torchrun's arguments with asyncrpc's rendezvous defaults."""

import pytest

from asyncrpc._launch import _cli as _launch

from conftest import PROGRAMS, bin_path, run_program


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
            "veth1",
            "x.py",
        ]
    )
    assert args.rdzv_endpoint == "10.23.0.1:29555"
    assert args.rdzv_conf == "rank=1"
    assert args.interface == "veth1"


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
