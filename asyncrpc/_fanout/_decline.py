"""Which members the "vmap" engine can stack, and why not where it cannot.

`decline(members)` is asked once, when a `Fanout` is made (and again when a
member's layers are replaced): one class and layout, no RNN kernels (vmap has
no batching rule for them), every submodule provably stackable (_allowlist:
known layers or plain classes of the user's own, plain tensors, immutable
settings, no hooks of any kind), parameters to stack, equal settings.
What can change later (a tensor's memory, a setting, a mode, a hook added)
is read on every call instead (_storage, _attributes). `chain_of` finds the
Sequentials of Linear and element-wise layers that run as batched GEMMs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._core import _torch
from ._allowlist import article, plain_attributes, same_setting, unprovable

_MISSING = object()

__all__ = ("RNN_REASON", "Declined", "chain_of", "decline")

# Layers applied to the stacked activations as they are (element-wise).
_ELEMENTWISE = (
    torch.nn.ReLU,
    torch.nn.ReLU6,
    torch.nn.LeakyReLU,
    torch.nn.ELU,
    torch.nn.GELU,
    torch.nn.SiLU,
    torch.nn.Mish,
    torch.nn.Tanh,
    torch.nn.Sigmoid,
    torch.nn.Softplus,
    torch.nn.Hardtanh,
    torch.nn.Identity,
)
RNN_REASON = (
    "holds {name}: torch.func.vmap has no batching rule for torch's fused RNN "
    "kernels, and 4 BiLSTMs (T=50, B=8, C=256) written as one stacked-GEMM LSTM ran "
    "2x slower than one by one on a 2-core CPU (51 vs 26 ms, 2026-11-23): oneDNN's "
    "fused LSTM beats batched GEMMs plus per-step element-wise ops; threads and fork "
    "run them"
)


class Declined(Exception):
    """The stacked engine cannot run these members; the message says why.

    Raised by a call, it carries that call's `results`, from the members themselves.
    """

    def __init__(self, reason: str, results: list[Any] | None = None) -> None:
        super().__init__(reason)
        self.results = results


def decline(members: Sequence[Any]) -> str | None:
    """Why these members cannot run stacked, or None when they can."""
    try:
        _check(members)
    except Declined as reason:
        return str(reason)
    return None


def _check(members: Sequence[Any]) -> None:
    first = members[0]
    seen: dict[int, int] = {}
    for i, member in enumerate(members):
        if not isinstance(member, torch.nn.Module):
            raise Declined(f"member {i} is {article(type(member).__name__)}, not an nn.Module")
        if isinstance(member, torch.jit.ScriptModule):
            raise Declined(f"member {i} is a TorchScript module (engine='fork' runs those)")
        if id(member) in seen:
            raise Declined(
                f"member {i} is member {seen[id(member)]} again: a stacked call would run it "
                "once, where one by one it runs twice"
            )
        seen[id(member)] = i
        for name, sub in member.named_modules():
            if _torch.is_parametrized(sub):
                raise Declined(_parametrized(i, name))
        if type(member) is not type(first):
            raise Declined(
                f"member {i} is {article(type(member).__name__)}, "
                f"member 0 {article(type(first).__name__)}"
            )
    for sub in first.modules():
        if isinstance(sub, torch.nn.RNNBase):
            raise Declined("member 0 " + RNN_REASON.format(name=article(type(sub).__name__)))
    for i, member in enumerate(members):
        for name, sub in member.named_modules():
            reason = unprovable(sub, f"member {i}'s " + (f"layer {name!r}" if name else "module"))
            if reason is not None:
                raise Declined(reason)
    if not dict(first.named_parameters()):
        raise Declined("the members have no parameters to stack")
    for i, member in enumerate(members[1:], start=1):
        _check_same(first, member, i)


def _parametrized(i: int, name: str) -> str:
    where = f"layer {name!r}" if name else "module"
    return (
        f"member {i}'s {where} is parametrized (torch.nn.utils.parametrizations: weight_norm, "
        "spectral_norm, ...): each call computes its weight from parametrizations.<name>."
        "original0/original1, and the vmap engine stacks only layers it knows, which do "
        "not include parametrized ones; engine='threads' runs them (for inference, "
        "torch.nn.utils.parametrize.remove_parametrizations turns the weight into a plain "
        "parameter, which stacks)"
    )


def _check_same(first: torch.nn.Module, member: torch.nn.Module, i: int) -> None:
    ours = dict(first.named_modules(remove_duplicate=False))
    theirs = dict(member.named_modules(remove_duplicate=False))
    if ours.keys() != theirs.keys():
        raise Declined(f"member {i}'s layers differ from member 0's")
    for name, sub in ours.items():
        other = theirs[name]
        if type(sub) is not type(other):
            raise Declined(f"member {i}'s layer {name!r} is {article(type(other).__name__)}")
        for ours_table, theirs_table in zip(
            _torch.tensor_tables(sub), _torch.tensor_tables(other), strict=True
        ):
            _check_tensors(ours_table, theirs_table, name, i)
        _check_settings(sub, other, name, i)


def _check_tensors(ours: dict[str, Any], theirs: dict[str, Any], where: str, i: int) -> None:
    if ours.keys() != theirs.keys():
        raise Declined(f"member {i}'s tensors in {where or 'the module'!r} differ in name")
    for key, tensor in ours.items():
        other = theirs[key]
        label = f"member {i}'s {where + '.' if where else ''}{key}"
        if (tensor is None) != (other is None):
            raise Declined(f"{label} differs in shape (None in one member only)")
        if tensor is None:
            continue
        if tensor.shape != other.shape:
            raise Declined(f"{label} differs in shape: {tuple(other.shape)}, member 0's "
                           f"{tuple(tensor.shape)}")  # fmt: skip
        if tensor.dtype != other.dtype:
            raise Declined(f"{label} differs in dtype: {other.dtype}, member 0's {tensor.dtype}")
        if tensor.device != other.device:
            # One stacked call runs on one device: members on several (two GPUs, or
            # a GPU and the CPU) run one by one, each where it lives.
            raise Declined(f"{label} is on {other.device}, member 0's on {tensor.device}: "
                           f"a stacked call runs on one device; move the members to one "
                           f"(.to(device)) to stack them")  # fmt: skip


def _check_settings(sub: torch.nn.Module, other: torch.nn.Module, where: str, i: int) -> None:
    # Plain attributes are settings every member must share (a scale, a slope):
    # stacking runs member 0's code with every member's tensors. `training` may
    # differ: it is read on every call, as every plain attribute is. Each is
    # immutable (unprovable checked), so `==` compares values.
    for key, value in plain_attributes(sub).items():
        if key == "training":
            continue
        if not same_setting(value, vars(other).get(key, _MISSING)):
            raise Declined(f"member {i}'s {where or 'module'}.{key} differs from member 0's")


def chain_of(member: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The layers of an nn.Sequential of Linear, LayerNorm (over the last dimension) and
    element-wise layers, or None for anything else."""
    if type(member) is not torch.nn.Sequential:
        return None
    layers = list(member)
    if not any(isinstance(layer, torch.nn.Linear) for layer in layers):
        return None
    if all(_in_chain(layer) for layer in layers):
        return layers
    return None


def _in_chain(layer: torch.nn.Module) -> bool:
    if type(layer) is torch.nn.LayerNorm:  # over the features: stacked affine after
        return len(layer.normalized_shape) == 1
    return type(layer) is torch.nn.Linear or type(layer) in _ELEMENTWISE
