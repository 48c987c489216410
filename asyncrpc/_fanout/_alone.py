"""Rows that save and copy as themselves alone: a member's tensor is a view of a whole stack.

A member's parameters and buffers are rows of the "vmap" engine's stacks
(_storage). Saved or copied as they are, a row would write or copy the whole
stack; so:

    member.state_dict() ── a post-hook (`mark_entries`) marks each entry that is
                           a row of any live stack (`LIVE`): it pickles and
                           deep-copies as a copy of its row alone
    copy.deepcopy(buffer) ─ a buffer that is a row carries `Alone`'s marks
                           (a Parameter copies its own data alone already)
"""

from __future__ import annotations

import copy
import functools
import weakref
from typing import Any, Protocol

import torch

from .._core import _torch

__all__ = ("LIVE", "Alone", "mark_entries")


class _Stacks(Protocol):
    def owns(self, tensor: torch.Tensor) -> bool: ...


LIVE: weakref.WeakSet[_Stacks] = weakref.WeakSet()  # the stacks state dicts are checked against


def _stack_memory(tensor: torch.Tensor) -> bool:
    """True when `tensor` is a row of any live stack (one Fanout's, or another's)."""
    return any(storage.owns(tensor) for storage in list(LIVE))


def mark_entries(
    module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    for table in _torch.tensor_tables(module):
        for key, own in table.items():
            entry = state_dict.get(prefix + key)
            # keep_vars=True hands out the member's own tensors: those are left alone.
            if isinstance(entry, torch.Tensor) and entry is not own and _stack_memory(entry):
                ref = weakref.ref(entry)
                setattr(entry, "__reduce_ex__", functools.partial(_reduce_alone, ref))  # noqa: B010
                setattr(entry, "__deepcopy__", functools.partial(_copy_alone, ref))  # noqa: B010


def _reduce_alone(ref: weakref.ref[torch.Tensor], protocol: int) -> Any:
    # pickle and torch.save look __reduce_ex__ up on the object: this one reduces
    # a copy of the row alone, not the view of the whole stack.
    tensor = ref()
    assert tensor is not None
    return tensor.clone().__reduce_ex__(protocol)  # type: ignore[no-untyped-call]


def _copy_alone(ref: weakref.ref[torch.Tensor], memo: dict[int, Any]) -> torch.Tensor:
    tensor = ref()
    assert tensor is not None
    copied = memo[id(tensor)] = tensor.clone()
    return copied


class Alone:
    """Set on a member's plain tensor (a buffer) that is a row: it deep-copies as its row alone.

    A Parameter copies its own data alone already (`Parameter.__deepcopy__`); a
    plain tensor's `__deepcopy__` copies its whole storage, the stack. The
    instance's `__getstate__` leaves these marks out when it is pickled.
    """

    __slots__ = ("tensor",)
    _KEYS = ("__deepcopy__", "__getstate__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @classmethod
    def mark(cls, tensor: torch.Tensor) -> None:
        if type(tensor) is torch.Tensor and "__deepcopy__" not in vars(tensor):
            alone = cls(tensor)
            vars(tensor).update(__deepcopy__=alone.deepcopy, __getstate__=alone.state)

    @classmethod
    def unmark(cls, tensor: torch.Tensor) -> None:
        for key in cls._KEYS:
            vars(tensor).pop(key, None)

    def deepcopy(self, memo: dict[int, Any]) -> torch.Tensor:
        with torch.no_grad():
            copied = self.tensor.clone().requires_grad_(self.tensor.requires_grad)
        memo[id(self.tensor)] = copied
        vars(copied).update(copy.deepcopy(self.state(), memo))
        return copied

    def state(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self.tensor).items() if k not in self._KEYS}
