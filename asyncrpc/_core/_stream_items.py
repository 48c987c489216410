"""A stream's items on their way: captured at the generator's `yield`, unpacked by the consumer.

A generator may update a tensor in place after yielding it (an RNN state, a
reused buffer). torch RPC keeps a reply's tensors by reference until their
bytes are on the wire, so the producer copies each item's tensors at the
yield, before the generator resumes:

    item ──> pickled by torch RPC's pickler (payload: bytes; tensors aside)
         ──> each tensor snapshotted: what torch RPC would send of it, copied now

A snapshot equals what torch RPC would deliver of the tensor at that moment.
For a plain dense CPU tensor without grad (the allowlist) it is exact: its
storage copied whole, once per item (views of one storage still share it),
with the same offset, sizes and strides; or, when torch would send a compact
clone of it (a small view of a large storage), that clone made now. Any
other tensor (one that requires grad, sparse, quantized, not on the CPU) is
cloned: the same values, dtype, device and autograd link, its own storage.
A CUDA tensor is cloned on its device, on the current stream: after the
CUDA work the generator queued there, before any it queues once resumed.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from . import _torch

__all__ = ["Packed", "pack", "snapshot", "unpack"]

# torch RPC sends a compact clone of a tensor instead of its storage when the
# storage is at least this big and this many times the tensor's own bytes
# (cloneSparseTensors in torch/csrc/distributed/rpc/utils.cpp).
_RECOPY_MIN_BYTES = 8 * 1024
_RECOPY_MIN_MULTIPLE = 2


class Packed:
    """An item pickled on its own (tensors aside): one the consumer cannot unpickle fails
    alone, not the message of items it travels with."""

    __slots__ = ("payload", "tensors")

    def __init__(self, payload: bytes, tensors: list[Any]) -> None:
        self.payload, self.tensors = payload, tensors

    def __reduce__(self) -> tuple[Any, ...]:
        return (Packed, (self.payload, self.tensors))


def pack(item: Any) -> Any:
    """`item` as it is now, ready to send: a plain tensor as its snapshot, anything else
    pickled with its tensors snapshotted. Raises what pickling raises."""
    if type(item) is torch.Tensor:
        return snapshot([item])[0]  # any worker can read a tensor: it travels as it is
    payload, tensors = _torch.serialize(item)
    return Packed(payload, snapshot(tensors))


def unpack(item: Any) -> Any:
    """What `pack` made of an item, as the producer yielded it. Raises what unpickling raises."""
    if type(item) is Packed:
        return _torch.deserialize(item.payload, item.tensors)
    return item


def snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors`, made now, that torch RPC delivers as it would the originals."""
    seen = collections.Counter(_storage_key(t) for t in tensors) if len(tensors) > 1 else None
    storages: dict[int, torch.UntypedStorage] = {}  # views of one storage share its copy
    return [_copy(t, storages, seen is None or seen[_storage_key(t)] == 1) for t in tensors]


def _copy(t: torch.Tensor, storages: dict[int, torch.UntypedStorage], alone: bool) -> torch.Tensor:
    """`t` copied now; `alone`: no other tensor of its item shares its storage."""
    if not _exact(t):
        with torch.enable_grad():  # a generator under no_grad: the copy keeps requires_grad
            return t.clone()
    storage = t.untyped_storage()
    nbytes, useful = storage.nbytes(), t.element_size() * t.numel()
    if nbytes >= _RECOPY_MIN_BYTES and nbytes >= useful * _RECOPY_MIN_MULTIPLE:
        return t.clone()  # torch RPC would send a compact clone: this one, made now
    if alone and nbytes == useful and t.storage_offset() == 0 and t.is_contiguous():
        return t.clone()  # it covers its storage: the clone has its offset and strides
    key = storage.data_ptr()
    copied = storages.get(key) if key else None
    if copied is None:
        copied = storage.clone()  # type: ignore[no-untyped-call]
        if key:
            storages[key] = copied
    whole = torch.empty((0,), dtype=t.dtype)
    return whole.set_(copied, t.storage_offset(), t.size(), t.stride())


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if _exact(t) else id(t)


def _exact(t: torch.Tensor) -> bool:
    """True for the tensors whose storage copy is exact: plain, dense, CPU, no grad."""
    return (
        type(t) is torch.Tensor
        and not t.requires_grad
        and t.is_cpu
        and t.layout == torch.strided
        and not t.is_quantized
        and not t.is_nested
        and not t.is_conj()
        and not t.is_neg()
    )
