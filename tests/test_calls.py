"""Checked calls between real workers, and the errors for calls made wrongly."""

import pytest
import torch

import asyncrpc

from conftest import PROGRAMS, run_program


def whoami() -> str:
    return asyncrpc.current_context().name


def test_rpc_sync_runs_on_the_named_worker(world: asyncrpc.Context) -> None:
    assert asyncrpc.rpc_sync("worker1", whoami) == "worker1"
    assert asyncrpc.rpc_sync(2, whoami) == "worker2"
    out = asyncrpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
    assert torch.equal(out, torch.tensor([2.0, 2.0]))


def test_rpc_async_returns_a_future(world: asyncrpc.Context) -> None:
    futs = [asyncrpc.rpc_async(n, whoami) for n in world.names]
    assert [f.wait() for f in futs] == list(world.names)


def test_remote_keeps_the_result_on_the_owner(world: asyncrpc.Context) -> None:
    rref = asyncrpc.remote("worker2", torch.ones, args=((3,),))
    assert rref.owner().name == "worker2"
    assert torch.equal(rref.to_here(), torch.ones(3))


def test_kwargs_and_list_args_are_passed(world: asyncrpc.Context) -> None:
    out = asyncrpc.rpc_sync("worker1", torch.full, args=[(2,)], kwargs={"fill_value": 7.0})
    assert torch.equal(out, torch.full((2,), 7.0))


def test_unknown_worker_name_suggests_the_closest(world: asyncrpc.Context) -> None:
    with pytest.raises(asyncrpc.UnknownWorkerError, match=r"'wroker1'.*did you mean 'worker1'"):
        asyncrpc.rpc_sync("wroker1", whoami)
    with pytest.raises(asyncrpc.UnknownWorkerError, match="ranks run from 0 to 2"):
        asyncrpc.rpc_async(7, whoami)
    assert asyncrpc.rpc_sync("worker1", whoami) == "worker1"  # still works afterwards


def test_called_instead_of_passed_says_how_to_pass(world: asyncrpc.Context) -> None:
    x = torch.ones(2)
    with pytest.raises(TypeError, match=r"got a Tensor where a callable.*args=\(x,\)"):
        asyncrpc.rpc_async("worker1", torch.neg(x))


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"args": 5}, TypeError, r"args must be a tuple, got int 5"),
        ({"kwargs": [1]}, TypeError, "kwargs must be a dict"),
        ({"timeout": -2}, ValueError, r"finite number of seconds >= 0.*-2"),
        ({"timeout": float("inf")}, ValueError, "inf"),
        ({"timeout": "5"}, TypeError, "timeout must be seconds"),
    ],
)
def test_bad_arguments_fail_before_sending(
    world: asyncrpc.Context, kwargs: dict[str, object], error: type, pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        asyncrpc.rpc_sync("worker1", whoami, **kwargs)  # type: ignore[arg-type]


def test_bad_target_type(world: asyncrpc.Context) -> None:
    with pytest.raises(TypeError, match="worker name, rank or WorkerInfo"):
        asyncrpc.rpc_sync(1.5, whoami)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("case", "pattern"),
    [
        ("before_init", "asyncrpc.rpc_sync was called but no RPC agent runs in this process"),
        ("after_shutdown", "NotInitializedError: asyncrpc.rpc_async was called after"),
    ],
)
def test_calls_outside_a_world(case: str, pattern: str) -> None:
    done = run_program("python", str(PROGRAMS / "misuse.py"), case, timeout=60)
    assert done.returncode == 3, done.stderr
    assert pattern in done.stdout


async def undecorated(x: int) -> int:
    return x


@asyncrpc.async_execution
async def decorated(x: int) -> int:
    return x


def test_an_undecorated_async_function_says_to_decorate_it(world: asyncrpc.Context) -> None:
    with pytest.raises(asyncrpc.SerializationError, match=r"@asyncrpc\.async_execution"):
        asyncrpc.rpc_sync("worker1", undecorated, args=(1,))
    with pytest.raises(asyncrpc.SerializationError, match=r"@asyncrpc\.async_execution"):
        asyncrpc.rpc_async("worker1", undecorated, args=(1,)).wait()
    assert asyncrpc.rpc_sync("worker1", decorated, args=(1,)) == 1
