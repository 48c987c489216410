"""An object's mailbox: the order of its method calls, and how many run at once.

Every method call through a handle carries a ticket: the stream of the
handle (one per handle and worker, shared by its copies), the call's
number in it, the object's concurrency options and the call's timeout.
The owner keeps one
`Mailbox` per object, found by its RRef's id; it starts the calls of a
stream in the order they were sent, and at most a group's limit at once::

    caller                                  owner: the object's Mailbox
    h.call_async("add", 1)                  stream: is it call k's turn?
      ticket (stream, k, options) ─ rpc ──>   no: parked until k-1 has been let through
                                              yes: let through to the method's group
                                            group: fewer than its limit running?
                                              no: waits in the group's queue (first in,
                                                  first out)
                                              yes: starts; a sync method runs on this
                                                  RPC thread (on an `asyncrpc-actor` thread
                                                  when it had to wait), an `async def` on
                                                  the world's event loop
    reply  <── the call's Future ─────────  ends: the next waiting call of its group starts

Limits: a named group's own (`concurrency_groups`); in the default group,
`max_concurrency`, else 1 for sync methods and 1000 for async ones (`async
def`, or `async_execution` returning a Future), counted apart: a sync call
may run beside the object's async ones.
The common case takes a short way: a sync call whose turn it is, with
nothing parked early in its stream and a place free in its group, takes
that place (`Mailbox.take_turn`) and runs at once (`_job.run_now`), with
no Job queued. A call cancelled while it waits gives up its place at once; one cancelled
before it arrived gives up its number in the stream (`ON_SKIPPED`). A call
whose turn comes after its timeout (counted from its arrival, so its caller
has already given up on it) never starts: it gives its turn to the next.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from torch.futures import Future

from . import _cancel, _runtime, _torch
from ._execution import (
    DESCRIBE_CALL,
    ON_LOOP,
    ON_SKIPPED,
    Kind,
    cancelled_error,
    classify,
    made_early,
    outcome_of,
    runs_on_loop,
    torch_called,
)
from ._failures import Failure
from ._futures import completed, new_future
from ._job import Job, no_method, run_now
from ._objects import has_refs, resolving
from ._promised import outcome

__all__ = (
    "ASYNC_LIMIT",
    "METHOD_OPTIONS",
    "Mailboxes",
    "Options",
    "invoke",
    "method_group",
    "no_method",
    "skip_turn",
)

ASYNC_LIMIT = 1000  # calls at once on an object with async methods, by default (as Ray)
_ACTOR_THREADS = 32  # threads that run sync calls which had to wait for their turn
METHOD_OPTIONS = "__asyncrpc_method__"  # where asyncrpc.method keeps a method's options


class Options(NamedTuple):
    """An object's concurrency options, as its handles send them with each call."""

    max_concurrency: int | None = None  # None: 1, or ASYNC_LIMIT with async methods
    groups: tuple[tuple[str, int], ...] = ()


def method_group(cls: type, name: str) -> str:
    """The concurrency group of `cls.name` ("" for the default one)."""
    options = getattr(getattr(cls, name, None), METHOD_OPTIONS, None)
    group = getattr(options, "concurrency_group", None)
    return group or ""


# ---- the owner's entry: what a handle's method call runs -----------------------------


def invoke(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], ticket: list[Any],
           rref: Any) -> Future[Any]:  # fmt: skip
    """Run `obj.name(*args, **kwargs)` when the object's mailbox lets it; a Future of it.

    The RRef comes last: the caller pickles it last, after the arguments, so an
    argument that cannot be pickled fails the send before torch forks the RRef
    (a fork never sent would hold torch's shutdown until its timeout).
    """
    for_torch = torch_called()
    if has_refs(args, kwargs):
        return made_early(_deliver_resolved(name, args, kwargs, ticket, rref), for_torch)
    return made_early(_deliver(name, args, kwargs, ticket, rref), for_torch)


def _deliver(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], ticket: list[Any],
             rref: Any) -> Future[Any]:  # fmt: skip
    obj = rref.local_value()
    box = _runtime.part(Mailboxes).find(rref, obj, ticket[2])
    group = box.take_turn(name, ticket[0], ticket[1])
    if group is not None:  # the common case: a sync call whose turn it is, a place free
        return run_now(box, group, obj, name, args, kwargs)
    job = Job(box, obj, name, args, kwargs)
    patience = ticket[3]
    if patience > 0:  # counted from here: the caller's own deadline passed before it
        job.deadline = time.monotonic() + patience
    state = _cancel.current()
    # The job holds its call before it takes charge of its cancel: a cancel that came
    # first runs job.cancel inside claim, and the job must end the call then.
    job.state = state
    if state is not None and not _cancel.claim(state, job.cancel):
        job.state = None
    box.admit(job, ticket[0], ticket[1])
    return job.out


def _deliver_resolved(name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                      ticket: list[Any], rref: Any) -> Future[Any]:  # fmt: skip
    """A call whose top-level arguments hold ObjectRefs enters the mailbox once each is
    its value; its turn waits for it, and with it the calls sent after it."""
    ready = resolving(args, kwargs)
    if ready.done():
        return _deliver_ready(ready, name, ticket, rref)
    state, out = _cancel.current(), new_future()

    def deliver(_: Future[Any]) -> None:  # on the thread whose fetch ended last
        outer = _cancel.enter(state)
        try:
            inner = _deliver_ready(ready, name, ticket, rref)
        finally:
            _cancel.enter(outer)
        _torch.add_callback(inner, lambda done: out.set_result(outcome_of(done, name)))

    _torch.add_callback(ready, deliver)
    return out


def _deliver_ready(ready: Future[Any], name: str, ticket: list[Any], rref: Any) -> Future[Any]:
    value = outcome(ready)  # (args, kwargs), or the Failure of an argument
    state = _cancel.current()
    if not isinstance(value, Failure) and not (state is not None and state.cancelled):
        args, kwargs = value
        return _deliver(name, args, kwargs, ticket, rref)
    skip_turn(ticket, rref)  # it never runs: its number goes to the next call
    if state is not None and state.cancelled:
        label = f"{type(rref.local_value()).__qualname__}.{name}()"
        return completed(Failure(cancelled_error(label, before=True)))
    return completed(value)


def skip_turn(ticket: list[Any], rref: Any) -> None:
    """Its caller gave up on a call (it timed out, was cancelled, or the owner could not
    unpickle its arguments): if it has not reached the mailbox, its number is let
    through, and the call never runs should it come later; if it has, nothing changes."""
    box = _runtime.part(Mailboxes).find(rref, rref.local_value(), ticket[2])
    box.admit(None, ticket[0], ticket[1])


def _skipped(name: str, args: Any, kwargs: Any, ticket: list[Any], rref: Any) -> None:
    """A call cancelled before it arrived: its number in the stream is let through."""
    box = _runtime.part(Mailboxes).find(rref, rref.local_value(), ticket[2])
    box.admit(None, ticket[0], ticket[1])


def _describe(name: str, args: Any, kwargs: Any, ticket: list[Any], rref: Any) -> str:
    return f"{type(rref.local_value()).__qualname__}.{name}()"


def _on_loop(name: str, args: Any, kwargs: Any, ticket: list[Any], rref: Any) -> bool:
    """Asked on the owner (a call to this worker): is the method a coroutine function?"""
    method = getattr(type(rref.local_value()), name, None)
    return method is not None and runs_on_loop(method)


_torch.mark_async(invoke, invoke)
setattr(invoke, DESCRIBE_CALL, _describe)
setattr(invoke, ON_SKIPPED, _skipped)
setattr(invoke, ON_LOOP, _on_loop)


# ---- the mailboxes of this worker's objects -------------------------------------------


class Mailboxes:
    """This world's mailboxes, by RRef id, and the threads that run waiting sync calls."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.boxes: dict[int | tuple[int, int], Mailbox] = {}
        self.executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.closed = False

    def find(self, rref: Any, obj: object, options: Options) -> Mailbox:
        # By the object's id while it lives (cheap: reading an RRef's id costs a repr); an
        # object that cannot be weakly referenced, by its RRef's id.
        box = self.boxes.get(id(obj))
        if box is not None:
            return box
        with self.lock:
            key: int | tuple[int, int] = id(obj)
            try:
                weakref.finalize(obj, self.boxes.pop, key, None)
            except TypeError:  # kept, small (no reference to the object), until the world ends
                key = _torch.rref_id(rref)
            box = self.boxes.get(key)
            if box is None:
                box = self.boxes[key] = Mailbox(self, type(obj), Options(*options))
            return box

    def run_later(self, job: Job) -> None:
        try:
            self.submit(job.run)
        except RuntimeError:  # the world has ended
            job.finish(Failure(RuntimeError("the world ended before the call could start")))

    def submit(self, fn: Callable[[], Any]) -> None:
        """Run `fn()` on an `asyncrpc-actor` thread; RuntimeError once the world ended."""
        with self.lock:
            if self.executor is None:
                self.executor = concurrent.futures.ThreadPoolExecutor(
                    _ACTOR_THREADS, thread_name_prefix="asyncrpc-actor"
                )
            executor = self.executor
        executor.submit(fn)

    def close(self) -> None:
        with self.lock:
            self.closed, executor = True, self.executor
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)


class _Order:
    """One stream's place: the number of the call to let through next, and those early."""

    __slots__ = ("early", "next")

    def __init__(self) -> None:
        self.next = 0
        self.early: dict[int, Job | None] = {}


class _Group:
    __slots__ = ("limit", "running", "waiting")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.running = 0
        self.waiting: collections.deque[Job] = collections.deque()


class Mailbox:
    """One object's calls: the order of each stream, each group's running and waiting."""

    def __init__(self, boxes: Mailboxes, cls: type, options: Options) -> None:
        self.boxes = boxes
        self.lock = threading.Lock()
        self.max_concurrency = options.max_concurrency
        self.limits = dict(options.groups)
        self.cls = cls
        self.streams: dict[int, _Order] = {}
        self.groups: dict[tuple[str, bool], _Group] = {}
        self.kinds: dict[str, tuple[tuple[str, bool], bool]] = {}  # method -> _group_of
        self.pending: collections.deque[Job] = collections.deque()  # let through, to start
        self.handing_on = False

    def admit(self, job: Job | None, stream: int, number: int) -> None:
        """Take a call (None: a skipped number), and start what may start now."""
        with self.lock:
            gone = job is not None and self._turn_gone(stream, number)
            through = [] if gone else self._let_through(job, stream, number)
            start = [j for j in through if self._take_place(j)]
            # A sync call that brought the turn runs on its own RPC thread, after the
            # others let through with it have been handed on (it may take long).
            here = None
            if start and start[0] is job and not job.is_async and _torch.is_rpc_thread():
                here = start.pop(0)
            self.pending.extend(start)
        if gone and job is not None:  # its caller gave up on it, and its turn went on
            job.finish(Failure(cancelled_error(job.label, before=True)))
        self._hand_on()
        if here is not None:
            here.run()

    def _hand_on(self) -> None:
        """Start the calls let through, in the order they were let through, whichever
        threads let them through: one thread at a time hands them on."""
        with self.lock:
            if self.handing_on:
                return  # the thread that is handing on takes these too
            self.handing_on = True
        while True:
            with self.lock:
                if not self.pending:
                    self.handing_on = False
                    return
                ready = self.pending.popleft()
            self._start(ready, here=False)

    def take_turn(self, name: str, stream: int, number: int) -> tuple[str, bool] | None:
        """A sync call whose turn it is, its group's place free and nothing early: its
        place is taken now, and its group returned (None: the call goes the way of jobs)."""
        with self.lock:
            group_key, is_async = self._group_of(name)
            group = self.groups.get(group_key)
            if is_async or group is None or group.running >= group.limit:
                return None
            if stream:
                order = self.streams.get(stream)
                if order is None:
                    order = self.streams[stream] = _Order()
                if number != order.next or order.early:
                    return None
                order.next += 1
            group.running += 1
            return group_key

    def done(self, job: Job) -> None:
        """`job` has ended: its group's next waiting calls start."""
        self.free(job.group)

    def free(self, group_key: tuple[str, bool]) -> None:
        """A call of the group has ended: the group's next waiting calls start."""
        with self.lock:
            group = self.groups[group_key]
            group.running -= 1
            while group.waiting and group.running < group.limit:
                waiting = group.waiting.popleft()
                if not waiting.ended:
                    group.running += 1
                    waiting.placed = True
                    self.pending.append(waiting)
        self._hand_on()

    def _let_through(self, job: Job | None, stream: int, number: int) -> list[Job]:
        if stream == 0:  # a caller that keeps no order
            return [job] if job is not None else []
        order = self.streams.get(stream)
        if order is None:
            order = self.streams[stream] = _Order()
        if number != order.next:
            if job is not None or (number > order.next and number not in order.early):
                order.early[number] = job  # a skip of a number let through, or here: nothing
            return []
        through = [job] if job is not None else []
        order.next += 1
        while order.next in order.early:
            early = order.early.pop(order.next)
            order.next += 1
            if early is not None:
                through.append(early)
        return through

    def _turn_gone(self, stream: int, number: int) -> bool:
        """Whether call `number` of `stream` comes after its turn was given away (its
        caller gave up on it first: `skip_turn`)."""
        order = self.streams.get(stream) if stream else None
        if order is None:
            return False
        return number < order.next or (number in order.early and order.early[number] is None)

    def _take_place(self, job: Job) -> bool:
        job.group, job.is_async = self._group_of(job.name)
        group = self.groups.get(job.group)
        if group is None:
            group = self.groups[job.group] = _Group(self._limit(*job.group))
        if job.ended:
            return False  # cancelled while it waited for its turn
        if group.running < group.limit:
            group.running += 1
            job.placed = True
            return True
        group.waiting.append(job)
        return False

    def _group_of(self, name: str) -> tuple[tuple[str, bool], bool]:
        """((group, async?), async?): the default group counts sync and async calls apart."""
        found = self.kinds.get(name)
        if found is None:
            is_async = _is_async_method(getattr(self.cls, name, None))
            group = method_group(self.cls, name)
            found = self.kinds[name] = ((group, is_async and not group), is_async)
        return found

    def _limit(self, group: str, is_async: bool) -> int:
        if group:
            return self.limits.get(group, self.max_concurrency or 1)
        return self.max_concurrency or (ASYNC_LIMIT if is_async else 1)

    def _start(self, job: Job, here: bool) -> None:
        if here or job.is_async:  # an async method only starts (its Task, its Future)
            job.run()
        else:
            self.boxes.run_later(job)


def _is_async_method(attr: object) -> bool:
    """Whether `attr` runs without holding a thread: an `async def`, or async_execution."""
    return attr is not None and classify(attr) is Kind.ASYNC
