"""The one call path: torch's `rpc_sync`, `rpc_async` and `remote`, same signatures.

These three, every handle verb, `call_all`, `Batch` and the Ensemble's
shards all go through `check` and `send`, and read their reply through one
step, so a mistake, a dead worker, a timeout or a remote exception is
reported the same way whichever verb made the call::

    caller                                            callee
    check: a world runs, `to` is known, func callable,
           args a tuple, kwargs a dict, timeout >= 0
    outgoing hook (the trace's; one global read when off)
    classify(func): a Python function goes inside   ─> run_python / run_python_async:
      a runner (torch operators and TorchScript go     runs func; an exception is
      as they are)                                     returned as a Failure value
    torch's rpc_async / remote
    reply read: wait(), value(), await, to_here() <──
      a Failure ─> raised (its own type, and RemoteError)
      torch's RuntimeError ─> CallTimeoutError, WorkerUnreachableError,
                              SerializationError, naming the worker
    rpc_sync from an RPC thread: refused when it would take the last free one

Where the reply is read, and a failure named, depends on the verb (the
table in docs/design.md, "A call, end to end"); all three name through
`_failures.name_failure`, so a failure reads the same whichever verb met it:

- `rpc_async` (`send`): the Future returned is asyncrpc's own, which one
  callback per call (`_reply.Reply`, on torch's Future) settles with the
  reply, naming a failure there, unless a cancel came first;
- `rpc_sync` (`call_sync`): waits on torch's own Future (nothing can cancel
  it), tagged with the call's `Sent`; torch's patched `wait` unwraps a
  Failure (`check_reply`) and names torch's failures (`_hooks`, `name_read`);
- `remote` (`send_remote`): torch's RRef; its patched `to_here` names them
  (`_hooks`, `name_rref`: a dead owner is `ObjectLostError`).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, TypeAlias, TypeVar, overload

import torch.distributed.rpc as rpc
from torch.futures import Future

from . import _activity, _hang, _loop, _runtime, _torch, _world
from ._cancel import KEY_BITS, Sent, new_key
from ._errors import NestedCallError, UnknownWorkerError
from ._execution import Kind, classify, run_python, run_python_async, run_resolved, runs_on_loop
from ._failures import check_reply, label_of, raise_unsendable
from ._futures import check_seconds
from ._objects import has_refs
from ._promised import lend, release, release_after
from ._reply import Reply
from ._torch import WorkerInfo
from ._unwaited import unwaited_logging, watch_unwaited

__all__ = [
    "Call",
    "call_sync",
    "check",
    "check_timeout",
    "holding_rpc_thread",
    "remote",
    "rpc_async",
    "rpc_sync",
    "seconds_of",
    "send",
    "send_remote",
    "set_outgoing_hook",
]

T = TypeVar("T")
Target: TypeAlias = str | int | WorkerInfo
UNSET_RPC_TIMEOUT = _torch.UNSET_TIMEOUT


class Call(NamedTuple):
    """One checked call: where it goes, what runs there, and how errors name it."""

    worker: str  # the name of `to`
    to: Target
    func: Callable[..., Any]
    args: Sequence[Any] | None
    kwargs: Mapping[str, Any] | None
    seconds: float  # the timeout in torch's terms (-1: the world's default)
    label: object  # the function, or a text such as "Counter.add()"
    sent: Sent  # where it goes and its key: its Future's tag (naming, cancel)
    hang_after: float | None = None  # report it if still pending then (_hang)
    lent: tuple[int, ...] = ()  # Futures passed in its arguments, kept until it replies


# ---- the public verbs -----------------------------------------------------------------


@overload
def rpc_sync(
    to: Target,
    func: Callable[..., Coroutine[Any, Any, T]],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> T: ...
@overload
def rpc_sync(
    to: Target,
    func: Callable[..., T],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> T: ...
def rpc_sync(
    to: Target,
    func: Callable[..., Any],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Any:
    """Run `func(*args, **kwargs)` on worker `to` and return its result (torch's signature).

    Example::

        total = asyncrpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
    """
    return call_sync(check("rpc_sync", to, func, args, kwargs, timeout))


@overload
def rpc_async(
    to: Target,
    func: Callable[..., Coroutine[Any, Any, T]],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Future[T]: ...
@overload
def rpc_async(
    to: Target,
    func: Callable[..., T],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Future[T]: ...
def rpc_async(
    to: Target,
    func: Callable[..., Any],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Future[Any]:
    """Start `func(*args, **kwargs)` on worker `to`; a Future of its result (torch's signature).

    Example::

        fut = asyncrpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 1))
        print(fut.wait())
    """
    fut = send(check("rpc_async", to, func, args, kwargs, timeout))
    _torch.collect_for_wait_all(fut)  # as torch's rpc_async does, inside rpc._wait_all()
    return fut


def remote(
    to: Target,
    func: Callable[..., T],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> rpc.RRef[T]:
    """Run `func(*args, **kwargs)` on `to` and keep the result there: torch's `remote`.

    Returns torch's RRef, for a function and a class alike (to build an
    object and call its methods, `asyncrpc.spawn` gives a handle instead).

    Example::

        rref = asyncrpc.remote("worker1", torch.zeros, args=((3,),))
        print(rref.to_here())  # tensor([0., 0., 0.])
    """
    return send_remote(check("remote", to, func, args, kwargs, timeout))


# ---- checks ---------------------------------------------------------------------------


def check(
    verb: str,
    to: Any,
    func: Any,
    args: Any,
    kwargs: Any,
    timeout: float | None,
    label: object = None,
    continuing: bool = False,
    lent: tuple[int, ...] = (),
) -> Call:
    """Validate one call before anything is sent; `label` names it in errors (default: func).

    `continuing`: a call that goes on with one already running (a stream's next
    pull or its close), which a worker being removed still takes until it has left.
    A top-level Future in `args` or `kwargs` goes as its value or a `Promised`
    (`_promised.lend`); `lent`: those lent already (a handle's method arguments).
    """
    world = _world.running() or _world.current_world(f"asyncrpc.{verb}")
    # A world that heals or grows: members added since this one started count too.
    names = world.context.names if world.members is None else world.members.names
    worker = _worker_name(verb, to, names)
    if world.members is not None:  # a world that heals: `worker` may be being replaced
        world.members.check_call(worker, continuing)
    if world.infos or _torch.agent_running():  # peers may call before the agent is set
        to = world.info(worker)
    if not callable(func):
        raise TypeError(
            f"{verb}: got a {type(func).__name__} where a callable was expected; pass the "
            f"function itself: {verb}(to, f, args=(x,)) rather than {verb}(to, f(x))"
        )
    if args is not None and not isinstance(args, (tuple, list)):
        raise TypeError(
            f"{verb}: args must be a tuple, got {type(args).__name__} {args!r:.60}; "
            f"for one argument write args=(x,)"
        )
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"{verb}: kwargs must be a dict, got {type(kwargs).__name__}")
    seconds = check_timeout(verb, timeout)
    label = func if label is None else label
    callee = int(to.id) if isinstance(to, WorkerInfo) else names.index(worker)
    caller = world.key_rank if world.key_rank >= 0 else world.context.rank  # torch's id
    sent = Sent(worker, label, callee, new_key(caller))
    args, kwargs, more = lend(args, kwargs)
    return Call(worker, to, func, args, kwargs, seconds, label, sent, world.hang_after,
                lent + more)  # fmt: skip


def _worker_name(verb: str, to: object, names: Sequence[str]) -> str:
    if isinstance(to, str):
        if to not in names:
            close = difflib.get_close_matches(to, names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UnknownWorkerError(
                f"{verb}: no worker is named {to!r}; {hint}this world has {list(names)}"
            )
        return to
    if isinstance(to, int) and not isinstance(to, bool):
        if not 0 <= to < len(names):
            raise UnknownWorkerError(
                f"{verb}: no worker has rank {to}; ranks run from 0 to {len(names) - 1}"
            )
        return names[to]
    if isinstance(to, WorkerInfo):  # a replacement's is "name:<torch id>" (_membership)
        return _worker_name(verb, str(to.name).split(":", 1)[0], names)
    raise ValueError(  # torch's own type here
        f"{verb}: 'to' must be a worker name, rank or WorkerInfo, got "
        f"{type(to).__name__} {to!r:.60}; e.g. to='worker1' or to=1"
    )


def check_timeout(verb: str, timeout: float | None) -> float:
    """A timeout in torch's terms: torch's -1 (or None) means the world's default."""
    if timeout is None or timeout == UNSET_RPC_TIMEOUT:
        return UNSET_RPC_TIMEOUT
    return check_seconds(verb, timeout, hint=" (0: no timeout; -1: the world's default)")


def seconds_of(timeout: float) -> float:
    """A timeout in torch's terms as seconds: -1 is the world's default, 0 none."""
    return _torch.default_timeout() if timeout < 0 else timeout


# ---- sending and reading the reply ----------------------------------------------------


def send(call: Call, cancellable: bool = True) -> Future[Any]:
    """torch's rpc_async for a checked call; the reply reads as the module doc says.

    The Future is asyncrpc's own (`_reply`), settled by one callback on
    torch's (named and counted there), which a cancel can fail at once; with
    `cancellable=False` (rpc_sync: nobody can cancel it) torch's own, tagged,
    named as it is read and counted by `call_sync`.
    """
    fut, traced, replied = _dispatch(call, remote=False)
    if cancellable:
        # torch's operators run without a cancel key: a cancel fails the Future only.
        reply = Reply(call.sent if not traced else call.sent._replace(key=0))
        out = reply.future  # tagged with the Reply; taken first: the reply may be in already
        if call.hang_after:
            _hang.watch(reply, call.hang_after, _world.side_queues())
        _torch.add_callback(fut, reply)
        fut = out
        if _needs_own_loop(call):  # read blocking on this worker's loop: it would never end
            _torch.guard_reads(out, functools.partial(_refuse_on_loop, call), blocking_only=True)
    else:
        _torch.set_unwrap(fut, check_reply)
        _torch.tag_future(fut, call.sent)
        _watched(call, fut, None)
    if replied is not None:
        fut.add_done_callback(replied)
    if call.lent:  # read by the callee once it replied; or given up: cancelled, timed out
        release_after(fut, call.lent)
    if unwaited_logging():
        watch_unwaited(fut, call.worker, call.label)
    return fut  # type: ignore[no-any-return]


def send_remote(call: Call) -> rpc.RRef[Any]:
    """torch's remote for a checked call; the owner keeps the value (or the Failure)."""
    rref, _, replied = _dispatch(call, remote=True)
    _watched(call, _torch.rref_future(rref), replied)
    if call.lent:
        release_after(_torch.rref_future(rref), call.lent)
    return rref  # type: ignore[no-any-return]


def call_sync(call: Call, sending: AbstractContextManager[None] | None = None) -> Any:
    """`send` and wait for the reply, refusing to block the last free RPC thread.

    `sending`: held while the call is sent, not while its reply is waited for.
    """
    _refuse_waiting_for_own_loop(call)
    with holding_rpc_thread(call.worker, call.label):
        outgoing = _activity.sent(call.worker, call.label, call.sent.key)
        failed = True
        try:
            with sending if sending is not None else contextlib.nullcontext():
                fut = send(call, cancellable=False)
            value = fut.wait()
            failed = False
            return value
        finally:
            _activity.ended(outgoing, failed)


def _dispatch(call: Call, remote: bool) -> tuple[Any, bool, Callable[[Any], None] | None]:
    """The one way a call leaves: (torch's Future or RRef, sent as torch sends it?, on_reply).

    The trace's hook swaps the function (and gives `on_reply`), the runner
    wraps it by its kind, and in a world that heals its RRefs cross as
    `_forks` says (those sent by id live until the reply).
    """
    traced, replied = _traced(call.worker, call.func)
    func, args, kwargs = _wrapped(call.func, traced, call.args, call.kwargs, call.sent.key)
    try:
        healing = _healing(call)
        if healing is None:
            out = _send_now(call, func, args, kwargs, remote)
        else:
            with _torch.sending_to(healing) as keep:
                out = _send_now(call, func, args, kwargs, remote)
            _torch.keep_until_done(_torch.rref_future(out) if remote else out, keep)
    except Exception as exc:
        release(call.lent)
        raise_unsendable(exc, call.worker, call.label)
    if remote and healing is not None:  # `_forks` may send it on before its owner confirmed it
        _torch.note_kind(out, _torch.PY_OBJECT if func in _RUNNERS else _torch.PENDING)
    return out, func is traced, replied


def _healing(call: Call) -> int | None:
    """The callee's torch id in a world that heals (see `_forks`), else None."""
    world = _world.running()
    if world is None or world.members is None or not isinstance(call.to, WorkerInfo):
        return None
    return int(call.to.id)


def _send_now(call: Call, func: Any, args: Any, kwargs: Any, remote: bool) -> Any:
    if remote:
        return _torch.remote(call.to, func, args=args, kwargs=kwargs, timeout=call.seconds)
    if kwargs is None and isinstance(call.to, WorkerInfo) and func in _RUNNERS:
        is_async = func is not run_python
        return _torch.send_python(call.to, func, args or (), {}, call.seconds, is_async)
    return _torch.send_torch(call.to, func, args, kwargs, call.seconds)


def _watched(call: Call, fut: Future[Any], replied: Callable[[Any], None] | None) -> None:
    """A call read through torch's own Future (rpc_sync, remote): on_reply, hang watch."""
    if replied is not None:
        fut.add_done_callback(replied)
    if call.hang_after:
        queues = _world.side_queues()
        _hang.watch_future(fut, call.worker, call.label, call.sent.key, call.hang_after, queues)


# While a trace records (asyncrpc._trace), it swaps each outgoing function for a
# recording one and gets a callback for the reply; the core knows only this hook.
OutgoingHook: TypeAlias = Callable[
    [str, Callable[..., Any]], tuple[Callable[..., Any], Callable[[Any], None] | None]
]


class Outgoing:
    """This world's outgoing calls' state (a part of `_runtime`): the trace's hook, nested waits.

    `outgoing`: while a trace records, every call passes through it.
    `blocked`: how many of this process's RPC threads wait in a nested blocking call.
    """

    def __init__(self) -> None:
        self.outgoing: OutgoingHook | None = None
        self.lock = threading.Lock()
        self.blocked = 0


def set_outgoing_hook(hook: OutgoingHook | None) -> None:
    """Have every call pass through `hook(worker, func) -> (sent, on_reply)`; None: off."""
    _runtime.part(Outgoing).outgoing = hook


def _traced(worker: str, func: Callable[..., Any]) -> tuple[Callable[..., Any], Any]:
    hook = _runtime.part(Outgoing).outgoing
    if hook is None:
        return func, None  # the common case costs one lookup
    return hook(worker, func)


_RUNNERS = (run_python, run_python_async, run_resolved)


def _wrapped(
    func: Callable[..., Any],
    traced: Callable[..., Any],
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    key: int,
) -> tuple[Callable[..., Any], tuple[Any, ...] | None, Mapping[str, Any] | None]:
    """What to send: `traced` inside its runner, or as torch sends it (by `func`'s kind)."""
    kind = classify(func)
    args = None if args is None else tuple(args)
    if has_refs(args, kwargs):  # each arrives as its value (Ray's rule: top level only)
        return run_resolved, (traced, args or (), dict(kwargs or {}), key), None
    if kind is Kind.TORCH:
        return traced, args, kwargs
    runner = run_python_async if kind is Kind.ASYNC else run_python
    return runner, (traced, args or (), dict(kwargs or {}), key), None


# ---- blocking calls from RPC threads and from the event loop ---------------------------


def _refuse_waiting_for_own_loop(call: Call) -> None:
    """A coroutine that waits, blocking, for a coroutine of its own worker waits forever.

    Both need the worker's one event loop, which the waiting one holds; without
    this the call would only end at its timeout.
    """
    if _loop.in_loop() and _needs_own_loop(call):
        _refuse_on_loop(call)


def _needs_own_loop(call: Call) -> bool:
    """A call to this worker that runs as a coroutine on its event loop."""
    return call.sent.callee == call.sent.key >> KEY_BITS and runs_on_loop(call.func, call.args)


def _refuse_on_loop(call: Call) -> None:
    """The guard of such a call's Future: a blocking read of it on the loop would not end."""
    if _loop.in_loop():
        raise NestedCallError(
            f"a blocking call of {label_of(call.label)} on {call.worker!r}, this worker, from "
            "inside a coroutine would wait forever: both need this worker's event loop, which "
            "the waiting coroutine holds; write `await` (await asyncrpc.rpc_async(...), "
            "await handle.call_async(...)) instead of the blocking call"
        )


class holding_rpc_thread:
    """Count a blocking wait made on an RPC thread; refuse the one that takes the last."""

    def __init__(self, worker: str, label: object) -> None:
        self.nested = _torch.is_rpc_thread()
        self.worker, self.label = worker, label
        self.sending: Outgoing | None = None

    def __enter__(self) -> None:
        if not self.nested:
            return
        limit = _world.current_world("rpc_sync").threads - 1
        sending = self.sending = _runtime.part(Outgoing)
        with sending.lock:
            if sending.blocked >= limit:
                raise NestedCallError(
                    f"rpc_sync of {label_of(self.label)} to {self.worker!r} from inside an RPC "
                    f"would block the last free RPC thread of this worker ({limit} of "
                    f"{limit + 1} already wait in nested rpc_sync calls), and the worker would "
                    "stall until they time out; make the function @asyncrpc.async_execution "
                    "and return or await rpc_async(...) instead of calling rpc_sync"
                )
            sending.blocked += 1

    def __exit__(self, *exc: object) -> None:
        if self.nested:  # the part counted in: a world may end meanwhile
            sending = self.sending
            assert sending is not None
            with sending.lock:
                sending.blocked -= 1
