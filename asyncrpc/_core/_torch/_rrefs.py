"""RRefs as the boundary reaches them: ids, owners, kinds, and forks made without torch's messages.

torch forks an RRef as it pickles it; the receiver, or the owner, then tells
the others by messages it retries for seconds and whose last failure is
raised on a thread of torch's own, where it ends the process
(RpcAgent::retryExpiredRpcs runs the failed retry's callbacks itself when
the retry failed at once, as one to a dead process does). `_forks` avoids
those messages where it can; these are its torch-side pieces, and the patch
of torch's RRef pickling that lets it (`patch_pickling`). The kinds noted
for RRefs live in the world's `RRefKinds` part (`_runtime`).

torch's RRefForkData as a tuple (`_serialize`): owner id, the RRef's id
(created on, local id), the fork's id (created on, local id), the parent's
id, the type.
"""

from __future__ import annotations

import functools
import re
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._C._distributed_rpc import PyRRef, WorkerInfo
from torch.distributed.rpc import internal as _rpc_internal

from .. import _runtime
from .._errors import UnsupportedTorchError
from ._originals import future_wait
from ._patches import Hooks, Patches
from ._releases import hold
from ._sending import Sending
from ._versions import TESTED_TORCH

__all__ = (
    "PENDING",
    "PY_OBJECT",
    "PyRRef",
    "RRefKinds",
    "adopt_fork",
    "check_received",
    "created",
    "drop_fork",
    "fork_from_owner",
    "note_kind",
    "owner_view",
    "patch_pickling",
    "rref_future",
    "rref_id",
    "rref_kind",
    "rref_owner",
)

PY_OBJECT = "PyObject"  # the type torch gives an RRef to the value of a Python function
PENDING = "?"  # a kind noted for an RRef from `remote` whose type is not known here
_RREF_ID = re.compile(r"created_on=(-?\d+), local_id=(\d+)")
_NO_FORK = (-1, 0)  # a fork id torch never makes (worker ids are not negative)
_NO_DESTINATION = re.compile(r"could not find destination id (\d+)")
# torch's refusal of an RRef's type on its owner (rref_context.cpp), naming the real one.
_OWNER_TYPE = re.compile(
    r"OwnerRRef type is (\S+), expected type is|sub-type of TensorType, but got (\S+)"
)


class RRefKinds:
    """The type torch gives each RRef's value, where known here (an RRef's fork carries it)."""

    __slots__ = ("__weakref__", "kinds")

    def __init__(self) -> None:
        self.kinds: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def note_kind(rref: Any, kind: str) -> None:
    """Remember the type torch gives `rref`'s value (an RRef's fork carries it).

    `PENDING`: `rref` came from `remote` here (it has a creation to wait for,
    `wait_created`), and its type is not known.
    """
    _runtime.part(RRefKinds).kinds[rref] = kind
    hold(rref)  # dropped on one thread only (`_releases`: torch 2.15's lock order)


def rref_kind(rref: Any) -> str | None:
    """The type of `rref`'s value as torch names it, where known here (`note_kind`)."""
    return _runtime.part(RRefKinds).kinds.get(rref)


def rref_future(rref: Any) -> Any:
    """The Future that completes when `rref`'s value exists on its owner."""
    return rref._get_future()


def rref_owner(rref: Any) -> WorkerInfo | int:
    """The owner of `rref`: torch's WorkerInfo, or only its id if the agent does not know it.

    A process that joined a dynamic group after a member died never knew that
    member: torch's `owner()` raises "could not find destination id N", and N
    is returned.
    """
    try:
        owner: WorkerInfo = rref.owner()
    except RuntimeError as exc:
        found = _NO_DESTINATION.search(str(exc))
        if found is None:
            raise
        return int(found.group(1))
    return owner


def rref_id(rref: Any) -> tuple[int, int]:
    """The id of the object `rref` refers to, (created on, local id); read from its repr."""
    match = _RREF_ID.search(repr(rref))
    if match is None:
        raise UnsupportedTorchError(
            f"asyncrpc reads an RRef's id from its repr, and torch {torch.__version__} "
            f"writes {repr(rref)!r}; asyncrpc is tested with torch "
            f"{' and '.join(TESTED_TORCH)}"
        )
    return int(match.group(1)), int(match.group(2))


def check_received(owner: int, sender: int | None = None) -> None:
    """An RRef arriving in a call: raise if its owner (or sender) died (`Hooks.check_fork`)."""
    hooks = _runtime.part(Patches).hooks
    if hooks is not None:
        hooks.check_fork(owner, sender)


def owner_view(owner: int, rref: tuple[int, int], kind: str) -> Any:
    """On the owner: an RRef to its own object `rref`, made without forking (no message).

    torch's "owner sends an RRef to itself" case, with a fork id torch never
    made: the owner removes no fork of its own (it finds none to remove).
    `kind` is the type torch gives the value; "" where the sender did not
    know it (then the object must exist here already): torch's refusal of
    a wrong type names the right one, and it is asked again with that.
    """
    try:
        return PyRRef._deserialize((owner, *rref, *_NO_FORK, owner, kind or PY_OBJECT))
    except RuntimeError as exc:
        found = _OWNER_TYPE.search(str(exc))
        if kind or found is None:
            raise
        named = found.group(1) or found.group(2)
        return PyRRef._deserialize((owner, *rref, *_NO_FORK, owner, named))


def created(rref: Any) -> bool | None:
    """Whether `rref`'s owner has made its value: True, False (it failed), None (not yet).

    Only for an RRef `remote` made in this process: one received has no
    creation to ask about (torch's Future of it is null: reading it crashes).
    torch leaves the Future of a creation whose owner died undone for good:
    None then, and the caller learns of the death otherwise.
    """
    if rref.confirmed_by_owner():
        return True
    fut = rref._get_future()
    if not fut.done():
        return None
    try:
        future_wait(fut)
    except RuntimeError:
        return False
    return True


def fork_from_owner(owner_rref: Any) -> tuple[Any, ...]:
    """On the owner: a new fork of its RRef for another worker, registered now (torch's
    early registration); a receiver takes it in without telling anyone (`adopt_fork`)."""
    data: tuple[Any, ...] = owner_rref._serialize()
    return data


def adopt_fork(data: tuple[Any, ...]) -> Any:
    """A fork made by its owner (`fork_from_owner`), taken in: torch sends no message."""
    return PyRRef._deserialize(data)


def drop_fork(data: tuple[Any, ...]) -> None:
    """On the owner: delete the fork `data` it made (`fork_from_owner`) for a process that
    died holding it, as torch deletes a fork its owner sent itself (delForkOfOwner: the
    owner's object goes with its last fork). Its object must still exist here: torch
    would make an empty one otherwise."""
    PyRRef._deserialize(data)


def patch_pickling(patches: Patches, hooks: Hooks) -> None:
    """An RRef sent to, or received by, any worker: `hooks.check_fork(owner's torch id)` first.

    torch forks an RRef as it pickles it (the receiver asks the owner to
    confirm the fork before the call runs): an RRef whose owner died could
    only wait. The sender raises instead, and so does a receiver that knows
    of the death before its sender did.
    """
    pickler = _rpc_internal._internal_rpc_pickler
    reduce: Callable[[Any], Any] = pickler._py_rref_reducer
    receive = vars(_rpc_internal._InternalRPCPickler)["_py_rref_receiver"].__func__
    # The parts are looked up per RRef, never kept: torch may hold these functions
    # (a pickler made while they were patched) after the world has ended.

    @functools.wraps(reduce)
    def checked_reduce(py_rref: Any) -> Any:
        call = _runtime.part(Sending).call
        replying = _runtime.THREAD.replying
        own = None
        if call is not None:  # a call of asyncrpc's: the callee is known
            own = hooks.reduce_rref(py_rref, *call)
        elif replying is not None:  # the reply to a call of asyncrpc's: so is the caller
            own = hooks.reduce_rref(py_rref, replying, None)
        else:
            hooks.check_fork(py_rref)
        return reduce(py_rref) if own is None else own

    @functools.wraps(receive)
    def checked_receive(cls: Any, fork_data: tuple[Any, ...]) -> Any:
        # torch's RRefForkData: (owner, rref id (2), fork id (2), parent, type): torch
        # would tell both the owner and the parent (the sender) of this fork.
        heals = hooks.check_fork(int(fork_data[0]), int(fork_data[5]))
        rref = receive(cls, fork_data)
        if heals:  # its owner made it: `_forks` may send it on without torch's messages
            note_kind(rref, str(fork_data[6]))
        return rref

    patches.patch(pickler, "_py_rref_reducer", checked_reduce)
    patches.patch(
        _rpc_internal._InternalRPCPickler, "_py_rref_receiver", classmethod(checked_receive)
    )
