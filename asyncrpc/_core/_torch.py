"""The torch boundary: every private torch name and every match on torch's message text.

`torch.distributed.rpc` is in maintenance mode and will not grow the hooks
asyncrpc needs, so where asyncrpc reaches past torch's public API it does so
here and nowhere else. tests/test_torch_boundary.py checks each item against
the installed torch, so an upgrade that moves one fails there, by name.

    asyncrpc modules ──> _torch ──> torch._C._distributed_rpc (agent, options)
                                ──> torch._C.Future (_set_unwrap_func, __await__,
                                    named reads), torch._C._collect_all
                                ──> RRef._get_future, RRef.to_here, RemoteException
                                ──> PythonUDF and its pickler (the direct send)
                                ──> torch's error texts (timeout, transport, pickle)
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, TypeAlias

import torch
import torch.distributed.rpc as rpc
from torch._C import _distributed_rpc as _rpc_c
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore
from torch._C._distributed_rpc import PyRRef, WorkerInfo
from torch.distributed.rpc import api as _rpc_api
from torch.distributed.rpc.internal import PythonUDF, RemoteException

__all__ = [
    "ASYNC_MARK",
    "UNSET_TIMEOUT",
    "FutureType",
    "PrefixStore",
    "PyRRef",
    "RemoteException",
    "Store",
    "TCPStore",
    "WorkerInfo",
    "agent_running",
    "agent_threads",
    "agent_timeout",
    "async_target",
    "backend_options",
    "bound_static_rendezvous",
    "current_agent",
    "failure_kind",
    "install_await",
    "interop_pool_started",
    "is_builtin",
    "is_rpc_thread",
    "mark_async",
    "name_future_failures",
    "name_rref_failures",
    "profiler_config",
    "quiet_torchscript",
    "register_rendezvous",
    "remote",
    "rpc_async",
    "rpc_sync",
    "rref_future",
    "send_python",
    "set_unwrap",
    "tag_future",
    "uninstall_await",
    "watch_agent_failures",
    "watch_unread",
    "worker_infos",
]

FutureType = torch._C.Future
UNSET_TIMEOUT: float = rpc.constants.UNSET_RPC_TIMEOUT
# torch's own verbs, bound once: a program may swap rpc.rpc_async for asyncrpc's.
rpc_async = rpc.rpc_async
remote = rpc.remote
rpc_sync = rpc.rpc_sync


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
        return rpc_async(to, func, args=args, kwargs=kwargs, timeout=timeout)
    udf = PythonUDF(func, args, kwargs)
    pickled, tensors = _rpc_api._default_pickler.serialize(udf)  # type: ignore[no-untyped-call]
    return _rpc_c._invoke_rpc_python_udf(to, pickled, tensors, timeout, is_async)


# torch's caller reads this attribute to send a call as async_execution.
ASYNC_MARK = "_wrapped_async_rpc_function"

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


def agent_threads(default: int = 16) -> int:
    """How many RPC threads serve incoming calls (torch's `num_worker_threads`)."""
    try:
        return int(current_agent()._get_backend_options().num_worker_threads)
    except AttributeError:  # an agent other than TensorPipe's
        return default


def agent_timeout() -> float:
    """The world's default call timeout in seconds (0: none)."""
    return float(_rpc_c.get_rpc_timeout())


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


def profiler_config() -> Any:
    """A profiler configuration that records every thread, torch's RPC threads included."""
    from torch._C._profiler import _ExperimentalConfig

    return _ExperimentalConfig(profile_all_threads=True)


def register_rendezvous(name: str, create: Callable[..., Any]) -> None:
    """Register a torchrun rendezvous backend once."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    if name not in rendezvous_handler_registry._registry:
        rendezvous_handler_registry.register(name, create)


# ---- naming the failures of RRef.to_here ----------------------------------------------

_to_here = PyRRef.to_here


def name_rref_failures(name: Callable[[BaseException, str], BaseException]) -> None:
    """Make `RRef.to_here()` raise `name(error, owner)` for torch's failures (once).

    torch's RRef is a C++ type that asyncrpc cannot wrap, so `to_here` of
    every RRef passes its RuntimeError through `name`, which returns an error
    that is still a RuntimeError carrying torch's text.
    """
    with _await_lock:
        if PyRRef.__dict__.get("to_here") is not _to_here:
            return

        @functools.wraps(_to_here)
        def to_here(self: Any, timeout: float = UNSET_TIMEOUT) -> Any:
            try:
                return _to_here(self, timeout)
            except RuntimeError as exc:
                named = name(exc, str(self.owner().name))
                if named is exc:
                    raise
                raise named from exc

        PyRRef.to_here = to_here  # type: ignore[method-assign]


def unname_rref_failures() -> None:
    """Put torch's own `RRef.to_here` back."""
    with _await_lock:
        PyRRef.to_here = _to_here  # type: ignore[method-assign]


# ---- naming the failures of a Future's reply -------------------------------------------

# A Python done-callback per call cost about 8% of a burst's throughput, so no
# callback names a failed call: the read does. `tag_future` notes where a
# Future's call went; torch's `wait`/`value` of a tagged Future pass a
# RuntimeError through the namer. Two ways of reading hand torch a Future
# without our tag, and are covered here too:
#   - a callback (`then`, `add_done_callback`) gets a new Python wrapper when
#     the caller kept none; the callback keeps the tagged one alive instead;
#   - `collect_all`/`wait_all` fail with the first member's error, so the
#     combined Future is tagged with its members.
_future_wait = FutureType.wait
_future_value = FutureType.value
_future_then = FutureType.then
_future_add_done_callback = FutureType.add_done_callback
_collect_all = torch._C._collect_all
_tags: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_Namer: TypeAlias = Callable[[BaseException, Any], BaseException]


def tag_future(fut: Any, tag: object) -> None:
    """Pass `tag` to the namer when reading `fut` raises torch's RuntimeError."""
    _tags[fut] = tag


def name_future_failures(name: _Namer) -> None:
    """Make reads of tagged torch Futures raise `name(error, tag)` (installed once)."""
    with _await_lock:
        if FutureType.__dict__.get("wait") is not _future_wait:
            return
        FutureType.wait = _named_read(_future_wait, name)  # type: ignore[method-assign,assignment]
        FutureType.value = _named_read(_future_value, name)  # type: ignore[method-assign,assignment]
        FutureType.then = _held(_future_then)  # type: ignore[method-assign]
        FutureType.add_done_callback = _held(_future_add_done_callback)  # type: ignore[method-assign]
        torch._C._collect_all = _tagged_collect_all


def _named_read(read: Callable[[Any], Any], name: _Namer) -> Callable[[Any], Any]:
    @functools.wraps(read)
    def named_read(self: Any) -> Any:
        if _unread:
            _mark_read(self)
        try:
            return read(self)
        except RuntimeError as exc:
            tag = _tag_of(self, exc)
            named = exc if tag is None else name(exc, tag)
            if named is exc:
                raise
            raise named from exc

    return named_read


def _tag_of(fut: Any, error: BaseException) -> Any:
    tag = _tags.get(fut)
    if not isinstance(tag, _Members):
        return tag
    for member in tag.futures:  # the member that failed with this very error
        if member in _tags and member.done():
            try:
                _future_wait(member)
            except RuntimeError as exc:
                if str(exc) == str(error):
                    return _tag_of(member, error)
    return None


def _held(add: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(add)
    def add_callback(self: Any, callback: Callable[[Any], Any]) -> Any:
        if self in _tags:
            callback = functools.partial(_call_held, callback, self)
            _mark_read(self)
        return add(self, callback)

    return add_callback


def _call_held(callback: Callable[[Any], Any], held: Any, fut: Any) -> Any:
    return callback(held)


class _Members(NamedTuple):
    futures: list[Any]


def _tagged_collect_all(futures: list[Any]) -> Any:
    combined = _collect_all(futures)
    for fut in futures if _unread else ():
        _mark_read(fut)
    if any(fut in _tags for fut in futures):
        _tags[combined] = _Members(list(futures))
    return combined


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


# ---- torchrun's rendezvous -------------------------------------------------------------


def bound_static_rendezvous(
    backend: str,
    host_store: Callable[[str, int, float], Any],
    client_store: Callable[[str, int, float], Any],
) -> type[Any]:
    """torch's static TCP rendezvous, with the store made by `host_store`/`client_store`.

    It fills torch's private `_store` slot before torch would make its own
    store (which listens on every interface).
    """
    from torch.distributed.elastic.rendezvous import RendezvousInfo
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import (
        StaticTCPRendezvous,
    )

    class BoundStaticRendezvous(StaticTCPRendezvous):
        """torch's static rendezvous, with the store bound to the master address only."""

        def get_backend(self) -> str:
            return backend

        def next_rendezvous(self) -> RendezvousInfo:
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

    return BoundStaticRendezvous


def watch_agent_failures(
    report: Callable[[Any, str, list[tuple[int, int, int]], list[int]], None],
) -> None:
    """Have torchrun's agent call `report(store, attempt, [(rank, pid, exitcode)], elsewhere)`.

    `elsewhere` lists the ranks of the world's workers on other nodes.

    The agent learns every local worker's exit (signal included) first; this
    wraps its private `_monitor_workers` so the world's store hears of it too.
    """
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    original = LocalElasticAgent._monitor_workers
    if getattr(original, "_asyncrpc", False):
        return

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
        return result

    monitor._asyncrpc = True  # type: ignore[attr-defined]
    LocalElasticAgent._monitor_workers = monitor  # type: ignore[method-assign]


# ---- awaiting torch Futures -----------------------------------------------------------

_await_lock = threading.Lock()


def install_await(method: Callable[[Any], Any]) -> bool:
    """Give torch Futures an `__await__`; False when one is already there (kept)."""
    with _await_lock:
        if hasattr(FutureType, "__await__"):
            return False
        FutureType.__await__ = method  # type: ignore[attr-defined]
        return True


def uninstall_await(method: Callable[[Any], Any]) -> None:
    """Remove the `__await__` that `install_await` put there (and only that one)."""
    with _await_lock:
        if FutureType.__dict__.get("__await__") is method:
            del FutureType.__await__  # type: ignore[attr-defined]


# ---- torch's failure texts ------------------------------------------------------------

# Each pattern is matched against the first lines of the RuntimeError that torch
# raises from wait()/to_here(); tests/test_torch_boundary.py provokes each one.
_KINDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("timeout", re.compile(r"ran for more than set timeout|timed out", re.IGNORECASE)),
    (
        "unreachable",
        re.compile(
            r"originated at tensorpipe/|Connection (reset|refused|closed)|"
            r"RPCAgent has been shutdown|pipe has been closed|end of file"
        ),
    ),
    ("unimportable", re.compile(r"No module named|Can't get attribute|can't get attribute")),
    ("unpicklable", re.compile(r"pickl", re.IGNORECASE)),
)


def failure_kind(error: BaseException) -> str | None:
    """Which torch failure `error` stands for: timeout, unreachable, unpicklable, unimportable.

    None for anything else (a remote function's own error, say).
    """
    text = str(error)[:2000]
    for kind, pattern in _KINDS:
        if pattern.search(text):
            return kind
    return None


def remote_exception_parts(value: object) -> tuple[str, type[BaseException]] | None:
    """(message, type) when `value` is torch's wire form of a remote exception."""
    if isinstance(value, RemoteException):
        return str(value.msg), value.exception_type
    return None


# ---- TorchScript's warnings and torch's inter-op pool ---------------------------------


@contextlib.contextmanager
def quiet_torchscript(show: bool = False) -> Iterator[None]:
    """Hide torch's TorchScript deprecation warnings inside the block, unless `show`."""
    if show:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.jit")
        warnings.filterwarnings("ignore", message=r".*torch\.jit.*deprecated", category=Warning)
        yield


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
