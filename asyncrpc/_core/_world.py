"""The RPC world of this process: joining it, describing it, leaving it.

`init` reads what it is not told from the launcher's environment (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_WORLD_SIZE), meets its peers
through `_rendezvous`, binds TensorPipe to the right interface and starts
torch's RPC agent. `shutdown` stops it and puts back what `init` changed
(environment variables, torch's intra-op thread count, which it sets only
where OMP_NUM_THREADS does not give one). `Context` is what a
worker knows of the world.

A world started by torch's own `rpc.init_rpc` is adopted on first use:
names and ranks come from torch's agent (its worker infos), the RPC thread
count and default timeout from the agent's options::

    asyncrpc.init / run ──> _current (Context, store, settings)
    rpc.init_rpc (torch) ──> adopted on first call: agent worker infos ──> Context
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import os
import threading
from collections.abc import Callable, Mapping

import torch.distributed.rpc as rpc

from . import (
    _devices,
    _environ,
    _healing,
    _hooks,
    _membership,
    _records,
    _registry,
    _rendezvous,
    _runtime,
    _snapshot,
    _threadstates,
    _torch,
    _watcher,
)
from ._context import Context, Settings
from ._errors import (
    AsyncRPCError,
    NotInitializedError,
    WorkerUnreachableError,
)
from ._liveness import Liveness
from ._membership import Joining, Members, Replaced
from ._torch import PrefixStore, Store, WorkerInfo
from ._unwaited import log_unwaited_failures

__all__ = [
    "Context",
    "Replaced",
    "Settings",
    "current_context",
    "heals",
    "on_replaced",
    "shutdown",
    "start",
    "target",
]


@dataclasses.dataclass
class World:
    """The running world: what calls check against, and what `shutdown` puts back."""

    context: Context
    threads: int  # RPC threads serving incoming calls
    store: Store | None = None  # None in a world torch started
    settings: Settings | None = None
    changes: _environ.Changes = dataclasses.field(default_factory=_environ.Changes)
    liveness: Liveness | None = None  # the peers' heartbeats (launched and init worlds)
    registration: str | None = None  # this worker's file for asyncrpc-dump/top (_registry)
    hang_after: float | None = None  # Settings.hang_report_after, or ASYNCRPC_HANG_REPORT_AFTER
    # torch's WorkerInfo per name, filled on first use: handing torch a WorkerInfo
    # spares it a lookup by name on every call.
    infos: dict[str, WorkerInfo] = dataclasses.field(default_factory=dict)
    members: Members | None = None  # a world that heals (restart="worker"): see _membership
    # Set once `members` is (or the start failed): the side channel's news and a
    # replacement's welcome that arrive while this member still starts wait for it.
    members_known: threading.Event = dataclasses.field(default_factory=threading.Event)
    # Set once this worker is being removed (`remove_workers`): `asyncrpc.stopping()`.
    stopping: threading.Event = dataclasses.field(default_factory=threading.Event)
    key_rank: int = -1  # this process's torch id: its calls' cancel keys (see _cancel)
    torch_name: str = ""  # the name torch's group knows this process by (see _membership)
    tag: str = ""  # the world's key space in the store: asyncrpc/<tag>/...
    # What undoes the world: each step of `start` pushes its undo once done, and a
    # failed start and `shutdown` both unwind this one stack.
    stack: contextlib.ExitStack = dataclasses.field(default_factory=contextlib.ExitStack)
    # Where the world's state lives (`_runtime`): its parts end with it.
    runtime: _runtime.Runtime = dataclasses.field(default_factory=lambda: _runtime.SLOT.runtime)
    # An embedded worker's: ends its process at once, its registration removed (a removed
    # worker whose leave only calls its callers cancelled still hold; see `_healing.leave`).
    end_process: Callable[[], None] | None = None

    def info(self, name: str) -> WorkerInfo:
        """torch's WorkerInfo of worker `name` (one of `context.names`).

        In a world that heals, of the process that answers for `name` now.
        """
        members = self.members
        if members is not None:
            return members.info(name)
        found = self.infos.get(name)
        if found is None:
            found = self.infos[name] = rpc.get_worker_info(name)
        return found


def current_context() -> Context:
    """The `Context` of the running world of this process.

    Example::

        @torch.no_grad()
        def who_am_i() -> str:
            return asyncrpc.current_context().name
    """
    return current_world("asyncrpc.current_context()").context


def running() -> World | None:
    """The world asyncrpc started or adopted, if one runs now (None: none, or not adopted yet).

    The typed form of `_runtime.running_world()`, for the modules above this
    one. Example::

        world = _world.running()
        if world is not None and world.settings is not None:  # a world asyncrpc started
            ...
    """
    world: World | None = _runtime.SLOT.runtime.world  # as running_world() reads it
    return world


def heals() -> bool:
    """Whether the world running here heals: a dead worker is replaced (`restart="worker"`)."""
    world = running()
    return world is not None and world.members is not None


def current_world(what: str) -> World:
    """The running world, started by asyncrpc or by torch; NotInitializedError outside one."""
    world = running()
    if world is not None:
        return world
    if not _torch.agent_running():
        raise NotInitializedError(_not_running_message(what))
    return _adopt()


def _adopt() -> World:
    agent = _torch.current_agent()
    runtime = _runtime.SLOT.runtime
    cached = runtime.adopted
    if cached is not None and cached[0] is agent:
        adopted: World = cached[1]
        return adopted
    infos = _torch.worker_infos()
    me = rpc.get_worker_info()
    names = tuple(str(info.name) for info in infos)
    context = Context(int(me.id), len(names), str(me.name), names, _leave=_leave)
    world = World(context, _torch.agent_threads(), hang_after=_hang_after_from_env())
    world.key_rank = int(me.id)
    world.stack.callback(_end_runtime, runtime)  # torch's patches, the watcher, ...
    _hooks.install()  # first: a world is only cached once torch is patched for it
    runtime.adopted = (agent, world)
    world.stack.callback(_unregister, world)
    _watch(world, _watcher.SIDE_PREFIX, agent_gone=_torch_shut_down)
    return world


def _torch_shut_down() -> bool:
    """torch's own `rpc.shutdown()` ended a world asyncrpc adopted: end what it set up.

    Called by the side channel's guard thread; False while a shutdown of
    asyncrpc's own holds the lock (that one ends the world).
    """
    lock = _runtime.SLOT.lock
    if not lock.acquire(blocking=False):
        return False
    try:
        _end_stale_adoption()
        return True
    finally:
        lock.release()


def _hang_after_from_env() -> float | None:
    """ASYNCRPC_HANG_REPORT_AFTER (seconds): hang reports in any world, torch's own too."""
    raw = os.environ.get("ASYNCRPC_HANG_REPORT_AFTER", "")
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(
            f"environment variable ASYNCRPC_HANG_REPORT_AFTER={raw!r} is not a number of "
            f"seconds above 0; set it to e.g. 30, or unset it to turn hang reports off"
        )
    return seconds


def _watch(
    world: World, prefix: str, agent_gone: Callable[[], bool] | None = None, heals: bool = False
) -> None:
    """Start the side channel's watcher and register the world for asyncrpc-dump/top.

    `heals`: a world that heals, where a replacement's queue is its torch id,
    not its rank: the registration says where the commands read each name's.
    """
    ctx = world.context
    reporter = _snapshot.Reporter(
        ctx.rank, ctx.names, world.threads, attempt=ctx.attempt, members=lambda: world.members
    )
    _watcher.watch(prefix, reporter, agent_gone, member=_healing.news,
                  exits_at_once=world.end_process is not None)  # fmt: skip
    channel = _watcher.side_channel()
    if channel is None or world.registration is not None:
        return
    _, address, side = channel
    heal = None
    if heals:
        heal = _registry.Healing(_membership.heal_prefix(world.tag),
                                 world.key_rank, ctx.attempt)  # fmt: skip
    if address is not None:  # a store others can reach: a TCPStore
        world.registration = _registry.register(address, side, ctx.rank, ctx.name, ctx.names, heal)


def current_store() -> Store:
    """The rendezvous store of a world asyncrpc started (NotInitializedError otherwise)."""
    world = current_world("the world's store")
    if world.store is None:
        raise NotInitializedError(
            "this RPC world was started by torch's rpc.init_rpc, so asyncrpc has no "
            "rendezvous store for it; start the world with asyncrpc.init() or asyncrpc.run()"
        )
    return world.store


def _not_running_message(what: str) -> str:
    if _runtime.SLOT.shut_down:
        return (
            f"{what} was called after asyncrpc.shutdown(); no RPC agent runs in this "
            f"process any more"
        )
    return (
        f"{what} was called but no RPC agent runs in this process; call it inside the "
        f"main(ctx) given to asyncrpc.run(main, world_size=N), after asyncrpc.init(), or "
        f"after torch's rpc.init_rpc(...)"
    )


def start(
    rank: int,
    world_size: int,
    name: str,
    master_addr: str,
    master_port: int,
    settings: Settings,
    *,
    roles: Mapping[str, int] | None = None,
    hosts_store: bool,
    attempt: int | None = None,
    watch_peers: bool = False,
    joining: Joining | None = None,
    end_process: Callable[[], None] | None = None,
) -> Context:
    """Start RPC with everything resolved; `init` and `run` both end here.

    `watch_peers`: beat in the store and watch the peers' beats (`_liveness`);
    a failure is recorded (`current_liveness().failure`), and a graceful
    shutdown raises it instead of waiting for a dead peer. `joining`: join a
    world that heals (`_membership`), as its supervisor or launcher says.
    `end_process`: how an embedded worker ends its process at once (it must
    not return), for a removed worker's leave that only cancelled calls hold.

    Everything the start sets up is undone by one stack (`World.stack`):
    a failure at any step unwinds what the steps before it did, and so does
    `shutdown`.
    """
    with _runtime.SLOT.lock:
        _end_stale_adoption()
        _refuse_second_world()
        if hosts_store:
            store = _rendezvous.host_store(master_addr, master_port, settings.init_timeout)
        else:
            store = _rendezvous.client_store(master_addr, master_port, settings.init_timeout)
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
        tag = joining.tag if joining is not None else restarts
        if joining is not None and joining.replacement:
            names = _records.read_names(_membership.heal_space(store, tag), settings.init_timeout)
        else:
            names = _rendezvous.agree(
                store, rank, world_size, name, settings.init_timeout, tag, hosts=hosts_store
            )
        attempt = attempt if attempt is not None else int(restarts or 0)
        roles_seen = tuple((roles or {}).items())
        context = Context(rank, world_size, name, names, roles_seen, attempt, _leave=_leave)
        # Peers may call in as soon as the agent starts, before init_rpc returns
        # here: the world must already be visible to the functions they run.
        world = World(
            context, settings.num_worker_threads, store, settings,
            hang_after=settings.hang_report_after or _hang_after_from_env(),
            tag=joining.tag if joining is not None else str(attempt),
        )  # fmt: skip
        if end_process is not None:
            world.end_process = functools.partial(_end_process, world, end_process)
        try:
            _build(world, master_addr, watch_peers, joining)
        except BaseException:
            world.stack.close()
            raise
        _runtime.SLOT.shut_down = False
        return context


def _end_stale_adoption() -> None:
    """End an adopted world whose agent torch's own `rpc.shutdown()` stopped.

    Its guard thread notices within 0.2 s; a world started sooner must not
    take over what the adopted one set up (its side channel, its parts).
    """
    runtime = _runtime.SLOT.runtime
    adopted = runtime.adopted
    if adopted is None or runtime.world is not None:
        return
    if not _torch.agent_running() or _torch.current_agent() is not adopted[0]:
        _end_world(adopted[1], left=True)


def _refuse_second_world() -> None:
    world = running()
    if world is not None or _torch.agent_running():
        name = world.context.name if world is not None else rpc.get_worker_info().name
        raise AsyncRPCError(
            f"this process already runs RPC as {name!r}; call asyncrpc.shutdown() "
            f"(or torch's rpc.shutdown()) before starting another world"
        )


def _build(world: World, master_addr: str, watch_peers: bool, joining: Joining | None) -> None:
    """The steps of `start`, each pushing its undo onto `world.stack` before it runs.

    Pushed first, so that a step failing half-way (or interrupted) is undone
    too: every undo is a no-op for what was not done.
    """
    ctx, settings, stack = world.context, world.settings, world.stack
    assert settings is not None and world.store is not None
    # Last to run: every part of the world's runtime closes (torch's patches, the
    # side channel's watcher, the hang reporter, the kept thread states...).
    stack.callback(_end_runtime, world.runtime)
    _hooks.install()
    stack.callback(_forget, world)
    world.runtime.world = world
    if settings.log_unwaited_failures is not None:
        log_unwaited_failures(settings.log_unwaited_failures)
    stack.callback(_environ.put_back, world.changes)
    stack.callback(_stop_agent)
    _start_agent(world, master_addr, joining)
    if settings.keep_thread_states:
        _threadstates.keep(world.torch_name, settings.num_worker_threads)
    stack.callback(_unregister, world)
    _watch(world, f"asyncrpc/{world.tag}/side/", heals=joining is not None)
    if joining is not None:
        stack.callback(world.members_known.set)
        _healing.join(world, joining)
    if watch_peers:
        world.liveness = Liveness(
            world.store, ctx.rank, ctx.names, world.tag, timeout=settings.heartbeat_timeout,
            on_failure=_recorded,
        )  # fmt: skip
        stack.callback(world.liveness.stop, left=False)
        world.liveness.start()
    # A program's own freeze is kept. Python 3.12 itself starts with a few hundred
    # objects frozen: only a count above the one at `import asyncrpc` is a program's.
    frozen = _runtime.SLOT.frozen_at_import  # None: a warm interpreter froze it (`_forking`)
    if settings.freeze_gc and (frozen is None or gc.get_freeze_count() <= frozen):
        world.changes.froze_gc = True  # first: put_back thaws it, also if freeze fails half-way
        gc.freeze()


def _end_runtime(runtime: _runtime.Runtime) -> None:
    _runtime.end(runtime)
    _torch.uninstall()


def _forget(world: World) -> None:
    if world.runtime.world is world:
        world.runtime.world = None


def _stop_agent() -> None:
    """Stop torch's agent if it still runs (a start that failed after starting it)."""
    if _torch.agent_running():
        rpc.shutdown(graceful=False)


def _end_process(world: World, end: Callable[[], None]) -> None:
    """End this process now (`end`), its registration for asyncrpc-dump/top removed first."""
    _unregister(world)
    end()


def _unregister(world: World) -> None:
    if world.registration is not None:
        _registry.unregister(world.registration)
        world.registration = None


def _start_agent(world: World, master_addr: str, joining: Joining | None) -> None:
    ctx, settings = world.context, world.settings
    assert settings is not None and world.store is not None
    _environ.bind_interface(world.changes, master_addr, ctx.world_size, settings.interface)
    _environ.set_intra_op_threads(world.changes, settings.intra_op_threads, ctx.world_size)
    world.key_rank = joining.torch_id if joining is not None else ctx.rank
    size = (joining.size if joining is not None else 0) or ctx.world_size
    world.torch_name = _membership.torch_name(ctx.name, world.key_rank, size)
    maps = _devices.resolve(
        settings.devices, settings.device_maps, ctx, world.store, world.tag,
        joining is not None, settings.init_timeout,
    )  # fmt: skip
    # Keys of its own per attempt: after a restart, torch's agent must not read the
    # addresses the previous attempt's workers left in the store.
    rpc_store = PrefixStore(f"asyncrpc/{world.tag}/rpc/", world.store)
    static = joining is None  # a static group: torch's agent started without its Gloo group
    # A dynamic group (a world that heals) meets through torch's rendezvous: the handoff.
    init_method = "" if static else _rendezvous.hand_off(rpc_store, world.key_rank, ctx.world_size)
    options = _torch.backend_options(
        settings.num_worker_threads, settings.rpc_timeout, init_method, settings.transports,
        settings.channels, maps,
    )  # fmt: skip
    if static:
        _torch.start_static(rpc_store, world.torch_name, ctx.rank, ctx.world_size, options)
        return
    with _torch.failing_fast():
        # A world that heals is one of torch's dynamic groups: members join and leave.
        rpc.init_rpc(  # type: ignore[no-untyped-call]
            world.torch_name, rank=world.key_rank, world_size=None, rpc_backend_options=options
        )


def shutdown(graceful: bool = True, timeout: float = 0) -> None:
    """Leave the RPC world; with `graceful`, first wait for every worker's pending work.

    torch's `rpc.shutdown`, same signature: in a world torch's `rpc.init_rpc`
    started it shuts torch's agent down as `rpc.shutdown()` would; in an
    `init`/`run` world it also puts back what `init` changed. Either way it
    removes what asyncrpc patched into torch. Does nothing when no world runs.

    In a world joined with `init`, a graceful shutdown waits for the other
    workers as long as they live: a peer that died (it stopped beating in the
    world's store for `heartbeat_timeout` s) makes it leave without waiting
    and raise `WorkerUnreachableError` naming that peer.

    Example::

        ctx = asyncrpc.init()
        try:
            ...
        finally:
            asyncrpc.shutdown()
    """
    with _runtime.SLOT.lock:
        world = running()
        dead_peer = None
        try:
            if world is not None or _torch.agent_running():
                if graceful and world is not None and world.liveness is not None:
                    dead_peer = world.liveness.meet_to_leave(timeout)
                if world is not None and world.members is not None:
                    _healing.leave(world, graceful, timeout)
                else:
                    # A graceful shutdown still serves peers' calls while it waits, so the
                    # world stays visible to them (current_context, call checks) until it ends.
                    rpc.shutdown(graceful=graceful and dead_peer is None, timeout=timeout)
                _runtime.SLOT.shut_down = True
        finally:
            _end_world(world, left=dead_peer is None)
    if dead_peer is not None:
        raise WorkerUnreachableError(
            f"shutdown did not wait for every worker: {dead_peer}; this worker left the "
            f"world without it (graceful=False)",
            _dead_name(dead_peer),
        )


def _end_world(world: World | None, left: bool) -> None:
    """Undo what the world set up: its runtime's parts, then its stack (agent stopped)."""
    runtime = _runtime.SLOT.runtime
    try:
        # What ends with the world (streams' generators: their `finally` blocks)
        # still sees it: current_context() works there, in a world torch started too.
        if runtime.world is None and runtime.adopted is not None:
            runtime.world = runtime.adopted[1]
        runtime.close()
    finally:
        ended: World | None = runtime.world if runtime.world is not None else world
        _end_runtime(runtime)  # a fresh runtime: no world is visible from here
        if ended is not None:
            if ended.liveness is not None:
                ended.liveness.stop(left=left)
            ended.stack.close()


def _recorded(failure: str) -> None:
    """An `init` world's liveness only records a failure (see `shutdown`)."""


def _dead_name(record: str) -> str:
    # A liveness record starts "worker 'name' (rank r, ...": the name, or "".
    parts = record.split("'")
    return parts[1] if record.startswith("worker '") and len(parts) > 2 else ""


def current_liveness() -> Liveness | None:
    """The running world's liveness watch, if it has one."""
    world = running()
    return world.liveness if world is not None else None


def _leave(graceful: bool) -> None:
    shutdown(graceful=graceful)


def on_replaced(callback: Callable[[Replaced], object]) -> Callable[[], None]:
    """Call `callback(event)` on this worker each time another worker is replaced in place.

    For a world that heals (`asyncrpc.run(..., restart="worker")` or
    `asyncrpc-launch --restart worker`). `event` is a `Replaced`: the
    worker's `name`, `rank` and `attempt`, and the `reason` its process
    ended ("was killed by SIGKILL"). The callback runs on a thread of
    its own once the replacement has joined, before its `main` starts, so it
    may call the replacement, e.g. to create there again the objects lost
    with the dead process. Returns a function that unregisters the callback.

    Example::

        def main(ctx):
            def respawn(event: asyncrpc.Replaced) -> None:
                actors[event.name] = asyncrpc.spawn(event.name, Actor)

            asyncrpc.on_replaced(respawn)
    """
    world = current_world("asyncrpc.on_replaced()")
    if not callable(callback):
        raise TypeError(
            f"on_replaced takes a function callback(event), got {type(callback).__name__} "
            f"{callback!r:.60}"
        )
    members = world.members
    if members is None:
        raise AsyncRPCError(
            "asyncrpc.on_replaced() needs a world that heals, where a dead worker is replaced "
            "in place; this one restarts as a whole or not at all: start it with "
            "asyncrpc.run(main, world_size=N, max_restarts=K, restart='worker') or "
            "asyncrpc-launch --max-restarts K --restart worker"
        )
    members.callbacks.append(callback)

    def unregister() -> None:
        if callback in members.callbacks:
            members.callbacks.remove(callback)

    return unregister


def side_queues() -> tuple[int, ...]:
    """Each worker's side-channel queue, in rank order: its torch id (its rank until replaced)."""
    world = current_world("the side channel")
    members = world.members
    if members is None:
        return tuple(range(world.context.world_size))
    return tuple(members.ids[name] for name in members.names)


def target(name: str) -> WorkerInfo:
    """What torch's own verbs take to reach worker `name` (in a world that heals: now)."""
    return current_world("a call").info(name)


def describe_self() -> str:
    """How this process is named in error messages: `worker 'worker1' (rank 1)`."""
    if not is_running():
        return "this process"
    ctx = current_context()
    return f"worker {ctx.name!r} (rank {ctx.rank})"


def is_running() -> bool:
    """True while this process is part of a running world (asyncrpc's or torch's)."""
    return _runtime.SLOT.runtime.world is not None or _torch.agent_running()
