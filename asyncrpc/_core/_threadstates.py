"""Python thread states kept on torch's RPC threads while a world runs.

torch's agent runs Python on its pool threads (unpickling a call, running the
function, pickling the reply, completing the caller's Future), and those are
not Python threads: each time one takes the GIL, pybind11 makes it a new
Python thread state, and deletes it when the thread lets the GIL go. Counted
with uprobes on `PyThreadState_New` (2-core machine, torch 2.13): a small
`rpc_sync` of a Python function made and deleted 9.0 thread states (a builtin
op 3.1), which took about a fifth of the call's time and lost every
thread-local (and context variable) between calls. `keep` gives each pool
thread one state that lives as long as the thread (one more hold on it,
`PyGILState_Ensure`), so pybind11 finds it each time and keeps it::

    main thread, as the world starts     the agent's pool (N threads)
    keep(name, N)    ── N self-calls ──> each: PyGILState_Ensure() once, then
                                         wait until all N are there (so each
                                         call lands on a thread of its own)
    ... every call: pybind11 finds the thread's state; none made per call ...

The holds are never given back: torch's agent leaves its pool threads
parked after its shutdown (all still there after `rpc.shutdown()` and a
collection), and a state given back while peers still call in (a graceful
shutdown serves them) would only be made again. So each RPC thread has one
state for as long as it exists, as a Python thread has: its thread-locals
and context variables carry from one call to the next on that thread (as on
a `ThreadPoolExecutor`'s threads), and live on after the world ends.
TensorPipe's loop threads still make one state per message whose tensors
Python has let go (to drop their Python objects): torch's, out of reach.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import sys
import threading

import torch.distributed.rpc as rpc

from . import _runtime

__all__ = ("Kept", "forget", "keep", "kept")

_log = logging.getLogger("asyncrpc")


class Kept:
    """This world's record of kept thread states (a part of `_runtime`).

    `close` drops the record as the world ends; the states stay with their threads.
    """

    def __init__(self) -> None:
        # (pid, thread ident) of the RPC threads holding a kept state. Only the thread
        # itself adds its key, so no lock: a lock held across a fork would stay held.
        self.held: set[tuple[int, int]] = set()
        self.rounds: dict[int, _Round] = {}
        self.tokens = itertools.count(1)

    def close(self) -> None:
        self.held.clear()


class _Round:
    """One `keep`: a barrier for the self-calls, and an event for when it ends."""

    def __init__(self, threads: int) -> None:
        self.done = threading.Event()
        self.barrier = threading.Barrier(threads, action=self.done.set)


def keep(name: str, threads: int, timeout: float = 2.0) -> int:
    """Give each of this worker's `threads` RPC threads a Python state for good.

    `name` is this worker's own name; returns how many threads hold one now.
    Waits at most about `timeout` seconds: a thread busy with a peer's call
    gets its state when it is free (its self-call is queued behind).
    """
    if sys.implementation.name != "cpython" or threads < 1:
        return kept()
    record = _runtime.part(Kept)
    token = next(record.tokens)
    record.rounds[token] = this = _Round(threads)
    try:
        for _ in range(threads):
            rpc.rpc_async(name, _on_rpc_thread, args=(token, timeout), timeout=timeout + 1)
        this.done.wait(timeout + 0.5)
    except RuntimeError as error:  # the agent refused a self-call: calls work as torch's do
        _log.warning("could not keep the RPC threads' Python states: %s", error)
    finally:
        del record.rounds[token]
    count = kept()
    if count < threads:
        _log.debug("%d of %d RPC threads hold a kept state; busy ones follow", count, threads)
    return count


def kept() -> int:
    """How many of this process's threads hold a state that `keep` gave them."""
    pid = os.getpid()
    return sum(1 for owner, _ in tuple(_runtime.part(Kept).held) if owner == pid)


def forget() -> None:
    """Drop the record of kept states as a world ends (the states stay with their threads)."""
    _runtime.part(Kept).close()


def _on_rpc_thread(token: int, timeout: float) -> None:
    """On an RPC thread: give it a state for good, then wait for the other threads."""
    key = (os.getpid(), threading.get_ident())
    record = _runtime.part(Kept)
    if key not in record.held:
        _gil_state_ensure()
        record.held.add(key)
    this = record.rounds.get(token)
    if this is not None:
        try:
            this.barrier.wait(timeout)
        except threading.BrokenBarrierError:  # some thread was busy: the others go on
            this.done.set()


def _gil_state_ensure() -> None:
    # Item access makes a function object of our own: the shared
    # ctypes.pythonapi attributes keep whatever types others gave them.
    ensure = ctypes.pythonapi["PyGILState_Ensure"]
    ensure.argtypes, ensure.restype = [], ctypes.c_int
    ensure()
