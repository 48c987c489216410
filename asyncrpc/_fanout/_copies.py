"""Copies of a `Fanout`: what `copy.deepcopy` and `pickle` carry, and what they leave.

A `Fanout` holds thread pools, locks, its tuner's timings and (engine
"vmap") the stacks its members' tensors are rows of; none of that is copied.
A copy is a new `Fanout` over copies of the members with the same options
(engine, threads, names, show_warnings): it times its plans afresh, and each
copied member holds memory of its own::

    copy.deepcopy(fan) ── deepcopy(members, memo) ── rows of the stacks? ──
                          (a copied buffer would view one copied stack)   │
                          clone them: each copy owns its tensors  <───────┘
    pickle.dumps(fan)  ── members stacked? pickle copies of them (a row
                          pickles its whole stack), else the members

Members that cannot be copied or pickled (a lambda, a local function) fail
with their own error, as they would alone.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._storage import Storage

__all__ = ("copied_members", "rows_of")

Members = Sequence[Callable[..., Any]]


def rows_of(members: Members, storage: Storage | None) -> list[list[str]]:
    """Each member's parameter and buffer names that are views of the stacks now."""
    if storage is None:
        return [[] for _ in members]
    found = []
    for member in members:
        assert isinstance(member, torch.nn.Module)  # only modules are stacked
        tensors = [*member.named_parameters(), *member.named_buffers()]
        found.append([name for name, tensor in tensors if storage.owns(tensor)])
    return found


def copied_members(
    members: Members, rows: list[list[str]], memo: dict[int, Any] | None = None
) -> list[Callable[..., Any]]:
    """Deep copies of `members` (through `memo`), each holding its tensors in memory of its own."""
    copies: list[Callable[..., Any]] = copy.deepcopy(list(members), memo)
    for member, names in zip(copies, rows, strict=True):
        if names:
            assert isinstance(member, torch.nn.Module)
            _own_memory(member, names)
    return copies


def _own_memory(member: torch.nn.Module, names: list[str]) -> None:
    params = dict(member.named_parameters())
    for name in names:
        if name in params:
            param = params[name]
            if _is_view(param):
                param.data = param.detach().clone()
            continue
        prefix, _, leaf = name.rpartition(".")
        owner = member.get_submodule(prefix)
        buffer = getattr(owner, leaf)
        if isinstance(buffer, torch.Tensor) and _is_view(buffer):
            setattr(owner, leaf, buffer.detach().clone().requires_grad_(buffer.requires_grad))


def _is_view(tensor: torch.Tensor) -> bool:
    """True when `tensor`'s memory is part of a larger block (a copied stack)."""
    return tensor.untyped_storage().nbytes() > tensor.nbytes
