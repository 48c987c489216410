"""async_execution: Future-returning and `async def` functions, methods, RRef proxies, errors.

Every flow runs on worker1 and makes a nested call to worker2, called from
this process (worker0) with rpc_sync, rpc_async and remote.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.futures import Future

import asyncrpc
from asyncrpc import rpc_async

from conftest import PROGRAMS, ROOT, run_program

ONES = torch.ones(2)


# ---- the functions under test (module level: workers import them by name) ----------


@asyncrpc.async_execution
def add_chained(to: str, x: torch.Tensor, y: int, z: int) -> Future[torch.Tensor]:
    return rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)


@asyncrpc.async_execution
def add_with_future_ctor(to: str, x: torch.Tensor, y: int, z: int) -> Future[torch.Tensor]:
    out: Future[torch.Tensor] = Future()
    rpc_async(to, torch.add, args=(x, y)).then(lambda fut: out.set_result(fut.wait() + z))
    return out


@asyncrpc.async_execution
async def add_awaiting(to: str, x: torch.Tensor, y: int, z: int) -> torch.Tensor:
    total = await rpc_async(to, torch.add, args=(x, y))
    return total + z


@asyncrpc.async_execution
async def add_nested(to: str, x: torch.Tensor, y: int, z: int) -> torch.Tensor:
    # worker1 awaits an async function on worker2 that itself awaits worker2.
    inner = await rpc_async(to, add_awaiting, args=(to, x, 0, y))
    return inner + z


@asyncrpc.async_execution
async def add_fanned_out(to: str, x: torch.Tensor, n: int) -> torch.Tensor:
    futs = [rpc_async(to, torch.add, args=(x, i)) for i in range(n)]
    return sum([await f for f in futs], torch.zeros_like(x))


@asyncrpc.async_execution
async def add_after_then(to: str, x: torch.Tensor, y: int, z: int) -> torch.Tensor:
    return await rpc_async(to, torch.add, args=(x, y)).then(lambda f: f.wait() + z)


@asyncrpc.async_execution
async def add_local_future(x: torch.Tensor) -> torch.Tensor:
    ready: Future[torch.Tensor] = Future()
    ready.set_result(x)
    return (await ready) + 1


class Adder:
    def __init__(self, bias: int = 0) -> None:
        self.bias = bias

    @staticmethod
    @asyncrpc.async_execution
    def static_add(to: str, x: torch.Tensor, y: int, z: int) -> Future[torch.Tensor]:
        return rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)

    @asyncrpc.async_execution  # the order torch rejects: outside staticmethod
    @staticmethod
    def static_add_outer(to: str, x: torch.Tensor, y: int, z: int) -> Future[torch.Tensor]:
        return rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)

    @classmethod
    @asyncrpc.async_execution
    def class_add(cls, to: str, x: torch.Tensor, y: int, z: int) -> Future[torch.Tensor]:
        out: Future[torch.Tensor] = Future()
        rpc_async(to, torch.add, args=(x, y)).then(lambda fut: out.set_result(fut.wait() + z))
        return out

    @asyncrpc.async_execution
    @classmethod
    def class_add_outer(cls, to: str, x: torch.Tensor, y: int, z: int) -> Future[torch.Tensor]:
        return rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)

    @asyncrpc.async_execution
    def bound_add(self, to: str, x: torch.Tensor, y: int, z: int) -> Future[torch.Tensor]:
        return rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z + self.bias)

    @staticmethod
    @asyncrpc.async_execution
    async def static_await(to: str, x: torch.Tensor, y: int, z: int) -> torch.Tensor:
        return (await rpc_async(to, torch.add, args=(x, y))) + z

    @asyncrpc.async_execution
    @classmethod
    async def class_await(cls, to: str, x: torch.Tensor, y: int, z: int) -> torch.Tensor:
        return (await rpc_async(to, torch.add, args=(x, y))) + z

    @asyncrpc.async_execution
    async def bound_await(self, to: str, x: torch.Tensor, y: int, z: int) -> torch.Tensor:
        return (await rpc_async(to, torch.add, args=(x, y))) + z + self.bias


@torch.jit.script
def script_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + y


@asyncrpc.async_execution
@torch.jit.script
def script_async_add(to: str, x: torch.Tensor, y: torch.Tensor) -> Future[torch.Tensor]:
    return torch.distributed.rpc.rpc_async(to, script_add, (x, y))


@asyncrpc.async_execution
def returns_tensor() -> torch.Tensor:
    return torch.zeros(2)


@asyncrpc.async_execution
def returns_failed_future() -> Future[None]:
    return asyncrpc.failed(KeyError("no such shard"))


@asyncrpc.async_execution
def returns_chain_that_raises(to: str) -> Future[Any]:
    return rpc_async(to, torch.ones, args=((2,),)).then(lambda fut: fut.wait()[5])


@asyncrpc.async_execution
async def awaits_then_raises(to: str) -> None:
    await rpc_async(to, torch.ones, args=((2,),))
    raise ValueError("bad shard 7")


@asyncrpc.async_execution
async def awaits_a_number() -> None:
    await 5  # type: ignore[misc]


@asyncrpc.async_execution
async def awaits_asyncio(to: str) -> list[object]:
    """asyncio's own awaitables, mixed with asyncrpc's Futures, in one coroutine."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    await queue.put(3)
    await asyncio.sleep(0.01)
    pair = await asyncio.gather(asyncio.sleep(0, "slept"), rpc_async(to, torch.neg, args=(ONES,)))
    late = await asyncio.wait_for(rpc_async(to, torch.add, args=(ONES, 1)), 10)
    try:
        await asyncio.wait_for(asyncio.sleep(5), 0.01)
        timed_out = False
    except TimeoutError:
        timed_out = True
    return [await queue.get(), pair[0], pair[1].sum().item(), late.sum().item(), timed_out]


async def on_which_thread() -> str:
    import threading

    await asyncio.sleep(0)
    return threading.current_thread().name


def sleepy(seconds: float) -> float:
    import time

    time.sleep(seconds)
    return seconds


@asyncrpc.async_execution
async def awaits_with_timeout(to: str, seconds: float, limit: float) -> float:
    return await asyncrpc.with_timeout(rpc_async(to, sleepy, args=(seconds,)), limit)


@asyncrpc.async_execution
async def awaits_remote_failure(to: str) -> str:
    try:
        await rpc_async(to, awaits_then_raises, args=(to,))
    except ValueError as exc:  # the remote type survives two hops
        return "caught: " + ("bad shard 7" in str(exc)) * "bad shard 7"
    return "not raised"


# ---- helpers ---------------------------------------------------------------------------


def call(mode: str, fn: Callable[..., Any], *args: Any) -> Any:
    if mode == "sync":
        return asyncrpc.rpc_sync("worker1", fn, args=args)
    if mode == "async":
        return asyncrpc.rpc_async("worker1", fn, args=args).wait()
    return asyncrpc.remote("worker1", fn, args=args).to_here()


MODES = ["sync", "async", "remote"]
FOUR = torch.tensor([4.0, 4.0])
THREE = torch.tensor([3.0, 3.0])


# ---- Future-returning functions (torch's forms) ---------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fn", [add_chained, add_with_future_ctor, add_awaiting, add_after_then])
def test_chained_add_gives_three(world: asyncrpc.Context, mode: str, fn: Any) -> None:
    assert torch.equal(call(mode, fn, "worker2", ONES, 1, 1), THREE)


@pytest.mark.parametrize("mode", MODES)
def test_nested_async_functions(world: asyncrpc.Context, mode: str) -> None:
    assert torch.equal(call(mode, add_nested, "worker2", ONES, 1, 1), THREE)


def test_fan_out_inside_an_async_def(world: asyncrpc.Context) -> None:
    out = asyncrpc.rpc_sync("worker1", add_fanned_out, args=("worker2", torch.zeros(2), 10))
    assert torch.equal(out, torch.full((2,), 45.0))


def test_torchscript_async_function(world: asyncrpc.Context) -> None:
    out = asyncrpc.rpc_sync("worker1", script_async_add, args=("worker2", ONES, ONES))
    assert torch.equal(out, torch.tensor([2.0, 2.0]))
    rref = asyncrpc.remote("worker1", script_async_add, args=("worker2", ONES, ONES))
    assert torch.equal(rref.to_here(), torch.tensor([2.0, 2.0]))


METHODS = [
    Adder.static_add,
    Adder.static_add_outer,
    Adder.class_add,
    Adder.class_add_outer,
    Adder.static_await,
    Adder.class_await,
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.__name__)
def test_static_and_class_methods_either_order(
    world: asyncrpc.Context, mode: str, method: Any
) -> None:
    assert torch.equal(call(mode, method, "worker2", ONES, 1, 2), FOUR)


NAMES = ["static_add", "static_add_outer", "class_add", "class_add_outer", "bound_add"]
NAMES += ["static_await", "class_await", "bound_await"]


@pytest.mark.parametrize("name", NAMES)
def test_methods_through_rref_proxies(world: asyncrpc.Context, name: str) -> None:
    rref = asyncrpc.remote("worker1", Adder)
    args = ("worker2", ONES, 1, 2)
    assert torch.equal(getattr(rref.rpc_sync(), name)(*args), FOUR)
    assert torch.equal(getattr(rref.rpc_async(), name)(*args).wait(), FOUR)
    assert torch.equal(getattr(rref.remote(), name)(*args).to_here(), FOUR)


def test_local_calls_return_futures(world: asyncrpc.Context) -> None:
    assert torch.equal(add_awaiting("worker2", ONES, 1, 1).wait(), THREE)
    assert torch.equal(add_local_future(ONES).wait(), torch.full((2,), 2.0))
    assert torch.equal(Adder(1).bound_await("worker1", ONES, 1, 1).wait(), FOUR)


# ---- errors ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_non_future_return_says_what_to_return(world: asyncrpc.Context, mode: str) -> None:
    pattern = r"must return a torch\.futures\.Future object, but returns_tensor\(\) returned"
    with pytest.raises(RuntimeError, match=pattern):
        call(mode, returns_tensor)
    with pytest.raises(asyncrpc.NotAFutureError, match=r"returned Tensor.*return rpc_async"):
        returns_tensor()


@pytest.mark.parametrize("mode", MODES)
def test_failed_future_raises_at_the_caller(world: asyncrpc.Context, mode: str) -> None:
    # torch alone sends set_exception's error back as an ordinary return value.
    with pytest.raises(
        Exception,
        match=r"(?s)On worker .{0,4}worker1.*no such shard|no such shard.*On worker 'worker1'",
    ):
        call(mode, returns_failed_future)


@pytest.mark.parametrize("mode", MODES)
def test_exception_in_a_chained_callback_keeps_its_cause(
    world: asyncrpc.Context, mode: str
) -> None:
    with pytest.raises(Exception, match=r"IndexError.*index 5 is out of bounds"):
        call(mode, returns_chain_that_raises, "worker2")


def test_async_def_exception_keeps_type_message_and_traceback(world: asyncrpc.Context) -> None:
    with pytest.raises(ValueError, match=r"(?s)bad shard 7.*On worker 'worker1'.*line \d+"):
        asyncrpc.rpc_sync("worker1", awaits_then_raises, args=("worker2",))
    with pytest.raises(ValueError, match="bad shard 7"):  # remote() keeps the type
        asyncrpc.remote("worker1", awaits_then_raises, args=("worker2",)).to_here()
    with pytest.raises(ValueError, match="bad shard 7"):  # and so does a local call
        awaits_then_raises("worker2").wait()


def test_a_timeout_firing_inside_an_async_def_reaches_the_caller(world: asyncrpc.Context) -> None:
    assert asyncrpc.rpc_sync("worker1", awaits_with_timeout, args=("worker2", 0.0, 5.0)) == 0.0
    with pytest.raises(TimeoutError, match=r"(?s)within 0\.2 s.*On worker 'worker1'"):
        asyncrpc.rpc_sync("worker1", awaits_with_timeout, args=("worker2", 2.0, 0.2))
    call_timeout = asyncrpc.rpc_async(
        "worker1", awaits_with_timeout, args=("worker2", 2.0, 9.0), timeout=0.3
    )
    with pytest.raises(RuntimeError, match="timeout"):
        call_timeout.wait()


def test_an_awaited_remote_failure_can_be_caught(world: asyncrpc.Context) -> None:
    out = asyncrpc.rpc_sync("worker1", awaits_remote_failure, args=("worker2",))
    assert out == "caught: bad shard 7"


def test_awaiting_a_non_awaitable_is_pythons_type_error(world: asyncrpc.Context) -> None:
    with pytest.raises(TypeError, match=r"int.*can't be used in 'await'"):
        asyncrpc.rpc_sync("worker1", awaits_a_number)
    with pytest.raises(TypeError, match=r"int.*can't be used in 'await'"):
        awaits_a_number().wait()
    assert asyncrpc.rpc_sync("worker1", torch.neg, args=(ONES,)).sum() == -2  # still serving


def test_asyncio_awaitables_work_in_remote_coroutines(world: asyncrpc.Context) -> None:
    # decorated (torch's way) or not, asyncio and asyncrpc Futures mix in one coroutine
    out = asyncrpc.rpc_sync("worker1", awaits_asyncio, args=("worker2",))
    assert out == [3, "slept", -2.0, 4.0, True]
    assert asyncrpc.rpc_async("worker1", on_which_thread).wait() == "asyncrpc-loop"


def test_decorating_a_non_function_is_refused() -> None:
    with pytest.raises(TypeError, match=r"expects a function, got int 3"):
        asyncrpc.async_execution(3)


def test_torch_futures_work_under_asyncio(world: asyncrpc.Context) -> None:
    async def main() -> torch.Tensor:
        first = await asyncrpc.rpc_async("worker1", torch.add, args=(ONES, 1))
        return first + await asyncrpc.rpc_async("worker2", torch.add, args=(ONES, 1))

    assert torch.equal(asyncio.run(main()), FOUR)


# ---- capacity: no RPC thread is held while waiting ------------------------------------


@pytest.mark.subprocess
@pytest.mark.timeout(150)  # past run_program's own: a stuck run shows its stacks
def test_1000_nested_calls_on_4_callee_threads() -> None:
    result = run_program("python", str(PROGRAMS / "nested_capacity.py"), "1000", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "1000 calls, 0 errors, sum ok" in result.stdout


@pytest.mark.subprocess
def test_async_execution_example_prints_the_reference_results() -> None:
    result = run_program("python", str(ROOT / "examples" / "async_execution.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert sum(line.endswith("tensor([3., 3.])") for line in lines) == 2
    assert sum(line.endswith("tensor([2., 2.])") for line in lines) == 2
    assert sum(line.endswith("tensor([4., 4.])") for line in lines) == 8 + 18
    assert len(lines) == 30, result.stdout
