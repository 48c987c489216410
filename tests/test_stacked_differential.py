"""Differential test: the "vmap" engine and "auto" agree with the members run one by one.

Hypothesis builds random same-architecture ensembles (Sequential chains, one
with LayerNorm and SiLU, other module classes, with and without buffers and
dropout; classes with tuple settings, list and dict settings, an override of
nn.Module's, a parametrization; what libraries build: an nn.Sequential
subclass holding a class, a list and a dict its forward never names
(torchrl's MLP), an abc.ABC subclass holding a function, a partial and a
class; hooks of every kind registered before the `Fanout` is made) and
applies random sequences of what users do between calls: optimizer steps
(SGD with momentum; Adam plain, foreach and fused; over the members'
parameters, or over the stacks `Fanout.parameters()` gives), a call on a
computed input that needs gradients (the actor update's), `.data`
writes, Polyak updates, `load_state_dict`, attribute and slope changes,
lists and dicts mutated in place, train/eval switches, `requires_grad`
toggles, hooks added (forward, forward-pre, full backward, full backward
pre, tensor and post-accumulate-grad hooks, global module hooks) and
removed, calls under grad, `no_grad` and `inference_mode`, and dtype
moves. Three copies of the ensemble take every step alike: one behind
`Fanout(engine="vmap")`, one behind `Fanout()` ("auto"), one called member
by member; after every call their outputs, `requires_grad`, gradients
(after a backward), what their hooks saw and state must agree. What the
engine cannot prove when it is made (hooks, mutable settings, overrides,
parametrizations) must be declined then, and what it can, not.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import functools
import itertools
from collections import Counter
from collections.abc import Callable, Iterator
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


class Clamped(torch.nn.Module):
    """Immutable settings of a class of the user's own: stacked; a rebinding is seen."""

    def __init__(self, dropout: bool) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)
        self.drop = torch.nn.Dropout(0.3) if dropout else torch.nn.Identity()
        self.bounds = (-0.5, 0.5)
        self.mode = "tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x).clamp(*self.bounds)
        return self.drop(h.tanh() if self.mode == "tanh" else h)


class Bounded(Clamped):
    """Mutable settings (a list, a dict): a change inside one (`m.bounds[0] = 5`) is unseen."""

    def __init__(self, dropout: bool) -> None:
        super().__init__(dropout)
        self.bounds = [-0.5, 0.5]  # type: ignore[assignment]
        self.cfg = {"temperature": 1.0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) / self.cfg["temperature"]


class Overriding(Clamped):
    """Overrides one of nn.Module's methods: not provable, whatever the override does."""

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> Overriding:
        return super()._apply(fn, recurse)  # type: ignore[return-value]


class Halve(torch.nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * 0.5


def parametrized(dropout: bool) -> torch.nn.Module:
    member = chain(dropout)
    torch.nn.utils.parametrize.register_parametrization(member[0], "weight", Halve())
    return member


def chain(dropout: bool) -> torch.nn.Module:
    layers: list[torch.nn.Module] = [torch.nn.Linear(6, 8), torch.nn.LeakyReLU(0.1)]
    if dropout:
        layers.append(torch.nn.Dropout(0.3))  # not element-wise: the vmap path runs it
    return torch.nn.Sequential(*layers, torch.nn.Linear(8, 6), torch.nn.Tanh())


def normed_chain(dropout: bool) -> torch.nn.Module:
    """LayerNorm and SiLU in a chain: the batched-GEMM path, each member's own affine."""
    layers: list[torch.nn.Module] = [torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.SiLU()]
    if dropout:
        layers.append(torch.nn.Dropout(0.3))
    return torch.nn.Sequential(*layers, torch.nn.Linear(8, 6))


class LibraryMLP(torch.nn.Sequential):
    """As torchrl's MLP: an nn.Sequential subclass holding a type, a list and a dict that
    only __init__ reads (forward never names them), so they are not settings."""

    def __init__(self, dropout: bool) -> None:
        self.in_features, self.out_features = 6, 6
        self.num_cells = [8]
        self.activation_class = torch.nn.Tanh
        self.activation_kwargs: dict[str, Any] = {}
        super().__init__(*self._make_net(dropout))

    def _make_net(self, dropout: bool) -> list[torch.nn.Module]:
        layers: list[torch.nn.Module] = []
        width = self.in_features
        for cells in self.num_cells:
            layers += [
                torch.nn.Linear(width, cells),
                self.activation_class(**self.activation_kwargs),
            ]
            width = cells
        return [*layers, *([torch.nn.Dropout(0.3)] if dropout else []),
                torch.nn.Linear(width, self.out_features)]  # fmt: skip

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if len(inputs) > 1:
            inputs = (torch.cat([*inputs], -1),)
        return super().forward(*inputs)  # type: ignore[no-any-return]


class Head(torch.nn.Module, abc.ABC):
    """An abstract base (abc.ABC): Python's `__abstractmethods__` is not the user's."""

    @abc.abstractmethod
    def squash(self, x: torch.Tensor) -> torch.Tensor: ...


class Functional(Head):
    """Settings that are a function, a partial of one, and a class (identity compared)."""

    def __init__(self, dropout: bool) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)
        self.drop = torch.nn.Dropout(0.3) if dropout else torch.nn.Identity()
        self.act = torch.nn.functional.relu
        self.leaky = functools.partial(torch.nn.functional.leaky_relu, negative_slope=0.2)
        self.kind = torch.nn.Tanh

    def squash(self, x: torch.Tensor) -> torch.Tensor:
        return self.leaky(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.squash(self.act(self.linear(x)) - 0.1))


KINDS: dict[str, Callable[[bool], torch.nn.Module]] = {
    "normed-chain": normed_chain,
    "library": LibraryMLP,
    "functional": Functional,
    "chain": chain,
    "residual": Residual,
    "normed": Normed,
    "clamped": Clamped,
    "bounded": Bounded,
    "overriding": Overriding,
    "parametrized": parametrized,
}
UNPROVABLE = {"bounded", "overriding", "parametrized"}  # declined when the Fanout is made
# Hooks on a member: on its last submodule (so a backward hook's scaling reaches every
# parameter's gradient) or its first parameter; each records what it saw.
MEMBER_HOOKS = ["forward", "forward-pre", "backward", "backward-pre", "tensor", "accumulate",
                "state-dict"]  # fmt: skip
GLOBAL_HOOKS = ["global-forward", "global-pre", "global-backward"]

Step = tuple[str, int, int, float]  # what, member, seed, a number


def _steps() -> st.SearchStrategy[list[Step]]:
    what = st.sampled_from(
        ["call", "call", "call", "sgd", "adam", "adam-foreach", "adam-fused", "data",
         "sgd-stacked", "adam-stacked", "adam-foreach-stacked", "call-nonleaf",
         "polyak", "load", "attribute", "mutate", "mode", "mode-all", "freeze", "dtype",
         "hook", "hook", "unhook"]
    )  # fmt: skip
    number = st.floats(0.05, 0.95)
    return st.lists(
        st.tuples(what, st.integers(0, 3), st.integers(0, 10_000), number), min_size=3, max_size=9
    )


class Copies:
    """One copy of the ensemble, how it is called, and what its hooks saw."""

    def __init__(self, members: list[torch.nn.Module], engine: str | None) -> None:
        self.members = members
        self.seen: Counter[tuple[str, int]] = Counter()  # (hook, member) -> times it ran
        self.handles: list[Any] = []
        self.fan: asyncrpc.Fanout | None = None
        self.engine = engine
        self.stacked = False  # fan.parameters() handed out: gradients go to the stacks

    def start(self) -> None:
        if self.engine is not None:
            self.fan = asyncrpc.Fanout(self.members, engine=self.engine)  # type: ignore[arg-type]

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


def _hook(c: Copies, index: int, kind: str) -> None:
    """Register a `kind` hook on member `index` of `c`: it records, and most change a value."""
    member = c.members[index]
    last = list(member.modules())[-1]
    first = next(member.parameters())
    saw = c.seen

    def note(result: Any = None) -> Any:
        saw[(kind, index)] += 1
        return result

    register: dict[str, Callable[[], Any]] = {
        "forward": lambda: last.register_forward_hook(lambda m, a, out: note(out * 1.5)),
        "forward-pre": lambda: last.register_forward_pre_hook(lambda m, a: note((a[0] * 0.5,))),
        "backward": lambda: last.register_full_backward_hook(
            lambda m, gin, gout: note(_scaled(gin))
        ),
        "backward-pre": lambda: last.register_full_backward_pre_hook(
            lambda m, gout: note(_scaled(gout))
        ),
        "tensor": lambda: first.register_hook(lambda grad: note(grad * 4.5)),
        "accumulate": lambda: first.register_post_accumulate_grad_hook(_halve_grad(note)),
        "state-dict": lambda: member.register_state_dict_post_hook(
            lambda m, sd, prefix, meta: None
        ),
    }
    if kind in ("tensor", "accumulate") and not first.requires_grad:
        return  # a frozen parameter takes no gradient hook (torch refuses one), as in eager
    c.handles.append(register[kind]())


def _scaled(grads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
    return tuple(None if g is None else g * 4.5 for g in grads)


def _halve_grad(note: Callable[[], Any]) -> Callable[[torch.Tensor], None]:
    def hook(p: torch.Tensor) -> None:
        note()
        if p.grad is not None:
            p.grad.mul_(0.5)

    return hook


def _global_hook(copies: list[Copies], kind: str) -> Any:
    """One hook for every module in the process; it records each call by copy and member."""
    owner = {
        id(sub): (c, i) for c in copies for i, m in enumerate(c.members) for sub in m.modules()
    }

    def note(module: torch.nn.Module, result: Any) -> Any:
        c, i = owner.get(id(module), (None, -1))
        if c is None:  # a module no copy holds (a template, a check's copy) ran: a hook
            _STRAYS[kind] += 1  # the engine would have run where the members did not
            return None
        c.seen[(kind, i)] += 1
        return result if isinstance(module, torch.nn.Linear) else None

    hooks = torch.nn.modules.module
    return {
        "global-forward": lambda: hooks.register_module_forward_hook(
            lambda m, a, out: note(m, out * 1.25)
        ),
        "global-pre": lambda: hooks.register_module_forward_pre_hook(
            # A parametrization's module is called with no argument at all.
            lambda m, a: note(m, (a[0] * 0.75,) if a else None)
        ),
        "global-backward": lambda: hooks.register_module_full_backward_hook(
            lambda m, gin, gout: note(m, None)
        ),
    }[kind]()


_STRAYS: Counter[str] = Counter()
_GLOBALS: list[Any] = []  # this example's global hooks, removed when it ends


def _apply(step: Step, copies: list[Copies], x: torch.Tensor) -> None:
    what, index, seed, number = step
    if what == "hook":
        kinds = MEMBER_HOOKS + GLOBAL_HOOKS
        kind = kinds[seed % len(kinds)]
        if kind in ("tensor", "accumulate") and any(c.stacked for c in copies):
            return  # cannot run while the stacks hold the gradients: a call would raise
        if kind in GLOBAL_HOOKS:
            _GLOBALS.append(_global_hook(copies, kind))
        for c in copies if kind in MEMBER_HOOKS else []:
            _hook(c, index % len(c.members), kind)
        return
    if what == "unhook":
        for handle in [*_GLOBALS, *(h for c in copies for h in c.handles)]:
            handle.remove()
        _GLOBALS.clear()
        for c in copies:
            c.handles.clear()
        return
    if what == "call-nonleaf":
        _call_nonleaf(copies, x, number)
        return
    for c in copies:
        torch.manual_seed(seed)
        member = c.members[index % len(c.members)]
        _APPLY[what.split("-")[0]](c, member, what, number, x)


def _call_nonleaf(copies: list[Copies], x: torch.Tensor, number: float) -> None:
    """The actor update's input: computed, needing gradients; they reach its source alike."""
    if _drawing(copies[0].members):
        return
    dtype = next(copies[0].members[0].parameters()).dtype
    grads = []
    for c in copies:
        source = torch.full((x.shape[-1],), number, dtype=dtype, requires_grad=True)
        outputs = c.call((x.to(dtype) * source).tanh())
        loss = sum(out.sum() for out in outputs if out.requires_grad)
        if isinstance(loss, torch.Tensor):
            loss.backward()
        grads.append(source.grad)
        for m in c.members:
            m.zero_grad(set_to_none=True)
    for got in grads[:-1]:
        assert (got is None) == (grads[-1] is None)
        if got is not None and grads[-1] is not None:
            torch.testing.assert_close(got, grads[-1], rtol=1e-4, atol=1e-4)


def _optimize(c: Copies, member: torch.nn.Module, what: str, number: float, x: Any) -> None:
    params = [p for m in c.members for p in m.parameters() if p.requires_grad]
    if not params or _drawing(c.members):  # dropout masks would differ: so would the steps
        return
    fan, stacked = c.fan, what.endswith("-stacked")
    what = what.removesuffix("-stacked")
    hooked = any(_torch_hooks(p) for m in c.members for p in m.parameters())
    if stacked and fan is not None and fan.engine == "vmap" and not fan.declined and not hooked:
        params = fan.parameters()  # one optimizer over the stacks: every member stepped
        c.stacked = True
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


def _torch_hooks(tensor: torch.Tensor) -> bool:
    return bool(tensor._backward_hooks or tensor._post_accumulate_grad_hooks)


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
            if type(sub) is Clamped:  # rebound: a new immutable value
                sub.bounds = (-number, number)
                sub.mode = "tanh" if number > 0.5 else "none"


def _mutate(c: Copies, member: torch.nn.Module, what: str, number: float, x: Any) -> None:
    if isinstance(member, Bounded):  # changed inside: the same list and dict
        member.bounds[0] = -number  # type: ignore[index]
        member.cfg["temperature"] = number


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
    "load": _load, "attribute": _attribute, "mutate": _mutate, "mode": _mode, "freeze": _freeze,
    "dtype": _dtype,
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
    if mode == "grad" and not random:
        _compare_gradients(copies, outputs)
    for c in copies[:-1]:  # every hook ran as often, on the same members
        assert c.seen == copies[-1].seen, (c.engine, c.seen, copies[-1].seen)
    assert not _STRAYS, _STRAYS
    _compare_state(copies)


def _compare_gradients(copies: list[Copies], outputs: list[list[Any]]) -> None:
    """A backward through each copy's outputs: every member's gradients agree."""
    for got in outputs:
        loss = sum(out.square().sum() for out in got if out.requires_grad)
        if isinstance(loss, torch.Tensor):
            loss.backward()
    grads = [[p.grad for m in c.members for p in m.parameters()] for c in copies]
    for ours in grads[:-1]:
        for a, b in zip(ours, grads[-1], strict=True):
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for c in copies:
        for m in c.members:
            m.zero_grad(set_to_none=True)


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


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    kind=st.sampled_from(sorted(KINDS)),
    n=st.integers(2, 4),
    dropout=st.booleans(),
    seed=st.integers(0, 1000),
    hooks=st.lists(st.tuples(st.sampled_from(MEMBER_HOOKS), st.integers(0, 3)), max_size=2),
    steps=_steps(),
    modes=st.lists(st.sampled_from(["grad", "no_grad", "inference"]), min_size=9, max_size=9),
)
def test_the_engines_agree_with_the_members_whatever_happens_between_calls(
    kind: str,
    n: int,
    dropout: bool,
    seed: int,
    hooks: list[tuple[str, int]],
    steps: list[Step],
    modes: list[str],
) -> None:
    base = _build(kind, n, dropout, seed)
    copies = [
        Copies(copy.deepcopy(base), "vmap"),
        Copies(copy.deepcopy(base), "auto"),
        Copies(copy.deepcopy(base), None),  # the reference: one by one
    ]
    for c, (hook, index) in itertools.product(copies, hooks):
        _hook(c, index % n, hook)
    for c in copies:
        c.start()
    declined = "vmap" in copies[0].fan.declined  # type: ignore[union-attr]
    assert declined == (kind in UNPROVABLE or bool(hooks)), copies[0].fan.declined  # type: ignore[union-attr]
    with _global_hooks_removed():
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


@contextlib.contextmanager
def _global_hooks_removed() -> Iterator[None]:
    """Global hooks reach every module in the process: none outlives its example."""
    _STRAYS.clear()
    try:
        yield
    finally:
        for handle in _GLOBALS:
            handle.remove()
        _GLOBALS.clear()
