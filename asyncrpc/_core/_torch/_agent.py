"""torch's RPC agent of this process: its group and store, its workers, and its shutdown steps.

Also the edits asyncrpc makes to a dynamic group's member list in the store
(a world that heals), the probe that has the agent close its pipe to a
process that died, and a join that fails without waiting for itself
(`failing_fast`).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch._C import _distributed_rpc as _rpc_c
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore
from torch._C._distributed_rpc import WorkerInfo
from torch.distributed.rpc import api as _rpc_api
from torch.distributed.rpc import backend_registry as _backends

from .. import _polling
from ._originals import rpc_async

__all__ = (
    "PrefixStore",
    "Store",
    "TCPStore",
    "WorkerInfo",
    "agent_running",
    "agent_store",
    "agent_threads",
    "backend_options",
    "close_pipe",
    "current_agent",
    "default_timeout",
    "failing_fast",
    "forget_member",
    "group_key_prefix",
    "known_ids",
    "own_id",
    "own_name",
    "release_user_rrefs",
    "root_store",
    "serving",
    "stop_serving",
    "store_address",
    "worker_info",
    "worker_infos",
)


def agent_running() -> bool:
    """True while torch's RPC agent runs in this process, whoever started it."""
    return bool(_rpc_c._is_current_rpc_agent_set())


def current_agent() -> Any:
    """torch's RPC agent of this process (call only while `agent_running()`)."""
    return _rpc_c._get_current_rpc_agent()


def worker_infos() -> list[WorkerInfo]:
    """Every worker of the running world, in rank order."""
    return sorted(current_agent().get_worker_infos(), key=lambda info: info.id)


def worker_info(name: str) -> WorkerInfo:
    """torch's WorkerInfo of the process torch's group knows as `name`."""
    info: WorkerInfo = rpc.get_worker_info(name)
    return info


def own_id() -> int:
    """This process's torch id in its agent's group."""
    return int(current_agent().get_worker_info().id)


def own_name() -> str:
    """This process's worker name in its agent's group."""
    return str(current_agent().get_worker_info().name)


def default_timeout() -> float:
    """The timeout, in seconds, a call given torch's -1 (the default) gets (0: none)."""
    return float(_rpc_c.get_rpc_timeout())


def agent_threads(default: int = 16) -> int:
    """How many RPC threads serve incoming calls (torch's `num_worker_threads`)."""
    try:
        return int(current_agent()._get_backend_options().num_worker_threads)
    except AttributeError:  # an agent other than TensorPipe's
        return default


def backend_options(
    num_worker_threads: int,
    rpc_timeout: float,
    init_method: str,
    transports: Sequence[str] | None,
    channels: Sequence[str] | None,
    device_maps: Mapping[str, Mapping[Any, Any]] | None = None,
) -> rpc.TensorPipeRpcBackendOptions:
    """TensorPipe's options, with its private transport and channel choice.

    With `device_maps`, torch's own channel choice (the CPU-only set asyncrpc
    picks on a CPU build, `channels`, has none that moves CUDA tensors), and
    torch's device list: derived from the maps and their inverses.
    """
    return rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=num_worker_threads,
        rpc_timeout=rpc_timeout,
        init_method=init_method,
        device_maps={peer: dict(m) for peer, m in device_maps.items()} if device_maps else None,
        _transports=list(transports) if transports else None,
        _channels=list(channels) if channels and not device_maps else None,
    )


# ---- the store --------------------------------------------------------------------------


def agent_store() -> Store:
    """The store torch's agent formed its world with (any world; a PrefixStore)."""
    store: Store = current_agent().store
    return store


def root_store(store: Store) -> Store:
    """The store under every PrefixStore wrapping `store` (a TCPStore for a reachable world)."""
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return store


def store_address(store: Store) -> str | None:
    """`host:port` where a TCPStore listens, else None (a file or hash store)."""
    if isinstance(store, TCPStore):
        return f"{store.host}:{store.port}"
    return None


def group_key_prefix() -> str:
    """The PrefixStore prefix under which the last `init_rpc` here keeps its group's keys."""
    return f"rpc_prefix_{int(rpc._init_counter) - 1}"


# ---- a dynamic group's members (a world that heals) ------------------------------------
# torch's dynamic groups (init_rpc with world_size=None) keep a member that died: its
# name stays taken. asyncrpc never drops one from a running agent: torch's own
# `_update_group_membership(info, [], {}, False)` erases the member's entry while
# torch's RRef notices wait to be retried to it (RpcRetryInfo holds a reference to that
# entry: a retry then reads freed memory), and it erases without the lock its readers
# take. The store keeps the group's names as "name-id," in names/_ALL_WORKER_INFOS
# (under torch's rpc_prefix_N/), and a join holds RpcGroupManagementToken.

_MEMBER_LIST = "names/_ALL_WORKER_INFOS"
_MEMBER_TOKEN = "RpcGroupManagementToken"
_PROBE_S = 5.0
_ZERO = torch.zeros(())


def known_ids() -> set[int]:
    """The torch ids of every process this agent knows (itself, members, dead ones kept)."""
    return {int(info.id) for info in current_agent().get_worker_infos()}


def close_pipe(name: str) -> None:
    """Have this agent close its connections to the dead process torch knows as `name`.

    torch reads from a connection only while it waits for a reply there, so it
    never sees a peer that died while it had no call in flight: the sockets
    stay open (CLOSE-WAIT) until the agent stops. One message to the dead
    process fails (EOF, or a refused connection where none was open), and
    TensorPipe then closes the pipe's connections; the entry stays, failing
    every later send at once (torch's retries of RRef notices among them).
    Nothing waits for it. The process must be dead: `name` is never a live one.
    """
    try:
        rpc_async(name, torch.add, args=(_ZERO, 0), timeout=_PROBE_S)
    except RuntimeError:  # not known here (never joined this agent's group): no pipe
        pass


def forget_member(
    store: Store, name: str, torch_id: int, dead: Callable[[str], bool], timeout: float
) -> None:
    """Take member `name` (torch id) off the group's list in `store`, as torch's leave would.

    `store` holds the group's keys (the agent's store plus `group_key_prefix()`).
    torch's joins and leaves read the list and write it back whole, holding the
    group's token (RpcGroupManagementToken); so does this: an edit made beside a
    join would be written over, and the dead member listed again (every later
    join would then call it, and fail). A token held by a process that died
    (`dead(its torch name)`: a join or leave it left half done) is released;
    one held by a live process is waited for, up to `timeout` s, then taken
    (a join stuck that long called a dead member: torch's own clean-up of it
    waits for the token it holds). After this, a process may join with a
    fresh id.
    """
    mine = f"Token_for_asyncrpc-forget-{name}-{torch_id}_leave"

    def take(force: bool) -> bool:
        while True:
            held = store.compare_set(_MEMBER_TOKEN, "", mine).decode()
            if held == mine:
                return True
            holder = _token_holder(held)
            if holder is None or not dead(holder):
                break
            store.compare_set(_MEMBER_TOKEN, held, "")
            store.set(held, "Done")  # a member waiting for the token reads this key
        return force and store.compare_set(_MEMBER_TOKEN, held, mine).decode() == mine

    if not _polling.within(lambda: take(force=False), timeout):
        while not take(force=True):  # stuck (a join that called a dead member): taken
            pass
    try:
        entry = f"{name}-{torch_id},"
        if store.check([_MEMBER_LIST]):
            listed = store.get(_MEMBER_LIST).decode()
            if entry in listed:
                store.set(_MEMBER_LIST, listed.replace(entry, ""))
    finally:
        store.set(_MEMBER_TOKEN, "")
        store.set(mine, "Done")


def _token_holder(token: str) -> str | None:
    """The torch name in torch's "Token_for_<name>_<join|leave>", else None."""
    for what in ("_join", "_leave"):
        if token.startswith("Token_for_") and token.endswith(what):
            return token[len("Token_for_") : -len(what)]
    return None


# ---- shutting the agent down ------------------------------------------------------------

_RREF_RELEASE_S = 5.0
_STOP_SERVING_S = 10.0


def release_user_rrefs(timeout: float) -> None:
    """Delete this process's user RRefs at their owners, as torch's static shutdown does."""
    try:
        seconds = datetime.timedelta(seconds=timeout or _RREF_RELEASE_S)
        _rpc_api._delete_all_user_and_unforked_owner_rrefs(seconds)  # type: ignore[attr-defined]
    except RuntimeError:  # an owner that died with its objects: nothing to release there
        pass


def serving() -> int:
    """How many calls this agent runs for peers now (torch's metrics count them).

    torch's join waits only for this agent's own calls, then stops replying:
    a worker that leaves waits for these first.
    """
    metrics = current_agent().get_metrics()
    active = int(metrics.get("agent.server_active_calls", 0))
    return active + int(metrics.get("agent.server_active_async_calls", 0))


def stop_serving(timeout: float) -> None:
    """Finish the calls this agent runs and mark it shutting down (torch's join, no barrier).

    Bounded (`timeout`, else `_STOP_SERVING_S`): a call sent to a process that
    died as it started may never end, and the join would wait for it forever.
    """
    try:
        current_agent().join(shutdown=True, timeout=timeout or _STOP_SERVING_S)
    except RuntimeError:  # timed out: the shutdown that follows stops the agent anyway
        pass


@contextlib.contextmanager
def failing_fast() -> Iterator[None]:
    """Around a join of a dynamic group (`init_rpc` with no world size): a failure ends it at once.

    torch's join holds the group's token (RpcGroupManagementToken) while it
    asks every member for its devices; if one cannot be reached (it died
    meanwhile, or refused the connection under load), torch answers with a
    graceful `rpc.shutdown()`, whose leave waits for that same token, held by
    the join itself, until the store's timeout (20 s) and then fails. Here
    the agent stops at once instead (`graceful=False`) and the join's own
    failure is raised: the process fails, its supervisor starts it again, and
    a token left held by a dead process is released (`forget_member`).

    It also skips the first of the join's two rounds, asking each member in
    turn for its devices and device maps: asyncrpc's dynamic groups refuse
    CUDA devices in every member (`_devices`), so each answer is "none",
    and each ask cost a round trip per member under the token.
    """
    module = vars(_backends)["api"]
    setattr(_backends, "api", _FastLeave(module))  # noqa: B010 (a module torch does not type)
    try:
        yield
    finally:
        setattr(_backends, "api", module)  # noqa: B010


class _FastLeave:
    """torch's `rpc.api` as its join sees it, with a shutdown that does not wait."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def shutdown(self, graceful: bool = True, timeout: float = 0) -> None:
        self._module.shutdown(graceful=False)

    def rpc_sync(self, to: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if func is _backends._get_device_infos and not _own_devices():
            return 0, {}, []  # a member's devices: none in any member, as this one has none
        return self._module.rpc_sync(to, func, *args, **kwargs)


def _own_devices() -> bool:
    """Whether this process's agent was given devices or device maps."""
    options = current_agent()._get_backend_options()
    return bool(options.devices or options.device_maps)
