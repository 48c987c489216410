"""A world that heals, as a member lives it: joining, welcoming a replacement, leaving.

`_membership` holds who is in the world (`Members`) and the store's
records; this module holds what a member *does* with them, at the three
moments a world that heals differs from one that does not::

    start   join(world)       publish this member, meet the others (or, a
                              replacement: welcome every survivor by RPC);
                              watch this worker's listener (`_torch._listener`)
    a death news(text)        the supervisor's "member gone ..." on the side
                              channel: forget the process, close its pipe, ack
            welcome(...)      (RPC, on each survivor) the replacement is up
    end     leave(world)      every main done, every RRef deleted, then stop

The world itself (`_world.World`, a layer above) is passed in, or, for
what arrives by RPC or the side channel, read from the runtime
(`_runtime`); `_World` names what this module reads and sets of it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch.distributed.rpc as rpc

from . import _cancel, _membership, _polling, _records, _runtime, _torch
from ._context import Context, Settings
from ._errors import JOIN_REFUSED_EXIT, LISTENER_CLOSED_EXIT
from ._membership import Joining, Members
from ._torch import Store

__all__ = ("join", "leave", "news", "start_failed_exit")

_REPLIES_LEAVE_S = 0.05  # a removed worker, idle, waits this long again before it leaves


class _World(Protocol):
    """What a member of a world that heals reads and sets of its world (`_world.World`)."""

    members: Members | None  # set by `join`

    @property
    def context(self) -> Context: ...

    @property
    def settings(self) -> Settings | None: ...

    @property
    def store(self) -> Store | None: ...

    @property
    def tag(self) -> str: ...  # the world's key space in the store

    @property
    def key_rank(self) -> int: ...  # this process's torch id

    @property
    def stack(self) -> contextlib.ExitStack: ...  # what undoes the world

    @property
    def members_known(self) -> threading.Event: ...

    @property
    def stopping(self) -> threading.Event: ...

    # Embedded: ends this process at once (its supervisor hears it left); else None.
    end_process: Callable[[], None] | None


def join(world: _World, joining: Joining) -> None:
    """After torch's join: publish this member, meet the others (or welcome them)."""
    ctx, settings = world.context, world.settings
    assert world.store is not None and settings is not None
    space = _membership.heal_space(world.store, world.tag)
    first = not joining.replacement
    _records.publish(space, ctx, joining.torch_id, _torch.group_key_prefix(), first)
    if first:
        _records.wait_for_all(space, ctx.names, settings.init_timeout)
    members = _records.read_members(space, ctx.names, joining.size or ctx.world_size)
    if joining.replacement:  # another member may be being replaced as this one joins
        members.missed(_torch.known_ids())
    members.here(ctx.name)
    world.members = members
    world.stack.callback(members.stop)
    world.members_known.set()
    # Before this member counts as ready, so no main sees the world without its thread;
    # a listener closed before is seen closed at once.
    _torch.watch_listener(lambda: _listener_closed(world))
    _records.mark_ready(space, ctx.name)
    if joining.replacement:
        _welcome_all(world, settings.rpc_timeout)
        # Every member knows this one now: `add_workers` returns (see `_elastic`).
        space.set(f"joined/{ctx.name}", str(time.time()))
    else:  # no member's main calls one that does not know the members yet
        _records.wait_for_all(space, ctx.names, settings.init_timeout, key="ready")


def start_failed_exit(joining: Joining | None, text: str) -> int:
    """The exit code of a worker whose start failed, with traceback `text`.

    `JOIN_REFUSED_EXIT` for a replacement whose join another member refused:
    that member's listener closed, and it ends to be replaced too. Its
    supervisor (embedded, or a launcher) starts it again a moment later,
    uncounted (`_launch/_replacing`). Else 1.
    """
    if joining is not None and joining.replacement and _torch.refused(text):
        return JOIN_REFUSED_EXIT
    return 1


def _listener_closed(world: _World) -> None:
    """torch's listener here stopped accepting: restart, or no replacement could join again.

    A worker no process can connect to any more is a failed worker in a world
    that heals: it ends, and the supervisor replaces it like any other.
    """
    if _runtime.running_world() is not world:
        return
    print(
        f"asyncrpc: worker {world.context.name!r} (pid {os.getpid()}) can no longer accept "
        f"connections: torch's TensorPipe closed its listener after an incoming connection "
        f"ended before its first message (a process killed while it connected, or something "
        f"else that connected to its port and closed). Connections already open still work, "
        f"but no replacement could join the world any more; this worker ends so that the "
        f"world replaces it",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os._exit(LISTENER_CLOSED_EXIT)  # the main thread may be blocked in torch (a call, a wait)


def _welcome_all(world: _World, timeout: float) -> None:
    """Tell every other member that this replacement is up (before `main` runs here)."""
    ctx, members = world.context, world.members
    assert members is not None
    futures = []
    for name in members.names:
        if name == ctx.name or name in members.replacing or name in members.lost.values():
            continue
        try:
            args = (ctx.name, world.key_rank, ctx.attempt, ctx.rank)
            info = members.info(name)
            futures.append(_torch.rpc_async(info, _welcome, args=args, timeout=timeout))
        except RuntimeError:  # not in the group now: being replaced itself
            continue
    for fut in futures:
        try:
            fut.wait()
        except Exception:  # a member that died meanwhile: its own heal follows
            continue


def _starting_members() -> _World | None:
    """This process's world, once it knows its members (waiting while it starts)."""
    world: _World | None = _runtime.running_world()
    if world is not None and world.settings is not None:
        world.members_known.wait(world.settings.init_timeout)
    return world


def _welcome(name: str, torch_id: int, attempt: int, rank: int = -1) -> None:
    """Run on a member: `name`'s replacement (torch id, attempt) has joined, or a new member."""
    world = _starting_members()
    if world is None or world.members is None:
        return
    event = world.members.joined(name, torch_id, attempt, rank)
    if event is not None:
        world.members.announce(event)
        if isinstance(event, _membership.Replaced):  # a heal freed what the dead held
            _membership.trim_heap()


def news(text: str) -> None:
    """The side channel's "member gone" from the supervisor: forget the dead process, ack."""
    parsed = _membership.parse_gone(text)
    world = _starting_members()
    if parsed is None or world is None or world.members is None or world.store is None:
        return
    kind, seq, torch_id, name, why = parsed
    if kind == _membership.LEAVING:
        _leaving(world, name, why)
    elif kind == _membership.LEFT:
        _departed(world, name, torch_id, why)
    elif world.members.gone(name, torch_id, why):
        _let_go(world.members, name, torch_id)
    _membership.heal_space(world.store, world.tag).set(f"{seq}/ack/{world.context.name}", "1")


def _leaving(world: _World, name: str, why: str) -> None:
    """`name` is being removed: calls to it fail from now; if it is this worker, it stops."""
    assert world.members is not None
    world.members.leaving(name, why)
    if name == world.context.name:
        world.stopping.set()


def _departed(world: _World, name: str, torch_id: int, why: str) -> None:
    """`name`'s process has left the world: its objects are lost, its pipe closed."""
    assert world.members is not None
    if world.members.departed(name, torch_id, why) is not None:  # its Left is out
        _let_go(world.members, name, torch_id)


def _let_go(members: _membership.Members, name: str, torch_id: int) -> None:
    """`name`'s process `torch_id` is gone (died or left): close its pipe, run the hooks.

    Kept in torch's group (see _membership); its pipe closed, or its sockets
    would stay open (CLOSE-WAIT) here for good.
    """
    _torch.close_pipe(_membership.torch_name(name, torch_id, members.size))
    for hook in list(members.gone_hooks):
        hook(torch_id)


def _finish(members: _membership.Members, timeout: float) -> None:
    """A removed worker: wait until it runs no call and no stream for a peer any more.

    A call its caller cancelled does not count: nobody waits for its result
    (a sync function may run on; it ends with the process). Unbounded
    without `timeout`: its supervisor stops it at the removal's.
    """

    def done() -> bool:
        return _torch.serving() <= _cancel.cancelled_running() and not members.busy()

    def still_done() -> bool:
        # torch stops counting a call as its reply is handed to the pipe, before the
        # reply is written: idle for a moment more, so the last replies leave first.
        if not done():
            return False
        time.sleep(_REPLIES_LEAVE_S)
        return done()

    _polling.within(still_done, timeout or None)


def leave(world: _World, graceful: bool, timeout: float) -> None:
    """Leave a world that heals: once every member's `main` is done, all at once.

    torch's graceful leave of a dynamic group passes a token from member to
    member, each calling every other one; a member that stalls holds the
    token, and the others wait for it. Instead: every `main` is done (the
    first meeting), every member has deleted its RRefs at their owners (the
    second: nothing is in flight any more), then each stops its agent.
    """
    assert world.store is not None and world.members is not None
    space = _membership.heal_space(world.store, world.tag)
    if graceful:
        graceful = _records.meet_to_end(space, world.context, timeout)
    # Every main is done (or this one leaves at once): no replacement joins from
    # here, and the agent closes its listener as it stops.
    _torch.unwatch_listener()
    # After a heal, a delete sent to a dead owner fails with a C++ trace and an
    # owner then waits for deletes that never come; and torch's join of a dynamic
    # group can wait forever for a message it sent to a process that died. So only
    # a world never healed deletes its RRefs and joins (then the pipes peers close
    # are expected, and torch logs nothing); a replacement knows it is one, and
    # the survivors saw the heal.
    members = world.members
    healed = bool(members.lost) or any(attempt > 0 for attempt in members.attempts.values())
    if world.context.name in _records.read_state(space).get("left", ()):
        world.stopping.set()  # removed (`remove_workers`): the others go on without it
    leaving = world.stopping.is_set()
    if graceful and not healed and not leaving:
        # Not a leaving worker's: torch's release also waits for the forks of the
        # objects it owns to be deleted, and those are lost with it.
        _torch.release_user_rrefs(timeout)
    if graceful and leaving:  # the calls it runs finish, and deliver their results
        _finish(members, timeout)
    if graceful and (leaving or not healed):
        _torch.stop_serving(timeout)
    if graceful and leaving and world.end_process is not None and _cancel.cancelled_running():
        # torch's agent would wait for the calls their callers cancelled (a sync
        # function runs on): nobody waits for them, so the process ends now.
        world.end_process()
    if graceful and not world.stopping.is_set():
        _records.meet_to_stop(space, len(_records.live_names(space)), timeout)
    rpc.shutdown(graceful=False)
