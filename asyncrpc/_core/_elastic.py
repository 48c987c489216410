"""Worlds that grow and shrink while they run: the members' verbs.

An elastic world (`asyncrpc.run(main, world_size=N, elastic=True)`, and
every world that heals) is one of torch's dynamic groups, as a world that
heals is (`_membership`). A member asks its supervisor for a change through
the world's store, and the supervisor makes it (`_launch/_changes` has the
diagram)::

    add_workers(2)        request ──> supervisor: names += new ones, started warm
                          <── their names; each joins torch's group under a fresh
                          id, welcomes every member (on_members: Joined), then
                          says joined/<name>: add_workers returns
    remove_workers("w2")  request ──> supervisor: every member hears "w2 is
                          leaving" (calls to it fail with WorkerLeftError), then
                          w2 (stopping() is True there); w2 leaves when its main
                          returns, or is killed at the timeout; every member hears
                          it left (on_members: Left): remove_workers returns
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, Literal, overload

from torch.futures import Future

from . import _environ, _membership, _polling, _records, _world
from ._errors import (
    AsyncRPCError,
    JoinTimeoutError,
    NotElasticError,
    RendezvousError,
    UnknownWorkerError,
    WorldFullError,
)
from ._membership import Joined, Left, Replaced

__all__ = ("add_workers", "members", "on_members", "remove_workers", "stopping")

_STOPPED_S = 30.0  # past a removal's timeout: how long its kill and news may take


def members() -> tuple[str, ...]:
    """The names of the world's workers now, in rank order.

    In an elastic world it changes as workers are added and removed (a
    worker's `ctx.names` is the world as that worker started); elsewhere it
    is `ctx.names`.

    Example::

        for name in asyncrpc.members():
            print(name, asyncrpc.rpc_sync(name, os.getpid))
    """
    world = _world.current_world("asyncrpc.members()")
    if world.members is None:
        return world.context.names
    return world.members.live()


def stopping() -> bool:
    """True once this worker is being removed (`remove_workers`): return from `main` soon.

    It leaves the world when its `main` returns, after the calls it runs
    have finished; past the removal's timeout it is stopped. Example::

        def main(ctx):
            while not asyncrpc.stopping():
                step()
    """
    return _world.current_world("asyncrpc.stopping()").stopping.is_set()


def on_members(
    callback: Callable[[Joined | Left | Replaced], object],
) -> Callable[[], None]:
    """Call `callback(event)` on this worker for each change of the world's members.

    `event` is an `asyncrpc.Joined(name, rank)`, `asyncrpc.Left(name, rank,
    reason)` or `asyncrpc.Replaced(name, rank, attempt, reason)`. Callbacks
    run on one thread of their own (`asyncrpc-on-members`), one event after
    the other in the order this worker learnt them (changes made one after
    another arrive in that order on every worker; the workers of one
    `add_workers` call join in any order); a callback may call the world.
    Returns a function that unregisters the callback.

    Example::

        def main(ctx):
            def seen(event):
                print(ctx.name, "sees", event)

            asyncrpc.on_members(seen)
    """
    world = _world.current_world("asyncrpc.on_members()")
    if not callable(callback):
        raise TypeError(
            f"on_members takes a function callback(event), got {type(callback).__name__} "
            f"{callback!r:.60}"
        )
    if world.members is None:
        raise NotElasticError(_not_elastic("asyncrpc.on_members()"))
    return world.members.events.register(callback)  # type: ignore[arg-type]


def add_workers(
    count: int = 1,
    *,
    role: str | None = None,
    timeout: float | None = None,
    node: int | None = None,
) -> tuple[str, ...]:
    """Start `count` new workers in this elastic world; their names, once all can call them.

    Each runs the world's `main(ctx)` with a rank never used before here, named
    `worker<rank>` or, with `role`, by that role's numbering (`actor4`).
    Embedded they fork warm from the world's forkserver; under
    `asyncrpc-launch --elastic` the launcher of the caller's node starts
    them (or of the node `node` names: its node rank, or a joined node's
    number). Past `max_world_size` it raises
    `WorldFullError` and starts nothing; a worker that fails to join, or does
    not join within `timeout` s (default: the world's `init_timeout`), makes
    it raise (`RendezvousError`, `JoinTimeoutError`) with none of the new
    workers left in the world.

    Example::

        names = asyncrpc.add_workers(2, role="actor")  # ("actor4", "actor5")
        handles = [asyncrpc.spawn(name, Actor) for name in names]
    """
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"count must be a positive int, got {count!r}; e.g. add_workers(2)")
    world = _elastic_world("asyncrpc.add_workers()")
    ctx = world.context
    if role is not None and (not isinstance(role, str) or not role.isidentifier()):
        raise ValueError(f"role must be a name such as 'actor', got {role!r}")
    if role is None and ctx.roles:
        raise ValueError(
            f"this world names its workers by role ({[r for r, _ in ctx.roles]}); pass "
            f"role=... to add_workers"
        )
    if node is not None and (not isinstance(node, int) or isinstance(node, bool) or node < 0):
        raise ValueError(f"node must be a node's rank (an int >= 0) or None, got {node!r}")
    seconds = _seconds(timeout, world, "init_timeout")
    deadline = time.monotonic() + seconds
    # The supervisor's answer is not the join: it is waited for past a short timeout,
    # so that the workers it started are known and can be stopped (`_STOPPED_S`).
    where = node if node is not None else _environ.from_env(_environ.NODE_VARIABLE)
    request = {"op": "add", "count": count, "role": role, "by": ctx.name, "node": where}
    reply = _ask(world, request, max(seconds, _STOPPED_S))
    names = tuple(reply["names"])
    try:
        _wait_joined(world, names, deadline, seconds)
    except BaseException:
        # None of them stays half-joined: those still members leave again, at once.
        live = _records.live_names(_space(world))
        rest = [n for n in names if n in live]
        if rest:
            _ask(world, {"op": "remove", "names": rest, "by": ctx.name, "timeout": 0}, 60)
            _wait_keys(world, [f"left/{n}" for n in rest], _STOPPED_S)
        raise
    return names


@overload
def remove_workers(
    *names: str, timeout: float | None = None, wait: Literal[True] = True
) -> None: ...


@overload
def remove_workers(
    *names: str, timeout: float | None = None, wait: Literal[False]
) -> Future[tuple[str, ...]]: ...


def remove_workers(
    *names: str, timeout: float | None = None, wait: bool = True
) -> Future[tuple[str, ...]] | None:
    """Remove workers from this elastic world, gracefully; returns once they have left.

    New calls to them fail at once with `asyncrpc.WorkerLeftError`; calls they
    are running finish and deliver their results (a call whose caller
    cancelled it is not waited for). On each, `asyncrpc.stopping()` turns
    True, and it leaves once its `main` returns, or is stopped past `timeout`
    s (default: the world's `rpc_timeout`); handles to objects it held then
    raise `ObjectLostError`. A worker may remove itself: then this returns at
    once, and it leaves when its `main` returns.

    With `wait=False` it returns as soon as the removal has begun (calls to
    them fail from then on): a torch Future that completes with the names
    once they have left, after this worker's `on_members` callbacks got their
    `Left` (a worker removing itself is not waited for). It fails if this
    worker's world ends first. Example::

        asyncrpc.remove_workers("actor2")
        gone = asyncrpc.remove_workers("actor3", "actor4", wait=False)
        ...  # go on; gone.wait() == ("actor3", "actor4") once both have left
    """
    world = _elastic_world("asyncrpc.remove_workers()")
    ctx = world.context
    members = world.members
    assert members is not None
    live = members.live()  # a worker still joining is no member yet
    for name in names:
        if not isinstance(name, str) or name not in live:
            raise UnknownWorkerError(
                f"remove_workers: {name!r} is not a member of the world now; its members: "
                f"{list(live)}"
            )
    if not isinstance(wait, bool):
        raise TypeError(f"wait must be True or False, got {wait!r}")
    asked = tuple(dict.fromkeys(names))
    seconds = _seconds(timeout, world, "rpc_timeout")
    if asked:
        request = {"op": "remove", "names": list(asked), "by": ctx.name}
        _ask(world, {**request, "timeout": seconds}, seconds + _STOPPED_S)
    others = tuple(name for name in asked if name != ctx.name)
    if not wait:
        return members.wait_left(others) if others else _done(asked)
    if others:
        _wait_keys(world, [f"left/{n}" for n in others], seconds + _STOPPED_S)
    return None


def _done(names: tuple[str, ...]) -> Future[tuple[str, ...]]:
    fut: Future[tuple[str, ...]] = Future()
    fut.set_result(names)
    return fut


def _elastic_world(what: str) -> _world.World:
    world = _world.current_world(what)
    if world.members is None or world.store is None:
        raise NotElasticError(_not_elastic(what))
    if not _space(world).check(["elastic"]):
        raise NotElasticError(
            f"{what}: this world was started by asyncrpc-launch without --elastic, so its "
            f"launchers do not add or remove workers; launch it with asyncrpc-launch "
            f"--elastic (or start it embedded with asyncrpc.run(main, world_size=N, "
            f"elastic=True))"
        )
    return world


def _not_elastic(what: str) -> str:
    return (
        f"{what} needs an elastic world, whose members may change while it runs; this "
        f"one's are fixed: start it with asyncrpc.run(main, world_size=N, elastic=True) "
        f"(or restart='worker', which is elastic too), or launch it with asyncrpc-launch "
        f"--elastic (torchrun's and rpc.init_rpc's worlds cannot change)"
    )


def _space(world: _world.World) -> Any:
    assert world.store is not None
    return _membership.heal_space(world.store, world.tag)


def _seconds(timeout: float | None, world: _world.World, default: str) -> float:
    if timeout is None:
        return float(getattr(world.settings, default))
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")
    return float(timeout)


def _ask(world: _world.World, request: dict[str, Any], seconds: float) -> dict[str, Any]:
    """Write `request` for the supervisor; its reply (an error in it raised, named)."""
    space = _space(world)
    rid = int(space.add("requests", 1))
    space.set(f"request/{rid}", json.dumps(request))
    _wait_keys(world, [f"reply/{rid}"], seconds)
    reply: dict[str, Any] = json.loads(space.get(f"reply/{rid}").decode())
    kind = reply.get("kind")
    if kind == "full":
        raise WorldFullError(f"add_workers({request['count']}): {reply['error']}")
    if kind == "node":
        raise ValueError(f"add_workers: {reply['error']}")
    if kind == "unknown":
        raise UnknownWorkerError(f"remove_workers: {reply['error']}")
    if kind is not None:
        raise AsyncRPCError(f"{request['op']} workers: {reply['error']}")
    return reply


def _wait_joined(
    world: _world.World, names: tuple[str, ...], deadline: float, seconds: float
) -> None:
    space = _space(world)
    waiting = list(names)

    def joined() -> bool:
        for name in list(waiting):
            if space.check([f"failed/{name}"]):
                how = space.get(f"failed/{name}").decode()
                raise RendezvousError(
                    f"add_workers: worker {name!r} failed as it joined the world ({how}); "
                    f"none of {list(names)} stays in it (its output says more)"
                )
            if space.check([f"joined/{name}"]):
                waiting.remove(name)
        return not waiting

    _polling.until(
        joined,
        deadline - time.monotonic(),
        lambda: (
            f"add_workers: {waiting} did not join the world within timeout={seconds} s; "
            f"none of {list(names)} stays in it: pass a larger timeout=..., or see their "
            f"output for what held them"
        ),
        JoinTimeoutError,
    )


def _wait_keys(world: _world.World, keys: list[str], seconds: float) -> None:
    space = _space(world)
    awaited = (
        f"the world's supervisor did not answer ({keys} missing after {seconds:g} s); "
        f"it may be overloaded or gone"
    )
    _polling.until(lambda: not keys or space.check(keys), seconds, awaited)
