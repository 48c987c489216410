"""The "vmap" engine's first-call check: stacked and one by one must agree, deterministically.

Before the members' tensors become rows of the stacks, one call runs on two
copies of the members, stacked on one and member by member on the other,
and everything a caller could see is compared: outputs, then each member's
parameters, buffers and plain attributes after the call. It runs inside
`torch.random.fork_rng`, so the caller's random stream moves as if only the
real call had run. A forward that draws random numbers (dropout in training)
cannot be compared as it is: its two copies run in eval mode instead, and a
forward that is random in eval mode too is declined, with the reason.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._allowlist import plain_attributes, same_setting

__all__ = (
    "Calls",
    "detached_copy",
    "deterministic",
    "difference",
    "first_line",
    "leaves",
    "replay",
)

Calls = list[tuple[tuple[Any, ...], dict[str, Any]]]
RANDOM_REASON = (
    "their forward draws random numbers in eval mode too, so the stacked call cannot "
    "be checked against the members; engine='threads' runs them"
)


def _cuda_devices() -> list[int]:
    """The CUDA devices whose generators a check must leave as it found them
    (`torch.manual_seed` seeds every device's)."""
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return []
    return list(range(torch.cuda.device_count()))


def detached_copy(calls: Calls) -> Calls:
    """A deep copy of `calls` whose tensors are new leaves: values and `requires_grad` alone.

    The check compares what the members compute, which does not depend on how an
    input was computed; a non-leaf input (the actor update's `cat([s, actor(s)])`)
    cannot be deep-copied with its autograd history, and need not be.
    """
    memo: dict[int, Any] = {}
    with torch.no_grad():
        for tensor in leaves(calls):
            copied = tensor.detach().clone()
            if tensor.requires_grad:
                copied.requires_grad_(True)
            memo[id(tensor)] = copied
    return copy.deepcopy(calls, memo)


def deterministic(member: torch.nn.Module, call: tuple[tuple[Any, ...], dict[str, Any]]) -> bool:
    """True when two copies of `member` give equal outputs under different seeds."""
    outputs = []
    with torch.random.fork_rng(devices=_cuda_devices()), torch.no_grad():
        for seed in (1, 2):
            torch.manual_seed(seed)
            args, kwargs = copy.deepcopy(call)
            outputs.append(copy.deepcopy(member)(*args, **kwargs))
    return difference([outputs[0]], [outputs[1]]) is None


def replay(
    stacked: Callable[[], list[Any]],
    stacked_copies: Sequence[torch.nn.Module],
    own_copies: Sequence[torch.nn.Module],
    own_calls: Calls,
) -> str | None:
    """Run `stacked()` and each own copy; why what a caller sees would differ, or None."""
    with torch.random.fork_rng(devices=_cuda_devices()):
        got = stacked()
        want = [m(*a, **k) for m, (a, k) in zip(own_copies, own_calls, strict=True)]
    found = difference(got, want)
    if found is not None:
        return f"stacked outputs differ from the members' ({found})"
    for i, (ours, theirs) in enumerate(zip(stacked_copies, own_copies, strict=True)):
        found = _state_difference(ours, theirs)
        if found is not None:
            return f"after a stacked call member {i}'s {found}"
    return None


def _state_difference(ours: torch.nn.Module, theirs: torch.nn.Module) -> str | None:
    tensors = dict(theirs.named_parameters()) | dict(theirs.named_buffers())
    for name, tensor in [*ours.named_parameters(), *ours.named_buffers()]:
        other = tensors.get(name)
        if other is None or not torch.allclose(tensor.detach(), other.detach(), 1e-4, 1e-5):
            return (
                f"{name} differs from what its own forward leaves (does forward assign "
                f"it a new tensor? update it in place, e.g. {name.split('.')[-1]}.add_(1))"
            )
    for (name, sub), other_sub in zip(ours.named_modules(), theirs.modules(), strict=True):
        mine, yours = plain_attributes(sub), plain_attributes(other_sub)
        for key in mine.keys() | yours.keys():
            if not same_setting(mine.get(key), yours.get(key)):
                where = f"{name}.{key}" if name else key
                return (
                    f"attribute {where} differs from what its own forward leaves (a stacked "
                    f"call runs the forward once for all members)"
                )
    return None


def difference(stacked: list[Any], serial: list[Any]) -> str | None:
    """Where two lists of outputs differ (shape, count or values), or None."""
    for i, (a, b) in enumerate(zip(stacked, serial, strict=True)):
        ours, theirs = leaves(a), leaves(b)
        if len(ours) != len(theirs):
            return f"member {i}: {len(ours)} tensors where its own forward gives {len(theirs)}"
        for x, y in zip(ours, theirs, strict=True):
            x, y = x.detach(), y.detach()
            if x.shape != y.shape:
                return f"member {i}: shape {tuple(x.shape)} where its own is {tuple(y.shape)}"
            if not torch.allclose(x, y, rtol=1e-4, atol=1e-5):
                return f"member {i}: largest difference {(x - y).abs().max().item():.3g}"
    return None


def leaves(out: Any) -> list[torch.Tensor]:
    """The tensors in a nest of tuples, lists and dicts."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [leaf for item in out for leaf in leaves(item)]
    if isinstance(out, dict):
        return [leaf for value in out.values() for leaf in leaves(value)]
    return []


def first_line(error: BaseException) -> str:
    """`Type: first line of the message`."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
