"""Cancelling calls: the caller's request, the callee's record of the calls it runs.

A cancel must reach a callee whose RPC threads may all be busy (the call to
stop may itself wait in torch's queue behind them), so it does not travel as
an RPC: it goes through the world's side channel, a queue per worker in the
store the world was formed with, which a watcher thread on each worker
(`_watcher`), blocked on that store, takes at once::

    caller                        world's store                      callee
    fut.cancel()
      add  queue/{callee}/n    ──> n
      set  queue/{callee}/{n}  ──> "{key}"  ── wakes ──> watcher: deliver(key)
                                                           running?   mark it cancelled; an
                                                                      async def gets CancelledError
                                                                      at its await and cancels
                                                                      what it awaits (the next hop)
                                                           not yet?   a tombstone: it never starts
    <──────────── the call's reply: CancelledError ──────────── (its own Future fails) ──

Every call asyncrpc sends carries a key, ``caller rank << 40 | number``. A
sync function cannot be stopped from outside: it can poll `cancelled()`;
whatever it returns, a cancelled call's reply is a CancelledError.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from torch.futures import Future

from . import _runtime, _torch
from ._errors import CancelledError
from ._failures import hold
from ._futures import new_future

__all__ = (
    "KEY_BITS",
    "Calls",
    "Running",
    "Sent",
    "begin",
    "bookkeeping",
    "cancel",
    "cancelled",
    "cancelled_running",
    "claim",
    "current",
    "deliver",
    "end",
    "enter",
    "hand_over",
    "new_key",
    "running_calls",
    "taker",
)

TOMBSTONE_S = 120.0  # how long a cancel waits for a call that has not started yet
TOMBSTONES_MAX = 65_536  # the most kept at once: the oldest go first
ENDED_KEPT = 4_096  # calls that ended lately: a cancel racing their reply finds them
KEY_BITS = 40  # a call's key: caller rank << KEY_BITS | number


class Sent(NamedTuple):
    """Where a call went (its Future's tag): names its failures, addresses its cancel."""

    worker: str
    label: object
    callee: int  # rank
    key: int  # caller rank << 40 | number


def new_key(caller_rank: int) -> int:
    """A key for the next call this process sends."""
    return (caller_rank << KEY_BITS) | next(_runtime.part(Calls).numbers)


# ---- the caller's side -----------------------------------------------------------------


def cancel(fut: Any) -> bool:
    """Cancel the call behind `fut`; False when it has finished or cannot be cancelled.

    Works on the Futures of `rpc_async`, a handle's `call_async`, `Batch`,
    `call_all`, `gather`, an Ensemble's `call_async`, and a local `async def`
    run by asyncrpc; `fut.cancel()` is the same. The callee stops the call
    (an `async def` at its current `await`, and what it awaits in turn; a
    call not started yet never starts; a sync function may poll
    `asyncrpc.cancelled()`), and `fut` fails with `asyncrpc.CancelledError`.

    Example::

        fut = asyncrpc.rpc_async("worker1", rollout, args=(policy,))
        if asyncrpc.cancel(fut):
            ...  # fut.wait() raises asyncrpc.CancelledError
    """
    if not isinstance(fut, _torch.FutureType):
        raise TypeError(
            f"cancel takes a Future (what rpc_async returns), got {type(fut).__name__} {fut!r:.60}"
        )
    return _torch.cancel(fut)


# ---- the callee's side: calls running here, and cancels that came first ----------------


class Running:
    """One call this worker runs: whether it was cancelled, and how to stop it.

    Also what `asyncrpc-dump` shows of it: what runs (`call`: the function and
    its arguments, named when read), since when, on which thread (None while
    an async call waits at an `await`), and its coroutine if it has one, or
    the thread that does its work without holding an RPC thread (`worker`:
    a stream's generator runs on a thread of its own).
    """

    __slots__ = (
        "call",
        "cancelled",
        "coro",
        "key",
        "on_cancel",
        "started",
        "takers",
        "thread",
        "worker",
    )

    def __init__(self, key: int, call: tuple[Any, ...] = ()) -> None:
        self.key = key
        self.cancelled = False
        self.on_cancel: Callable[[], object] | None = None
        self.call = call
        self.started = time.monotonic()
        self.thread: int | None = threading.get_ident()
        self.coro: Any = None
        self.worker: int | None = None
        self.takers: list[Future[Any]] | None = None  # who waits for its reply (`taker`)


class Calls:
    """This world's calls, as the callee sees them (a part of `_runtime`).

    The calls running here, the cancels that came before their call
    (tombstones), the calls that ended lately, and this process's key
    numbers; `close` forgets the cancels.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: dict[int, Running] = {}
        # key -> when the cancel expires; in the order they came, which is expiry order.
        self.tombstones: collections.OrderedDict[int, float] = collections.OrderedDict()
        # Calls that ended lately (a cancel that raced their reply needs no tombstone).
        self.ended: collections.deque[int] = collections.deque(maxlen=ENDED_KEPT)
        self.ended_keys: set[int] = set()
        self.numbers = itertools.count(1)

    def close(self) -> None:
        with self.lock:  # the world has ended: no cancel can come for these any more
            self.tombstones.clear()
            self.ended.clear()
            self.ended_keys.clear()


def begin(key: int, call: tuple[Any, ...] = ()) -> Running | None:
    """Record a call as running; None when it was cancelled before it started.

    `call`: (function, args), for naming it in dumps.
    """
    state = Running(key, call)
    calls = _runtime.part(Calls)
    with calls.lock:
        if calls.tombstones and calls.tombstones.pop(key, None) is not None:
            _note_ended(calls, key)  # a second copy of its cancel finds it ended
            return None
        calls.running[key] = state
    return state


def claim(state: Running, on_cancel: Callable[[], object]) -> bool:
    """Take charge of a call's cancellation (the first Task or Future it makes does).

    Returns False when someone already has; runs `on_cancel` at once if the
    call was cancelled before anyone took charge.
    """
    with _runtime.part(Calls).lock:
        if state.on_cancel is not None:
            return False
        state.on_cancel = on_cancel
        already = state.cancelled
    if already:
        on_cancel()
    return True


def end(state: Running, settled: bool = False) -> None:
    """The call is over: nobody takes charge of its cancel after it (`claim` returns
    False), and it lets go of what it ran. `settled`: it ended where it ran, before
    anyone took charge of its cancel."""
    calls = _runtime.part(Calls)
    with calls.lock:
        if settled or state.on_cancel is not None:
            state.on_cancel = _nothing
        # What it ran goes with it: the call's Task refers to its state through its
        # context, so a state that kept them would hold its arguments until gc ran.
        state.call, state.coro = (), None
        if calls.running.pop(state.key, None) is None:
            return  # ended twice (a reply path and a cancel): counted once
        _note_ended(calls, state.key)


def _note_ended(calls: Calls, key: int) -> None:
    """Keep `key` among the calls that ended lately (under `calls.lock`)."""
    if len(calls.ended) == ENDED_KEPT:
        calls.ended_keys.discard(calls.ended[0])
    calls.ended.append(key)
    calls.ended_keys.add(key)


def _nothing() -> None:
    """The cancel of a call that has ended."""


def taker(key: int) -> Future[Any] | None:
    """A Future of the reply of call `key`, set as the call ends here (`hand_over`); None
    when no such call runs here now (it ended, or has not arrived yet).

    How a Future passed as an argument goes from the worker computing it
    straight to the callee using it (`_promised`).
    """
    calls = _runtime.part(Calls)
    fut: Future[Any] = new_future()
    with calls.lock:
        state = calls.running.get(key)
        if state is None:
            return None
        cancelled = state.cancelled
        if not cancelled:
            if state.takers is None:
                state.takers = []
            state.takers.append(fut)
    if cancelled:  # its reply will be a CancelledError, whenever it ends
        _cancelled_for([fut])
    return fut


def hand_over(state: Running, reply: Any) -> None:
    """The call `state` ended (`end`) and replies `reply`: to whoever asked too (`taker`).

    Every path that ends a call calls it with the reply it sends; a taker
    cannot join once the call has ended, so none is missed.
    """
    takers = state.takers
    if takers:
        state.takers = None
        for fut in takers:
            fut.set_result(reply)


def deliver(key: int) -> None:
    """A cancel for `key` arrived: stop the call, or keep a tombstone until it comes.

    A cancel for a call that ended lately (it raced the reply) is dropped; the
    tombstones expire oldest first, and at most TOMBSTONES_MAX are kept.
    """
    calls = _runtime.part(Calls)
    with calls.lock:
        state = calls.running.get(key)
        if state is None:
            if key not in calls.ended_keys:
                _bury(calls.tombstones, key)
            return
        if state.cancelled:  # asked twice, or cancelled here already: it stops once
            return
        state.cancelled = True
        on_cancel = state.on_cancel
        takers, state.takers = state.takers, None
    if takers:  # its reply will be a CancelledError, whenever it ends: they have it now
        _cancelled_for(takers)
    if on_cancel is not None:
        on_cancel()


def _cancelled_for(takers: list[Future[Any]]) -> None:
    me = _torch.own_name()
    error = CancelledError(
        f"the call whose result was passed on was cancelled on worker {me!r} before it "
        f"ended, so the call that took its Future does not run",
        me,
    )
    for fut in takers:
        fut.set_result(hold(error))


def _bury(tombstones: collections.OrderedDict[int, float], key: int) -> None:
    now = time.monotonic()
    while tombstones:
        oldest, until = next(iter(tombstones.items()))
        if until >= now and len(tombstones) < TOMBSTONES_MAX:
            break
        del tombstones[oldest]
    tombstones[key] = now + TOMBSTONE_S


def running_calls() -> list[Running]:
    """The calls this worker runs now, oldest first."""
    calls = _runtime.part(Calls)
    with calls.lock:
        running = list(calls.running.values())
    return sorted(running, key=lambda state: state.started)


def cancelled_running() -> int:
    """How many calls running here their callers cancelled (a sync function may run on).

    Nobody waits for their results any more: a removed worker leaves without them.
    """
    calls = _runtime.part(Calls)
    with calls.lock:
        return sum(1 for state in calls.running.values() if state.cancelled)


def bookkeeping() -> dict[str, int]:
    """How much cancel state this worker holds (for checks and the benchmarks).

    `running` leaves out the call that asks, when a call asks.
    """
    asking = current()
    calls = _runtime.part(Calls)
    with calls.lock:
        running = len(calls.running) - (asking is not None and asking.key in calls.running)
        return {
            "running": running,
            "tombstones": len(calls.tombstones),
            "ended": len(calls.ended),
        }


def current() -> Running | None:
    """The call this thread runs now, if any."""
    return _runtime.THREAD.call or _runtime.TASK_CALL.get()  # type: ignore[no-any-return]


def enter(state: Running | None) -> Running | None:
    """Make `state` this thread's current call; returns the one to put back."""
    thread = _runtime.THREAD
    before: Running | None = thread.call
    thread.call = state
    return before


def cancelled() -> bool:
    """True inside a call whose caller has cancelled it: stop early and return.

    A running sync function cannot be interrupted safely; it can poll this
    (an `async def` is interrupted at its current `await`). Outside a call,
    False. Example::

        def search(queries):
            for q in queries:
                if asyncrpc.cancelled():
                    return None  # the caller gets CancelledError anyway
                work(q)
    """
    state = current()
    return state is not None and bool(state.cancelled)
