"""The "vmap" engine in real training: what RL libraries build, the actor update, one optimizer.

- an input computed with gradients (the SAC/TD3/REDQ actor update's
  `cat([s, actor(s)])`) is checked and stacked, its gradients reaching the actor;
- what libraries build stacks: an nn.Sequential subclass holding a class, a
  list and a dict its forward never names (torchrl's MLP), settings that are
  functions, partials and classes, abc.ABC bases; what cannot be proved is
  declined with a reason that says what works;
- `Fanout.parameters()`: one optimizer over the stacks trains every member as
  a loop does, wherever `zero_grad` is called and whichever way a call runs;
- `"auto"` settles within the bound the docs state.
"""

from __future__ import annotations

import abc
import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

import asyncrpc

pytestmark = pytest.mark.timeout(120)


def critic(width: int = 16) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(6, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)
    )


def _stacked(outputs: list[torch.Tensor]) -> bool:
    """True when the outputs are rows of one stacked result (a stacked call made them)."""
    bases = {id(out._base) for out in outputs}
    return len(bases) == 1 and outputs[0]._base is not None


def test_the_actor_update_input_is_checked_and_stacked_and_its_gradients_reach_the_actor() -> None:
    torch.manual_seed(0)
    critics = [critic() for _ in range(4)]
    loop = copy.deepcopy(critics)
    actor, loop_actor = torch.nn.Linear(4, 2), None
    loop_actor = copy.deepcopy(actor)
    fan = asyncrpc.Fanout(critics, engine="vmap")
    s = torch.rand(8, 4)
    for call in range(3):
        actor.zero_grad()
        loop_actor.zero_grad()
        q = fan(torch.cat([s, actor(s)], -1))  # a non-leaf that needs gradients
        assert call == 0 or _stacked(q), call  # the first call checks, the others stack
        torch.stack(q).mean().neg().backward()
        mine = torch.cat([s, loop_actor(s)], -1)
        torch.stack([c(mine) for c in loop]).mean().neg().backward()
        assert actor.weight.grad is not None and loop_actor.weight.grad is not None
        torch.testing.assert_close(actor.weight.grad, loop_actor.weight.grad)
    assert fan.declined == {}


class LibraryMLP(torch.nn.Sequential):
    """As torchrl's MLP: settings only __init__ reads (a list, a dict, a class)."""

    def __init__(self) -> None:
        self.in_features, self.out_features = 6, 2
        self.num_cells = [16, 16]
        self.activation_class = torch.nn.Tanh
        self.activation_kwargs: dict[str, Any] = {}
        super().__init__(*self._make_net())

    def _make_net(self) -> list[torch.nn.Module]:
        layers: list[torch.nn.Module] = []
        width = self.in_features
        for cells in self.num_cells:
            layers += [
                torch.nn.Linear(width, cells),
                self.activation_class(**self.activation_kwargs),
            ]
            width = cells
        return [*layers, torch.nn.Linear(width, self.out_features)]

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if len(inputs) > 1:
            inputs = (torch.cat([*inputs], -1),)
        return super().forward(*inputs)  # type: ignore[no-any-return]


class Squash(torch.nn.Module, abc.ABC):
    @abc.abstractmethod
    def squash(self, x: torch.Tensor) -> torch.Tensor: ...


class FunctionalHead(Squash):
    """A function, a partial and a class as settings; an abstract base."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 2)
        self.act = torch.nn.functional.relu
        self.leaky = functools.partial(torch.nn.functional.leaky_relu, negative_slope=0.2)
        self.kind = torch.nn.Tanh

    def squash(self, x: torch.Tensor) -> torch.Tensor:
        return self.leaky(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.squash(self.act(self.linear(x)) - 0.1)


def normed() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.SiLU(), torch.nn.Linear(16, 2)
    )


@pytest.mark.parametrize(
    "make",
    [LibraryMLP, FunctionalHead, normed],
    ids=["torchrl-mlp", "functional-abc", "layernorm"],
)
def test_what_libraries_build_is_stacked_and_equals_the_members(
    make: Callable[[], torch.nn.Module],
) -> None:
    torch.manual_seed(1)
    members = [make() for _ in range(3)]
    for m in members:  # each member its own LayerNorm affine
        for p in m.parameters():
            p.data.add_(torch.randn_like(p) * 0.1)
    fan = asyncrpc.Fanout(members, engine="vmap")
    x = torch.rand(5, 6, requires_grad=True)
    for _ in range(3):
        got = fan(x)
    assert fan.declined == {} and _stacked(got)
    torch.stack(got).sum().backward()
    stacked_grads = [p.grad.clone() for m in members for p in m.parameters()]  # type: ignore[union-attr]
    for m in members:
        m.zero_grad()
    want = [m(x) for m in members]
    torch.stack(want).sum().backward()
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    own = [p.grad for m in members for p in m.parameters()]
    for a, b in zip(stacked_grads, own, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class HandsOnSelf(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 2)
        self.cfg = {"scale": 1.0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _scaled(self, self.linear(x))  # self handed on: cfg may be read


def _scaled(module: HandsOnSelf, y: torch.Tensor) -> torch.Tensor:
    return y * module.cfg["scale"]


class ReadsByName(HandsOnSelf):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * getattr(self, "cfg")["scale"]  # noqa: B009


@pytest.mark.parametrize("kind", [HandsOnSelf, ReadsByName], ids=["hands-on-self", "getattr"])
def test_a_setting_that_code_may_read_unseen_is_declined_with_what_works(kind: type) -> None:
    fan = asyncrpc.Fanout([kind() for _ in range(2)], engine="vmap")
    reason = fan.declined["vmap"]
    assert "holds attribute 'cfg', a dict" in reason, reason
    assert "the nn.Sequential inside" in reason and "immutable value" in reason, reason


def test_declines_name_what_failed_in_plain_words() -> None:
    gru = asyncrpc.Fanout([torch.nn.GRU(2, 2) for _ in range(2)], engine="vmap")
    assert gru.declined["vmap"].startswith("member 0 holds a GRU:"), gru.declined
    lstm = asyncrpc.Fanout([torch.nn.LSTM(2, 2) for _ in range(2)], engine="vmap")
    assert lstm.declined["vmap"].startswith("member 0 holds an LSTM:"), lstm.declined
    normed = [critic() for _ in range(2)]
    for member in normed:
        torch.nn.utils.parametrizations.weight_norm(member[0])
    reason = asyncrpc.Fanout(normed, engine="vmap").declined["vmap"]
    assert "layer '0' is parametrized" in reason and "engine='threads'" in reason, reason
    assert "none to stack" not in reason
    compiled = [torch.compile(critic()) for _ in range(2)]  # compiles lazily: nothing runs
    reason = asyncrpc.Fanout(compiled, engine="vmap").declined["vmap"]  # type: ignore[arg-type]
    assert "compiled" in reason and "_orig_mod" in reason, reason


def test_a_member_without_forward_is_refused_when_the_fanout_is_made() -> None:
    class NoForward(torch.nn.Module):
        pass

    with pytest.raises(TypeError, match=r"member 1 \(NoForward\) has no forward"):
        asyncrpc.Fanout([critic(), NoForward()])


def _train(
    fan: asyncrpc.Fanout,
    members: list[torch.nn.Module],
    loop: list[torch.nn.Module],
    steps: int,
    between: Callable[[int], Any] = lambda step: None,
) -> None:
    opt = torch.optim.Adam(fan.parameters(), lr=0.01)
    loop_opt = torch.optim.Adam([p for c in loop for p in c.parameters()], lr=0.01)
    for step in range(steps):
        x, y = torch.rand(8, 6), torch.rand(8, 1)
        hook = between(step)
        if step % 4 == 2:  # one input each, of different shapes: member by member
            got = fan.map([(x,), (x[:5],), (x,)])
            want = [loop[0](x), loop[1](x[:5]), loop[2](x)]
        else:
            got, want = fan(x), [c(x) for c in loop]
        if hook is not None:
            hook.remove()
        opt.zero_grad()  # after the forward, as CleanRL writes it
        loop_opt.zero_grad()
        sum((out - y[: len(out)]).pow(2).mean() for out in got).backward()
        sum((out - y[: len(out)]).pow(2).mean() for out in want).backward()
        for ours, theirs in zip(members, loop, strict=True):
            for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
                assert p.grad is not None and q.grad is not None
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
        opt.step()
        loop_opt.step()
    for ours, theirs in zip(members, loop, strict=True):
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_one_optimizer_over_the_stacks_trains_every_member_as_a_loop_does() -> None:
    torch.manual_seed(2)
    members = [critic() for _ in range(3)]
    loop = copy.deepcopy(members)
    fan = asyncrpc.Fanout(members, engine="vmap")
    stacks = fan.parameters()
    assert [tuple(s.shape) for s in stacks] == [(3, 16, 6), (3, 16), (3, 1, 16), (3, 1)]

    def hooked(step: int) -> Any:  # a hook on one member: that call runs member by member
        if step % 4 == 1:
            return members[1].register_forward_hook(lambda module, args, out: out)
        return None

    _train(fan, members, loop, 12, hooked)
    weight = members[2][0].weight
    assert weight.grad is not None and stacks[0].grad is not None
    assert weight.grad.data_ptr() == stacks[0].grad[2].data_ptr()  # a view of its row
    fan.close()
    assert weight.untyped_storage().nbytes() == weight.nbytes  # memory of its own again


def test_stacks_keep_training_the_members_after_the_engine_declines() -> None:
    torch.manual_seed(3)
    members = [critic() for _ in range(3)]
    loop = copy.deepcopy(members)
    fan = asyncrpc.Fanout(members, engine="vmap")

    def replace_a_layer(step: int) -> None:
        if step == 3:  # a layer replaced by one the engine does not know: declined
            for m in (members[0], loop[0]):
                m[1] = torch.nn.Hardswish()
                m[1].register_forward_hook(lambda module, args, out: out)

    _train(fan, members, loop, 8, replace_a_layer)
    assert "vmap" in fan.declined


def test_parameters_needs_the_vmap_engine() -> None:
    for engine in ("threads", "auto"):
        fan = asyncrpc.Fanout([critic() for _ in range(2)], engine=engine)  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match=f"needs engine='vmap'.*got engine='{engine}'"):
            fan.parameters()
    declined = asyncrpc.Fanout([torch.nn.GRU(2, 2) for _ in range(2)], engine="vmap")
    with pytest.raises(RuntimeError, match="declined: member 0 holds a GRU"):
        declined.parameters()


def test_auto_settles_within_the_bound_the_docs_state() -> None:
    torch.manual_seed(4)
    fan = asyncrpc.Fanout([critic() for _ in range(4)])
    x = torch.rand(8, 6)
    calls = 0
    while fan.plan is None:
        fan(x)
        calls += 1
        assert calls <= 1 + 30 * len(fan.plans), (calls, fan.timings())
    timings = fan.timings()
    assert all(len(samples) >= 2 for samples in timings.values()), timings
    assert fan.plan in timings


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_members_are_stacked_and_trained_as_a_loop() -> None:
    # `is_shared()` is always True for CUDA tensors: they are not in shared memory.
    torch.manual_seed(5)
    with torch.device("cuda"):
        members = [critic() for _ in range(3)]
    loop = copy.deepcopy(members)
    fan = asyncrpc.Fanout(members, engine="vmap")
    assert fan.declined == {}
    with torch.device("cuda"):
        _train(fan, members, loop, 6)


def test_a_frozen_parameter_takes_no_gradient_in_its_row() -> None:
    torch.manual_seed(6)
    members = [critic() for _ in range(3)]
    loop = copy.deepcopy(members)
    fan = asyncrpc.Fanout(members, engine="vmap")
    stacks = fan.parameters()
    for m in members + loop:
        m[0].requires_grad_(False)  # a fixed feature layer
    members[1][2].requires_grad_(False)  # and one member's head alone
    loop[1][2].requires_grad_(False)
    opt = torch.optim.SGD(stacks, lr=0.1)
    loop_opt = torch.optim.SGD([p for c in loop for p in c.parameters()], lr=0.1)
    for _ in range(4):
        x = torch.rand(5, 6)
        opt.zero_grad()
        loop_opt.zero_grad()
        sum(o.sum() for o in fan(x)).backward()
        sum(c(x).sum() for c in loop).backward()
        opt.step()
        loop_opt.step()
    assert stacks[0].grad is None  # every member's first layer frozen: no gradient at all
    for ours, theirs in zip(members, loop, strict=True):
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(p, q)


def test_new_stacks_after_a_dtype_change_carry_the_members_gradients() -> None:
    torch.manual_seed(7)
    members = [critic() for _ in range(2)]
    loop = copy.deepcopy(members)
    fan = asyncrpc.Fanout(members, engine="vmap")
    fan.parameters()
    x = torch.rand(4, 6)
    sum(o.sum() for o in fan(x)).backward()
    sum(c(x).sum() for c in loop).backward()
    for m in members + loop:
        m.double()
    stacks = fan.parameters()  # restacked now, before any call
    assert all(s.dtype == torch.float64 for s in stacks)
    opt = torch.optim.SGD(stacks, lr=0.1)
    loop_opt = torch.optim.SGD([p for c in loop for p in c.parameters()], lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        loop_opt.zero_grad()
        sum(o.sum() for o in fan(x.double())).backward()
        sum(c(x.double()).sum() for c in loop).backward()
        opt.step()
        loop_opt.step()
    for ours, theirs in zip(members, loop, strict=True):
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(p, q)


def test_what_parameters_cannot_do_is_said(caplog: pytest.LogCaptureFixture) -> None:
    members = [torch.nn.Linear(3, 1) for _ in range(2)]
    fan = asyncrpc.Fanout(members, engine="vmap")
    fan.parameters()
    x = torch.ones(1, 3)
    sum(o.sum() for o in fan(x)).backward()  # a gradient in the stacks
    out = fan(x)
    for m in members:
        m.zero_grad()  # member by member, between the call and its backward
    sum(o.sum() for o in out).backward()
    assert "set to None on its own between a call and its backward" in caplog.text
    handle = members[1].weight.register_hook(lambda grad: grad * 0.5)
    with pytest.raises(RuntimeError, match="member 1's weight has a tensor hook"):
        fan(x)
    handle.remove()
    out = fan(x)
    sum(o.pow(2).sum() for o in out).backward(create_graph=True)
    weight = members[0].weight
    assert weight.grad is not None and weight.grad.grad_fn is not None  # differentiable
