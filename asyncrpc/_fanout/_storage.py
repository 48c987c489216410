"""The stacked storage of the "vmap" engine: the members' tensors are its rows.

For every parameter and buffer name the engine keeps one tensor that holds
all members' values, and each member's own tensor is a view of its row that
shares the stack's version counter::

    member i's tensor (m_i.fc.weight) ── a view of ──> stack["fc.weight"][i]
                                                              │
    optimizer steps (fused and foreach too), .data writes,    │ read as it is by
    load_state_dict, buffers updated in place in forward ─────┘ the stacked call

So what a member holds and what the stacked call reads are one thing, and a
change in place to a member's tensor (an optimizer step) bumps the stack's
version: a graph that saved the stack raises torch's own "modified by an
inplace operation" error in backward, as eager does. The swap that makes a
tensor share the counter (`_torch.share_version`) cannot be done while a live
graph holds the tensor: such a tensor shares memory only (`.data = row`),
and calls with gradients on run member by member until it can be linked.
Per call only where each member's tensor lives is compared (data pointers,
read with C-level maps): a tensor replaced or given other memory (`p.data =
t`, `.to()`, `load_state_dict(assign=True)`) is copied into its row and made
a view of it again, unless another tensor shares its memory: then it is
copied into its row before every call without gradients (calls with
gradients run member by member), and the member keeps sharing. A tensor in
shared memory (`share_memory()`: another process may write it) is never
moved: `InSharedMemory` declines the engine. `release` gives each member
memory of its own again (the Fanout closed or collected, the engine declined
or not chosen), except rows of a stack that was itself moved to shared
memory.

Several `Fanout`s over the same members, in the same order, share one
Storage (`storage_for`; the last to leave releases it).

What aliasing would change for a member, and what is done about it:
  - `torch.save(member.state_dict())` and `copy.deepcopy` of its entries would
    write or copy the whole stack: a state-dict hook (_alone) marks entries that are
    rows of any live stack so they save and copy as themselves alone;
  - RPC sends a row alone (torch copies a view of a larger storage);
  - left as they are (documented): `p.untyped_storage()` is the stack's, and
    `torch.save(member)` of the whole module object writes the stacks.
"""

from __future__ import annotations

import logging
import operator
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from .._core import _torch
from ._alone import LIVE, Alone, mark_entries
from ._grads import StackedGrads

_logger = logging.getLogger("asyncrpc")

__all__ = ("InSharedMemory", "Storage", "Unstackable", "storage_for")


class Unstackable(Exception):
    """This call cannot run stacked (its inputs, the members' tensors or modes); the next may."""


class InSharedMemory(Unstackable):
    """A member's tensor is in shared memory: the stack cannot be that memory, so no call may."""


class _Slot:
    """Where one member keeps one named tensor: a table of a submodule, and its key."""

    __slots__ = ("is_param", "key", "name", "table")

    def __init__(self, name: str, is_param: bool, table: dict[str, Any], key: str) -> None:
        self.name, self.is_param, self.table, self.key = name, is_param, table, key


def slots_of(member: torch.nn.Module) -> list[_Slot]:
    """Each distinct parameter and buffer of `member`, named as `named_parameters` does."""
    found, seen = [], set()
    for prefix, sub in member.named_modules():
        for table, is_param in zip(_torch.tensor_tables(sub), (True, False), strict=True):
            for key, tensor in table.items():
                if tensor is None or id(tensor) in seen:  # tied: one slot, as torch names it
                    continue
                seen.add(id(tensor))
                found.append(_Slot(f"{prefix}.{key}" if prefix else key, is_param, table, key))
    return found


_data_ptr = torch.Tensor.data_ptr
_stride = torch.Tensor.stride


class Storage:
    """The members' parameters and buffers as rows of one stacked tensor per name."""

    def __init__(self, members: Sequence[torch.nn.Module]) -> None:
        self.count = len(members)
        self.member_refs = [weakref.ref(m) for m in members]
        self.users = 0  # the engines that use it (storage_for, leave)
        per_member = [slots_of(m) for m in members]
        self.names = [slot.name for slot in per_member[0]]
        for i, slots in enumerate(per_member[1:], start=1):
            if [slot.name for slot in slots] != self.names:
                raise Unstackable(f"member {i} ties or names its tensors unlike member 0")
        self.param_names = [s.name for s in per_member[0] if s.is_param]
        self.buffer_names = [s.name for s in per_member[0] if not s.is_param]
        # Name-major: slot j is member j % count's tensor of name j // count.
        flat = [per_member[i][k] for k in range(len(self.names)) for i in range(self.count)]
        self._tables = [slot.table for slot in flat]
        self._keys = [slot.key for slot in flat]
        self.stacks: dict[str, torch.Tensor] = {}
        self._rows: list[torch.Tensor] = [torch.empty(0)] * len(flat)
        self._expected: list[int] = [0] * len(flat)
        self._strides: list[tuple[int, ...]] = [()] * len(flat)
        self._links: list[tuple[int, int] | None] = [None] * len(flat)  # (tensor, stack) ids
        self._foreign: set[int] = set()  # copied in before every call, and back after
        self._unlinked: set[int] = set()  # rows in memory, not yet in version
        self._in_shm: set[int] = set()  # in shared memory: left where they are
        self._lock = threading.Lock()
        self.grads: StackedGrads | None = None  # the stacks handed to an optimizer (_grads)
        # A module-level hook: a member stays picklable and copyable.
        self._hooks = [
            sub.register_state_dict_post_hook(mark_entries)  # type: ignore[no-untyped-call]
            for m in members
            for sub in m.modules()
        ]
        LIVE.add(self)
        held = self.held()
        with self._lock, _stacking():
            for k in range(len(self.names)):
                self._restack(k, held)

    def held(self) -> list[torch.Tensor]:
        """What each member holds now, slot by slot (name-major)."""
        return list(map(operator.getitem, self._tables, self._keys))

    def sync(self) -> list[torch.Tensor]:
        """Make the stacks hold what the members hold now; returns the members' tensors.

        Raises `InSharedMemory` for a member's tensor in shared memory, and
        `Unstackable` for a call with gradients on while a member's tensor
        cannot share its stack's version counter.
        """
        held = self.held()
        try:
            pointers = list(map(_data_ptr, held))
            strides = list(map(_stride, held))  # `.data = w.t()` keeps the pointer
        except TypeError:  # a slot set to None
            raise Unstackable("a member's parameter or buffer was set to None") from None
        if pointers != self._expected or strides != self._strides:
            with self._lock, _stacking():
                self._repoint(held, pointers, strides)
        if self._in_shm:
            raise InSharedMemory(self._shm_reason(min(self._in_shm)))
        if self._foreign:
            with _stacking():
                for j in list(self._foreign):
                    self._rows[j].data.copy_(held[j])  # the stack's version is not the user's
        if (self._unlinked or self._foreign) and torch.is_grad_enabled():
            self._link_or_refuse(held)
        return held

    def _link_or_refuse(self, held: list[torch.Tensor]) -> None:
        with self._lock, _stacking():
            for j in list(self._unlinked):
                if _torch.share_version(held[j], self._rows[j]):
                    self._linked(j, held[j])
        if self._unlinked or self._foreign:
            j = min(self._unlinked | self._foreign)
            raise Unstackable(
                f"member {j % self.count}'s {self.names[j // self.count]} cannot share the "
                "stack's version counter (a live autograd graph or a tensor of yours holds it)"
            )

    def _shm_reason(self, j: int) -> str:
        return (
            f"member {j % self.count}'s {self.names[j // self.count]} is in shared memory "
            "(share_memory()): another process may write it, and a stack cannot be that "
            "memory, so the members run one by one and keep their shared tensors"
        )

    def shared_memory_reason(self) -> str | None:
        """Why the members cannot be stacked because of shared memory, or None."""
        return self._shm_reason(min(self._in_shm)) if self._in_shm else None

    def versions(self) -> dict[str, int]:
        """Each stack's version: a stacked call that changes one in place bumps it."""
        return {name: _torch.tensor_version(stack) for name, stack in self.stacks.items()}

    def write_back(self, held: list[torch.Tensor], before: dict[str, int]) -> None:
        """Copy rows a stacked call changed in place into members' shared tensors."""
        if not self._foreign:
            return
        changed = {k for k, name in enumerate(self.names)
                   if _torch.tensor_version(self.stacks[name]) != before.get(name)}  # fmt: skip
        for j in self._foreign:
            if j // self.count in changed:
                tensor = held[j]
                with torch.no_grad(), torch.inference_mode(tensor.is_inference()):
                    tensor.copy_(self._rows[j])

    def group(self, held: list[torch.Tensor], name: str) -> list[torch.Tensor]:
        """The members' tensors of `name`, in member order."""
        k = self.names.index(name)
        return held[k * self.count : (k + 1) * self.count]

    def members_of(self, name: str) -> list[torch.Tensor]:
        """What the members hold of `name` now, in member order."""
        k = self.names.index(name)
        return list(map(operator.getitem, self._tables[k * self.count : (k + 1) * self.count],
                        self._keys[k * self.count : (k + 1) * self.count]))  # fmt: skip

    def stacked_gradients(self) -> StackedGrads:
        """The parameter stacks as leaves that need gradients, for one optimizer (_grads)."""
        with self._lock:
            if self.grads is None:
                stacks = {name: self.stacks[name] for name in self.param_names}
                self.grads = StackedGrads(stacks, self.members_of)
                self.grads.adopt()  # gradients the members hold now: the stacks' from here on
            return self.grads

    def leave(self) -> None:
        """One engine stops using this Storage; the last one releases it."""
        with self._lock:
            self.users -= 1
            last = self.users <= 0
        if last:
            self.release()

    def release(self) -> None:
        """Give every member memory (and a version counter) of its own again; drop the stacks.

        Rows of a stack moved to shared memory stay where they are: another
        process may hold that memory.
        """
        with self._lock, _stacking():
            # .get: a slot may be gone (a parametrization registered since moved it)
            for j, tensor in enumerate(map(dict.get, self._tables, self._keys)):
                row = self._rows[j]
                if tensor is None or _data_ptr(tensor) != _data_ptr(row) or _in_shm(row):
                    continue
                Alone.unmark(tensor)
                own = row.clone()
                if not _torch.share_version(tensor, own):
                    tensor.data = own  # a live graph holds it: the memory alone
            if self.grads is not None:
                _orphaned("the members were given memory of their own again")
                self.grads = None
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            LIVE.discard(self)
            self.stacks.clear()
            self._rows = [torch.empty(0)] * len(self._rows)
            self._expected = [-1] * len(self._rows)
            self._strides = [()] * len(self._rows)
            self._links = [None] * len(self._rows)
            for table in (self._foreign, self._unlinked, self._in_shm):
                table.clear()

    def owns(self, tensor: torch.Tensor) -> bool:
        """True when `tensor` is a view into one of the stacks."""
        base = tensor.untyped_storage().data_ptr()
        return any(s.untyped_storage().data_ptr() == base for s in self.stacks.values())

    def _repoint(
        self, held: list[torch.Tensor], pointers: list[int], strides: list[tuple[int, ...]]
    ) -> None:
        restacked: set[int] = set()
        moved = [
            j for j, (p, st) in enumerate(zip(pointers, strides, strict=True))
            if p != self._expected[j] or st != self._strides[j]
        ]  # fmt: skip
        for j in moved:
            k = j // self.count
            if k in restacked:
                continue
            tensor, row = held[j], self._rows[j]
            if (tensor.shape, tensor.dtype, tensor.device) != (row.shape, row.dtype, row.device):
                self._restack(k, held)  # every member's tensor of this name, or Unstackable
                restacked.add(k)
                continue
            # A view of the stack itself (`.data = w.t()`) overlaps the row: copy a clone.
            # Written past the version counter, as the `.data` write it mirrors.
            row.data.copy_(tensor.clone() if self.owns(tensor) else tensor)
            self._adopt(j, tensor)

    def _restack(self, k: int, held: list[torch.Tensor]) -> None:
        group = held[k * self.count : (k + 1) * self.count]
        if len({(t.shape, t.dtype, t.device) for t in group}) != 1:
            raise Unstackable(f"the members' {self.names[k]} differ in shape, dtype or device")
        name = self.names[k]
        if self.grads is not None and name in self.grads.stacks:
            _orphaned(f"the members' {name} changed shape, dtype or device")
        stack = self.stacks[name] = torch.stack([t.detach() for t in group])
        if self.grads is not None and name in self.grads.stacks:
            self.grads.replace(name, stack)
        for i, tensor in enumerate(group):
            j = k * self.count + i
            self._rows[j] = stack[i]  # one view each (unbind's views refuse in-place writes)
            self._adopt(j, tensor)

    def _adopt(self, j: int, tensor: torch.Tensor) -> None:
        """Make `tensor` a view of row j sharing its version, or keep it apart and say how.

        A tensor in shared memory is left alone (`InSharedMemory` at the next
        call); one whose memory another tensor shares stays as it is (the
        sharing is the user's), and so does an inference tensor (it cannot take
        other data): both are copied in before every call.
        """
        row = self._rows[j]
        for table in (self._foreign, self._unlinked, self._in_shm):
            table.discard(j)
        ours = self.owns(tensor)
        if _in_shm(tensor) and not ours:
            self._in_shm.add(j)
        elif tensor.is_inference() or (_torch.storage_shared(tensor) and not ours):
            self._foreign.add(j)
        elif self._links[j] == self._link_of(j, tensor):
            tensor.data = row  # linked already: `.data =` keeps the shared version counter
        elif _torch.share_version(tensor, row):
            self._linked(j, tensor)
        else:
            try:
                tensor.data = row
                self._unlinked.add(j)
            except RuntimeError:
                self._foreign.add(j)
        if j not in self._foreign:
            Alone.mark(tensor)
        self._expected[j] = _data_ptr(tensor)
        self._strides[j] = tensor.stride()

    def _link_of(self, j: int, tensor: torch.Tensor) -> tuple[int, int]:
        return _torch.impl_id(tensor), id(self.stacks[self.names[j // self.count]])

    def _linked(self, j: int, tensor: torch.Tensor) -> None:
        self._unlinked.discard(j)
        self._links[j] = self._link_of(j, tensor)


def _in_shm(tensor: torch.Tensor) -> bool:
    """True for a CPU tensor in shared memory (`is_shared()` is always True on CUDA)."""
    return tensor.device.type == "cpu" and bool(tensor.is_shared())  # type: ignore[no-untyped-call]


def _orphaned(why: str) -> None:
    _logger.warning(
        "Fanout: %s, so the stacks Fanout.parameters() handed out no longer hold the members' "
        "tensors: an optimizer over them no longer trains the members; call "
        "fan.parameters() again and make a new optimizer",
        why,
    )


class _Shared:
    """Each live Storage by its members' ids (weakly), and the lock its lookups take.

    Process-lifetime on purpose: a Storage belongs to its Fanouts, not to a
    world (fan-out runs with or without one), and this index holds none alive.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_members: weakref.WeakValueDictionary[tuple[int, ...], Storage]
        self.by_members = weakref.WeakValueDictionary()


_SHARED = _Shared()


def storage_for(members: Sequence[torch.nn.Module]) -> Storage:
    """The Storage of these members (in this order), made or shared; one more user."""
    key = tuple(map(id, members))
    with _SHARED.lock:
        found = _SHARED.by_members.get(key)
        alive = (
            found is not None
            and found.stacks
            and all(ref() is m for ref, m in zip(found.member_refs, members, strict=True))
        )
        storage = found if alive and found is not None else Storage(members)
        _SHARED.by_members[key] = storage
        with storage._lock:
            storage.users += 1
        return storage


class _stacking:
    """Stacks are written outside autograd, and are normal tensors even in inference mode."""

    def __enter__(self) -> None:
        # In this order: leaving inference mode turns grad mode back on.
        self._modes = (torch.inference_mode(False), torch.no_grad())
        for mode in self._modes:
            mode.__enter__()

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
