"""Differential test: the "vmap" engine and "auto" agree with the members run one by one.

Hypothesis builds random same-architecture ensembles (Sequential chains,
other module classes, with and without buffers and dropout) and applies
random sequences of what users do between calls: optimizer steps (SGD with
momentum; Adam plain, foreach and fused), `.data` writes, Polyak updates,
`load_state_dict`, attribute and slope changes, train/eval switches,
`requires_grad` toggles, calls under grad, `no_grad` and `inference_mode`,
and dtype moves. Three copies of the ensemble take every step alike: one
behind `Fanout(engine="vmap")`, one behind `Fanout()` ("auto"), one called
member by member; after every call their outputs, `requires_grad` and state
must agree.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncrpc

pytestmark = pytest.mark.timeout(300)


class Residual(torch.nn.Module):
    """Not a chain: runs through torch.func.vmap. A plain attribute used in forward."""

    def __init__(self, dropout: bool) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.drop = torch.nn.Dropout(0.3) if dropout else torch.nn.Identity()
        self.scale = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.norm(x + self.scale * self.linear(x)))


class Normed(torch.nn.Module):
    """Buffers: BatchNorm's running statistics, and a counter updated in forward."""

    def __init__(self, dropout: bool) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)
        self.bn = torch.nn.BatchNorm1d(6)
        self.drop = torch.nn.Dropout(0.3) if dropout else torch.nn.Identity()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.drop(self.bn(self.linear(x)))


def chain(dropout: bool) -> torch.nn.Module:
    layers: list[torch.nn.Module] = [torch.nn.Linear(6, 8), torch.nn.LeakyReLU(0.1)]
    if dropout:
        layers.append(torch.nn.Dropout(0.3))  # not element-wise: the vmap path runs it
    return torch.nn.Sequential(*layers, torch.nn.Linear(8, 6), torch.nn.Tanh())


KINDS: dict[str, Callable[[bool], torch.nn.Module]] = {
    "chain": chain,
    "residual": Residual,
    "normed": Normed,
}

Step = tuple[str, int, int, float]  # what, member, seed, a number


def _steps() -> st.SearchStrategy[list[Step]]:
    what = st.sampled_from(
        ["call", "call", "call", "sgd", "adam", "adam-foreach", "adam-fused", "data",
         "polyak", "load", "attribute", "mode", "mode-all", "freeze", "dtype"]
    )  # fmt: skip
    number = st.floats(0.05, 0.95)
    return st.lists(
        st.tuples(what, st.integers(0, 3), st.integers(0, 10_000), number), min_size=3, max_size=9
    )


class Copies:
    """One copy of the ensemble and how it is called."""

    def __init__(self, members: list[torch.nn.Module], engine: str | None) -> None:
        self.members = members
        self.fan = asyncrpc.Fanout(members, engine=engine) if engine else None  # type: ignore[arg-type]

    def call(self, x: torch.Tensor) -> list[Any]:
        if self.fan is not None:
            return self.fan(x)
        return [m(x) for m in self.members]


def _build(kind: str, n: int, dropout: bool, seed: int) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    members = [KINDS[kind](dropout) for _ in range(n)]
    for m in members:
        for b in m.buffers():
            if b.is_floating_point() and b.dim() > 0:
                b.uniform_(0.5, 1.5)
    return [m.eval() for m in members]


def _apply(step: Step, copies: list[Copies], x: torch.Tensor) -> None:
    what, index, seed, number = step
    for c in copies:
        torch.manual_seed(seed)
        member = c.members[index % len(c.members)]
        _APPLY[what.split("-")[0]](c, member, what, number, x)


def _optimize(c: Copies, member: torch.nn.Module, what: str, number: float, x: Any) -> None:
    params = [p for m in c.members for p in m.parameters() if p.requires_grad]
    if not params or _drawing(c.members):  # dropout masks would differ: so would the steps
        return
    if what == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    else:
        kind = {"adam": {"foreach": False}, "adam-foreach": {"foreach": True}}
        opt = torch.optim.Adam(params, lr=0.01, eps=1e-3, **kind.get(what, {"fused": True}))
    for _ in range(2):
        opt.zero_grad()
        outputs = c.call(x.to(params[0].dtype))
        loss = sum(out.square().mean() for out in outputs if out.requires_grad)
        if isinstance(loss, torch.Tensor):
            loss.backward()
            opt.step()


def _write(c: Copies, member: torch.nn.Module, what: str, number: float, x: Any) -> None:
    for p in member.parameters():
        p.data.mul_(number).add_(torch.randn_like(p) * 0.1)


def _polyak(c: Copies, member: torch.nn.Module, what: str, number: float, x: Any) -> None:
    for m in c.members:
        for p in m.parameters():
            source = torch.randn_like(p)
            p.data.mul_(1 - number).add_(number * source)


def _load(c: Copies, member: torch.nn.Module, what: str, number: float, x: Any) -> None:
    fresh = copy.deepcopy(member)
    for p in fresh.parameters():
        p.data.normal_(0, 0.5)
    member.load_state_dict(fresh.state_dict(), assign=number > 0.5)


def _attribute(c: Copies, member: torch.nn.Module, what: str, number: float, x: Any) -> None:
    targets = c.members if number > 0.3 else [member]  # all alike, or one unlike the rest
    for m in targets:
        for sub in m.modules():
            if isinstance(sub, torch.nn.LeakyReLU):
                sub.negative_slope = number
            if isinstance(sub, Residual):
                sub.scale = number


def _mode(c: Copies, member: torch.nn.Module, what: str, number: float, x: Any) -> None:
    for m in c.members if what == "mode-all" else [member]:
        m.train(number > 0.5)


def _freeze(c: Copies, member: torch.nn.Module, what: str, number: float, x: Any) -> None:
    for p in member.parameters():
        p.requires_grad_(number > 0.5)


def _dtype(c: Copies, member: torch.nn.Module, what: str, number: float, x: Any) -> None:
    for m in c.members:
        m.to(torch.float64 if number > 0.5 else torch.float32)


def _call(c: Copies, member: torch.nn.Module, what: str, number: float, x: Any) -> None:
    pass  # every step ends in a compared call


_APPLY = {
    "call": _call, "sgd": _optimize, "adam": _optimize, "data": _write, "polyak": _polyak,
    "load": _load, "attribute": _attribute, "mode": _mode, "freeze": _freeze, "dtype": _dtype,
}  # fmt: skip


def _compare_call(copies: list[Copies], x: torch.Tensor, mode: str) -> None:
    dtype = next(copies[0].members[0].parameters()).dtype
    random = _drawing(copies[0].members)
    outputs = []
    for c in copies:
        torch.manual_seed(7)
        context = {
            "grad": torch.enable_grad(),
            "no_grad": torch.no_grad(),
            "inference": torch.inference_mode(),
        }[mode]
        with context:
            outputs.append(c.call(x.to(dtype)))
    reference = outputs[-1]
    for got in outputs[:-1]:
        assert len(got) == len(reference)
        for a, b in zip(got, reference, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert a.requires_grad == b.requires_grad, (mode, a.requires_grad, b.requires_grad)
            if not random:  # dropout in training: masks are drawn, not compared
                torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-4, atol=1e-4)
    _compare_state(copies)


def _drawing(members: list[torch.nn.Module]) -> bool:
    """True when some member's dropout is in training: its outputs are random."""
    return any(
        isinstance(sub, torch.nn.Dropout) and sub.training for m in members for sub in m.modules()
    )


def _compare_state(copies: list[Copies]) -> None:
    reference = copies[-1].members
    for c in copies[:-1]:
        for ours, theirs in zip(c.members, reference, strict=True):
            mine = dict(ours.named_parameters()) | dict(ours.named_buffers())
            for name, tensor in [*theirs.named_parameters(), *theirs.named_buffers()]:
                other = mine[name]
                assert other.requires_grad == tensor.requires_grad, name
                torch.testing.assert_close(other.detach(), tensor.detach(), rtol=1e-4, atol=1e-4)
            assert ours.training == theirs.training


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    kind=st.sampled_from(sorted(KINDS)),
    n=st.integers(2, 4),
    dropout=st.booleans(),
    seed=st.integers(0, 1000),
    steps=_steps(),
    modes=st.lists(st.sampled_from(["grad", "no_grad", "inference"]), min_size=9, max_size=9),
)
def test_the_engines_agree_with_the_members_whatever_happens_between_calls(
    kind: str, n: int, dropout: bool, seed: int, steps: list[Step], modes: list[str]
) -> None:
    base = _build(kind, n, dropout, seed)
    copies = [
        Copies(copy.deepcopy(base), "vmap"),
        Copies(copy.deepcopy(base), "auto"),
        Copies(copy.deepcopy(base), None),  # the reference: one by one
    ]
    torch.manual_seed(seed)
    x = torch.rand(5, 6)
    _compare_call(copies, x, "no_grad")
    for step, mode in zip(steps, modes, strict=False):
        _apply(step, copies, x)
        _compare_call(copies, x, mode)
    for c in copies:
        if c.fan is not None:
            c.fan.close()
    _compare_state(copies)
