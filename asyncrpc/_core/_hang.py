"""Hang reports: a call still pending after `Settings.hang_report_after` s logs one WARNING.

Off by default, and then it costs nothing but one read per call. On, each
call sets an alarm on the shared clock; if the call is still pending when it
fires, a reporter thread asks every worker of the world for its dump
through the side channel (no RPC thread needed) and logs, on the
`asyncrpc` logger::

    call to g() on worker1 still pending after 3.0 s: worker1 runs it at
    examples/hang.py:28 in g (waits on worker0: h()); cycle: worker1 g() ->
    worker0 (queued: all 2 RPC threads busy) -> worker0 f() -> back to worker1 g()

("waiting: ..." in place of "cycle: ..." for a cycle that ends once a busy
RPC thread in it is free: see `_waits`.)

The reporter is one thread, started at the first report and ended with the
world; reports wait in its queue (at most `QUEUE_MAX`, later ones dropped).
"""

from __future__ import annotations

import logging
import os
import queue
import sysconfig
import threading
import weakref
from typing import Any

import torch

from . import _runtime, _side, _waits, _watcher
from ._failures import label_of
from ._futures import call_later

__all__ = ("QUEUE_MAX", "Reporter", "stop", "watch", "watch_future")

QUEUE_MAX = 256
_ASK_S = 3.0  # how long the reporter waits for the workers' dumps
_logger = logging.getLogger("asyncrpc")
# Frames in these are not the user's code: asyncrpc's, torch's, Python's own.
_NOT_USERS = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    sysconfig.get_paths()["stdlib"] + os.sep,
    "<frozen",
)


class Reporter:
    """This world's hang reporter (a part of `_runtime`): its thread, started on the
    first report, and the reports waiting for it; `close` ends the thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.jobs: queue.Queue[tuple[Any, ...] | None] = queue.Queue(QUEUE_MAX)

    def close(self) -> None:
        with self.lock:
            thread, self.thread = self.thread, None
            jobs, self.jobs = self.jobs, queue.Queue(QUEUE_MAX)
        if thread is not None:
            jobs.put(None)
            thread.join(_ASK_S + 1)


def watch(reply: Any, seconds: float, queues: tuple[int, ...]) -> None:
    """Report `reply`'s call if it is still pending in `seconds` (and its world still runs)."""
    ref, world = weakref.ref(reply), weakref.ref(_runtime.SLOT.runtime)
    call_later(seconds, lambda: _due(ref, world, seconds, queues))


class _Pending:
    """A call whose only Future is torch's (rpc_sync, remote): pending until it is done."""

    __slots__ = ("__weakref__", "future", "key", "label", "worker")

    def __init__(self, future: Any, worker: str, label: object, key: int) -> None:
        self.future, self.worker, self.label, self.key = future, worker, label, key

    def pending(self) -> bool:
        return not self.future.done()

    def __call__(self, _: Any) -> None:
        """Done: torch drops this callback, and with it the last reference to self."""


def watch_future(
    future: Any, worker: str, label: object, key: int, seconds: float, queues: tuple[int, ...]
) -> None:
    """`watch` for a call read through torch's own Future (rpc_sync, remote)."""
    pending = _Pending(future, worker, label, key)
    future.add_done_callback(pending)  # keeps it alive while the call is pending, no longer
    watch(pending, seconds, queues)


def _due(
    ref: weakref.ref[Any],
    world: weakref.ref[_runtime.Runtime],
    seconds: float,
    queues: tuple[int, ...],
) -> None:
    reply, runtime = ref(), world()
    if reply is None or not reply.pending() or runtime is None or runtime.closed:
        return  # done, or its world ended: no reporter thread in the next world
    job = (reply.worker, reply.label, reply.key, seconds, queues)
    reporter = runtime.make(Reporter)
    with reporter.lock:
        if reporter.thread is None:
            reporter.thread = threading.Thread(
                target=_report_loop, args=(reporter.jobs,), name="asyncrpc-hang-reports",
                daemon=True,
            )  # fmt: skip
            reporter.thread.start()
    try:
        reporter.jobs.put_nowait(job)
    except queue.Full:
        pass  # enough reports are waiting to be written: this one adds nothing new


def stop() -> None:
    """End the reporter thread (the world has ended)."""
    _runtime.part(Reporter).close()


def _report_loop(jobs: queue.Queue[tuple[Any, ...] | None]) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            _logger.warning("%s", _describe(*job))
        except Exception as exc:  # a report must never end the reporter
            _logger.warning("a hang report could not be made: %s", exc)


def _describe(
    worker: str, label: object, key: int, seconds: float, queues: tuple[int, ...]
) -> str:
    head = f"call to {label_of(label)} on {worker} still pending after {seconds:g} s"
    channel = _watcher.side_channel()
    if channel is None:
        return f"{head} (this worker has no side channel to ask {worker})"
    store = channel[0].clone()
    answers = _side.ask(store, queues, "dump", _ASK_S)
    reports = [a for a in answers.values() if a is not None and "threads" in a]
    callee = next((r for r in reports if r["name"] == worker), None)
    where = _where(callee, key, worker)
    cycles = [_waits.describe(c) for c in _waits.cycles(reports)]
    cycles += [_waits.describe_wait(w) for w in _waits.waits(reports)]
    return f"{head}: {where}" + (f"; {'; '.join(cycles)}" if cycles else "")


def _where(callee: dict[str, Any] | None, key: int, worker: str) -> str:
    if callee is None:
        return f"{worker} did not answer within {_ASK_S:g} s"
    call = next((c for c in callee["threads"] if c["key"] == key), None)
    if call is None:
        busy = sum(1 for c in callee["threads"] if c.get("thread") is not None)
        return (
            f"it has not started on {worker} ({busy} of {callee['total_threads']} RPC threads "
            f"busy there)"
        )
    frame = _innermost_user_frame(call["stack"])
    waits = [f"{f['to']}: {f['call']}" for f in callee["in_flight"] if f["parent"] == key]
    waiting = f" (waits on {', '.join(waits)})" if waits else ""
    return f"{worker} runs it at {frame}{waiting}"


def _innermost_user_frame(stack: list[str]) -> str:
    """`file.py:line in func` of the innermost frame outside asyncrpc, torch and the stdlib."""
    for line in reversed(stack):
        path = line.split('"')[1] if line.count('"') >= 2 else ""
        if path and not path.startswith(_NOT_USERS):
            number = line.split(", line ")[1].split(",")[0]
            func = line.rsplit(" in ", 1)[1]
            shown = os.path.relpath(path)
            return f"{path if shown.startswith('..') else shown}:{number} in {func}"
    return stack[-1] if stack else "an unknown place"
