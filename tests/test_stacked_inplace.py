"""Differential test: in-place changes, shared memory and saved state on the "vmap" engine.

Hypothesis draws random sequences of stacked calls (the whole ensemble, or a
subset `Fanout` over its first members, as REDQ does), under grad or
`no_grad`; in-place changes to the members' weights between forward and
backward (an SGD step, `mul_`, `add_` on a bias, a `.data` write); in-place
changes to the outputs (`masked_fill_`); members in shared memory; and
`torch.save(member.state_dict())` sizes and `copy.deepcopy(member)`. A twin
of the ensemble takes every step member by member; after every call their
outputs, whether backward raises torch's own "modified by an inplace
operation" error, the gradients and the state must agree.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncrpc

pytestmark = pytest.mark.timeout(300)

MEMBERS, SUBSET = 3, 2
INPLACE = "modified by an inplace operation"


def _ensemble() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [
        torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        for _ in range(MEMBERS)
    ]


def _sgd(m: torch.nn.Module) -> None:
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    torch.optim.SGD(m.parameters(), lr=0.1).step()


CHANGES: dict[str, Callable[[torch.nn.Module], Any]] = {
    "none": lambda m: None,
    "sgd": _sgd,
    "mul_": lambda m: m[2].weight.mul_(0.5),
    "bias.add_": lambda m: m[2].bias.add_(1.0),  # no op saves a bias: no error either way
    "first.mul_": lambda m: m[0].weight.mul_(0.5),  # saved only when the input needs grad
    "data": lambda m: m[2].weight.data.mul_(2.0),  # not counted by autograd, either way
}

_CALL = st.tuples(
    st.just("call"),
    st.booleans(),  # the subset Fanout
    st.booleans(),  # gradients on
    st.booleans(),  # the input needs grad
    st.booleans(),  # outputs changed in place
    st.sampled_from(sorted(CHANGES)),
    st.integers(0, MEMBERS - 1),  # the member changed
)
_STEPS = st.lists(st.one_of(_CALL, st.tuples(st.just("sizes"))), min_size=1, max_size=7)


def _outcome(outputs: list[torch.Tensor]) -> str | None:
    try:
        sum(out.sum() for out in outputs).backward()  # type: ignore[union-attr]
    except RuntimeError as error:
        assert INPLACE in str(error), error  # torch's own error, nothing else
        return INPLACE
    return None


def _saved(obj: object) -> int:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return len(buffer.getvalue())


def _run(
    fan: asyncrpc.Fanout | None,
    members: list[torch.nn.Module],
    x: torch.Tensor,
    step: tuple[Any, ...],
) -> tuple[list[torch.Tensor], str | None, list[torch.Tensor | None]]:
    """One call, the change between forward and backward, and backward: by `fan` or one by one."""
    _, subset, grad, _, fill, change, who = step
    called = members[:SUBSET] if subset else members
    for m in members:
        m.zero_grad()
    with torch.set_grad_enabled(grad):
        outputs = fan(x) if fan is not None else [m(x) for m in called]
    if fill:
        for out in outputs:
            out.masked_fill_(out > 0, -1.0)
    with torch.no_grad():  # a member called: one's change is every stacked member's (docs)
        CHANGES[change](called[who % len(called)])
    raised = _outcome(outputs) if grad and outputs[0].requires_grad else None
    return outputs, raised, [p.grad for m in called for p in m.parameters()]


def _call(
    fan: asyncrpc.Fanout,
    members: list[torch.nn.Module],
    twins: list[torch.nn.Module],
    step: tuple[Any, ...],
) -> None:
    x = torch.rand(5, 4, requires_grad=step[3])
    got, got_raised, got_grads = _run(fan, members, x, step)
    want, want_raised, want_grads = _run(None, twins, x, step)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert a.requires_grad == b.requires_grad
    assert got_raised == want_raised, (step, got_raised, want_raised)
    if got_raised:
        return  # backward stopped part way: which gradients landed is torch's order
    for c, d in zip(got_grads, want_grads, strict=True):
        assert (c is None) == (d is None)
        if c is not None and d is not None:
            torch.testing.assert_close(c, d, rtol=1e-5, atol=1e-6)


def _sizes(members: list[torch.nn.Module], twins: list[torch.nn.Module]) -> None:
    for member, twin in zip(members, twins, strict=True):
        assert abs(_saved(member.state_dict()) - _saved(twin.state_dict())) < 2048
        copied = copy.deepcopy(member)
        assert all(p.untyped_storage().nbytes() == p.nbytes for p in copied.parameters())


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=_STEPS, shared=st.booleans())
def test_in_place_changes_shared_memory_and_saved_state_agree_with_the_members(
    steps: list[tuple[Any, ...]], shared: bool
) -> None:
    members, twins = _ensemble(), _ensemble()
    if shared:
        for m in members:
            m.share_memory()
    fan = asyncrpc.Fanout(members, engine="vmap")
    subset = asyncrpc.Fanout(members[:SUBSET], engine="vmap")
    with torch.no_grad():  # the first calls run one by one and check: stacked from here on
        fan(torch.rand(5, 4))
        subset(torch.rand(5, 4))
    for step in steps:
        if step[0] == "sizes":
            _sizes(members, twins)
            continue
        _call(subset if step[1] else fan, members, twins, step)
    for m, t in zip(members, twins, strict=True):
        for a, b in zip(m.parameters(), t.parameters(), strict=True):
            torch.testing.assert_close(a.detach(), b.detach())
    assert ("vmap" in fan.declined) == shared, fan.declined
    if shared:
        assert all(p.is_shared() for m in members for p in m.parameters())
    fan.close()
    subset.close()
