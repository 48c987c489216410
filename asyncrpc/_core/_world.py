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
import gc
import math
import os
import socket
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed.rpc as rpc

from . import (
    _cancel,
    _forks,
    _hang,
    _membership,
    _net,
    _registry,
    _rendezvous,
    _snapshot,
    _threadstates,
    _torch,
)
from ._cancel import Sent
from ._context import Context, Settings, names_for, resolve_world_size
from ._errors import (
    AsyncRPCError,
    NotInitializedError,
    ObjectLostError,
    WorkerUnreachableError,
    WorldSizeMismatchError,
)
from ._failures import check_reply, hold, name_failure
from ._futures import await_future, then_child
from ._liveness import Liveness
from ._membership import Joining, Members, Replaced
from ._torch import PrefixStore, Store, WorkerInfo
from ._unwaited import log_unwaited_failures

__all__ = [
    "Context",
    "Replaced",
    "Settings",
    "current_context",
    "init",
    "on_replaced",
    "shutdown",
    "start",
    "target",
]

_LOOPBACK = "127.0.0.1"


@dataclasses.dataclass
class World:
    """The running world: what calls check against, and what `shutdown` puts back."""

    context: Context
    threads: int  # RPC threads serving incoming calls
    store: Store | None = None  # None in a world torch started
    settings: Settings | None = None
    restore: list[tuple[str, str | None]] = dataclasses.field(default_factory=list)
    intra_op_before: int | None = None
    froze_gc: bool = False  # this world froze the heap (gc.freeze); its shutdown thaws it
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
    key_rank: int = -1  # this process's torch id: its calls' cancel keys (see _cancel)
    torch_name: str = ""  # the name torch's group knows this process by (see _membership)
    tag: str = ""  # the world's key space in the store: asyncrpc/<tag>/...
    # What undoes the world: each step of `start` pushes its undo once done, and a
    # failed start and `shutdown` both unwind this one stack.
    stack: contextlib.ExitStack = dataclasses.field(default_factory=contextlib.ExitStack)

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


_world: World | None = None
_adopted: tuple[object, World] | None = None  # (torch's agent, the world read from it)
_was_shut_down = False
_lock = threading.Lock()


def current_context() -> Context:
    """The `Context` of the running world of this process.

    Example::

        @torch.no_grad()
        def who_am_i() -> str:
            return asyncrpc.current_context().name
    """
    return current_world("asyncrpc.current_context()").context


def current_world(what: str) -> World:
    """The running world, started by asyncrpc or by torch; NotInitializedError outside one."""
    world = _world
    if world is not None:
        return world
    if not _torch.agent_running():
        raise NotInitializedError(_not_running_message(what))
    return _adopt()


def _adopt() -> World:
    global _adopted
    agent = _torch.current_agent()
    cached = _adopted
    if cached is not None and cached[0] is agent:
        return cached[1]
    infos = _torch.worker_infos()
    me = rpc.get_worker_info()
    names = tuple(str(info.name) for info in infos)
    context = Context(int(me.id), len(names), str(me.name), names, _leave=_leave)
    world = World(context, _torch.agent_threads(), hang_after=_hang_after_from_env())
    world.key_rank = int(me.id)
    _install_hooks()  # first: a world is only cached once torch is patched for it
    world.stack.callback(_torch.uninstall)
    _adopted = (agent, world)
    world.stack.callback(_cancel.stop_watching)
    world.stack.callback(_unregister, world)
    _watch(world, _cancel.SIDE_PREFIX, agent_gone=_torch_shut_down)
    if world.hang_after:
        world.stack.callback(_hang.stop)
    return world


def _torch_shut_down() -> bool:
    """torch's own `rpc.shutdown()` ended a world asyncrpc adopted: end what it set up.

    Called by the side channel's guard thread; False while a shutdown of
    asyncrpc's own holds the lock (that one ends the world).
    """
    if not _lock.acquire(blocking=False):
        return False
    try:
        if _world is None and _adopted is not None and not _torch.agent_running():
            _end_world(_adopted[1], left=True)
        return True
    finally:
        _lock.release()


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
    _cancel.watch(prefix, reporter, agent_gone, member=_member_news)
    channel = _cancel.side_channel()
    if channel is None or world.registration is not None:
        return
    _, address, side = channel
    heal = None
    if heals:
        heal = _registry.Healing(_membership.heal_prefix(world.tag),
                                 world.key_rank, ctx.attempt)  # fmt: skip
    if address is not None:  # a store others can reach: a TCPStore
        world.registration = _registry.register(address, side, ctx.rank, ctx.name, ctx.names, heal)


def _install_hooks() -> None:
    # Installed when asyncrpc first meets a world, never at import, and removed by
    # the shutdown that ends it (_torch.install / uninstall).
    _torch.install(_HOOKS)
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
    world = _world
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


def _reduce_rref(py_rref: Any, to: int, keep: list[Any]) -> Any:
    """An RRef pickled into an asyncrpc call to torch id `to` (see `_forks`)."""
    world = _world
    if world is None or world.members is None:
        _check_fork(py_rref)
        return None
    return _forks.reduce(py_rref, to, keep, world.key_rank, world.members)


def owner_of(rref: Any, what: str) -> str:
    """The name of `rref`'s owner; `ObjectLostError` when that process died (a world that heals).

    `what` names the object in the error ("the object of this handle").
    """
    owner = _torch.rref_owner(rref)
    world = _world
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


def _name_rref(error: BaseException, owner: str) -> BaseException:
    return name_failure(error, owner, "RRef.to_here()")


_HOOKS = _torch.Hooks(
    await_future=await_future,
    name_read=_name_read,
    name_rref=_name_rref,
    check_value=check_reply,
    carry=hold,
    cancel_call=_cancel.request,
    handoff=_rendezvous.handoff_handler,
    check_owner=_check_owner,
    check_fork=_check_fork,
    reduce_rref=_reduce_rref,
    then_child=then_child,
)


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
    if _was_shut_down:
        return (
            f"{what} was called after asyncrpc.shutdown(); no RPC agent runs in this "
            f"process any more"
        )
    return (
        f"{what} was called but no RPC agent runs in this process; call it inside the "
        f"main(ctx) given to asyncrpc.run(main, world_size=N), after asyncrpc.init(), or "
        f"after torch's rpc.init_rpc(...)"
    )


def _from_env(key: str) -> int | None:
    raw = os.environ.get(key)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {key}={raw!r} is not an integer") from None


def init(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    name: str | None = None,
    roles: Mapping[str, int] | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    joining: Joining | None = None,
    **options: Any,
) -> Context:
    """Join an RPC world from this process and return its `Context`.

    Missing values come from the launcher's environment (`RANK`, `WORLD_SIZE`,
    `MASTER_ADDR`, `MASTER_PORT`). Without a launcher, rank 0 hosts the
    rendezvous store on `master_addr:master_port` (default 127.0.0.1: loopback
    only). Options: see `Settings`. `joining` is how `asyncrpc-launch --restart
    worker` has its workers join a world that heals; leave it out. Example, in
    each of two processes::

        with asyncrpc.init(rank=r, world_size=2, master_port=29600) as ctx:
            print(asyncrpc.rpc_sync(ctx.names[1 - r], str.upper, args=("hi",)))
    """
    settings = Settings.from_options(options)
    rank = rank if rank is not None else _from_env("RANK")
    if rank is None:
        raise ValueError("init() needs rank=..., or a RANK environment variable")
    env_world = _from_env("WORLD_SIZE")
    asked = resolve_world_size(world_size, roles)
    if asked is not None and env_world is not None and asked != env_world:
        raise WorldSizeMismatchError(
            f"the program asks for world_size={asked} but the launcher started "
            f"WORLD_SIZE={env_world} workers; launch with --nproc-per-node {asked} "
            f"(per node), or drop world_size= to take the launcher's"
        )
    size = asked if asked is not None else env_world
    if size is None:
        raise ValueError("init() needs world_size=..., or a WORLD_SIZE environment variable")
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in 0..{size - 1} for world_size={size}, got {rank}")
    addr = master_addr or os.environ.get("MASTER_ADDR") or _LOOPBACK
    port = master_port if master_port is not None else _from_env("MASTER_PORT")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    hosts = rank == 0 and not agent_store
    if port is None or (port == 0 and not hosts):
        raise ValueError(
            "init() needs master_port=..., or a MASTER_PORT environment variable: the "
            "port where rank 0 hosts the rendezvous store"
        )
    worker_name = name or names_for(size, roles)[rank]
    # `joining` (asyncrpc-launch --restart worker): a world that heals, where the
    # launchers watch the workers; a peer's death must not end this one.
    return start(
        rank, size, worker_name, addr, port, settings, roles=roles, hosts_store=hosts,
        watch_peers=joining is None, joining=joining,
    )  # fmt: skip


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
) -> Context:
    """Start RPC with everything resolved; `init` and `run` both end here.

    `watch_peers`: beat in the store and watch the peers' beats (`_liveness`);
    a failure is recorded (`current_liveness().failure`), and a graceful
    shutdown raises it instead of waiting for a dead peer. `joining`: join a
    world that heals (`_membership`), as its supervisor or launcher says.

    Everything the start sets up is undone by one stack (`World.stack`):
    a failure at any step unwinds what the steps before it did, and so does
    `shutdown`.
    """
    global _world, _was_shut_down
    with _lock:
        _refuse_second_world()
        if hosts_store:
            store = _rendezvous.host_store(master_addr, master_port, settings.init_timeout)
        else:
            store = _rendezvous.client_store(master_addr, master_port, settings.init_timeout)
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
        tag = joining.tag if joining is not None else restarts
        if joining is not None and joining.replacement:
            names = _membership.read_names(
                _membership.heal_space(store, tag), settings.init_timeout
            )
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
        try:
            _build(world, master_addr, watch_peers, joining)
        except BaseException:
            world.stack.close()
            raise
        _was_shut_down = False
        return context


def _refuse_second_world() -> None:
    if _world is not None or _torch.agent_running():
        name = _world.context.name if _world is not None else rpc.get_worker_info().name
        raise AsyncRPCError(
            f"this process already runs RPC as {name!r}; call asyncrpc.shutdown() "
            f"(or torch's rpc.shutdown()) before starting another world"
        )


def _build(world: World, master_addr: str, watch_peers: bool, joining: Joining | None) -> None:
    """The steps of `start`, each pushing its undo onto `world.stack` before it runs.

    Pushed first, so that a step failing half-way (or interrupted) is undone
    too: every undo is a no-op for what was not done.
    """
    global _world
    ctx, settings, stack = world.context, world.settings, world.stack
    assert settings is not None and world.store is not None
    stack.callback(_torch.uninstall)
    _install_hooks()
    stack.callback(_forget, world)
    _world = world
    if settings.log_unwaited_failures is not None:
        log_unwaited_failures(settings.log_unwaited_failures)
    stack.callback(_put_back, world)
    stack.callback(_stop_agent)
    _start_agent(world, master_addr, joining)
    if settings.keep_thread_states:
        stack.callback(_threadstates.forget)
        _threadstates.keep(world.torch_name, settings.num_worker_threads)
    stack.callback(_cancel.stop_watching)
    stack.callback(_unregister, world)
    if world.hang_after:
        stack.callback(_hang.stop)
    _watch(world, f"asyncrpc/{world.tag}/side/", heals=joining is not None)
    if joining is not None:
        stack.callback(world.members_known.set)
        _join_members(world, joining)
    if watch_peers:
        world.liveness = Liveness(
            world.store, ctx.rank, ctx.names, world.tag, timeout=settings.heartbeat_timeout,
            on_failure=_recorded,
        )  # fmt: skip
        stack.callback(world.liveness.stop, left=False)
        world.liveness.start()
    if settings.freeze_gc and gc.get_freeze_count() == 0:  # a program's own: kept
        world.froze_gc = True  # first: _put_back thaws it, also if freeze fails half-way
        gc.freeze()


def _forget(world: World) -> None:
    global _world
    if _world is world:
        _world = None


def _stop_agent() -> None:
    """Stop torch's agent if it still runs (a start that failed after starting it)."""
    if _torch.agent_running():
        rpc.shutdown(graceful=False)


def _unregister(world: World) -> None:
    if world.registration is not None:
        _registry.unregister(world.registration)
        world.registration = None


def _start_agent(world: World, master_addr: str, joining: Joining | None) -> None:
    ctx, settings = world.context, world.settings
    assert settings is not None and world.store is not None
    _bind_interface(world, master_addr, ctx.world_size, settings.interface)
    _set_intra_op_threads(world, settings.intra_op_threads)
    world.key_rank = joining.torch_id if joining is not None else ctx.rank
    world.torch_name = _membership.torch_name(ctx.name, world.key_rank, ctx.world_size)
    options = _torch.backend_options(
        settings.num_worker_threads,
        settings.rpc_timeout,
        # Keys of its own per attempt: after a restart, torch's agent must not
        # read the addresses the previous attempt's workers left in the store.
        _rendezvous.hand_off(
            PrefixStore(f"asyncrpc/{world.tag}/rpc/", world.store),
            world.key_rank,
            ctx.world_size,
        ),
        settings.transports,
        settings.channels,
    )
    with warnings.catch_warnings():
        # torch's agent set-up uses a Gloo backend internally and warns about it.
        warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
        rpc.init_rpc(  # type: ignore[no-untyped-call]
            world.torch_name,
            rank=world.key_rank,
            # A world that heals is one of torch's dynamic groups: members join and leave.
            world_size=None if joining is not None else ctx.world_size,
            rpc_backend_options=options,
        )


# ---- a world that heals (restart="worker"; see _membership) ----------------------------


def _join_members(world: World, joining: Joining) -> None:
    """After torch's join: publish this member, meet the others (or welcome them)."""
    ctx, settings = world.context, world.settings
    assert world.store is not None and settings is not None
    space = _membership.heal_space(world.store, world.tag)
    _membership.publish(space, ctx, joining.torch_id, _torch.group_key_prefix())
    if not joining.replacement:
        _membership.wait_for_all(space, ctx.names, settings.init_timeout)
    members = _membership.read_members(space, ctx.names)
    if joining.replacement:  # another member may be being replaced as this one joins
        members.missed(_torch.known_ids())
    world.members = members
    world.stack.callback(members.stop)
    world.members_known.set()
    _membership.mark_ready(space, ctx.name)
    if joining.replacement:
        _welcome_all(world, settings.rpc_timeout)
    else:  # no member's main calls one that does not know the members yet
        _membership.wait_for_all(space, ctx.names, settings.init_timeout, key="ready")


def _welcome_all(world: World, timeout: float) -> None:
    """Tell every other member that this replacement is up (before `main` runs here)."""
    ctx, members = world.context, world.members
    assert members is not None
    futures = []
    for name in ctx.names:
        if name == ctx.name or name in members.replacing:
            continue
        try:
            args = (ctx.name, world.key_rank, ctx.attempt)
            info = members.info(name)
            futures.append(_torch.rpc_async(info, _welcome, args=args, timeout=timeout))
        except RuntimeError:  # not in the group now: being replaced itself
            continue
    for fut in futures:
        try:
            fut.wait()
        except Exception:  # a member that died meanwhile: its own heal follows
            continue


def _starting_members() -> World | None:
    """This process's world, once it knows its members (waiting while it starts)."""
    world = _world
    if world is not None and world.settings is not None:
        world.members_known.wait(world.settings.init_timeout)
    return world


def _welcome(name: str, torch_id: int, attempt: int) -> None:
    """Run on a member: `name`'s replacement (torch id, attempt) has joined."""
    world = _starting_members()
    if world is None or world.members is None:
        return
    event = world.members.joined(name, torch_id, attempt)
    if event is not None:
        world.members.announce(event)
        _membership.trim_heap()


def _member_news(text: str) -> None:
    """The side channel's "member gone" from the supervisor: forget the dead process, ack."""
    parsed = _membership.parse_gone(text)
    world = _starting_members()
    if parsed is None or world is None or world.members is None or world.store is None:
        return
    seq, torch_id, name, why = parsed
    if world.members.gone(name, torch_id, why):
        # Kept in torch's group (see _membership); its pipe closed, or its sockets
        # would stay open (CLOSE-WAIT) here for good.
        _torch.close_pipe(_membership.torch_name(name, torch_id, world.context.world_size))
        for hook in list(world.members.gone_hooks):
            hook(torch_id)
    _membership.heal_space(world.store, world.tag).set(f"{seq}/ack/{world.context.name}", "1")


def single_node(master_addr: str, world_size: int) -> bool:
    """True when every worker of the world runs on this machine."""
    local = _from_env("LOCAL_WORLD_SIZE")
    if local is not None:
        return local == world_size
    return _net.is_loopback(master_addr)


def _set_env(world: World, key: str, value: str) -> None:
    world.restore.append((key, os.environ.get(key)))
    os.environ[key] = value


def _put_back(world: World) -> None:
    """Undo what starting `world` changed in this process."""
    for key, value in reversed(world.restore):
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    world.restore.clear()
    if world.intra_op_before is not None:
        torch.set_num_threads(world.intra_op_before)
    if world.froze_gc:
        gc.unfreeze()
        world.froze_gc = False


def _bind_interface(
    world: World, master_addr: str, world_size: int, interface: str | None
) -> None:
    # TensorPipe reads TP_SOCKET_IFNAME when the agent starts, and the Gloo group
    # that torch's agent set-up builds reads GLOO_SOCKET_IFNAME; without them each
    # binds the address the hostname resolves to, which may be the wrong network.
    chosen = interface or os.environ.get("ASYNCRPC_INTERFACE")
    if chosen is None and "TP_SOCKET_IFNAME" in os.environ:
        if "GLOO_SOCKET_IFNAME" not in os.environ:
            _set_env(world, "GLOO_SOCKET_IFNAME", os.environ["TP_SOCKET_IFNAME"])
        return
    if chosen is None:
        if single_node(master_addr, world_size):
            chosen = _net.interface_for(_LOOPBACK)
        else:
            chosen = _net.interface_for(_net.local_address_towards(master_addr, 0))
    if chosen is None:
        raise AsyncRPCError(
            f"could not find the network interface to bind for master {master_addr!r}; "
            f"pass interface='eth0' (or set ASYNCRPC_INTERFACE) with the interface name"
        )
    if chosen not in {n for _, n in socket.if_nameindex()}:
        raise ValueError(
            f"interface {chosen!r} does not exist on this host; choose one of "
            f"{sorted(n for _, n in socket.if_nameindex())}"
        )
    _set_env(world, "TP_SOCKET_IFNAME", chosen)
    _set_env(world, "GLOO_SOCKET_IFNAME", chosen)


def _set_intra_op_threads(world: World, wanted: int | None) -> None:
    """Set torch's intra-op threads, unless the environment chose them.

    First of: `intra_op_threads=`, ASYNCRPC_INTRA_OP_THREADS, OMP_NUM_THREADS
    (set by the user or a launcher: torch read it when it started, and the
    count is left alone), cores // local workers (at least 1).
    """
    if wanted is None:
        wanted = _from_env("ASYNCRPC_INTRA_OP_THREADS") or None
    if wanted is None and os.environ.get("OMP_NUM_THREADS", "").strip():
        return
    if wanted is None:
        local = _from_env("LOCAL_WORLD_SIZE") or world.context.world_size
        wanted = max(1, len(os.sched_getaffinity(0)) // max(1, local))
    world.intra_op_before = torch.get_num_threads()
    torch.set_num_threads(wanted)


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
    global _was_shut_down
    with _lock:
        world = _world
        dead_peer = None
        try:
            if world is not None or _torch.agent_running():
                if graceful and world is not None and world.liveness is not None:
                    dead_peer = world.liveness.meet_to_leave(timeout)
                if world is not None and world.members is not None:
                    _leave_members(world, graceful, timeout)
                else:
                    # A graceful shutdown still serves peers' calls while it waits, so the
                    # world stays visible to them (current_context, call checks) until it ends.
                    rpc.shutdown(graceful=graceful and dead_peer is None, timeout=timeout)
                _was_shut_down = True
        finally:
            _end_world(world, left=dead_peer is None)
    if dead_peer is not None:
        raise WorkerUnreachableError(
            f"shutdown did not wait for every worker: {dead_peer}; this worker left the "
            f"world without it (graceful=False)",
            _dead_name(dead_peer),
        )


def _end_world(world: World | None, left: bool) -> None:
    """Undo what the world set up (its stack), after torch's agent has stopped."""
    global _world, _adopted
    try:
        # What ends with the world (streams' generators: their `finally` blocks)
        # still sees it: current_context() works there, in a world torch started too.
        if _world is None and _adopted is not None:
            _world = _adopted[1]
        for release in list(_at_end):
            release()
    finally:
        ended = _world if _world is not None else world
        _world = _adopted = None
        if ended is None:  # torch's own world, never adopted: nothing was set up but these
            _cancel.stop_watching()
            _torch.uninstall()
        else:
            if ended.liveness is not None:
                ended.liveness.stop(left=left)
            ended.stack.close()


def _leave_members(world: World, graceful: bool, timeout: float) -> None:
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
        graceful = _membership.meet_to_end(space, world.context, timeout)
    # After a heal, a delete sent to a dead owner fails with a C++ trace and an
    # owner then waits for deletes that never come; and torch's join of a dynamic
    # group can wait forever for a message it sent to a process that died. So only
    # a world never healed deletes its RRefs and joins (then the pipes peers close
    # are expected, and torch logs nothing); a replacement knows it is one, and
    # the survivors saw the heal.
    members = world.members
    healed = bool(members.lost) or any(attempt > 0 for attempt in members.attempts.values())
    if graceful and not healed:
        _torch.release_user_rrefs(timeout)
        _torch.stop_serving(timeout)
    if graceful:
        _membership.meet_to_stop(space, len(world.context.names), timeout)
    rpc.shutdown(graceful=False)


def _recorded(failure: str) -> None:
    """An `init` world's liveness only records a failure (see `shutdown`)."""


def _dead_name(record: str) -> str:
    # A liveness record starts "worker 'name' (rank r, ...": the name, or "".
    parts = record.split("'")
    return parts[1] if record.startswith("worker '") and len(parts) > 2 else ""


def current_liveness() -> Liveness | None:
    """The running world's liveness watch, if it has one."""
    world = _world
    return world.liveness if world is not None else None


_at_end: list[Callable[[], None]] = []


def at_world_end(release: Callable[[], None]) -> None:
    """Have `release()` run whenever this process leaves a world (once per function)."""
    if release not in _at_end:
        _at_end.append(release)


def _leave(graceful: bool) -> None:
    shutdown(graceful=graceful)


def on_replaced(callback: Callable[[Replaced], object]) -> Callable[[], None]:
    """Call `callback(event)` on this worker each time another worker is replaced in place.

    For a world that heals (`asyncrpc.run(..., restart="worker")` or
    `asyncrpc-launch --restart worker`). `event` is a `Replaced`: the
    worker's `name`, `rank` and `attempt`. The callback runs on a thread of
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
    return tuple(members.ids[name] for name in world.context.names)


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
    return _world is not None or _torch.agent_running()
