"""How RRefs and handles cross a call in a world that heals: without torch's fork messages.

torch forks an RRef as it pickles it into a call. The receiver, or the owner,
then tells the others (the owner of its new user, the sender that the fork
arrived) by messages torch retries for about 13 s after a failure. When the
process they go to died, the last retry fails, and torch raises that failure
on a thread of its own; if the retry failed at once (as one to a dead process
does), that thread is torch's retry thread, and the survivor ends there
(std::terminate). So in a world that heals, asyncrpc's calls send RRefs in
ways that need none of these messages::

    the RRef's owner is   the RRef is sent as                  messages after the call
    the caller            torch's own fork (the owner           none
                          registers it as it pickles)
    the callee            its id; the callee finds its own      none (the caller holds
                          object (`owned`)                       its RRef until the reply)
    a third worker        a fork its owner makes for the         one call from the caller
                          callee, asked for by the caller as     to the owner, as it
                          it pickles (`adopt`: taken in          pickles; an owner that
                          without telling anyone)                died: ObjectLostError

The reply of a call asyncrpc sent crosses the same way (the caller is the
receiver: `THREAD.replying`), except that an RRef owned by the caller goes
as torch's fork. Without this, an RRef owned by a third worker that died as
the reply was on its way made the caller send torch's fork request to it,
retried, whose last failure ended the caller's process (SIGABRT).

An RRef that asyncrpc's `remote()` made of an operator (a type not known here)
is waited for first: its owner makes it, or `ObjectLostError`. Where the callee
is not known (a value returned, torch's own verbs), and for an RRef made by
torch's own `remote()`, torch forks as usual, refused where the owner or the
sender is known dead (`_hooks._check_fork`).
"""

from __future__ import annotations

from typing import Any

from . import _polling, _torch
from ._errors import ObjectLostError, WorkerUnreachableError
from ._membership import Members

__all__ = ["LENT", "adopt", "fork_here", "owned", "reduce"]


def reduce(py_rref: Any, to: int, keep: list[Any] | None, me: int, members: Members) -> Any:
    """How `py_rref` is pickled into a call to torch id `to` (see the module's table).

    A reduce tuple, or None for torch's own fork. `me`: this process's torch id.
    `keep` None: the reply to a call `to` made; an RRef owned by `to` then goes
    as torch's fork (the owner sends one notice back, not retried), as nothing
    here can hold the reply's RRef until `to` has taken it in.
    """
    found = _torch.rref_owner(py_rref)
    owner = found if isinstance(found, int) else int(found.id)
    what = "returned by a call" if keep is None else "passed to a call"
    members.check_owner(owner, f"the object of an RRef or handle {what}")
    if owner == me:
        lent = _lent_hook(py_rref)
        if lent is None:
            return None  # torch's own fork
        data = _torch.fork_from_owner(py_rref)  # the same fork, noted for `to`'s death
        lent(to, data)
        return (adopt, (data,))
    if owner == to and keep is None:
        return None
    kind = _torch.rref_kind(py_rref)
    if kind is None:  # not made here by asyncrpc, nor received: torch's own remote()
        return None
    if kind == _torch.PENDING:  # asyncrpc's remote() of an operator: its type is the owner's
        _confirmed(py_rref, owner, members)
        kind = ""
    if owner == to and keep is not None:
        keep.append(py_rref)  # the owner keeps the object while this RRef lives
        return (owned, (owner, *_torch.rref_id(py_rref), kind))
    return (adopt, (_lend(py_rref, owner, kind, members, what, to),))


# An object that wants to hear of each fork of its RRef handed to another worker, so as
# to delete those a worker that died held (an ObjectRef's value: `_objects`), has this
# method: `_asyncrpc_lent(torch id, fork data)`.
LENT = "_asyncrpc_lent"


def _lent_hook(owner_rref: Any) -> Any:
    try:
        return getattr(owner_rref.local_value(), LENT, None)
    except Exception:  # not made yet, or not a Python object: torch's own fork
        return None


def _confirmed(py_rref: Any, owner: int, members: Members) -> None:
    """Wait until the owner made `py_rref`'s object; an owner that died: ObjectLostError.

    torch's own fork of an RRef its owner has not confirmed would wait for the
    owner with messages whose last failed retry can end this process. torch
    never completes the creation of an owner that died: its death is learnt
    from the members (within a heal's notice), bounded by `_CONFIRM_S`.
    """

    def lost(why: str) -> ObjectLostError:
        name = members.name_of(owner) or ""
        return ObjectLostError(
            f"an RRef passed to a call refers to an object that does not exist: {why} "
            f"(worker {name!r}); it has probably died: make the object again",
            name,
        )

    def made() -> bool:
        done = _torch.created(py_rref)
        if not done:
            members.check_owner(owner, "the object of an RRef passed to a call")
        if done is False:
            raise lost("its owner failed to make it")
        return bool(done)

    _polling.until(made, _CONFIRM_S, "its owner did not make it", lost)


_CONFIRM_S = 60.0


def _lend(py_rref: Any, owner: int, kind: str, members: Members, what: str,
          to: int) -> tuple[Any, ...]:  # fmt: skip
    """Ask `owner` for a fork of `py_rref` that the callee (torch id `to`) takes in without
    a message.

    `what`: how the RRef crosses ("passed to a call"), for the error.
    """
    name = members.name_of(owner)
    try:
        if name is None:
            raise WorkerUnreachableError(f"torch id {owner} is no member now", "")
        data: tuple[Any, ...] = _torch.rpc_sync(
            members.info(name), fork_here, args=(*_torch.rref_id(py_rref), kind, to)
        )
    except RuntimeError as exc:  # the owner died, or is dying: the object goes with it
        members.check_owner(owner, f"the object of an RRef or handle {what}")
        raise ObjectLostError(
            f"an RRef or handle {what} could not be handed on: its object lives "
            f"on worker {name!r}, which cannot be reached ({str(exc).splitlines()[0]}); "
            f"it has probably died, and the object with it",
            name or "",
        ) from exc
    return data


def fork_here(created_on: int, local_id: int, kind: str, to: int = -1) -> tuple[Any, ...]:
    """On the owner: a fork of its object's RRef, registered here, for worker `to`."""
    me = _torch.own_id()
    owner_rref = _torch.owner_view(me, (created_on, local_id), kind)
    data = _torch.fork_from_owner(owner_rref)
    lent = _lent_hook(owner_rref) if to >= 0 else None
    if lent is not None:
        lent(to, data)
    return data


def owned(owner: int, created_on: int, local_id: int, kind: str) -> Any:
    """On the callee, which owns the object: an RRef to it (no fork, no message)."""
    me = _torch.own_id()
    if owner != me:  # never sent so: the caller sends an id only to its owner
        raise RuntimeError(
            f"an RRef sent by id to torch id {me} belongs to torch id {owner}; "
            f"asyncrpc sends an RRef by id only to its owner"
        )
    rref = _torch.owner_view(owner, (created_on, local_id), kind)
    _torch.note_kind(rref, kind)
    return rref


def adopt(data: tuple[Any, ...]) -> Any:
    """On the callee: the fork its owner made for it (`fork_here`), taken in silently."""
    _torch.check_received(int(data[0]))
    rref = _torch.adopt_fork(data)
    _torch.note_kind(rref, str(data[-1]))
    return rref
