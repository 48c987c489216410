"""The torch boundary: every private torch name, every match on torch's text, every patch.

`torch.distributed.rpc` is in maintenance mode and will not grow the hooks
asyncrpc needs, so where asyncrpc reaches past torch's public API it does so
here and nowhere else. tests/test_torch_boundary.py checks each item against
the installed torch; `install` checks the ones it patches and names any that
is missing, with the torch versions asyncrpc is tested with.

    asyncrpc ──> _torch ──> torch._C._distributed_rpc (agent, options, the UDF send)
                        ──> torch._C.Future (_set_unwrap_func; patched: __await__,
                            wait/value/then/add_done_callback), torch._C._collect_all
                        ──> PyRRef (_get_future; patched: to_here, local_value)
                        ──> rendezvous registries, torchrun's agent and static rendezvous
                        ──> torch's error texts (timeout, transport, pickle)

Process-wide patches are installed by `install` when a world first needs
them, never at import, and `uninstall` puts back exactly what was there.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import inspect
import itertools
import os
import re
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.autograd.profiler as _autograd_profiler
import torch.distributed.rpc as rpc
from torch._C import _distributed_rpc as _rpc_c
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore
from torch._C._distributed_rpc import PyRRef, WorkerInfo
from torch.distributed.rpc import api as _rpc_api
from torch.distributed.rpc import internal as _rpc_internal

from ._errors import AsyncRPCError, CancelledError, UnsupportedTorchError

# A module that `torch.distributed` shadows with a function of the same name.
_rendezvous_module: Any = importlib.import_module("torch.distributed.rendezvous")

__all__ = [
    "PY_OBJECT",
    "TESTED_TORCH",
    "UNSET_TIMEOUT",
    "FutureType",
    "Hooks",
    "PrefixStore",
    "PyRRef",
    "RemoteException",
    "Store",
    "TCPStore",
    "WorkerInfo",
    "add_callback",
    "adopt_fork",
    "agent_running",
    "agent_store",
    "agent_threads",
    "any_tensor_hooks",
    "async_target",
    "backend_options",
    "bound_static_rendezvous",
    "call_hook_tables",
    "cancel",
    "check_guard",
    "check_received",
    "close_pipe",
    "collect_for_wait_all",
    "combine",
    "created",
    "current_agent",
    "deserialize",
    "failure_kind",
    "forget_member",
    "fork_from_owner",
    "global_call_hook_tables",
    "group_key_prefix",
    "guard_reads",
    "hook_tables",
    "impl_id",
    "install",
    "install_await",
    "interop_pool_started",
    "is_builtin",
    "is_parametrized",
    "is_rpc_thread",
    "keep_until_done",
    "known_ids",
    "mark_async",
    "module_tables",
    "note_kind",
    "on_then",
    "outcome",
    "own_id",
    "owner_view",
    "parts_of",
    "profiler_config",
    "profiling",
    "quiet_torchscript",
    "raise_remote_exception",
    "register_rendezvous",
    "release_user_rrefs",
    "remote",
    "remote_exception",
    "root_store",
    "rpc_async",
    "rpc_sync",
    "rref_future",
    "rref_id",
    "rref_kind",
    "rref_owner",
    "send_python",
    "send_torch",
    "sending_to",
    "serialize",
    "set_canceller",
    "set_unwrap",
    "share_version",
    "stop_serving",
    "storage_shared",
    "store_address",
    "tag_future",
    "tensor_hooks",
    "tensor_tables",
    "uninstall",
    "watch_agent_failures",
    "watch_unread",
    "worker_info",
    "worker_infos",
]

TESTED_TORCH = ("2.13.0", "2.15.0")  # CI runs both ends of the declared range
FutureType = torch._C.Future
UNSET_TIMEOUT: float = rpc.constants.UNSET_RPC_TIMEOUT
# torch's own verbs, bound once: a program may swap rpc.rpc_async for asyncrpc's.
rpc_async = rpc.rpc_async
remote = rpc.remote
rpc_sync = rpc.rpc_sync
# torch's caller reads this attribute to send a call as async_execution.
ASYNC_MARK = "_wrapped_async_rpc_function"


def _require(hooks: dict[str, Callable[[], object]]) -> None:
    """Raise UnsupportedTorchError naming the first private hook this torch lacks."""
    for name, find in hooks.items():
        try:
            found = find()
        except (AttributeError, ImportError):
            found = None
        if found is None:
            raise UnsupportedTorchError(
                f"asyncrpc needs torch's private {name}, which torch {torch.__version__} "
                f"does not have; asyncrpc is tested with torch {' and '.join(TESTED_TORCH)}: "
                f"install one of those (pip install torch=={TESTED_TORCH[-1]})"
            )


# ---- the agent ------------------------------------------------------------------------


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


_NO_DESTINATION = re.compile(r"could not find destination id (\d+)")


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


# ---- RRefs that cross a call without torch's fork messages (a world that heals) ----------
# torch forks an RRef as it pickles it; the receiver, or the owner, then tells the others
# by messages it retries for seconds and whose last failure is raised on a thread of
# torch's own, where it ends the process (RpcAgent::retryExpiredRpcs runs the failed
# retry's callbacks itself when the retry failed at once, as one to a dead process
# does). `_forks` avoids those messages where it can; these are its torch-side pieces.
# torch's RRefForkData as a tuple (`_serialize`): owner id, the RRef's id (created
# on, local id), the fork's id (created on, local id), the parent's id, the type.

PY_OBJECT = "PyObject"  # the type torch gives an RRef to the value of a Python function
_RREF_ID = re.compile(r"created_on=(-?\d+), local_id=(\d+)")
_NO_FORK = (-1, 0)  # a fork id torch never makes (worker ids are not negative)
_rref_kinds: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_sending = threading.local()  # while a call's arguments are pickled: .to, .keep


def own_id() -> int:
    """This process's torch id in its agent's group."""
    return int(current_agent().get_worker_info().id)


PENDING = "?"  # a kind noted for an RRef from `remote` whose type is not known here


def note_kind(rref: Any, kind: str) -> None:
    """Remember the type torch gives `rref`'s value (an RRef's fork carries it).

    `PENDING`: `rref` came from `remote` here (it has a creation to wait for,
    `wait_created`), and its type is not known.
    """
    _rref_kinds[rref] = kind


def rref_kind(rref: Any) -> str | None:
    """The type of `rref`'s value as torch names it, where known here (`note_kind`)."""
    return _rref_kinds.get(rref)


def check_received(owner: int, sender: int | None = None) -> None:
    """An RRef arriving in a call: raise if its owner (or sender) died (`Hooks.check_fork`)."""
    hooks = _hooks
    if hooks is not None:
        hooks.check_fork(owner, sender)


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


# torch's refusal of an RRef's type on its owner (rref_context.cpp), naming the real one.
_OWNER_TYPE = re.compile(
    r"OwnerRRef type is (\S+), expected type is|sub-type of TensorType, but got (\S+)"
)


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
        _future_wait(fut)
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


@contextlib.contextmanager
def sending_to(to: int) -> Iterator[list[Any]]:
    """While a call to torch id `to` is pickled: what RRefs must outlive it go in the list."""
    keep: list[Any] = []
    outer = getattr(_sending, "to", None), getattr(_sending, "keep", None)
    _sending.to, _sending.keep = to, keep
    try:
        yield keep
    finally:
        _sending.to, _sending.keep = outer


def keep_until_done(fut: Any, keep: list[Any]) -> None:
    """Hold `keep` until `fut` completes (the RRefs a call refers to by id)."""
    if keep:
        _future_add_done_callback(fut, functools.partial(_release, keep))


def _release(keep: list[Any], _: Any) -> None:
    keep.clear()


def release_user_rrefs(timeout: float) -> None:
    """Delete this process's user RRefs at their owners, as torch's static shutdown does."""
    try:
        seconds = datetime.timedelta(seconds=timeout or _RREF_RELEASE_S)
        _rpc_api._delete_all_user_and_unforked_owner_rrefs(seconds)  # type: ignore[attr-defined]
    except RuntimeError:  # an owner that died with its objects: nothing to release there
        pass


_RREF_RELEASE_S = 5.0


def stop_serving(timeout: float) -> None:
    """Finish the calls this agent runs and mark it shutting down (torch's join, no barrier).

    Bounded (`timeout`, else `_STOP_SERVING_S`): a call sent to a process that
    died as it started may never end, and the join would wait for it forever.
    """
    try:
        current_agent().join(shutdown=True, timeout=timeout or _STOP_SERVING_S)
    except RuntimeError:  # timed out: the shutdown that follows stops the agent anyway
        pass


_STOP_SERVING_S = 10.0


def group_key_prefix() -> str:
    """The PrefixStore prefix under which the last `init_rpc` here keeps its group's keys."""
    return f"rpc_prefix_{int(rpc._init_counter) - 1}"


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
    deadline = time.monotonic() + timeout
    while True:
        held = store.compare_set(_MEMBER_TOKEN, "", mine).decode()
        if held == mine:
            break
        holder = _token_holder(held)
        if holder is not None and dead(holder):
            store.compare_set(_MEMBER_TOKEN, held, "")
            store.set(held, "Done")  # a member waiting for the token reads this key
            continue
        if time.monotonic() > deadline:  # stuck (a join that called a dead member): taken
            if store.compare_set(_MEMBER_TOKEN, held, mine).decode() == mine:
                break
            continue
        time.sleep(0.005)
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
) -> rpc.TensorPipeRpcBackendOptions:
    """TensorPipe's options, with its private transport and channel choice."""
    return rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=num_worker_threads,
        rpc_timeout=rpc_timeout,
        init_method=init_method,
        _transports=list(transports) if transports else None,
        _channels=list(channels) if channels else None,
    )


def is_rpc_thread() -> bool:
    """True on one of torch's RPC threads (C++ threads: Python sees them as dummies)."""
    return isinstance(threading.current_thread(), threading._DummyThread)


def profiler_config() -> Any:
    """A profiler configuration that records every thread, torch's RPC threads included."""
    from torch._C._profiler import _ExperimentalConfig

    return _ExperimentalConfig(profile_all_threads=True)


# ---- sending --------------------------------------------------------------------------


def send_python(
    to: WorkerInfo,
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
    is_async: bool,
) -> Any:
    """torch's `rpc_async` of a Python function, less its per-call Python bookkeeping.

    Under an autograd profiler torch's own path runs, since it records RPCs.
    """
    if torch.autograd._profiler_enabled():  # type: ignore[attr-defined]
        return send_torch(to, func, args, kwargs, timeout)
    udf = _rpc_internal.PythonUDF(func, args, kwargs)
    pickled, tensors = _rpc_api._default_pickler.serialize(udf)  # type: ignore[no-untyped-call]
    return _rpc_c._invoke_rpc_python_udf(to, pickled, tensors, timeout, is_async)


def send_torch(to: Any, func: Callable[..., Any], args: Any, kwargs: Any, timeout: float) -> Any:
    """torch's own `rpc_async`, leaving an open `rpc._wait_all()` to the verb that asked."""
    fut = rpc_async(to, func, args=args, kwargs=kwargs, timeout=timeout)
    pending = getattr(_rpc_api._thread_local_var, "future_list", None)
    if pending and pending[-1] is fut:
        pending.pop()  # torch's rpc_async collects; asyncrpc's rpc_sync must not
    return fut


def serialize(obj: Any) -> tuple[bytes, list[torch.Tensor]]:
    """`obj` pickled as torch's RPC would: (bytes, its tensors, uncopied); raises if it cannot."""
    payload, tensors = _rpc_api._default_pickler.serialize(obj)  # type: ignore[no-untyped-call]
    return payload, list(tensors)


def deserialize(payload: bytes, tensors: list[torch.Tensor]) -> Any:
    """The object `serialize` made (`payload`, `tensors`)."""
    return _rpc_api._default_pickler.deserialize(payload, tensors)  # type: ignore[no-untyped-call]


def collect_for_wait_all(fut: Any) -> None:
    """Hand `fut` to torch's `rpc._wait_all()` block if one is open on this thread."""
    pending = getattr(_rpc_api._thread_local_var, "future_list", None)
    if pending is not None:
        pending.append(fut)


# ---- functions, Futures and RRefs -----------------------------------------------------


def is_builtin(func: object) -> bool:
    """True for a torch operator (torch.add): torch sends it by name, not pickled."""
    return torch.jit._builtins._find_builtin(func) is not None  # type: ignore[no-untyped-call]


def mark_async(wrapper: object, func: object) -> None:
    """Mark `wrapper` so torch sends calls to it as async_execution, running `func`."""
    setattr(wrapper, ASYNC_MARK, func)


def async_target(func: object) -> Any:
    """What an async_execution function wraps, or None for an ordinary function."""
    return getattr(func, ASYNC_MARK, None)


def set_unwrap(fut: Any, check: Callable[[Any], object]) -> None:
    """Run `check(value)` whenever `fut`'s value is read; an exception it raises propagates."""
    fut._set_unwrap_func(check)


def rref_future(rref: Any) -> Any:
    """The Future that completes when `rref`'s value exists on its owner."""
    return rref._get_future()


class _Absent:
    """Stands in for a name this torch lacks (`install` names it)."""


RemoteException: type = getattr(_rpc_internal, "RemoteException", _Absent)


def raise_remote_exception(value: Any) -> None:
    """Raise torch's wire form of a remote exception as torch's own reads do."""
    _rpc_internal._handle_exception(value)  # type: ignore[no-untyped-call]


def remote_exception(text: str, cls: type[BaseException]) -> tuple[Any, ...]:
    """The pickle reduction of torch's wire form of a remote exception (for torch callers)."""
    found: Any = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    if found is not cls:
        cls = RuntimeError  # a class torch's caller could not import by name
    return (_rpc_internal.RemoteException, (text, cls))


# ---- process-wide patches: installed by `install`, put back by `uninstall` ------------

_ABSENT = object()
_patched: dict[tuple[int, str], tuple[Any, Any]] = {}  # (id, name) -> (holder, original)
_patch_lock = threading.RLock()


def _patch(holder: Any, name: str, value: Any) -> None:
    """Set `holder.name` (`holder[name]` for a dict), remembering what was there once."""
    with _patch_lock:
        if isinstance(holder, dict):
            _patched.setdefault((id(holder), name), (holder, holder.get(name, _ABSENT)))
            holder[name] = value
        else:
            _patched.setdefault((id(holder), name), (holder, vars(holder).get(name, _ABSENT)))
            setattr(holder, name, value)


def uninstall() -> None:
    """Put back everything `install` and `install_await` changed in torch, newest first."""
    with _patch_lock:
        for (_, name), (holder, original) in reversed(list(_patched.items())):
            if isinstance(holder, dict):
                if original is _ABSENT:
                    holder.pop(name, None)
                else:
                    holder[name] = original
            elif original is _ABSENT:
                delattr(holder, name)
            else:
                setattr(holder, name, original)
        _patched.clear()
        _tags.clear()
        global _hooks
        _hooks = None


class Hooks(NamedTuple):
    """asyncrpc's side of the patches (given by the world that installs them)."""

    await_future: Callable[[Any], Any]  # Future.__await__
    name_read: Callable[[BaseException, Any], BaseException]  # a tagged Future's failure
    name_rref: Callable[[BaseException, str], BaseException]  # to_here's failure, by owner
    check_value: Callable[[object], object]  # a value read: raise a carried failure
    carry: Callable[[BaseException], object]  # a failure as a value to set on a Future
    cancel_call: Callable[[Any], bool]  # ask a tagged call's callee to stop it
    handoff: Callable[..., Any]  # the `asyncrpc-store://` rendezvous handler
    check_owner: Callable[[Any], None]  # before to_here: raise if the owner process died
    # An RRef being sent (the RRef), or received (its owner's and sender's torch ids):
    # raise if the owner (or the sender) process died; True in a world that heals.
    check_fork: Callable[..., bool]
    # An RRef pickled for a call to torch id `to`: how to send it without torch's fork
    # messages (a reduce tuple), or None for torch's own way; RRefs to hold go in `keep`.
    reduce_rref: Callable[[Any, int, list[Any]], Any]


_hooks: Hooks | None = None  # while installed


_CORE_HOOKS: dict[str, Callable[[], object]] = {
    "torch._C.Future._set_unwrap_func": lambda: FutureType._set_unwrap_func,
    "torch._C._collect_all": lambda: torch._C._collect_all,
    "torch._C._distributed_rpc.PyRRef._get_future": lambda: PyRRef._get_future,
    "torch._C._distributed_rpc.TensorPipeAgent.store": lambda: getattr(
        _rpc_c.TensorPipeAgent, "store", None
    ),
    "torch._C._distributed_rpc._invoke_rpc_python_udf": lambda: _rpc_c._invoke_rpc_python_udf,
    "torch._C._distributed_rpc._is_current_rpc_agent_set": lambda: (
        _rpc_c._is_current_rpc_agent_set
    ),
    "torch.distributed.rpc.api._default_pickler": lambda: _rpc_api._default_pickler.serialize,
    "torch.distributed.rpc.api._thread_local_var": lambda: _rpc_api._thread_local_var,
    "torch.distributed.rpc.internal.PythonUDF": lambda: _rpc_internal.PythonUDF,
    "torch.distributed.rpc.internal._InternalRPCPickler._py_rref_reducer": lambda: (
        _rpc_internal._internal_rpc_pickler._py_rref_reducer
    ),
    "torch.distributed.rpc.internal._InternalRPCPickler._py_rref_receiver": lambda: vars(
        _rpc_internal._InternalRPCPickler
    ).get("_py_rref_receiver"),
    "torch.distributed.rpc.internal.RemoteException": lambda: _rpc_internal.RemoteException,
    "torch.distributed.rpc.internal._handle_exception": lambda: _rpc_internal._handle_exception,
    "torch.distributed.rendezvous._rendezvous_handlers": lambda: (
        _rendezvous_module._rendezvous_handlers
    ),
    "torch.jit._builtins._find_builtin": lambda: torch.jit._builtins._find_builtin,
}


def install(hooks: Hooks) -> None:
    """Install every process-wide patch a world needs (once; `uninstall` undoes them).

    torch Futures become awaitable and cancellable (`fut.cancel()`); reading a
    tagged Future, `to_here()` and `local_value()` raise carried failures and
    name torch's; the `asyncrpc-store://` rendezvous scheme exists for
    asyncrpc's `init_rpc`.
    """
    with _patch_lock:
        if (id(FutureType), "wait") in _patched:
            return
        _require(_CORE_HOOKS)
        install_await(hooks.await_future)
        _patch(FutureType, "wait", _named_read(FutureType.wait, hooks))
        _patch(FutureType, "value", _named_read(FutureType.value, hooks))
        _patch(FutureType, "then", _held(FutureType.then, chained=True))
        _patch(FutureType, "add_done_callback", _held(FutureType.add_done_callback))
        _patch(torch._C, "_collect_all", _early_collect_all(torch._C._collect_all, hooks))
        _patch(PyRRef, "to_here", _checked_to_here(PyRRef.to_here, hooks))
        _patch(PyRRef, "local_value", _checked_local_value(PyRRef.local_value, hooks))
        _patch(FutureType, "cancel", cancel)
        _patch_rref_pickling(hooks)
        _patch(_rendezvous_module._rendezvous_handlers, "asyncrpc-store", hooks.handoff)
        global _hooks
        _hooks = hooks


def _patch_rref_pickling(hooks: Hooks) -> None:
    """An RRef sent to, or received by, any worker: `hooks.check_fork(owner's torch id)` first.

    torch forks an RRef as it pickles it (the receiver asks the owner to
    confirm the fork before the call runs): an RRef whose owner died could
    only wait. The sender raises instead, and so does a receiver that knows
    of the death before its sender did.
    """
    pickler = _rpc_internal._internal_rpc_pickler
    reduce: Callable[[Any], Any] = pickler._py_rref_reducer
    receive = vars(_rpc_internal._InternalRPCPickler)["_py_rref_receiver"].__func__

    @functools.wraps(reduce)
    def checked_reduce(py_rref: Any) -> Any:
        to = getattr(_sending, "to", None)
        if to is not None:  # a call of asyncrpc's: the callee is known
            own = hooks.reduce_rref(py_rref, to, _sending.keep)
            if own is not None:
                return own
        else:
            hooks.check_fork(py_rref)
        return reduce(py_rref)

    @functools.wraps(receive)
    def checked_receive(cls: Any, fork_data: tuple[Any, ...]) -> Any:
        # torch's RRefForkData: (owner, rref id (2), fork id (2), parent, type): torch
        # would tell both the owner and the parent (the sender) of this fork.
        heals = hooks.check_fork(int(fork_data[0]), int(fork_data[5]))
        rref = receive(cls, fork_data)
        if heals:  # its owner made it: `_forks` may send it on without torch's messages
            _rref_kinds[rref] = str(fork_data[6])
        return rref

    _patch(pickler, "_py_rref_reducer", checked_reduce)
    _patch(_rpc_internal._InternalRPCPickler, "_py_rref_receiver", classmethod(checked_receive))


def install_await(method: Callable[[Any], Any], keep: bool = False) -> None:
    """Give torch Futures an `__await__` (kept if torch ever ships its own).

    With `keep` it stays after `uninstall` (a user asked for it by hand).
    """
    key = (id(FutureType), "__await__")
    if keep:
        with _patch_lock:
            if vars(FutureType).get("__await__") is method:
                _patched.pop(key, None)  # already ours: now for good
            elif not hasattr(FutureType, "__await__"):
                FutureType.__await__ = method  # type: ignore[attr-defined]
        return
    if hasattr(FutureType, "__await__"):
        return
    with _patch_lock:
        if not hasattr(FutureType, "__await__"):
            _patch(FutureType, "__await__", method)


# ---- reads: carried failures raised, torch's named -------------------------------------

# A Python done-callback per call cost about 8% of a burst's throughput, so no
# callback names a failed call: the read does. `tag_future` notes where a
# Future's call went; torch's `wait`/`value` of a tagged Future pass a
# RuntimeError through the namer, and any Future whose value is a carried
# failure (a torch Future that was handed asyncrpc's reply) raises it. Two
# ways of reading hand torch a Future without our tag, and are covered too:
#   - a callback (`then`, `add_done_callback`) gets a new Python wrapper when
#     the caller kept none; the callback keeps the tagged one alive instead;
#   - `collect_all`/`wait_all` end at the first failed call, as torch's do for
#     its own failed calls: a failure carried as a value is no error to torch's
#     C++ collectAll, so for asyncrpc's calls the combined Future is ours.
_tags: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
# torch's own, taken before any patch: the unread watch must not count as a read.
_future_wait = FutureType.wait
_future_value = FutureType.value
_future_add_done_callback = FutureType.add_done_callback


def add_callback(fut: Any, callback: Callable[[Any], None]) -> None:
    """torch's own add_done_callback: counts as no read, and keeps no tagged wrapper."""
    _future_add_done_callback(fut, callback)


def outcome(fut: Any) -> tuple[bool, Any]:
    """A done Future's outcome as torch holds it: (True, value) or (False, torch's error).

    No read hook runs: a carried failure stays a value, torch's error is not named.
    """
    try:
        return True, _future_value(fut)
    except RuntimeError as error:
        return False, error.with_traceback(None)


def tag_future(fut: Any, tag: object) -> None:
    """Pass `tag` to the namer when reading `fut` raises torch's RuntimeError."""
    _tags[fut] = tag


# A read that would block on a Future that can never complete (a Batch call
# before its Batch is sent) should fail at once: `check()` runs first and raises.
_guards: weakref.WeakKeyDictionary[Any, Callable[[], None]] = weakref.WeakKeyDictionary()
# A Future made of others (gather, chain, with_timeout, wait_all): its inputs,
# which its guard checks and its cancel() cancels.
_combined: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()
# Futures cancelled by a function of their own (an async def's Task, say). Held
# weakly when a bound method: a value that reaches its key would keep it forever.
_cancellers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def guard_reads(fut: Any, check: Callable[[], None]) -> None:
    """Run `check()` (which may raise) before any read of `fut` that would block."""
    _guards[fut] = check


def combine(fut: Any, inputs: Sequence[Any]) -> None:
    """Record that `fut` is made of `inputs`: their guards are its guard, cancel reaches them."""
    _combined[fut] = list(inputs)


def parts_of(fut: Any) -> list[Any]:
    """The Futures `fut` is made of (`combine`), or none."""
    return list(_combined.get(fut, ()))


def check_guard(fut: Any) -> None:
    """Raise what a guard of `fut`, or of a Future it is made of, raises."""
    if not _guards or fut.done():
        return
    check = _guards.get(fut)
    if check is not None:
        check()
    for part in _combined.get(fut, ()):
        check_guard(part)


def set_canceller(fut: Any, cancel: Callable[[], bool]) -> None:
    """Make `cancel()` what cancelling `fut` does (it returns whether anything was stopped).

    A bound method is held weakly (its object must not hold `fut` for good);
    any other callable must not reach `fut` (use a weakref to it).
    """
    _cancellers[fut] = weakref.WeakMethod(cancel) if inspect.ismethod(cancel) else cancel


def cancel(fut: Any) -> bool:
    """Cancel the work behind `fut`; False when it is done or not asyncrpc's to cancel.

    An asyncrpc call asks its callee to stop (`Hooks.cancel_call`); a local
    Future runs its own canceller; a combined Future cancels its inputs.
    """
    if fut.done():
        return False
    own = _cancellers.get(fut)
    if isinstance(own, weakref.WeakMethod):
        own = own()
    if own is not None:
        return bool(own())
    inputs = _combined.get(fut)
    if inputs is not None:
        return any([cancel(part) for part in inputs])  # a list: every input is asked
    tag, hooks = _tags.get(fut), _hooks
    if tag is None or hooks is None:
        return False
    own_cancel = getattr(tag, "cancel", None)  # a call's Reply settles its own Future
    if own_cancel is not None:
        return bool(own_cancel())
    return hooks.cancel_call(tag)


def _named_read(read: Callable[[Any], Any], hooks: Hooks) -> Callable[[Any], Any]:
    @functools.wraps(read)
    def named_read(self: Any) -> Any:
        if _unread:
            _mark_read(self)
        if _guards:
            check_guard(self)
        try:
            return hooks.check_value(read(self))
        except RuntimeError as exc:
            tag = _tags.get(self)
            named = exc if tag is None else hooks.name_read(exc, tag)
            if named is exc:
                raise
            raise named from exc

    return named_read


def _held(add: Callable[..., Any], chained: bool = False) -> Callable[..., Any]:
    @functools.wraps(add)
    def add_callback(self: Any, callback: Callable[[Any], Any]) -> Any:
        ours = chained and (self in _tags or self in _cancellers or self in _combined)
        if self in _tags:
            callback = functools.partial(_call_held, callback, self)
            _mark_read(self)
        if ours:
            callback = functools.partial(_carry_cancel, callback)
        child = add(self, callback)
        if ours and _hooks is not None:
            child._set_unwrap_func(_hooks.check_value)
            if _then_child is not None:  # torch completes its child: hand out one a cancel can
                return _then_child(child, self)
            combine(child, [self])  # cancelling what `then` made cancels its source
        return child

    return add_callback


# What `then` on an asyncrpc Future returns in place of torch's child (which a cancel
# could not complete early): `make(child, source)`, registered by `_futures`.
_then_child: Callable[[Any, Any], Any] | None = None


def on_then(make: Callable[[Any, Any], Any] | None) -> None:
    """`then` on an asyncrpc Future returns `make(torch's child, its source)` (None: the child)."""
    global _then_child
    _then_child = make


def _carry_cancel(callback: Callable[[Any], Any], fut: Any) -> Any:
    # torch would wrap an error the callback lets through in a RuntimeError; asyncrpc's
    # own (a cancel, a dead worker, a failed call read in the callback) is carried as it
    # is, so the Future `then` made fails with that error, named as on every verb.
    try:
        return callback(fut)
    except AsyncRPCError as named:
        hooks = _hooks
        if hooks is None:
            raise
        return hooks.carry(named)


def _call_held(callback: Callable[[Any], Any], held: Any, fut: Any) -> Any:
    return callback(held)


def _early_collect_all(collect: Callable[[list[Any]], Any], hooks: Hooks) -> Callable[..., Any]:
    @functools.wraps(collect)
    def collect_all(futures: list[Any]) -> Any:
        for fut in futures if _unread else ():
            _mark_read(fut)
        if not any(fut in _tags for fut in futures):
            return collect(futures)
        early: Any = torch.futures.Future()
        early._set_unwrap_func(hooks.check_value)
        combine(early, futures)
        claim = threading.Lock()  # taken once: by the first failure, all values, or a cancel
        cancel_early = functools.partial(_cancel_collected, weakref.ref(early), claim, hooks)
        set_canceller(early, cancel_early)

        def settle(value: object) -> None:
            if claim.acquire(blocking=False):
                early.set_result(value)

        def on_member(fut: Any, _: Any) -> None:
            try:
                fut.wait()  # named, and a carried failure raised
            except Exception as exc:
                settle(hooks.carry(exc))

        def on_all(done: Any) -> None:
            try:
                settle(_future_wait(done))
            except Exception as exc:
                settle(hooks.carry(exc))

        # Before torch's own callback: a failed member settles first, named. A
        # member already done is read here, and needs no callback.
        for fut in futures:
            if fut.done():
                on_member(fut, None)
            else:
                _future_add_done_callback(fut, functools.partial(on_member, fut))
        _future_add_done_callback(collect(futures), on_all)
        return early

    return collect_all


def _cancel_collected(early: weakref.ref[Any], claim: threading.Lock, hooks: Hooks) -> bool:
    # Cancelling collect_all's Future: failed with CancelledError at once, then its inputs.
    fut = early()
    if fut is None or not claim.acquire(blocking=False):
        return False
    inputs = parts_of(fut)
    error = CancelledError(f"this Future, collecting {len(inputs)} others, was cancelled")
    fut.set_result(hooks.carry(error))
    for part in inputs:
        cancel(part)
    return True


def _checked_to_here(to_here: Callable[..., Any], hooks: Hooks) -> Callable[..., Any]:
    @functools.wraps(to_here)
    def checked_to_here(self: Any, timeout: float = UNSET_TIMEOUT) -> Any:
        hooks.check_owner(self)
        try:
            value = to_here(self, timeout)
        except RuntimeError as exc:
            named = hooks.name_rref(exc, str(self.owner().name))
            if named is exc:
                raise
            raise named from exc
        return hooks.check_value(value)

    return checked_to_here


def _checked_local_value(local_value: Callable[[Any], Any], hooks: Hooks) -> Callable[[Any], Any]:
    @functools.wraps(local_value)
    def checked_local_value(self: Any) -> Any:
        return hooks.check_value(local_value(self))

    return checked_local_value


# ---- failures nobody read --------------------------------------------------------------


class _Unread:
    """What is known of one watched Future: its error, and whether anyone read it."""

    __slots__ = ("dropped", "error", "read", "report")

    def __init__(self, report: Callable[[BaseException], None]) -> None:
        self.report: Callable[[BaseException], None] | None = report
        self.error: BaseException | None = None
        self.dropped = self.read = False

    def settle(self, fut: Any) -> None:
        try:
            _future_wait(fut)
        except Exception as error:  # the failure itself is what gets reported
            # Its traceback holds this frame, and so `fut`: it would never be dropped.
            self.error = error.with_traceback(None)
            if self.dropped:
                self.emit()

    def drop(self) -> None:
        self.dropped = True
        if self.error is not None:
            self.emit()

    def emit(self) -> None:
        report, self.report = self.report, None
        if report is not None and not self.read and self.error is not None:
            report(self.error)


_unread: weakref.WeakKeyDictionary[Any, _Unread] = weakref.WeakKeyDictionary()


def watch_unread(fut: Any, report: Callable[[BaseException], None]) -> None:
    """Call `report(error)` once if `fut` fails and is dropped without being read.

    A read is `wait`, `value`, `then`, `add_done_callback` or `collect_all`;
    it counts whether it comes before or after the failure.
    """
    state = _Unread(report)
    _unread[fut] = state
    weakref.finalize(fut, state.drop)
    _future_add_done_callback(fut, state.settle)


def _mark_read(fut: Any) -> None:
    state = _unread.get(fut)
    if state is not None:
        state.read = True


# ---- torchrun's rendezvous and agent (in the launcher's process) ----------------------


def register_rendezvous(name: str, create: Callable[..., Any]) -> Callable[[], None]:
    """Register a torchrun rendezvous backend; returns how to unregister it."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as handlers

    _require({"rendezvous_handler_registry._registry": lambda: handlers._registry})
    registry: dict[str, Any] = handlers._registry
    if name in registry:
        return lambda: None
    handlers.register(name, create)

    def unregister() -> None:
        registry.pop(name, None)

    return unregister


def bound_static_rendezvous(
    backend: str,
    host_store: Callable[[str, int, float], Any],
    client_store: Callable[[str, int, float], Any],
) -> type[Any]:
    """torch's static TCP rendezvous, with the store made by `host_store`/`client_store`.

    It fills torch's private `_store` slot before torch would make its own
    store (which listens on every interface). A handler's `on_shutdown` runs
    when the agent shuts the rendezvous down.
    """
    from torch.distributed.elastic.rendezvous import RendezvousInfo
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import (
        StaticTCPRendezvous,
    )

    class BoundStaticRendezvous(StaticTCPRendezvous):
        """torch's static rendezvous, with the store bound to the master address only."""

        on_shutdown: Callable[[], None] | None = None

        def get_backend(self) -> str:
            return backend

        def next_rendezvous(self) -> RendezvousInfo:
            _require({"StaticTCPRendezvous._store": lambda: "_store" in vars(self) or None})
            if self._store is None:
                seconds = self.timeout.total_seconds()
                if self.rank == 0:
                    store = host_store(self.master_addr, self.master_port, seconds)
                    self.master_port = store.port
                else:
                    store = client_store(self.master_addr, self.master_port, seconds)
                self._store = store
            info = RendezvousStoreInfo(self.master_addr, self.master_port)
            store_view = PrefixStore(self.run_id, self._store)
            return RendezvousInfo(store_view, self.rank, self.world_size, info)

        def shutdown(self) -> bool:
            if self.on_shutdown is not None:
                self.on_shutdown()
            return bool(super().shutdown())

    return BoundStaticRendezvous


def watch_agent_failures(
    report: Callable[[Any, str, list[tuple[int, int, int]], list[int]], None],
) -> Callable[[], None]:
    """Have torchrun's agent call `report(store, attempt, [(rank, pid, exitcode)], elsewhere)`.

    `elsewhere` lists the ranks of the world's workers on other nodes.
    Returns how to stop. The agent learns every local worker's exit (signal
    included) first; this wraps its private `_monitor_workers` so the
    world's store hears of it too.
    """
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    _require({"LocalElasticAgent._monitor_workers": lambda: vars(LocalElasticAgent).get(
        "_monitor_workers")})  # fmt: skip
    original = LocalElasticAgent._monitor_workers
    if getattr(original, "_asyncrpc", False):
        return lambda: None

    def monitor(self: Any, worker_group: Any) -> Any:
        result = original(self, worker_group)
        spec = worker_group.spec
        store = getattr(spec.rdzv_handler, "_store", None)
        if result.is_failed() and store is not None:
            attempt = str(spec.max_restarts - self._remaining_restarts)
            failed = [(rank, f.pid, f.exitcode) for rank, f in result.failures.items()]
            workers = worker_group.workers
            here = {w.global_rank for w in workers}
            size = workers[0].world_size if workers else 0
            report(store, attempt, failed, [r for r in range(size) if r not in here])
        if result.is_failed():
            _root_cause_first(result.failures)
        return result

    monitor._asyncrpc = True  # type: ignore[attr-defined]
    LocalElasticAgent._monitor_workers = monitor  # type: ignore[method-assign]

    def stop() -> None:
        if LocalElasticAgent.__dict__.get("_monitor_workers") is monitor:
            LocalElasticAgent._monitor_workers = original  # type: ignore[method-assign]

    return stop


def _root_cause_first(failures: dict[int, Any]) -> None:
    """Order torchrun's failures (rank -> ProcessFailure) so its "Root Cause" is the real one.

    torch names the failure with the earliest timestamp, in whole seconds,
    and the first in order on a tie: the lowest rank, often one stopped
    because another failed. A worker whose `main` raised first wrote an error
    file (`_supervisor`); those go first, earliest first, the rest keep their order.
    """
    recorded = {r: f.timestamp for r, f in failures.items() if os.path.isfile(f.error_file)}
    if recorded:
        ordered = sorted(failures.items(), key=lambda item: recorded.get(item[0], float("inf")))
        failures.clear()
        failures.update(ordered)


# ---- torch's failure texts ------------------------------------------------------------

# Each pattern is matched against the first lines of the RuntimeError that torch
# raises from wait()/to_here(); tests/test_torch_boundary.py provokes each one.
_KINDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    # An RRef in the call whose owner died: refused as the callee received it (the
    # callee's ObjectLostError, in torch's text), or owned by a process the callee's
    # agent never knew (it died before the callee joined).
    ("lost", re.compile(r"ObjectLostError: |could not find destination id \d+")),
    ("timeout", re.compile(r"ran for more than set timeout|timed out", re.IGNORECASE)),
    (
        "unreachable",
        re.compile(
            r"originated at tensorpipe/|Connection (reset|refused|closed)|"
            r"RPCAgent has been shutdown|pipe has been closed|end of file|"
            # a send to a process whose pipe failed already (it died): torch's agent
            # completes the call at once, and its own check of that fails
            r"Future marked complete from outside the thread pool|"
            # a member this agent never knew: it died before this process joined
            r"could not find destination (url for name|name) "
        ),
    ),
    ("unimportable", re.compile(r"No module named|Can't get attribute|can't get attribute")),
    ("unpicklable", re.compile(r"pickl", re.IGNORECASE)),
)


def failure_kind(error: BaseException) -> str | None:
    """Which torch failure `error` stands for (a kind of `_KINDS`: lost, timeout, ...).

    None for anything else (a remote function's own error, say).
    """
    text = str(error)[:2000]
    for kind, pattern in _KINDS:
        if pattern.search(text):
            return kind
    return None


# ---- TorchScript's warnings and torch's inter-op pool ---------------------------------


@contextlib.contextmanager
def quiet_torchscript(show: bool = False) -> Iterator[None]:
    """Hide torch's TorchScript deprecation warnings inside the block, unless `show`.

    torch 2.13 raises them as DeprecationWarning, 2.14 and later as FutureWarning.
    """
    if show:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.jit")
        warnings.filterwarnings("ignore", message=r".*torch\.jit.*deprecated", category=Warning)
        yield


def tensor_tables(module: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tables a module's own parameters and buffers live in (name -> tensor or None).

    Assigning a parameter (`layer.weight = ...`) replaces its entry in the same
    table, so reading the tables sees what the module holds now.
    """
    return module._parameters, module._buffers


def module_tables(module: torch.nn.Module) -> dict[str, Any]:
    """The table a module's own submodules live in (name -> module or None)."""
    return module._modules


def is_parametrized(module: torch.nn.Module) -> bool:
    """True for a module with torch.nn.utils.parametrize parametrizations."""
    return bool(torch.nn.utils.parametrize.is_parametrized(module))


def profiling() -> bool:
    """True while torch's profiler records: in this process, or on this thread only.

    torch keeps a process-wide flag for fast checks (set by `torch.profiler`
    and `autograd.profiler.profile`); a profiler on for one thread (an RPC
    callee's, while a profiled caller calls it) shows in its thread state.
    """
    return bool(_autograd_profiler._is_profiler_enabled) or bool(
        torch._C._autograd._profiler_enabled()
    )


def hook_tables(module: torch.nn.Module) -> dict[str, dict[Any, Any]]:
    """Every hook table `module` holds, by name (`_forward_hooks`, `_state_dict_hooks`, ...).

    Read as every `_...hook...` dict in the module's `__dict__`, so a table a
    later torch adds is found too.
    """
    return {
        name: table
        for name, table in vars(module).items()
        if name.startswith("_") and "hook" in name and isinstance(table, dict)
    }


_CALL_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def call_hook_tables(module: torch.nn.Module) -> list[dict[Any, Any]]:
    """The hook tables torch reads when `module` is called (forward, backward; pre and post)."""
    tables = vars(module)
    return [tables[name] for name in _CALL_HOOKS]


def global_call_hook_tables() -> list[dict[Any, Any]]:
    """The tables of hooks for every module torch reads on each call (register_module_*_hook)."""
    from torch.nn.modules import module as _module

    return [getattr(_module, "_global" + name) for name in _CALL_HOOKS]


_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def tensor_hooks(tensor: torch.Tensor) -> bool:
    """True when `tensor` has hooks (register_hook, register_post_accumulate_grad_hook)."""
    return any(getattr(tensor, name, None) for name in _TENSOR_HOOKS)


def any_tensor_hooks(tables: Sequence[dict[str, Any]]) -> bool:
    """True when a tensor in `tables` (name -> tensor or None) has hooks; a C-level scan."""
    for name in _TENSOR_HOOKS:
        tensors = itertools.chain.from_iterable(map(dict.values, tables))
        if any(map(getattr, tensors, itertools.repeat(name), itertools.repeat(None))):
            return True
    return False


def storage_shared(tensor: torch.Tensor) -> bool:
    """True when another tensor (a view, `.data` held somewhere) shares `tensor`'s memory.

    Counts the references to its storage: the tensor's own and the storage
    object made to ask (torch's private `_storage_Use_Count`).
    """
    storage = tensor.untyped_storage()
    return int(torch._C._storage_Use_Count(storage._cdata)) > 2


def share_version(tensor: torch.Tensor, row: torch.Tensor) -> bool:
    """Make `tensor` (the same Python object) a view of `row` that shares `row`'s version counter.

    `tensor.data = row` shares the memory only; the counter stays the tensor's,
    so autograd would not see in-place changes made through the tensor. This
    swaps in a tensor made from `row` (`torch.utils.swap_tensors`), keeping the
    class, attributes, `requires_grad` and `.grad`. False, changing nothing,
    where that cannot be done safely: something else holds the tensor's C++
    object (a live autograd graph that reads it; torch's private `_use_count`),
    or it has a weak reference, hooks, a history, or is an inference tensor.
    """
    if (
        not tensor.is_leaf
        or tensor.is_inference()
        or int(tensor._use_count()) != 1  # type: ignore[attr-defined]
        or weakref.getweakrefs(tensor)
        or tensor_hooks(tensor)
    ):
        return False
    cls = type(tensor)
    if cls is torch.Tensor:
        twin = row.detach().requires_grad_(tensor.requires_grad)
    else:
        twin = torch.Tensor._make_subclass(cls, row, tensor.requires_grad)
    twin.grad = tensor.grad
    twin.__dict__.update(tensor.__dict__)
    torch.utils.swap_tensors(tensor, twin)  # type: ignore[no-untyped-call]
    return True


def impl_id(tensor: torch.Tensor) -> int:
    """The address of the C++ object behind `tensor` (torch's private `_cdata`)."""
    return int(tensor._cdata)


def interop_pool_started() -> bool:
    """True once torch has started its inter-op thread pool (threads named PTThreadPool)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return True  # cannot tell on this platform: drain anyway, it is cheap
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                if comm.read().strip() == "PTThreadPool":
                    return True
        except OSError:
            continue
    return False
