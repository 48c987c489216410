"""The records of a world that heals or grows, in its store: who is in it, who is done.

`_membership` holds a member's view (`Members`); this module holds what
lies in the store under asyncrpc/<tag>/heal/, read and written by the
members (`_healing`, `_elastic`) and by supervisors and launchers
(`_launch`). Keys:

    names                    every rank's name, in rank order (JSON)
    id/<name>, attempt/<name>, group/<name>   the process that answers for <name> now
    ready/<name>             <name> knows the members: it may be called (a start's barrier)
    joined/<name>            an added or replacing <name> has welcomed every member
    state                    {"done": {name: attempt}, "healing": n, "ending": bool,
                             "left": [name]}: whose main has returned, heals and adds
                             under way, the world ends, who left
    <seq>/ack/<name>         <name> has heard the news of sequence <seq>
    request/<id>, reply/<id> a member's change of members and its answer (`_elastic`)
    left/<name>, failed/<name>   a removed worker has left; an added one failed to join
    seq, restarts, ids, requests   counters
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from . import _polling
from ._membership import Members

if TYPE_CHECKING:
    from ._context import Context
    from ._torch import Store

__all__ = (
    "begin_change",
    "begin_heal",
    "end_heal",
    "formed",
    "live_names",
    "mark_left",
    "mark_ready",
    "meet_to_end",
    "meet_to_stop",
    "publish",
    "read_members",
    "read_names",
    "read_state",
    "settle",
    "wait_for_all",
    "wait_keys",
)

_LOOK_S = 1.0  # how often a member waiting for the world's end looks again, unwoken
_STOP_S = 30.0  # how long members wait for each other to stop, once every main is done


# ---- the store protocol: members' side ----------------------------------------------


def publish(space: Store, ctx: Context, torch_id: int, group: str, first: bool) -> None:
    """Say who answers for `ctx.name` now: its torch id, attempt and group's key prefix.

    `first`: one of the processes the world formed with, which also writes the
    names (a replacement or an added member reads them; its supervisor wrote them).
    """
    space.set(f"id/{ctx.name}", str(torch_id))
    space.set(f"attempt/{ctx.name}", str(ctx.attempt))
    space.set(f"group/{ctx.name}", group)
    if first:
        space.set("names", json.dumps(list(ctx.names)))


def wait_for_all(space: Store, names: tuple[str, ...], timeout: float, key: str = "id") -> None:
    """Wait until every member has joined torch's group once (a world's start).

    `key="ready"`: until every member knows the others (`mark_ready`), so that
    no call reaches a member still starting. A member that dies before then
    is not replaced in place: the world starts again (`formed`).
    """
    keys = [f"{key}/{name}" for name in names]

    def missing() -> str:
        absent = [n for n, k in zip(names, keys, strict=True) if not space.check([k])]
        return (
            f"workers {absent} did not join the world within init_timeout={timeout} s; "
            f"they did not start (their own output says why)"
        )

    _polling.until(lambda: space.check(keys), timeout, missing)


def mark_ready(space: Store, name: str) -> None:
    """`name` knows every member now: calls to it find its `Members` set."""
    space.set(f"ready/{name}", "1")


def formed(space: Store, names: tuple[str, ...]) -> bool:
    """True once every member has been ready once: from then on `main`s may run."""
    return bool(space.check([f"ready/{name}" for name in names]))


def read_names(space: Store, timeout: float) -> tuple[str, ...]:
    """Every member's name in rank order (a replacement learns them from the store)."""
    wait_keys(space, ["names"], timeout)
    return tuple(json.loads(space.get("names").decode()))


def read_members(space: Store, names: tuple[str, ...], size: int = 0) -> Members:
    """`Members` as the store has them now (ids and attempts of every name).

    In a world that grew, `names` holds every rank given so far: a member
    added beside this one that has not joined torch's group yet is left out
    (its welcome adds it), and those that left are marked so.
    """
    ranks = {name: rank for rank, name in enumerate(names)}
    joined = tuple(n for n in names if space.check([f"id/{n}"]))
    ids = [int(v) for v in space.multi_get([f"id/{n}" for n in joined])]
    attempts = [int(v) for v in space.multi_get([f"attempt/{n}" for n in joined])]
    members = Members(
        joined,
        dict(zip(joined, ids, strict=True)),
        dict(zip(joined, attempts, strict=True)),
        size,
        {name: ranks[name] for name in joined},
    )
    for name in read_state(space).get("left", []):
        if name in members.ranks:
            members.left[name] = "it left"
            members.lost[members.ids[name]] = name
    return members


def meet_to_end(space: Store, ctx: Context, timeout: float = 0) -> bool:
    """Mark `main` done here; wait until every member's is and the world is ending.

    While a member is being replaced its replacement runs `main` again, and
    the world waits for it. True too once this member was removed (it leaves
    alone). False when `timeout` (> 0) passed first.

    Members do not poll the store while they wait (a world of 66 members
    polling every 10 ms kept two cores busy serving it): the change that ends
    the world, or removes a member, sets the member's `wake/<name>` (`settle`),
    for which a thread of its own blocks; it looks again every `_LOOK_S` too.
    """
    deadline = time.monotonic() + timeout if timeout > 0 else None
    _update(space, lambda state: state["done"].update({ctx.name: ctx.attempt}) or state)
    key = f"wake/{ctx.name}"
    woken = threading.Event()
    waiter = threading.Thread(
        target=_wait_for, args=(space.clone(), key, woken),  # type: ignore[attr-defined]
        name="asyncrpc-end-wait", daemon=True,
    )  # fmt: skip
    waiter.start()
    try:
        while True:
            state = settle(space)
            if state["ending"] or ctx.name in state.get("left", ()):
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            wait = _LOOK_S if deadline is None else min(_LOOK_S, deadline - time.monotonic())
            woken.wait(max(0.0, wait))
    finally:
        space.set(key, "1")  # the waiter's key: it returns
        waiter.join(_LOOK_S)


def _wait_for(space: Store, key: str, woken: threading.Event) -> None:
    try:
        space.wait([key], datetime.timedelta(days=365))
    except Exception:  # the store went away with the world: look once more and end
        pass
    woken.set()


def settle(space: Store) -> dict[str, Any]:
    """End the world if every member's `main` is done and no change is under way; the state.

    Called by each change that may end it (a `main` done, a heal or an add
    counted out, a removal); the one that ends it wakes every member.
    """

    flipped = [False]  # by this call (`_update` may try `end` more than once)

    def end(state: dict[str, Any]) -> dict[str, Any] | None:
        flipped[0] = False
        if state["ending"]:
            return None
        # Every member's, those added since included (their names are written before
        # their change is counted out of `healing`, see `begin_change`).
        live = set(read_names(space, 0)) - set(state.get("left", ()))
        if live <= set(state["done"]) and state["healing"] == 0:
            state["ending"] = flipped[0] = True
            return state
        return None

    state = _update(space, end)
    if flipped[0]:
        _wake(space, read_names(space, 0))
    return state


def _wake(space: Store, names: Iterable[str]) -> None:
    for name in names:
        space.set(f"wake/{name}", "1")


def live_names(space: Store) -> tuple[str, ...]:
    """The members now, in rank order (every rank given, less those that left)."""
    left = set(read_state(space).get("left", ()))
    return tuple(name for name in read_names(space, 0) if name not in left)


def meet_to_stop(space: Store, count: int, timeout: float = 0) -> None:
    """After `meet_to_end`: wait (bounded) until all `count` members are ready to stop."""
    space.add("stopping", 1)
    _polling.within(lambda: int(space.add("stopping", 0)) >= count, timeout or _STOP_S)


def _update(
    space: Store, change: Callable[[dict[str, Any]], dict[str, Any] | None]
) -> dict[str, Any]:
    """Apply `change` to the world's state key atomically; the state after (None: unchanged).

    One key holds who is done, how many heals run and whether the world is
    ending, so that each of these moves checks the others in one step.
    """
    while True:
        raw, state = _read(space)
        changed = change(json.loads(json.dumps(state)))
        if changed is None:
            return state
        text = json.dumps(changed, sort_keys=True)
        if space.compare_set("state", raw, text).decode() == text:
            return changed


def wait_keys(space: Store, keys: list[str], timeout: float, missing: str = "") -> None:
    """Wait (bounded) until `space` has every key; StoreTimeoutError(`missing`) past `timeout`."""
    awaited = missing or f"the world's store has no {keys} after {timeout} s"
    _polling.until(lambda: space.check(keys), timeout, awaited)


# ---- the store protocol: the supervisor's side ----------------------------------------


def read_state(space: Store) -> dict[str, Any]:
    """The world's state: `done` (name: attempt), `healing` (a count), `ending`."""
    return _read(space)[1]


def _read(space: Store) -> tuple[str, dict[str, Any]]:
    raw = space.get("state").decode() if space.check(["state"]) else ""
    return raw, (json.loads(raw) if raw else {"done": {}, "healing": 0, "ending": False})


def begin_change(space: Store) -> bool:
    """Count a change of members in (workers added); False once the world ends.

    While counted, the world does not end: the new names are written to the
    store before `end_heal` counts the change out.
    """

    def begin(state: dict[str, Any]) -> dict[str, Any] | None:
        if state["ending"]:
            return None
        state["healing"] += 1
        return state

    return not _update(space, begin)["ending"]


def mark_left(space: Store, names: list[str]) -> None:
    """`names` leave the world: its end does not wait for their `main`s any more."""

    def leave(state: dict[str, Any]) -> dict[str, Any]:
        state["left"] = sorted(set(state.get("left", [])) | set(names))
        return state

    _update(space, leave)
    _wake(space, names)  # one waiting for the end leaves now
    settle(space)


def begin_heal(space: Store, name: str) -> bool:
    """Count a heal of `name` in (its `main` is not done any more); False once the world ends."""

    def begin(state: dict[str, Any]) -> dict[str, Any] | None:
        if state["ending"]:
            return None
        state["done"].pop(name, None)
        state["healing"] += 1
        return state

    return not _update(space, begin)["ending"]


def end_heal(space: Store) -> None:
    """Count the heal out: its replacement has been started (or could not be)."""

    def end(state: dict[str, Any]) -> dict[str, Any]:
        state["healing"] -= 1
        return state

    _update(space, end)
    settle(space)
