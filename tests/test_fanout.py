"""Local fan-out: every engine, the timed "auto" choice, the thread budget, bad input,
random numbers under each engine, and copies (deepcopy, pickle)."""

from __future__ import annotations

import copy
import logging
import pickle
import statistics
import threading
import time
import warnings
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncrpc
from asyncrpc import FanoutPlan
from asyncrpc._fanout._copies import copied_members, rows_of
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
        # Blocks of 3 calls alternate until each plan has 0.3 s of samples (the quicker
        # call of each block's last two): 4 serial blocks of 80 ms, 8 of 40 ms on lanes.
        assert len(timings[fan.plan]) > len(timings[FanoutPlan("serial", 1, 2)]), timings
        assert calls == 1 + 3 * sum(map(len, timings.values())), (calls, timings)
        serial, lanes = (statistics.median(timings[plan]) for plan in fan.plans)
        assert serial > 1.5 * lanes
        assert "threads x2" in repr(fan)


def test_the_tuner_settles_even_when_calls_always_overlap() -> None:
    plans = [FanoutPlan("serial", 1, 2), FanoutPlan("threads", 2, 1)]
    tuner = Tuner(plans, most=5)
    for _ in range(5 * Tuner.BLOCK):
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
    assert _exit._GUARD.barrier.parties == torch.get_num_interop_threads()
    assert not _exit._GUARD.barrier.broken, "an inter-op thread never reached the barrier"


# ---- random numbers: "auto" keeps the serial stream ----------------------------------


def _dropouts(n: int = 3) -> list[torch.nn.Module]:
    torch.manual_seed(0)  # stackable: "auto" offers serial, vmap and thread lanes
    return [
        torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 2))
        for _ in range(n)
    ]


def _train(members: list[torch.nn.Module], fan: asyncrpc.Fanout | None) -> torch.Tensor:
    """20 SGD steps (dropout draws every step); the members' weights after them, flat."""
    opt = torch.optim.SGD([p for m in members for p in m.parameters()], lr=0.1)
    torch.manual_seed(1)
    for _ in range(20):
        x = torch.rand(8, 4)
        outputs = fan(x) if fan is not None else [m(x) for m in members]
        opt.zero_grad()
        sum(out.square().mean() for out in outputs).backward()  # type: ignore[union-attr]
        opt.step()
    return torch.cat([p.detach().flatten() for m in members for p in m.parameters()])


@pytest.mark.usefixtures("two_threads")
def test_auto_trains_dropout_members_as_serial_does_bit_for_bit() -> None:
    serial = _train(members := _dropouts(), None)
    for _ in range(3):  # whatever the timing: the first call draws, so every call is serial
        fan = asyncrpc.Fanout(members := _dropouts())
        assert [plan.engine for plan in fan.plans] == ["serial", "vmap", "threads"]
        assert torch.equal(_train(members, fan), serial)
        assert fan.plan == FanoutPlan("serial", 1, 2)
        assert "member 0 (Sequential) drew random numbers" in fan.declined["threads"]
        assert "drew random numbers" in fan.declined["vmap"]
        fan.close()


class _Plans:
    """`auto`'s choice, made by the test instead of the clock: any plan, at any call."""

    def __init__(self, fan: asyncrpc.Fanout) -> None:
        self.fan = fan

    def pick(self, index: int) -> None:
        if self.fan.plan is None:  # it picks once, as the tuner does
            plans = self.fan.plans
            self.fan._tuner.chosen = plans[index % len(plans)]


def _noisy(k: float) -> Any:
    def member(x: torch.Tensor) -> torch.Tensor:
        return x * k + torch.rand(x.shape)  # a function that draws: no mode to read

    return member


_STEPS = st.lists(
    st.tuples(st.sampled_from(["call", "map", "train", "eval", "pick"]), st.integers(0, 3)),
    min_size=1,
    max_size=8,
)


@pytest.mark.usefixtures("two_threads")
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["dropout", "function"]), steps=_STEPS)
def test_auto_draws_what_serial_draws_whichever_plan_it_picks_and_when(
    kind: str, steps: list[tuple[str, int]]
) -> None:
    members: list[Any] = _dropouts() if kind == "dropout" else [_noisy(k) for k in (1, 2, 3)]
    own = copy.deepcopy(members)  # the reference: one by one
    fan = asyncrpc.Fanout(members)
    plans = _Plans(fan)
    torch.manual_seed(5)
    for what, number in [*steps, ("call", 0)]:
        if what in ("train", "eval") and kind == "dropout":
            for m in [*members, *own]:
                m.train(what == "train")
        elif what == "pick":
            plans.pick(number)  # as if the timing had chosen this plan now
        inputs = [(torch.rand(2, 4),) for _ in members]
        before = torch.get_rng_state()
        got = fan.map(inputs) if what == "map" else fan(inputs[0][0])
        after = torch.get_rng_state()
        torch.set_rng_state(before)
        want = [m(*(i if what == "map" else inputs[0])) for m, i in zip(own, inputs, strict=True)]
        assert torch.equal(after, torch.get_rng_state())  # the same numbers were drawn
        drawing = kind == "function" or any(m.training for m in members)
        for a, b in zip(got, want, strict=True):  # vmap in eval: to float rounding
            assert torch.equal(a, b) if drawing else torch.allclose(a, b, atol=1e-6)
        if drawing:
            assert fan.plan is not None and fan.plan.engine == "serial"
    fan.close()


class _Sometimes(torch.nn.Module):
    """Draws only for inputs with a negative entry: its modes cannot tell."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w + (torch.rand(x.shape) if bool((x < 0).any()) else 0)


@pytest.mark.usefixtures("two_threads")
def test_auto_runs_serially_after_a_parallel_call_drew_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fan = asyncrpc.Fanout([_Sometimes(), _Sometimes()])
    lanes = FanoutPlan("threads", 2, 1)
    assert fan.plans[-1] == lanes
    with torch.no_grad():
        fan(torch.ones(2))  # the first call, serial: draws nothing
        _Plans(fan).pick(len(fan.plans) - 1)
        assert fan.plan == lanes and "threads" not in fan.declined
        fan(torch.ones(2))  # on the lanes, still nothing drawn
        with caplog.at_level(logging.WARNING, logger="asyncrpc"):
            fan(-torch.ones(2))  # drew on the lanes: caught after the call
        assert fan.plan == FanoutPlan("serial", 1, 2)
        assert (
            "drew random numbers" in fan.declined["threads"]
            and "not in member order" in caplog.text
        )
        torch.manual_seed(3)
        got = fan(-torch.ones(2))
        torch.manual_seed(3)
        assert all(
            torch.equal(a, m(-torch.ones(2))) for a, m in zip(got, fan.members, strict=True)
        )
    fan.close()


def test_the_vmap_engine_draws_the_same_numbers_for_the_same_seed() -> None:
    runs = []
    for _ in range(2):
        with asyncrpc.Fanout(members := _dropouts(), engine="vmap") as fan:
            runs.append(_train(members, fan))
            assert fan.plan is not None and fan.plan.engine == "vmap" and not fan.declined
    assert torch.equal(runs[0], runs[1])


# ---- copies: copy.deepcopy and pickle -----------------------------------------------


def _linears(n: int = 4) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(n)]


def _pointers(members: Any) -> set[int]:
    return {
        t.untyped_storage().data_ptr() for m in members for t in [*m.parameters(), *m.buffers()]
    }


@pytest.mark.parametrize("engine", ["auto", "threads", "vmap", "serial"])
def test_deepcopy_gives_a_new_fanout_over_copies_with_the_same_options(engine: str) -> None:
    members = _linears()
    names = [f"head {i}" for i in range(4)]
    fan = asyncrpc.Fanout(members, engine=engine, threads=2, names=names)  # type: ignore[arg-type]
    x = torch.rand(3, 8)
    with torch.no_grad():
        fan(x), fan(x)  # vmap: the members' tensors are rows of the stacks now
        copied = copy.deepcopy(fan)
        assert (copied.engine, copied.names, copied._options) == (engine, tuple(names), (2, False))
        assert all(c is not m for c, m in zip(copied.members, members, strict=True))
        assert not _pointers(copied.members) & _pointers(members)  # memory of its own
        if engine == "vmap":  # rows of the stacks: each copied tensor gets a block of its own
            assert fan._storage() is not None
            alone = copied_members(fan.members, rows_of(fan.members, fan._storage()))
            for t in [t for m in alone for t in [*m.parameters(), *m.buffers()]]:  # type: ignore[attr-defined]
                assert t.untyped_storage().nbytes() == t.nbytes
        for a, b in zip(copied(x), fan(x), strict=True):
            torch.testing.assert_close(a, b)
        copied.members[0][0].weight.add_(1)  # a copy's step leaves the original alone
        assert not torch.allclose(copied(x)[0], fan(x)[0])
    assert all(pool is not fan._pools.get(plan) for plan, pool in copied._pools.items())
    fan.close()
    copied.close()


def test_deepcopy_keeps_members_copied_alongside_the_fanout_one_object() -> None:
    members = _linears(2)
    fan = asyncrpc.Fanout(members, engine="threads")
    fan(torch.rand(1, 8))
    copied = copy.deepcopy({"fan": fan, "members": members})
    assert copied["fan"].members == tuple(copied["members"])
    fan.close()
    copied["fan"].close()


def test_pickle_gives_a_new_fanout_and_a_stacked_member_pickles_alone() -> None:
    members = [torch.nn.Linear(64, 64) for _ in range(8)]
    fan = asyncrpc.Fanout(members, engine="vmap", names=[f"q{i}" for i in range(8)])
    x = torch.rand(2, 64)
    with torch.no_grad():
        fan(x), fan(x)
    stacked = fan._stacked is not None and fan._stacked.storage is not None
    blob = pickle.dumps(fan)
    alone = len(pickle.dumps([torch.nn.Linear(64, 64) for _ in range(8)]))
    assert len(blob) < 1.5 * alone, (stacked, len(blob), alone)  # not 8 whole stacks
    loaded = pickle.loads(blob)
    assert (loaded.engine, loaded.names) == ("vmap", fan.names)
    with torch.no_grad():
        for a, b in zip(loaded(x), fan(x), strict=True):
            torch.testing.assert_close(a, b)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError), match="lambda"):
        pickle.dumps(asyncrpc.Fanout([lambda x: x, abs], engine="serial"))
    fan.close()
    loaded.close()
