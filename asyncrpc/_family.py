"""What every copy of one handle on one worker shares: its calls' order, the object, restarts.

A `Family` numbers the calls its handles send (under its lock, so a number
is used only if its call left: see `_core._mailbox`), holds the RRef of the
object now, and, on the worker that spawned it, the recipe to build it
again. In a world that heals, an object whose owner died is rebuilt on the
replacement from that recipe, at most `max_restarts` times (-1: always);
copies on other workers ask the spawning worker for the new RRef::

    creator (spawned it: recipe)            other worker (a copy)
    call ─> owner died? ObjectLostError     call ─> owner died?
      wait for the replacement to join        ─── rpc: current(origin) ──> creator
      build cls(*args) there: a new RRef            (revives it if not yet)
      new stream: the object starts fresh   <── the new RRef ───────────────┘
    the call goes to the new object

Past `max_restarts`, without a recipe, or when the creator is gone, the
handle raises `ObjectLostError` as before.
"""

from __future__ import annotations

import secrets
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from ._core import _calls, _hooks, _polling, _runtime, _torch, _world
from ._core._errors import ObjectLostError
from ._placement import count_held

__all__ = ("Family", "Recipe", "construct", "family_for", "my_name")

_REJOIN_S = 120.0  # the longest a restart waits for the owner's replacement to join


class Recipe(NamedTuple):
    """How to build the object again: what `spawn` sent, and how often it may."""

    cls: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    max_restarts: int


class _Sending:
    """`Family.sending`: a class, not a generator, as it runs on every handle's call."""

    __slots__ = ("family", "ticket")

    def __init__(self, family: Family, ticket: list[Any]) -> None:
        self.family, self.ticket = family, ticket

    def __enter__(self) -> None:
        family = self.family
        family.lock.acquire()
        self.ticket[0], self.ticket[1] = family.stream, family.next

    def __exit__(self, kind: object, *_: object) -> None:
        if kind is None:
            self.family.next += 1
        self.family.lock.release()


class Family:
    """One handle's shared state on this worker (see the module doc)."""

    __slots__ = (
        "__weakref__",
        "key",
        "lock",
        "next",
        "origin",
        "recipe",
        "restarts",
        "reviving",
        "rref",
        "stream",
        "suspected",
    )  # fmt: skip

    def __init__(self, rref: Any, origin: tuple[str, int] | None = None) -> None:
        self.rref = rref
        self.key = secrets.randbits(62) | 1  # how copies elsewhere name this family
        self.stream = secrets.randbits(62) | 1  # the owner orders this family's calls by it
        self.next = 0
        self.lock = threading.Lock()  # numbering calls as they leave
        self.reviving = threading.Lock()  # one restart at a time
        self.origin = origin  # (creator's name, its family's key); None: made here
        self.recipe: Recipe | None = None
        self.restarts = 0
        self.suspected: Any = None  # an RRef a call to which met the death of its owner

    def restarts_here(self) -> bool:
        """Whether this object was asked to restart (here, or by its creator elsewhere)."""
        return self.recipe is not None or self.origin is not None

    def suspect(self, rref: Any) -> None:
        """A call to `rref` met the death of its owner: the next call waits until the
        world knows, then rebuilds it (or raises `ObjectLostError` past its restarts)."""
        if self.restarts_here() and _world.heals():
            self.suspected = rref

    def sending(self, ticket: list[Any]) -> _Sending:
        """Number `ticket` and hold the order while its call is sent (a `with` block); a
        failed send gives its number back."""
        return _Sending(self, ticket)

    def may_restart(self) -> bool:
        """Whether a lost object may come back: restarts left here, or its creator's say."""
        if self.recipe is None:
            return self.origin is not None
        limit = self.recipe.max_restarts
        return limit == -1 or self.restarts < limit

    def revive(self, lost: Any, error: ObjectLostError) -> Any:
        """The RRef to use instead of `lost`, whose owner died: rebuilt, or `error`."""
        with self.reviving:
            if self.rref is not lost:
                return self.rref  # another thread revived it meanwhile
            if self.recipe is None:
                if self.origin is None:
                    raise error
                fresh = _ask_creator(self.origin, error)
            else:
                fresh = self._rebuild(error)
            with self.lock:
                self.rref, self.stream, self.next = fresh, secrets.randbits(62) | 1, 0
                self.suspected = None
            return fresh

    def _rebuild(self, error: ObjectLostError) -> Any:
        recipe = self.recipe
        assert recipe is not None
        if recipe.max_restarts != -1 and self.restarts >= recipe.max_restarts:
            raise error
        self.restarts += 1
        name = error.name
        _await_replacement(name, error)
        call = _calls.check("spawn", name, construct, (recipe.cls, recipe.args, recipe.kwargs),
                            None, None, recipe.cls)  # fmt: skip
        rref = _calls.send_remote(call)
        _torch.rref_future(rref).wait()  # built (or its constructor's error kept as the object)
        return rref


def construct(cls: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """On the owner: build the object `spawn` asked for, counted for placement."""
    made = cls(*args, **kwargs)
    count_held(made)  # for placing the next objects (`spawn(None, ...)`)
    return made


def _await_replacement(name: str, error: ObjectLostError) -> None:
    world = _world.running()
    members = None if world is None else world.members
    if members is None:
        raise error

    def joined() -> bool:
        if name in members.left:
            raise error  # it left the world: nowhere to rebuild it
        return name not in members.replacing

    try:
        _polling.until(joined, _REJOIN_S, f"the replacement of {name!r} ({_REJOIN_S:.0f} s)")
    except TimeoutError as exc:
        raise error from exc


class Families:
    """This world's families by key: those made here, and copies that came from elsewhere."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.made: weakref.WeakValueDictionary[int, Family] = weakref.WeakValueDictionary()
        self.copies: weakref.WeakValueDictionary[tuple[str, int], Family] = (
            weakref.WeakValueDictionary()
        )


def family_for(rref: Any, origin: tuple[str, int] | None = None) -> Family:
    """A new handle's family (`origin` None), or this worker's for a copy from `origin`."""
    families = _runtime.part(Families)
    with families.lock:
        if origin is None:
            made = Family(rref)
            families.made[made.key] = made
            return made
        if origin[0] == my_name():
            found = families.made.get(origin[1])
            if found is not None:
                return found  # back where it was made: the same family
        found = families.copies.get(origin)
        if found is None:
            found = families.copies[origin] = Family(rref, origin)
        return found


def _current(key: int) -> Any:
    """On the creator: the RRef of family `key`'s object now, revived if its owner died."""
    family = _runtime.part(Families).made.get(key)
    if family is None:
        return None
    rref = family.rref
    try:
        _hooks_owner(rref)
    except ObjectLostError as lost:
        rref = family.revive(rref, lost)
    return rref


def _hooks_owner(rref: Any) -> None:
    _hooks.owner_of(rref, "the object")


def my_name() -> str | None:
    """This worker's name, in a running world (None: no world)."""
    world = _world.running()
    return None if world is None else world.context.name


def _ask_creator(origin: tuple[str, int], error: ObjectLostError) -> Any:
    try:
        fresh = _calls.call_sync(_calls.check("call", origin[0], _current, (origin[1],), None,
                                              None, "restart"))  # fmt: skip
    except Exception as exc:  # the creator cannot answer (gone, or it failed): still lost
        raise error from exc
    if fresh is None:
        raise error
    return fresh
