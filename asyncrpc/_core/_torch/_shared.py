"""CPU tensors read from shared memory by processes of one machine: no copy per reader.

`snapshot_shared(value)` copies a value as it is now, its plain CPU tensors
into shared memory (what `asyncrpc.put` keeps). `dumps_shared(value)`
pickles `value` with each plain CPU tensor's storage
moved into shared memory (once: torch's file-system sharing, names under
/dev/shm kept alive by torch's shared-memory manager); the bytes carry the
names, not the data. `loads_shared` maps those storages in the reader::

    owner: dumps_shared(v) ── storage._share_filename_cpu_() (moved once) ──> names
    reader: loads_shared(names) ── UntypedStorage._new_shared_filename_cpu ──> the same memory

Tensors that need their autograd state, sparse, quantized or non-CPU ones
are pickled as usual (copied). `host_key()` names the memory a process can
map: the same boot, the same /dev/shm and /tmp (torch's manager listens on a
socket under /tmp).
"""

from __future__ import annotations

import io
import os
import pickle
import socket
from typing import Any

import torch

__all__ = ("dumps_shared", "host_key", "loads_shared", "snapshot_shared")


def host_key() -> str:
    """Equal in two processes that can map each other's shared storages."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        shm, tmp = os.stat("/dev/shm"), os.stat("/tmp")
    except OSError:
        return f"unknown:{os.getpid()}"  # never equal to another process's
    return f"{socket.gethostname()}:{boot}:{shm.st_dev}:{shm.st_ino}:{tmp.st_dev}:{tmp.st_ino}"


def _shareable(obj: object) -> bool:
    return (
        type(obj) is torch.Tensor
        and obj.device.type == "cpu"
        and obj.layout is torch.strided
        and not obj.requires_grad
        and not obj.is_quantized
    )


class _SharingPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, copies: list[torch.Tensor] | None = None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.copies = copies  # a list: each tensor is copied first, and kept here

    def reducer_override(self, obj: Any) -> Any:
        if not _shareable(obj):
            return NotImplemented
        if self.copies is not None:
            obj = obj.clone()
            self.copies.append(obj)
        handle = obj.untyped_storage()._share_filename_cpu_()
        layout = (obj.dtype, tuple(obj.shape), tuple(obj.stride()), obj.storage_offset())
        return _mapped, (*handle, *layout)


def _mapped(manager: bytes, name: bytes, size: int, dtype: torch.dtype, shape: tuple[int, ...],
            stride: tuple[int, ...], offset: int) -> torch.Tensor:  # fmt: skip
    storage = torch.UntypedStorage._new_shared_filename_cpu(manager, name, size)
    return torch.tensor([], dtype=dtype).set_(storage, offset, shape, stride)


def dumps_shared(value: Any) -> bytes:
    """`value` pickled with its plain CPU tensors' storages shared by name (moved once)."""
    buffer = io.BytesIO()
    _SharingPickler(buffer).dump(value)
    return buffer.getvalue()


def snapshot_shared(value: Any) -> tuple[Any, int]:
    """(A copy of `value` as it is now, its size in bytes): its plain CPU tensors copied
    into shared memory (once: readers on this machine then map them), other parts copied
    by pickling; the size counts both."""
    buffer = io.BytesIO()
    copies: list[torch.Tensor] = []
    _SharingPickler(buffer, copies).dump(value)
    size = buffer.tell() + sum(t.untyped_storage().nbytes() for t in copies)
    return pickle.loads(buffer.getvalue()), size  # the copies' memory, mapped again


def loads_shared(payload: bytes) -> Any:
    """The value `dumps_shared` pickled, its tensors mapping the owner's shared storages."""
    return pickle.loads(payload)
