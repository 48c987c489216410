"""The "vmap" engine: members of one architecture as one batched call over stacked weights."""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Callable
from typing import ClassVar

import pytest
import torch

import asyncrpc
from asyncrpc import FanoutPlan
from asyncrpc._fanout import _stacked

from conftest import ROOT, run_program

pytestmark = pytest.mark.timeout(120)

Factory = Callable[[], torch.nn.Module]


def mlp() -> torch.nn.Module:
    """A Linear/activation chain: the engine's own batched GEMMs."""
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 3),
    )  # fmt: skip


class Residual(torch.nn.Module):
    """Any module: torch.func.vmap over the stacked parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.norm(x + scale * self.linear(x)).relu()


class TwoHeads(torch.nn.Module):
    """Returns a tuple and a dict; holds buffers (BatchNorm, used in eval)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        h = self.body(x)
        return h, {"logits": self.head(h)}


def _members(factory: Factory, n: int = 4) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    members = [factory() for _ in range(n)]
    for member in members:
        for buffer in member.buffers():
            if buffer.is_floating_point():
                buffer.uniform_(0.5, 1.5)  # running stats that differ from member to member
        member.eval()
    return members


def _leaves(out: object) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [leaf for item in out for leaf in _leaves(item)]
    assert isinstance(out, dict)
    return [leaf for value in out.values() for leaf in _leaves(value)]


def _assert_close(got: list[object], want: list[object]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert type(a) is type(b)
        for x, y in zip(_leaves(a), _leaves(b), strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
            assert x.requires_grad == y.requires_grad


@pytest.mark.parametrize("factory", [mlp, Residual, TwoHeads], ids=["chain", "vmap", "pytree"])
def test_vmap_gives_the_members_outputs_and_gradients(factory: Factory) -> None:
    members = _members(factory)
    x = torch.rand(5, 8, requires_grad=True)
    fan = asyncrpc.Fanout(members, engine="vmap")
    assert fan.plan == FanoutPlan("vmap", 1, torch.get_num_threads()) and not fan.declined
    got, want = fan(x), [m(x) for m in members]
    _assert_close(got, want)

    def grads(outputs: list[object]) -> list[torch.Tensor]:
        loss = sum((leaf**2).sum() for out in outputs for leaf in _leaves(out))
        assert isinstance(loss, torch.Tensor)
        params = [p for m in members for p in m.parameters()]
        return list(torch.autograd.grad(loss, [x, *params]))

    for ours, theirs in zip(grads(got), grads(want), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    assert fan.plan is not None and fan.plan.engine == "vmap"  # still stacked, nothing declined
    with torch.no_grad():
        _assert_close(fan(x), [m(x) for m in members])


def test_map_stacks_each_members_own_input_and_keyword_arguments_reach_all() -> None:
    for factory in (mlp, Residual):
        members = _members(factory, 3)
        inputs = [torch.rand(4, 8) for _ in members]
        with torch.no_grad():
            fan = asyncrpc.Fanout(members, engine="vmap")
            want = [m(x) for m, x in zip(members, inputs, strict=True)]
            _assert_close(fan.map([(x,) for x in inputs]), want)
    members = _members(Residual, 3)
    x = torch.rand(4, 8)
    with torch.no_grad():
        fan = asyncrpc.Fanout(members, engine="vmap")
        _assert_close(fan(x, scale=0.5), [m(x, scale=0.5) for m in members])
        # inputs of different shapes cannot be stacked: that call runs member by member
        uneven = [(torch.rand(i + 1, 8),) for i in range(3)]
        _assert_close(fan.map(uneven), [m(*a) for m, a in zip(members, uneven, strict=True)])
    assert not fan.declined


def test_an_optimizer_step_on_a_member_is_seen_by_the_next_call() -> None:
    members = _members(mlp, 3)
    fan = asyncrpc.Fanout(members, engine="vmap")
    x = torch.rand(2, 8)
    with torch.no_grad():
        before = fan(x)
    optimizer = torch.optim.SGD(members[1].parameters(), lr=0.5)
    members[1](x).sum().backward()
    optimizer.step()
    with torch.no_grad():
        after = fan(x)
        _assert_close(after, [m(x) for m in members])
    torch.testing.assert_close(after[0], before[0])
    assert not torch.allclose(after[1], before[1])


def test_a_replaced_parameter_or_new_data_is_seen_by_the_next_call() -> None:
    members = _members(mlp, 3)
    fan = asyncrpc.Fanout(members, engine="vmap")
    x = torch.rand(2, 8)
    with torch.no_grad():
        fan(x)
        first = members[1][0]
        first.weight = torch.nn.Parameter(torch.zeros_like(first.weight))  # another object
        _assert_close(fan(x), [m(x) for m in members])
        members[2][2].weight.data = torch.ones_like(members[2][2].weight)  # other data
        _assert_close(fan(x), [m(x) for m in members])
    assert not fan.declined


def test_training_and_eval_mode_follow_the_members() -> None:
    members = _members(TwoHeads, 3)
    x = torch.rand(6, 8)
    fan = asyncrpc.Fanout(members, engine="vmap")
    with torch.no_grad():
        _assert_close(fan(x), [m(x) for m in members])  # eval: running stats, stacked
        for member in members:
            member.train()
        copies = [TwoHeads() for _ in members]
        for copy, member in zip(copies, members, strict=True):
            copy.load_state_dict(member.state_dict())
        got = fan(x)  # BatchNorm updates its buffers in training: member by member
        _assert_close(got, [c.train()(x) for c in copies])
        for copy, member in zip(copies, members, strict=True):
            torch.testing.assert_close(copy.body[1].running_mean, member.body[1].running_mean)
    assert not fan.declined  # only those calls ran unstacked


def test_a_chain_runs_stacked_whatever_its_members_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    members = _members(mlp, 3)  # Linear and element-wise layers: no mode of their own
    members[1].train()
    members[2][0].train()
    chains = _count_calls(monkeypatch, "_run_chain")
    x = torch.rand(5, 8)
    fan = asyncrpc.Fanout(members, engine="vmap")
    with torch.no_grad():
        _assert_close(fan(x), [m(x) for m in members])
        _assert_close(fan(x), [m(x) for m in members])
    assert not fan.declined and len(chains) == 2  # both calls ran as one stacked chain


def test_forward_hooks_are_run_never_skipped() -> None:
    members = _members(mlp, 3)
    members[1][2].register_forward_hook(lambda module, args, out: out * 0)
    x = torch.rand(5, 8)
    fan = asyncrpc.Fanout(members, engine="vmap")
    with torch.no_grad():
        _assert_close(fan(x), [m(x) for m in members])
    assert "member 1's layer '2' has forward hooks" in fan.declined["vmap"]
    plain = _members(mlp, 3)
    fan = asyncrpc.Fanout(plain, engine="vmap")
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: out + 1 if isinstance(module, torch.nn.Linear) else None
    )
    try:
        with torch.no_grad():
            _assert_close(fan(x), [m(x) for m in plain])  # hooked: member by member
    finally:
        handle.remove()
    assert not fan.declined  # only that call ran unstacked


class Branchy(torch.nn.Module):
    """Data-dependent control flow: vmap cannot run it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y if y.sum() > 0 else -y


class Scaled(torch.nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.k = k  # a setting outside the parameters: members must agree on it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.k * self.linear(x)


def test_members_vmap_cannot_run_fall_back_with_the_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    members = _members(Branchy, 3)
    x = torch.rand(2, 8)
    with caplog.at_level(logging.WARNING, logger="asyncrpc"):
        fan = asyncrpc.Fanout(members, engine="vmap")
        with torch.no_grad():
            _assert_close(fan(x), [m(x) for m in members])  # the very call that found out
            _assert_close(fan(x), [m(x) for m in members])
    assert "data-dependent control flow" in fan.declined["vmap"]
    assert fan.plan == FanoutPlan("serial", 1, torch.get_num_threads())
    assert "engine 'vmap' declined" in caplog.text


@pytest.mark.parametrize(
    ("members", "reason"),
    [
        (lambda: [torch.nn.LSTM(4, 4) for _ in range(2)], "2x slower than one by one"),
        (lambda: [Scaled(1.0), Scaled(2.0)], "member 1's module.k differs"),
        (lambda: [mlp(), Residual()], "member 1 is a Residual"),
        (lambda: [torch.nn.Linear(2, 3), torch.nn.Linear(2, 4)], "differs in shape: (4, 2)"),
        (
            lambda: [torch.nn.Linear(2, 3), torch.nn.Linear(2, 3).double()],
            "differs in dtype: torch.float64, member 0's torch.float32",
        ),
        (
            lambda: [torch.nn.Linear(2, 3), torch.nn.Linear(2, 3, device="meta")],
            "member 1's weight is on meta, member 0's on cpu: a stacked call runs on one device",
        ),
        (lambda: [torch.nn.ReLU(), torch.nn.ReLU()], "no parameters"),
        (lambda: [abs, abs], "not an nn.Module"),
    ],
    ids=[
        "lstm",
        "settings",
        "classes",
        "shapes",
        "dtypes",
        "devices",
        "no-parameters",
        "functions",
    ],
)
def test_members_that_cannot_be_stacked_are_declined_up_front(
    members: Callable[[], list[Callable[..., object]]], reason: str
) -> None:
    fan = asyncrpc.Fanout(members(), engine="vmap")
    assert reason in fan.declined["vmap"], fan.declined
    assert fan.plans == (FanoutPlan("serial", 1, torch.get_num_threads()),)
    auto = asyncrpc.Fanout(members())
    assert "vmap" in auto.declined
    assert all(plan.engine != "vmap" for plan in auto.plans)


_TRAINING_STEPS = [0]  # outside the members: no rule reads it, the first call's check does


def test_a_different_output_from_the_stacked_call_declines_it() -> None:
    class Counting(torch.nn.Module):
        """Stackable by every rule, but its output depends on how often it ran under grad."""

        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if torch.is_grad_enabled():
                _TRAINING_STEPS[0] += 1
            return self.linear(x) + _TRAINING_STEPS[0]

    members = [Counting() for _ in range(2)]
    fan = asyncrpc.Fanout(members, engine="vmap")
    assert not fan.declined
    out = fan(torch.ones(1, 2))
    assert "stacked outputs differ" in fan.declined["vmap"]
    assert fan.plan is not None and fan.plan.engine == "serial"
    assert len(out) == 2  # that call's results are the members' own


@pytest.mark.usefixtures("two_threads")
def test_auto_times_vmap_among_every_plan() -> None:
    members = _members(mlp, 8)
    fan = asyncrpc.Fanout(members)
    assert [plan.engine for plan in fan.plans] == ["serial", "vmap", "threads"]
    x = torch.rand(1, 8)
    with torch.no_grad():
        for _ in range(200):
            out = fan(x)
            if fan.plan is not None:
                break
        _assert_close(out, [m(x) for m in members])
    assert fan.plan is not None
    timings = fan.timings()
    assert all(len(seconds) >= 3 for seconds in timings.values()), timings
    assert len(timings) == 3


def test_an_ensemble_runs_on_the_vmap_engine() -> None:
    ensemble = asyncrpc.Ensemble(mlp, 4, engine="vmap", combine="stack", seed=3)
    x = torch.rand(2, 8)
    members = []
    for i in range(4):
        torch.manual_seed(3 + i)
        members.append(mlp())
    with torch.no_grad():
        torch.testing.assert_close(ensemble(x), torch.stack([m(x) for m in members]))


def test_a_chain_given_a_sequence_input_runs_through_vmap() -> None:
    members = _members(mlp, 3)
    fan = asyncrpc.Fanout(members, engine="vmap")
    x = torch.rand(6, 2, 8)  # (T, B, C): not the rows the batched GEMMs take
    with torch.no_grad():
        _assert_close(fan(x), [m(x) for m in members])
        _assert_close(fan(x[0]), [m(x[0]) for m in members])  # rows again
    assert not fan.declined


@pytest.mark.subprocess
def test_the_q_ensemble_example_checks_itself() -> None:
    done = run_program("python", str(ROOT / "examples" / "q_ensemble.py"), timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "plan: vmap (" in done.stdout, done.stdout
    assert "8 outputs equal to the members' own: True" in done.stdout, done.stdout
    assert "fused Adam step on the members: stacked call sees it: True" in done.stdout
    assert "Polyak update of the target ensemble: stacked call sees it: True" in done.stdout
    assert re.search(r"one by one \d+ us, vmap engine \d+ us per call", done.stdout)


# ---- the allowlist: only what the engine can prove is stacked ---------------------------


def _grads(members: list[torch.nn.Module], outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    loss = sum(out.square().sum() for out in outputs)
    assert isinstance(loss, torch.Tensor)
    params = [p for m in members for p in m.parameters()]
    return list(torch.autograd.grad(loss, params))


@pytest.mark.parametrize("kind", ["full", "pre"])
def test_backward_hooks_decline_and_scale_the_gradients_as_the_members_do(kind: str) -> None:
    members, twins = _members(mlp, 3), _members(mlp, 3)
    for group in (members, twins):
        if kind == "full":
            group[1][3].register_full_backward_hook(lambda m, gin, gout: (gin[0] * 4.5,))
        else:
            group[1][3].register_full_backward_pre_hook(lambda m, gout: (gout[0] * 4.5,))
    fan = asyncrpc.Fanout(members, engine="vmap")
    register = "register_full_backward_hook" if kind == "full" else "pre_hook"
    assert "member 1's layer '3' has backward" in fan.declined["vmap"]
    assert register in fan.declined["vmap"]
    x = torch.rand(5, 8)
    got = _grads(members, fan(x))
    want = _grads(twins, [m(x) for m in twins])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


class Configured(torch.nn.Module):
    """Settings read in forward: a pair of bounds and a temperature."""

    def __init__(self, bounds: object, cfg: object) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.bounds = bounds
        self.cfg = cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        temperature = self.cfg["temperature"] if isinstance(self.cfg, dict) else self.cfg
        return self.linear(x).clamp(*self.bounds) / temperature  # type: ignore[misc]


@pytest.mark.parametrize(
    ("bounds", "cfg", "reason"),
    [
        ([-1.0, 1.0], 1.0, "module holds attribute 'bounds', a list"),
        ((-1.0, 1.0), {"temperature": 1.0}, "module holds attribute 'cfg', a dict"),
    ],
    ids=["list", "dict"],
)
def test_a_mutable_setting_declines_and_a_change_inside_it_is_seen(
    bounds: object, cfg: object, reason: str
) -> None:
    members = [Configured(copy.deepcopy(bounds), copy.deepcopy(cfg)) for _ in range(3)]
    fan = asyncrpc.Fanout(members, engine="vmap")
    assert reason in fan.declined["vmap"]
    x = torch.rand(5, 8)
    with torch.no_grad():
        fan(x)
        if isinstance(bounds, list):
            members[1].bounds[0] = 5  # type: ignore[index]
        else:
            members[1].cfg["temperature"] = 0.1  # type: ignore[index]
        _assert_close(fan(x), [m(x) for m in members])


def test_immutable_settings_are_stacked_and_a_rebinding_is_seen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    members = [Configured((-1.0, 1.0), 1.0) for _ in range(3)]
    vmapped = _count_calls(monkeypatch, "_run_vmap")
    fan = asyncrpc.Fanout(members, engine="vmap")
    x = torch.rand(5, 8)
    with torch.no_grad():
        _assert_close(fan(x), [m(x) for m in members])
        members[1].bounds = (5.0, 6.0)  # one member unlike the rest: member by member
        _assert_close(fan(x), [m(x) for m in members])
        members[1].bounds = [-1.0, 1.0]  # rebound to a list: member by member too
        _assert_close(fan(x), [m(x) for m in members])
        members[1].bounds = (-1.0, 1.0)
        _assert_close(fan(x), [m(x) for m in members])
    assert not fan.declined and len(vmapped) == 2  # the first call's check, the last call


def _count_calls(monkeypatch: pytest.MonkeyPatch, method: str) -> list[int]:
    """A list that grows by one at each call of `Stacked.<method>` (a stacked run's path)."""
    calls: list[int] = []
    run = getattr(_stacked.Stacked, method)
    monkeypatch.setattr(_stacked.Stacked, method, lambda *a: calls.append(1) or run(*a))
    return calls


def _tensor_hook(members: list[torch.nn.Module]) -> object:
    return members[2][0].weight.register_hook(lambda grad: grad * 4.5)


@pytest.mark.parametrize(
    "register",
    [
        lambda ms: ms[2][2].register_forward_hook(lambda m, a, out: out * 2),
        lambda ms: ms[2][0].register_forward_pre_hook(lambda m, a: (a[0] * 2,)),
        lambda ms: ms[2][3].register_full_backward_hook(lambda m, gin, gout: (gin[0] * 4.5,)),
        lambda ms: ms[2][3].register_full_backward_pre_hook(lambda m, gout: (gout[0] * 4.5,)),
        _tensor_hook,
        lambda ms: torch.nn.modules.module.register_module_full_backward_hook(
            lambda m, gin, gout: tuple(None if g is None else g * 4.5 for g in gin)
        ),
        lambda ms: torch.nn.modules.module.register_module_forward_pre_hook(
            lambda m, a: (a[0] * 2,) if isinstance(m, torch.nn.Linear) else None
        ),
    ],
    ids=[
        "forward",
        "forward-pre",
        "backward",
        "backward-pre",
        "tensor",
        "global-backward",
        "global-pre",
    ],
)
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_a_hook_added_after_the_first_call_runs_and_its_removal_stacks_again(
    register: Callable[[list[torch.nn.Module]], object], monkeypatch: pytest.MonkeyPatch
) -> None:
    members, twins = _members(mlp, 3), _members(mlp, 3)
    chains = _count_calls(monkeypatch, "_run_chain")
    fan = asyncrpc.Fanout(members, engine="vmap")
    x = torch.rand(5, 8)
    fan(x)
    stacked = len(chains)
    handles = [register(members), register(twins)]
    try:
        got, want = fan(x), [m(x) for m in twins]
        _assert_close(got, want)
        for a, b in zip(_grads(members, got), _grads(twins, want), strict=True):
            torch.testing.assert_close(a, b)
        assert len(chains) == stacked  # that call ran member by member
    finally:
        for handle in handles:
            handle.remove()  # type: ignore[attr-defined]
    _assert_close(fan(x), [m(x) for m in twins])
    assert len(chains) == stacked + 1 and not fan.declined  # stacked again


class Overrides(Residual):
    def train(self, mode: bool = True) -> Overrides:
        return super().train(mode)


class Listed(Residual):
    sizes: ClassVar[list[int]] = [8, 8]  # shared by every instance, and mutable


def _state_dict_hooked() -> list[torch.nn.Module]:
    members = _members(Residual, 2)
    members[1].register_state_dict_post_hook(lambda m, sd, prefix, meta: None)  # type: ignore[no-untyped-call]
    return members


@pytest.mark.parametrize(
    ("members", "reason"),
    [
        (lambda: _members(Overrides, 2), "Overrides defines train"),
        (lambda: _members(Listed, 2), "Listed.sizes is a list"),
        (
            lambda: _members(
                lambda: torch.nn.Sequential(Residual(), torch.nn.InstanceNorm1d(8)), 2
            ),
            "layer '1' is an InstanceNorm1d, a torch layer the vmap engine does not know",
        ),
        (_state_dict_hooked, "member 1's module has state dict hooks"),
    ],
    ids=["override", "class-list", "unknown-layer", "state-dict-hook"],
)
def test_what_the_engine_cannot_prove_is_declined_with_the_reason(
    members: Callable[[], list[torch.nn.Module]], reason: str
) -> None:
    built = members()
    fan = asyncrpc.Fanout(built, engine="vmap")
    assert reason in fan.declined["vmap"], fan.declined
    x = torch.rand(3, 8)
    with torch.no_grad():
        _assert_close(fan(x), [m(x) for m in built])


def test_a_user_class_that_passes_the_proof_is_stacked() -> None:
    class Subclassed(Residual):  # a class of the user's own, over another: forward only
        scale = 2.0  # an immutable class-level setting

        def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            return self._helper(super().forward(x, scale))

        def _helper(self, h: torch.Tensor) -> torch.Tensor:
            return h * self.scale

    members = _members(Subclassed, 3)
    fan = asyncrpc.Fanout(members, engine="vmap")
    x = torch.rand(5, 8)
    with torch.no_grad():
        _assert_close(fan(x), [m(x) for m in members])
        _assert_close(fan(x), [m(x) for m in members])
    assert not fan.declined and fan._stacked is not None and fan._stacked.storage is not None


def test_a_parametrization_registered_after_stacking_declines_on_the_next_call() -> None:
    members = [
        torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        for _ in range(3)
    ]
    fan = asyncrpc.Fanout(members, engine="vmap")
    x = torch.rand(5, 4)
    with torch.no_grad():
        fan(x)
        torch.nn.utils.parametrizations.weight_norm(members[2][2])  # moves 'weight' away
        _assert_close(fan(x), [m(x) for m in members])  # was a KeyError from the release
    assert "parametrize" in fan.declined["vmap"], fan.declined
