"""`Batch`: many small calls to one worker, sent as one message.

Each call costs one message and one reply, whatever it carries; for tiny
calls that per-message cost is nearly all of it. A Batch collects calls and
sends, per worker, one call of `run_batch` carrying them all; the callee runs
them in order and returns one outcome per call, which the caller hands to
each call's own Future::

    caller                                           callee (worker1)
    batch.rpc_async("worker1", f, args=(1,)) -> fut0
    batch.rpc_async("worker1", g, args=(2,)) -> fut1
    batch.send()  (or leaving `with`)
      one call through the one call path ──────────> run_batch([(f, (1,)), (g, (2,))])
                                                       f(1) -> value
                                                       g(2) raises -> Failure
    reply [value, Failure] <────────────────────────
      fut0 <- value; fut1 <- g's exception (its own type, RemoteError)
    a failed message (dead worker, timeout) fails every call's Future, named

Each call is checked as `rpc_async` checks it, before anything is sent.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch
from torch.futures import Future

from ._core import _calls, _torch, _watcher
from ._core._errors import BatchNotSentError, CancelledError, WorkerUnreachableError
from ._core._execution import Kind, classify, run_python, run_python_async, run_resolved
from ._core._failures import Failure, hold, label_of
from ._core._futures import Settle, completed, failed
from ._core._objects import has_refs
from ._core._promised import Promised, release_after

__all__ = ("Batch", "run_batch")

_Entry = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], int]  # func, args, kw, key
_Pending = dict[str, list[tuple[_Entry, Settle]]]


class _Outbox:
    """One filling of a Batch: its calls, and whether they have left."""

    __slots__ = ("pending", "sent")

    def __init__(self) -> None:
        self.pending: _Pending = {}
        self.sent = False

    def __call__(self) -> None:
        """Refuse a read that would wait for a call this Batch has not sent (its guard)."""
        if not self.sent:
            raise BatchNotSentError(
                "this call is in a Batch that has not been sent, so its Future cannot "
                "complete; read it after the `with asyncrpc.Batch()` block, or call "
                "batch.send() first"
            )

    def drop(self) -> None:
        """The Batch was collected: fail what it never sent."""
        error = BatchNotSentError(
            "this call's Batch was dropped before it was sent; leave the `with "
            "asyncrpc.Batch()` block or call batch.send() while the Batch is alive"
        )
        for items in self.pending.values():
            _fail_all(items, error)
        self.pending.clear()


class Batch:
    """Collect calls, then send them as one message per worker.

    Calls that return at once (small pure functions, getters) gain the most:
    1000 calls in one Batch take a few messages' time instead of 1000. Each
    call keeps its own result and error; a lost worker or a timeout fails
    every call of its message. `timeout` bounds each message, as torch's
    `timeout` bounds a call (-1: the world's default, 0: none). Reading a
    call's Future before the Batch is sent raises `BatchNotSentError` at once
    (`wait`, `value`, `await`, `torch.futures.wait_all`, asyncrpc's
    combinators); so does a Batch dropped unsent, for each of its calls.

    Example::

        with asyncrpc.Batch() as batch:
            futs = [batch.rpc_async("worker1", torch.add, args=(x, i)) for i in range(1000)]
        values = torch.futures.wait_all(futs)
    """

    def __init__(self, timeout: float = _calls.UNSET_RPC_TIMEOUT) -> None:
        self._timeout = _calls.check_timeout("Batch", timeout)
        self._lock = threading.Lock()
        # The filling being collected; a finalizer fails its calls if the Batch is
        # dropped unsent (it holds this list, not the Batch).
        self._box = [_Outbox()]
        weakref.finalize(self, _drop, self._box)

    def rpc_async(
        self,
        to: Any,
        func: Callable[..., Any],
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> Future[Any]:
        """Add `func(*args, **kwargs)` on worker `to`; a Future of its result, set once sent.

        A call to a worker that cannot be reached now (it is being replaced)
        gets a Future failed with that `WorkerUnreachableError`; the Batch's
        other calls go as usual.
        """
        try:
            call = _calls.check("Batch.rpc_async", to, func, args, kwargs, self._timeout)
        except WorkerUnreachableError as unreachable:  # a death's: this call only
            return failed(unreachable)
        entry = (call.func, tuple(call.args or ()), dict(call.kwargs or {}), call.sent.key)
        settle = Settle()
        fut = settle.future
        if call.lent:  # Futures passed in its arguments: kept until it has its outcome
            release_after(fut, call.lent)
        # A call: named, ends wait_all early, cancellable (before the send it is taken
        # out of the message; after, it fails at once and its callee is asked to stop).
        _torch.tag_future(fut, call.sent)
        with self._lock:
            outbox = self._box[0]
            _torch.guard_reads(fut, outbox)
            outbox.pending.setdefault(call.worker, []).append((entry, settle))
        canceller = _Canceller(self._box, self._lock, weakref.ref(settle), call)
        _torch.set_canceller(fut, canceller)
        return fut

    def send(self) -> None:
        """Send what was added, one message per worker; a Batch can be filled and sent again.

        A message whose worker cannot be reached (it died, or is being
        replaced) fails its own calls with that `WorkerUnreachableError`, and
        the others are sent. If a message cannot be sent for another reason
        (an argument that cannot be pickled), its calls and those of the
        messages not yet sent fail, and the error is raised.
        """
        left = list(self._take().items())
        while left:
            worker, items = left.pop(0)
            try:
                label = f"a Batch of {len(items)} calls"
                entries = [entry for entry, _ in items]
                call = _calls.check("Batch.send", worker, run_batch, (entries,), None,
                                    self._timeout, label)  # fmt: skip
                reply = _calls.send(call)
            except WorkerUnreachableError as exc:  # that worker's calls only: a death's
                _fail_all(items, exc)
                continue
            except BaseException as exc:
                _fail_all(items, exc)
                unsent = BatchNotSentError("not sent: another message of this Batch failed")
                unsent.__cause__ = exc
                for _, rest in left:
                    _fail_all(rest, unsent)
                raise
            reply.add_done_callback(lambda r, items=items: _hand_out(r, items))  # type: ignore[misc]

    def __enter__(self) -> Batch:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if error is None:
            self.send()
            return
        unsent = BatchNotSentError(
            "this call was not sent: the `with asyncrpc.Batch()` block raised"
        )
        unsent.__cause__ = error
        for items in self._take().values():
            _fail_all(items, unsent)

    def _take(self) -> _Pending:
        with self._lock:
            outbox, self._box[0] = self._box[0], _Outbox()
            outbox.sent = True
            # The outbox lives on in its calls' guards: it must not hold their Futures.
            pending, outbox.pending = outbox.pending, {}
        return pending


class _Canceller:
    """Cancels one Batch call: out of its message if unsent, else failed now, callee told.

    Holds the call's Settle weakly: the Future's canceller must not keep it alive.
    """

    __slots__ = ("box", "label", "lock", "sent", "settle", "worker")

    def __init__(
        self,
        box: list[_Outbox],
        lock: threading.Lock,
        settle: weakref.ref[Settle],
        call: _calls.Call,
    ) -> None:
        self.box, self.lock, self.settle = box, lock, settle
        self.worker, self.sent = call.worker, call.sent  # not the call: it holds the args
        self.label = label_of(call.label)

    def __call__(self) -> bool:
        settle = self.settle()
        if settle is None or settle.future.done():
            return False
        with self.lock:
            items = self.box[0].pending.get(self.worker, [])
            taken = [item for item in items if item[1] is settle]
            for item in taken:
                items.remove(item)
        what = f"the call to {self.label} on worker {self.worker!r} was cancelled"
        if taken:
            unsent = f"{what} before it started: its Batch had not sent it"
            return settle.reject(CancelledError(unsent, self.worker))
        if not settle.reject(CancelledError(what, self.worker)):
            return False  # its outcome arrived first
        _watcher.request(self.sent)  # sent already: its callee stops it
        return True


def _drop(box: list[_Outbox]) -> None:
    box[0].drop()


def _hand_out(reply: Future[Any], items: list[tuple[_Entry, Settle]]) -> None:
    try:
        outcomes = reply.value()
    except BaseException as exc:  # the message failed: every call in it did
        _fail_all(items, exc)
        return
    for (_, settle), outcome in zip(items, outcomes, strict=True):
        settle.resolve(outcome)  # a Failure raises its call's own error when read


def _fail_all(items: list[tuple[_Entry, Settle]], error: BaseException) -> None:
    for _, settle in items:
        settle.reject(error)  # a detached copy each: `error` may still be propagating


# ---- the callee's side ----------------------------------------------------------------


def run_batch(entries: list[_Entry]) -> Future[list[Any]]:
    """Run each call in order on the callee; one outcome per call (a Failure for an error).

    async_execution functions run as they do alone; the reply waits for their Futures.
    """
    outcomes: list[Any] = []
    waiting: list[int] = []
    ended: dict[int, Any] = {}  # the outcomes of this message's sync calls, by key
    for func, args, kwargs, key in entries:
        if ended and has_refs(args, kwargs):
            args, kwargs, failed = _ended_here(args, kwargs, ended)
            if failed is not None:  # a Future of a call before it failed: it does not run
                outcomes.append(failed)
                continue
        if has_refs(args, kwargs):  # each arrives as its value, as for a call alone
            waiting.append(len(outcomes))
            outcomes.append(run_resolved(func, args, kwargs, key))
        elif classify(func) is Kind.ASYNC:
            waiting.append(len(outcomes))
            outcomes.append(run_python_async(func, args, kwargs, key))
        else:
            outcomes.append(ended.setdefault(key, run_python(func, args, kwargs, key)))
    if not waiting:
        return completed(outcomes)

    def fill(_: object) -> list[Any]:
        for i in waiting:
            outcomes[i] = _outcome(outcomes[i])
        return outcomes

    return torch.futures.collect_all([outcomes[i] for i in waiting]).then(fill)


def _ended_here(args: tuple[Any, ...], kwargs: dict[str, Any],
                ended: dict[int, Any]) -> tuple[Any, Any, Any]:  # fmt: skip
    """Futures passed of calls of this same message that ended: their outcomes (their
    worker runs them no more, and their caller has none until this message replies)."""
    me = _torch.own_name()

    def swap(value: Any) -> Any:
        if isinstance(value, Promised) and value.worker == me and value.key in ended:
            return ended[value.key]
        return value

    args = tuple(swap(a) for a in args)
    kwargs = {k: swap(v) for k, v in kwargs.items()}
    failed = next((v for v in (*args, *kwargs.values()) if type(v) is Failure), None)
    return args, kwargs, failed


def _outcome(fut: Future[Any]) -> Any:
    """A done Future's value, or its failure as a Failure value."""
    try:
        return fut.wait()
    except Exception as exc:
        return hold(exc)


_torch.mark_async(run_batch, run_batch)
