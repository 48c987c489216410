"""Handles to remote objects and modules: verbs, timeouts, lifetime, training, a dead owner."""

from __future__ import annotations

import functools
import gc
import json
import math
import re
import threading
import time

import pytest
import torch
import torch.distributed.autograd as dist_autograd
from torch.distributed.optim import DistributedOptimizer

import asyncrpc
from asyncrpc import rpc_async

from conftest import PROGRAMS, ROOT, run_program, until

_live: set[int] = set()  # ids of Counters alive in this process (read on the owner)
_live_lock = threading.Lock()


class Counter:
    kind = "counter"

    def __init__(self, start: int = 0, *, step: int = 1) -> None:
        self.value = start
        self.step = step
        with _live_lock:
            _live.add(id(self))

    def __del__(self) -> None:
        with _live_lock:
            _live.discard(id(self))

    def add(self, n: int = 1) -> int:
        self.value += n * self.step
        return self.value

    def where(self) -> str:
        return asyncrpc.current_context().name

    def slow(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.value

    def fail(self) -> None:
        raise KeyError("no such key")

    def ident(self) -> int:
        return id(self)

    async def fail_awaiting(self, to: str) -> None:
        await rpc_async(to, int, args=(1,))
        raise KeyError("no such key, after an await")

    def check(self, seconds: float) -> int:
        if self.value < 0:
            raise KeyError("no such key")
        time.sleep(seconds)
        return self.value

    @asyncrpc.async_execution
    def add_via(self, to: str, n: int) -> torch.futures.Future[int]:
        return rpc_async(to, int, args=(n,)).then(lambda fut: self.add(fut.wait()))

    @asyncrpc.async_execution
    async def add_awaiting(self, to: str, n: int) -> int:
        return self.add(await rpc_async(to, int, args=(n,)))


class Undecorated:
    async def plus_remote(self, to: str, n: int) -> int:
        return 1 + await rpc_async(to, int, args=(n,))


def live_counters() -> int:
    gc.collect()
    with _live_lock:
        return len(_live)


# ---- verbs -----------------------------------------------------------------------------


def test_call_call_async_and_call_remote(world: asyncrpc.Context) -> None:
    counter = asyncrpc.spawn("worker1", Counter, 10, step=2)
    assert isinstance(counter, asyncrpc.RemoteObject)
    assert counter.owner == "worker1"
    assert counter.call("where") == "worker1"
    assert counter.call("add") == 12
    assert counter.call_async("add", 2).wait() == 16
    rref = counter.call_remote("add", 1)
    assert rref.owner().name == "worker1"
    assert rref.to_here() == 18
    assert counter.to_here().value == 18  # a copy of the object itself


def test_async_execution_methods_run_on_the_owner(world: asyncrpc.Context) -> None:
    counter = asyncrpc.spawn("worker1", Counter)
    assert counter.call("add_via", "worker2", 5) == 5
    assert counter.call_async("add_awaiting", "worker2", 5).wait() == 10
    assert counter.call_remote("add_awaiting", "worker2", 1).to_here() == 11


def test_rref_style_proxies_still_work(world: asyncrpc.Context) -> None:
    counter = asyncrpc.spawn("worker2", Counter, 3)
    assert counter.rpc_sync().add(1) == 4
    assert counter.rpc_async().add(1).wait() == 5
    assert counter.remote().add(1).to_here() == 6


def test_options_set_the_timeout_of_every_verb(world: asyncrpc.Context) -> None:
    counter = asyncrpc.spawn("worker1", Counter)
    quick = counter.options(timeout=0.3)
    with pytest.raises(
        asyncrpc.CallTimeoutError, match=r"Counter.slow\(\) on worker 'worker1' timed"
    ):
        quick.call("slow", 2.0)
    with pytest.raises(asyncrpc.CallTimeoutError, match="worker1"):
        quick.call_async("slow", 2.0).wait()
    with pytest.raises(RuntimeError, match="timeout"):
        counter.call_remote("slow", 2.0).to_here(timeout=0.3)
    with pytest.raises(ValueError, match=r"-2"):
        counter.options(timeout=-2)
    # One call at a time, and a call's timeout counts its wait for its turn: the
    # first and the remote slow call run (2 s each), one after the other; the
    # second timed out while it waited, so it never starts.
    assert counter.options(timeout=30).call("slow", 0.0) == 0


class Timed:
    """Takes parameters named `timeout`: they are its own, never the call's."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout

    def wait_for(self, timeout: float) -> tuple[float, float]:
        return self.timeout, timeout


def test_arguments_named_timeout_reach_the_object(world: asyncrpc.Context) -> None:
    timed = asyncrpc.spawn("worker2", Timed, timeout=7.0)
    assert timed.call("wait_for", timeout=0.001) == (7.0, 0.001)
    assert timed.options(timeout=5).call_async("wait_for", 1.0).wait() == (7.0, 1.0)


def test_a_handle_wraps_an_rref_torch_code_holds(world: asyncrpc.Context) -> None:
    rref = torch.distributed.rpc.remote("worker1", Counter, args=(5,))
    counter: asyncrpc.RemoteObject[Counter] = asyncrpc.RemoteObject(rref)
    assert counter.call("add", 2) == 7
    assert counter.call_async("add_awaiting", "worker2", 1).wait() == 8
    with pytest.raises(AttributeError, match="did you mean 'add'"):
        counter.call("ad")  # checked on the owner: the class is not known here
    with pytest.raises(TypeError, match="wraps an RRef"):
        asyncrpc.RemoteObject(Counter())  # type: ignore[arg-type]


def test_factories_and_partials_give_handles(world: asyncrpc.Context) -> None:
    made = asyncrpc.spawn("worker1", functools.partial(Counter, 4, step=3))
    assert made.cls is Counter and made.call("add") == 7
    net = asyncrpc.spawn("worker2", make_linear, 2)
    assert isinstance(net, asyncrpc.RemoteModule)
    assert net(torch.ones(1, 2)).shape == (1, 1)


def make_linear(n: int) -> torch.nn.Module:
    return torch.nn.Linear(n, 1)


def test_async_def_methods_run_without_the_decorator(world: asyncrpc.Context) -> None:
    undecorated = asyncrpc.spawn("worker1", Undecorated)
    assert undecorated.call("plus_remote", "worker2", 2) == 3


def test_remote_errors_keep_their_cause(world: asyncrpc.Context) -> None:
    counter = asyncrpc.spawn("worker1", Counter)
    with pytest.raises(Exception, match="no such key"):
        counter.call("fail")
    with pytest.raises(Exception, match="no such key"):
        counter.call_async("fail").wait()


def test_a_wrong_method_name_suggests_the_closest(world: asyncrpc.Context) -> None:
    counter = asyncrpc.spawn("worker1", Counter)
    with pytest.raises(AttributeError, match=r"Counter has no method 'ad'; did you mean 'add'"):
        counter.call("ad")
    with pytest.raises(AttributeError, match="attribute, not a method"):
        counter.call("kind")


def test_remote_is_torchs_remote_for_functions_and_classes(world: asyncrpc.Context) -> None:
    rref = asyncrpc.remote("worker2", torch.ones, args=((2,),))
    assert torch.equal(rref.to_here(), torch.ones(2))
    observer = asyncrpc.remote("worker2", Counter, args=(3,), kwargs={"step": 2})
    assert isinstance(observer, torch.distributed.rpc.PyRRef)
    assert observer.rpc_sync().add(1) == 5
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'x'"):
        asyncrpc.remote("worker2", torch.ones, x=1)  # type: ignore[call-arg]


def test_call_all_keeps_order_and_fails_fast(world: asyncrpc.Context) -> None:
    handles = [asyncrpc.spawn(name, Counter, i) for i, name in enumerate(world.names)]
    assert asyncrpc.call_all(handles, "where").wait() == list(world.names)
    assert asyncrpc.call_all(handles, "add", 10).wait() == [10, 11, 12]
    slow_then_failing = [handles[1], asyncrpc.spawn("worker2", Counter, -1)]
    started = time.monotonic()
    with pytest.raises(Exception, match="no such key"):
        asyncrpc.call_all(slow_then_failing, "check", 3.0).wait()
    assert time.monotonic() - started < 2.5  # did not wait for the slow call
    with pytest.raises(TypeError, match="expects handles"):
        asyncrpc.call_all(["worker1"], "add")  # type: ignore[list-item]


# ---- lifetime ----------------------------------------------------------------------------


def is_live(ident: int) -> bool:
    gc.collect()
    with _live_lock:
        return ident in _live


def wait_released(owner: str, ident: int, what: str) -> None:
    gc.collect()
    released = until(lambda: not asyncrpc.rpc_sync(owner, is_live, args=(ident,)), 10, 0.05)
    assert released, f"the remote Counter was never released ({what})"


def test_the_object_is_released_with_its_last_handle(world: asyncrpc.Context) -> None:
    counter = asyncrpc.spawn("worker2", Counter)
    ident = counter.call("ident")
    assert asyncrpc.rpc_sync("worker2", is_live, args=(ident,))
    del counter
    wait_released("worker2", ident, "after calls that succeeded")


def test_the_object_is_released_whatever_its_methods_did(world: asyncrpc.Context) -> None:
    counter = asyncrpc.spawn("worker1", Counter)
    ident = counter.call("ident")
    for _ in range(3):  # failing sync and async methods, through every verb
        with pytest.raises(KeyError):
            counter.call("fail")
        with pytest.raises(KeyError):
            counter.call_async("fail_awaiting", "worker2").wait()
        with pytest.raises(KeyError):
            counter.rpc_sync().fail_awaiting("worker2")
        with pytest.raises(KeyError):
            counter.call_remote("fail").to_here()
    del counter
    wait_released("worker1", ident, "after failed calls")


@pytest.mark.subprocess
def test_calling_a_handle_whose_owner_died_names_the_owner() -> None:
    result = run_program("python", str(PROGRAMS / "dead_owner.py"), timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "WorkerUnreachableError: worker 'worker2' cannot be reached" in result.stdout
    assert "in flight: WorkerUnreachableError" in result.stdout
    assert "survivor still serves: worker1" in result.stdout
    took = re.search(r"shutdown took ([\d.]+) s", result.stdout)
    assert took is not None and float(took.group(1)) < 15, result.stdout  # bounded


# ---- modules -------------------------------------------------------------------------------


def test_remote_module_forward_sync_and_async(world: asyncrpc.Context) -> None:
    torch.manual_seed(0)
    local = torch.nn.Linear(4, 2)
    net = asyncrpc.spawn("worker1", torch.nn.Linear, 4, 2)
    assert isinstance(net, asyncrpc.RemoteModule)
    net.call("load_state_dict", local.state_dict())
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected = local(x)
    assert torch.allclose(net(x), expected)
    assert torch.allclose(net.forward_async(x).wait(), expected)
    assert len(net.parameter_rrefs()) == 2


def test_training_through_a_remote_module_lowers_the_loss(world: asyncrpc.Context) -> None:
    torch.manual_seed(0)
    net = asyncrpc.spawn("worker2", torch.nn.Linear, 3, 1)
    opt = DistributedOptimizer(torch.optim.SGD, net.parameter_rrefs(), lr=0.1)
    true_w = torch.tensor([[1.0, -2.0, 0.5]])
    losses: list[float] = []
    for _ in range(40):
        x = torch.randn(32, 3)
        y = x @ true_w.T
        with dist_autograd.context() as ctx_id:
            loss = torch.nn.functional.mse_loss(net(x), y)
            dist_autograd.backward(ctx_id, [loss])
            opt.step(ctx_id)
        losses.append(loss.item())
    assert losses[-1] < 0.05 * losses[0], losses


@pytest.mark.subprocess
@pytest.mark.parametrize(("mode", "steps"), [("batched", 60), ("immediate", 180)])
def test_parameter_server_example_trains(mode: str, steps: int) -> None:
    example = str(ROOT / "examples" / "parameter_server.py")
    result = run_program("python", example, "--rounds", "60", "--mode", mode)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert f"{mode}: " in summary and f"{steps} optimizer steps" in summary, summary
    first, last = (float(v) for v in summary.split("loss ")[1].split(",")[0].split(" -> "))
    if mode == "batched":  # one step per k gradients: the same steps in every run
        assert last < 0.6 * first, result.stdout
    else:
        # Each gradient applied as it arrives, in whatever order the trainers' calls
        # land: most runs reach 0.04-0.12 here, but a stale gradient can throw the
        # model onto the plateau at about 0.37 that docs/benchmarks.md shows for
        # immediate updates (seen in CI under load). It must not blow up.
        assert math.isfinite(last) and last < 1.25 * first, result.stdout


@pytest.mark.subprocess
def test_an_argument_that_cannot_be_pickled_forks_nothing_shutdown_would_wait_for() -> None:
    # Before, torch forked the object's RRef, then failed on the argument: the fork,
    # never sent, held the world's end for torch's 100 s.
    done = run_program("python", str(PROGRAMS / "unsendable_argument.py"), timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    refused = {v: "SerializationError" for v in ("call", "call_async", "call_remote", "stream")}
    assert {k: result[k] for k in refused} == refused and result["after"] == 1
    assert result["seconds"] < 40, result


@pytest.mark.subprocess
def test_an_argument_the_owner_cannot_unpickle_fails_alone_and_the_handle_goes_on() -> None:
    # It never reaches the object's mailbox: its turn is given back, or the handle's
    # next calls would wait for it until their timeout.
    done = run_program("python", str(PROGRAMS / "unreadable_argument.py"), timeout=90)
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    refused = "the arguments of Store.put() could not be unpickled on 'worker1'"
    for verb in ("call", "call_async"):
        assert result[verb] == refused and result[f"next after {verb}"] == "ran", result
        assert result[f"next after {verb} s"] < 5, result
