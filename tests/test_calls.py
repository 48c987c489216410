"""Checked calls between real workers, and the errors for calls made wrongly."""

import pytest
import torch

import asyncrpc

from conftest import until


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


def test_bad_target_type_is_torchs_value_error(world: asyncrpc.Context) -> None:
    with pytest.raises(ValueError, match=r"worker name, rank or WorkerInfo, got float 1\.5"):
        asyncrpc.rpc_sync(1.5, whoami)  # type: ignore[arg-type]
    with pytest.raises(ValueError):  # torch raises ValueError there too
        torch.distributed.rpc.rpc_sync(1.5, whoami)  # type: ignore[arg-type]


async def undecorated(x: int) -> int:
    return x


@asyncrpc.async_execution
async def decorated(x: int) -> int:
    return x


def test_an_undecorated_async_function_runs_as_async_execution(world: asyncrpc.Context) -> None:
    assert asyncrpc.rpc_sync("worker1", undecorated, args=(1,)) == 1
    assert asyncrpc.rpc_async("worker1", undecorated, args=(2,)).wait() == 2
    assert asyncrpc.remote("worker1", undecorated, args=(3,)).to_here() == 3
    assert asyncrpc.rpc_sync("worker1", decorated, args=(1,)) == 1
    with pytest.raises(RuntimeError, match="coroutine"):  # torch's own call cannot
        torch.distributed.rpc.rpc_sync("worker1", undecorated, args=(1,))


def fail_after(seconds: float) -> None:
    import time

    time.sleep(seconds)
    raise KeyError("shard-7")


def _unwaited_records(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "nobody waited" in r.getMessage()]


def test_a_failure_nobody_waited_for_is_logged_once(
    world: asyncrpc.Context, caplog: pytest.LogCaptureFixture
) -> None:
    import gc

    caplog.set_level("WARNING", logger="asyncrpc")
    asyncrpc.log_unwaited_failures()
    try:
        # Dropped before it fails (fire and forget) ...
        asyncrpc.rpc_async("worker1", fail_after, args=(0.2,))
        assert until(lambda: _unwaited_records(caplog)), "the dropped call's failure not logged"
        # ... and dropped after it failed.
        fut = asyncrpc.rpc_async("worker2", fail_after, args=(0,))
        assert until(fut.done), "a call that fails at once not done within 10 s"
        del fut
        gc.collect()
        assert until(lambda: len(_unwaited_records(caplog)) >= 2), _unwaited_records(caplog)
        # Read, so handled: not logged; and a success is never logged.
        read = asyncrpc.rpc_async("worker1", fail_after, args=(0,))
        with pytest.raises(KeyError):
            read.wait()
        del read
        asyncrpc.rpc_async("worker1", whoami).wait()
        gc.collect()
    finally:
        asyncrpc.log_unwaited_failures(False)
    records = _unwaited_records(caplog)
    assert len(records) == 2, records
    for record in records:
        assert "fail_after()" in record and "KeyError" in record and "shard-7" in record
    assert "on worker1" in records[0] and "on worker2" in records[1]


def test_unwaited_failures_are_not_logged_by_default(
    world: asyncrpc.Context, caplog: pytest.LogCaptureFixture
) -> None:
    import gc

    caplog.set_level("WARNING", logger="asyncrpc")
    fut = asyncrpc.rpc_async("worker1", fail_after, args=(0,))
    assert until(fut.done), "a call that fails at once not done within 10 s"
    del fut
    gc.collect()
    assert _unwaited_records(caplog) == []
    with pytest.raises(TypeError, match="True or False"):
        asyncrpc.log_unwaited_failures("yes")  # type: ignore[arg-type]
