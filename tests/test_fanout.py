"""Local fan-out: every engine, the timed "auto" choice, the thread budget, bad input."""

from __future__ import annotations

import statistics
import threading
import time
import warnings

import pytest
import torch

import asyncrpc
from asyncrpc import FanoutPlan
from asyncrpc._fanout._tuner import Tuner

from conftest import ROOT, run_program

ENGINES = ["serial", "threads", "fork"]


class Scale(torch.nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


class Wide(torch.nn.Module):
    """Scriptable, and enough work per call that the engines overlap something."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return out


class Eager(torch.nn.Module):
    """Not scriptable: TorchScript has no try/except."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return x + 1
        except RuntimeError:
            return x


def _scales(n: int = 4) -> list[torch.nn.Module]:
    return [Scale(float(i + 1)) for i in range(n)]


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_returns_each_members_output_in_order(engine: str) -> None:
    x = torch.ones(3)
    with asyncrpc.Fanout(_scales(), engine=engine) as fan:  # type: ignore[arg-type]
        assert fan.engine == engine
        outputs = fan(x)
    assert [o.tolist() for o in outputs] == [[k] * 3 for k in (1.0, 2.0, 3.0, 4.0)]


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_matches_serial_on_lstms(engine: str) -> None:
    torch.manual_seed(0)
    members = [Wide() for _ in range(3)]
    x = torch.rand(5, 2, 16)
    expected = [m(x) for m in members]
    with asyncrpc.Fanout(members, engine=engine) as fan:  # type: ignore[arg-type]
        got = fan(x)
        again = fan.call_async(x).wait()
    for e, g, a in zip(expected, got, again, strict=True):
        assert torch.allclose(e, g, atol=1e-6)
        assert torch.allclose(e, a, atol=1e-6)


@pytest.mark.parametrize("engine", ENGINES)
def test_map_gives_each_member_its_own_input(engine: str) -> None:
    inputs = [(torch.full((2,), float(i)),) for i in range(4)]
    with asyncrpc.Fanout(_scales(), engine=engine) as fan:  # type: ignore[arg-type]
        outputs = fan.map(inputs)
    assert [o[0].item() for o in outputs] == [0.0, 2.0, 6.0, 12.0]


def test_thread_engine_runs_members_at_the_same_time() -> None:
    meet = threading.Barrier(2, timeout=10)  # serial execution would break the barrier

    def member(tag: str) -> str:
        meet.wait()
        return tag

    with asyncrpc.Fanout([member, member], engine="threads", threads=2) as fan:
        assert fan("x") == ["x", "x"]


def test_thread_engine_keeps_the_thread_budget_and_grad_mode() -> None:
    seen: list[tuple[int, bool]] = []

    def member() -> None:
        seen.append((torch.get_num_threads(), torch.is_grad_enabled()))

    budget = torch.get_num_threads()
    with asyncrpc.Fanout([member] * 4, engine="threads") as fan:
        plan = fan.plan
        assert plan is not None and plan.engine == "threads"
        assert plan.threads * plan.intra_op_threads <= max(budget, plan.threads)
        with torch.no_grad():
            fan()
    assert seen == [(plan.intra_op_threads, False)] * 4
    # The pool's own intra-op setting does not leak into threads started later.
    later: list[int] = []
    probe = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    probe.start()
    probe.join()
    assert later == [budget]


@pytest.mark.usefixtures("two_threads")
def test_auto_offers_serial_lanes_and_fork_for_scripted_members() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scripted = [torch.jit.script(Scale(2.0)) for _ in range(2)]
    serial = FanoutPlan("serial", 1, 2)
    lanes = FanoutPlan("threads", 2, 1)
    assert asyncrpc.Fanout(_scales(2)).plans == (serial, lanes)
    assert asyncrpc.Fanout(scripted).plans == (serial, lanes, FanoutPlan("fork", 2, 1))
    for fixed in (asyncrpc.Fanout([Scale(1.0)]), asyncrpc.Fanout(_scales(2), threads=1)):
        assert fixed.plans == (serial,)
        assert fixed.plan == serial  # nothing to time
    fixed_width = asyncrpc.Fanout(_scales(4), threads=2)  # threads= fixes the plan too
    assert fixed_width.plans == (lanes,) and fixed_width.plan == lanes
    assert asyncrpc.Fanout(_scales(2)).plan is None  # not timed yet


@pytest.mark.usefixtures("two_threads")
def test_auto_times_each_plan_on_real_calls_then_keeps_the_fastest() -> None:
    def nap(x: int) -> int:
        time.sleep(0.02)  # releases the GIL: two lanes take half the time of serial
        return x

    with asyncrpc.Fanout([nap] * 4) as fan:
        calls = 0
        while fan.plan is None and calls < 100:
            assert fan(calls) == [calls] * 4  # timed calls are real calls
            calls += 1
        timings = fan.timings()
        assert fan.plan == FanoutPlan("threads", 2, 1), timings
        assert all(len(seconds) >= 3 for seconds in timings.values())
        # Plans alternate until the quicker one has 0.3 s of timed calls too (~8 x 40 ms)
        assert calls == 2 + 2 * len(timings[fan.plan]), (calls, timings)
        serial, lanes = (statistics.median(timings[plan]) for plan in fan.plans)
        assert serial > 1.5 * lanes
        assert "threads x2" in repr(fan)


def test_the_tuner_settles_even_when_calls_always_overlap() -> None:
    plans = [FanoutPlan("serial", 1, 2), FanoutPlan("threads", 2, 1)]
    tuner = Tuner(plans, most=5)
    for _ in range(5):
        (_, first), (_, second) = tuner.begin(), tuner.begin()
        assert first is not None and second is not None
        tuner.end(first, ok=True)
        tuner.end(second, ok=True)
    assert tuner.chosen == plans[1]  # nothing ran alone: lanes
    assert tuner.timings() == {plan: () for plan in plans}


@pytest.mark.usefixtures("two_threads")
def test_auto_does_not_count_calls_that_overlapped() -> None:
    def nap(x: int) -> int:
        time.sleep(0.02)
        return x

    with asyncrpc.Fanout([nap] * 2) as fan:
        first, second = fan.call_async(1), fan.call_async(2)
        assert (first.wait(), second.wait()) == ([1, 1], [2, 2])
        assert all(not seconds for seconds in fan.timings().values())
        assert fan.plan is None


def test_fork_engine_hides_torchscript_warnings_unless_asked() -> None:
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        asyncrpc.Fanout(_scales(2), engine="fork")(torch.ones(1))
    assert not [w for w in quiet if issubclass(w.category, DeprecationWarning)]
    with warnings.catch_warnings(record=True) as loud:
        warnings.simplefilter("always")
        asyncrpc.Fanout(_scales(2), engine="fork", show_warnings=True)
    assert [w for w in loud if "deprecated" in str(w.message)]


def test_declined_names_only_the_engines_left_out() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        forked = asyncrpc.Fanout(_scales(2), engine="fork")  # scripts its eager members
    assert forked.plans[0].engine == "fork" and "fork" not in forked.declined
    assert "fork" in asyncrpc.Fanout(_scales(2)).declined  # auto times fork for scripts only


def test_fanout_function_is_a_one_shot_fanout() -> None:
    def add(x: int, *, y: int) -> int:
        return x + y

    def mul(x: int, *, y: int) -> int:
        return x * y

    assert asyncrpc.fanout([add, mul], 3, y=4) == [7, 12]


@pytest.mark.parametrize("engine", ["serial", "threads"])
def test_a_failing_member_raises_its_error_and_the_fanout_keeps_working(engine: str) -> None:
    def picky(x: int) -> int:
        if x < 0:
            raise ValueError(f"member refused {x}")
        return x

    with asyncrpc.Fanout([abs, picky], engine=engine) as fan:  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="member refused -2"):
            fan(-2)
        assert fan(3) == [3, 3]


@pytest.mark.parametrize(
    ("members", "options", "error", "match"),
    [
        (Scale(1.0), {}, TypeError, "list of callables"),
        ([], {}, ValueError, "empty"),
        ([torch.ones(2)], {}, TypeError, "not the result of calling it"),
        ([abs], {"engine": "gpu"}, ValueError, "engine must be one of"),
        ([abs], {"threads": 0}, ValueError, "threads must be a positive int"),
        ([abs, abs], {"engine": "fork"}, TypeError, "wrap it in a Module"),
        ([Eager(), Eager()], {"engine": "fork"}, TypeError, "engine='threads'"),
    ],
)
def test_bad_input_says_what_to_do(
    members: object, options: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        asyncrpc.Fanout(members, **options)  # type: ignore[arg-type]


def test_fork_engine_rejects_calls_it_cannot_script() -> None:
    with asyncrpc.Fanout(_scales(2), engine="fork") as fan:
        with pytest.raises(TypeError, match="one Tensor"):
            fan(torch.ones(1), torch.ones(1))
        assert fan(torch.ones(1))[1].item() == 2.0


def test_map_checks_its_inputs() -> None:
    with asyncrpc.Fanout(_scales(2), engine="threads") as fan:
        with pytest.raises(ValueError, match="one argument tuple per member"):
            fan.map([(torch.ones(1),)])
        with pytest.raises(TypeError, match=r"write \(x,\)"):
            fan.map([torch.ones(1), torch.ones(1)])  # type: ignore[list-item]


@pytest.mark.subprocess
def test_fork_basics_example_prints_the_reference_results() -> None:
    result = run_program("python", str(ROOT / "examples" / "fork_basics.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "one fork: (tensor([-1.]), tensor([-1.]))",
        "100 forks summed: tensor(-100.)",
        "module fork with b=2: tensor(4)",
        "fanout, one member: [tensor([-1.]), tensor([-1.])]",
        "fanout, 100 members summed: tensor(-100.)",
        "fanout, module with b=2: [tensor(4)]",
    ]
    assert "Warning" not in result.stderr


def test_exit_hook_joins_pool_threads_and_meets_every_inter_op_thread() -> None:
    # What keeps a process from aborting at exit after fan-out (asyncrpc/_fanout/_exit.py).
    from asyncrpc._fanout import _exit

    fan = asyncrpc.Fanout([Scale(2.0), Scale(3.0)], engine="threads", threads=2)
    fan(torch.ones(2))
    (pool,) = fan._pools.values()
    fan.close()
    with asyncrpc.Fanout([Wide(), Wide()], engine="fork") as forked:
        forked(torch.rand(2, 1, 16))
    _exit.settle()
    assert not any(thread.is_alive() for thread in pool._threads)
    assert _exit._barrier.parties == torch.get_num_interop_threads()
    assert not _exit._barrier.broken, "an inter-op thread never reached the barrier"
