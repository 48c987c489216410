"""What an owner keeps for its ObjectRefs: each value `put` here, counted while it lives,
and, in a world that heals, the forks of its RRef handed to other workers.

torch frees an owner's value once every fork of its RRef is deleted; a
worker deletes its forks as it drops its refs. One that dies holding refs
never does, so the owner notes the latest forks it hands each worker
(`_forks` asks: `_Kept._asyncrpc_lent`) and deletes them itself when that
worker's death is known (`Members.on_gone`)::

    owner: put(v) ─> RRef(_Kept(v))     counted: asyncrpc-top's "objs", "obj MB"
      fork for worker3 ─ noted ─> worker3 holds a ref ── killed ──> on_gone(worker3):
                                                                   its forks deleted here
      last fork deleted: torch drops _Kept(v): the count goes down
"""

from __future__ import annotations

import collections
import contextlib
import sys
import weakref
from typing import Any

import torch

from . import _activity, _runtime, _torch, _world

__all__ = ("Kept", "Lending", "size_of")


class Kept:
    """What an ObjectRef's RRef holds on its owner: the value, counted while it lives
    (`asyncrpc-top`, `asyncrpc-dump`); torch drops it once no ref is left anywhere.

    In a world that heals, it also notes the forks of its RRef handed to each
    worker (`_forks`): a worker that dies holding some never deletes them, so the
    owner does (`Lending`), and the value goes once no living worker holds a ref.
    """

    __slots__ = ("__weakref__", "forks", "value")

    def __init__(self, value: object, size: int) -> None:
        self.value = value
        self.forks: dict[int, collections.deque[tuple[Any, ...]]] = {}
        _activity.holding(1, size)
        weakref.finalize(self, _activity.holding, -1, -size)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unkept, (self.value,))  # a copy read elsewhere is no longer counted

    def _asyncrpc_lent(self, to: int, data: tuple[Any, ...]) -> None:  # `_forks.LENT`
        forks = self.forks.get(to)
        if forks is None:
            forks = self.forks.setdefault(to, collections.deque(maxlen=_FORKS_NOTED))
            _runtime.part(Lending).note(self)
        forks.append(data)


_FORKS_NOTED = 16  # the latest forks noted per worker and value (older ones: dropped by now)


class Lending:
    """The values put here whose refs went to other workers, in a world that heals
    (a `_runtime` part): when one of them dies, the forks it held are deleted here."""

    def __init__(self) -> None:
        self.kept: weakref.WeakSet[Kept] = weakref.WeakSet()
        self.watching = False

    def note(self, kept: Kept) -> None:
        self.kept.add(kept)
        if not self.watching:
            world = _world.running()
            if world is not None and world.members is not None:
                world.members.on_gone(_drop_forks_of)
                self.watching = True


def _drop_forks_of(torch_id: int) -> None:
    """Process `torch_id` died or left: delete here the forks of values it held."""
    for kept in list(_runtime.part(Lending).kept):
        forks = kept.forks.pop(torch_id, ())
        # Held by torch (and this loop): torch still has the value, so deleting a fork
        # makes no new one (a value torch let go is skipped).
        if forks and sys.getrefcount(kept) > 3:
            for data in forks:
                with contextlib.suppress(Exception):
                    _torch.drop_fork(data)


def _unkept(value: object) -> object:
    return value


def size_of(value: object, depth: int = 4) -> int:
    """The bytes of the tensors in `value` (in lists, tuples and dicts, `depth` deep)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if depth == 0:
        return 0
    if isinstance(value, dict):
        return sum(size_of(item, depth - 1) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(size_of(item, depth - 1) for item in value)
    return 0
