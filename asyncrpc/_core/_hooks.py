"""What torch calls back into asyncrpc for, once patched (`_torch.install`).

torch's patched reads, its RRef methods and its RPC pickler know nothing of
asyncrpc's worlds; each asks through one of these hooks::

    fut.wait() / value() / then ──> name_read, check_value, carry (a call's failure, named)
    await fut                   ──> await_future
    rref.to_here()              ──> check_owner (its owner died?), name_rref
    pickling an RRef            ──> check_fork, reduce_rref (a world that heals: `_forks`)
    fut.cancel()                ──> cancel_call
    init_rpc's rendezvous       ──> handoff (the world's store)

The world they ask about is the runtime's (`_runtime`): `_world` puts it
there as it starts, or as it adopts torch's.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from . import _forks, _rendezvous, _runtime, _torch, _watcher
from ._cancel import Sent
from ._errors import ObjectLostError, WorkerUnreachableError
from ._failures import check_reply, hold, name_failure
from ._futures import await_future, then_child
from ._membership import Members
from ._unwaited import log_unwaited_failures

__all__ = ("HOOKS", "install", "owner_of")


class _World(Protocol):
    """What these hooks read of the running world (`_world.World`, a layer above)."""

    @property
    def members(self) -> Members | None: ...  # a world that heals: see _membership

    @property
    def key_rank(self) -> int: ...  # this process's torch id


def install() -> None:
    """Patch torch for a world asyncrpc meets (`_torch.install`), with these hooks."""
    # Installed when asyncrpc first meets a world, never at import, and removed by
    # the shutdown that ends it (_torch.install / uninstall).
    _torch.install(HOOKS)
    if os.environ.get("ASYNCRPC_LOG_UNWAITED", "").lower() in ("1", "true", "yes"):
        log_unwaited_failures(True)


def _check_owner(rref: Any) -> None:
    owner_of(rref, "the value of this RRef")


def _check_fork(owner: Any, sender: int | None = None) -> bool:
    """An RRef crosses a call: `ObjectLostError` if its owner's process died.

    `owner`: the RRef being sent, or its owner's torch id as it is received
    (`sender`: the process that sent it). torch would tell the owner and the
    sender of the fork, each by a message retried for seconds and then
    failed on a thread of torch's own, where the failure ends the process:
    a fork that involves a dead process is refused here first. Cheap where
    nothing died: one attribute read. True in a world that heals.
    """
    world: _World | None = _runtime.running_world()
    members = world.members if world is not None else None
    if members is None:
        return False
    if not members.lost:
        return True
    if not isinstance(owner, int):
        found = _torch.rref_owner(owner)
        owner = found if isinstance(found, int) else int(found.id)
    members.check_owner(owner, "the object of an RRef or handle passed to a call")
    if sender is not None and sender in members.lost:
        raise ObjectLostError(
            f"a call carried an RRef or handle from worker {members.lost[sender]!r}, whose "
            f"process died before the call ran here; it is not run",
            members.lost[sender],
        )
    return True


def _reduce_rref(py_rref: Any, to: int, keep: list[Any] | None) -> Any:
    """An RRef pickled into an asyncrpc call to torch id `to`, or its reply (`keep` None)."""
    world: _World | None = _runtime.running_world()
    if world is None or world.members is None:
        _check_fork(py_rref)
        return None
    return _forks.reduce(py_rref, to, keep, world.key_rank, world.members)


def owner_of(rref: Any, what: str) -> str:
    """The name of `rref`'s owner; `ObjectLostError` when that process died (a world that heals).

    `what` names the object in the error ("the object of this handle").
    """
    owner = _torch.rref_owner(rref)
    world: _World | None = _runtime.running_world()
    if world is not None and world.members is not None:
        owner_id = owner if isinstance(owner, int) else int(owner.id)
        world.members.check_owner(owner_id, what)
        name = world.members.name_of(owner_id)
        if name is not None:
            return name  # the member's name, not torch's for a replacement (name:id)
    if isinstance(owner, int):
        raise WorkerUnreachableError(
            f"{what} lives on a process (torch id {owner}) that is not in the world any more",
            "",
        )
    # The member's name: a replacement's torch name is "name:<torch id>" (_membership).
    return str(owner.name).split(":", 1)[0]


def _name_read(error: BaseException, sent: Sent) -> BaseException:
    return name_failure(error, sent.worker, sent.label)  # a call's tag


def _name_rref(error: BaseException, rref: Any) -> BaseException:
    # Its owner may have died while to_here waited, and left torch's agent with it
    # (a world that heals): torch's owner() then fails, so ask `owner_of`, whose
    # ObjectLostError names the death.
    try:
        owner = owner_of(rref, "the value of this RRef")
    except (ObjectLostError, WorkerUnreachableError) as named:
        return named
    return name_failure(error, owner, "RRef.to_here()")


HOOKS = _torch.Hooks(
    await_future=await_future,
    name_read=_name_read,
    name_rref=_name_rref,
    check_value=check_reply,
    carry=hold,
    cancel_call=_watcher.request,
    handoff=_rendezvous.handoff_handler,
    check_owner=_check_owner,
    check_fork=_check_fork,
    reduce_rref=_reduce_rref,
    then_child=then_child,
)
