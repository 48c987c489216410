"""`asyncrpc.trace`: record every worker with torch's profiler, as one timeline.

torch's profiler sees one process. While a trace is open, each worker runs
it on all of its threads, and every call made through asyncrpc carries an id
so that its two ends can be joined afterwards::

    driver: with asyncrpc.trace("run.json"):
      |-- begin --> every worker: profiler on (all threads); clock sample
      |     caller: span "-> worker2: f()" --(call id)--> callee: span "f() <- worker0"
      |-- finish -> every worker: profiler off; its trace and call spans come back
      `-- _timeline.merge: a process per worker, clocks aligned, a flow per call

The control calls (begin, finish, clock samples) go through torch's own verbs
on purpose, around asyncrpc's call path: they are not user calls, so they are
neither traced nor counted as spans.

A worker's recording belongs to its world (`_Recording`, a part of the
world's runtime): a world that ends while a trace records stops the profiler
and drops what it recorded, so the next world starts untraced.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import os
import pathlib
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.futures import Future

from .._core import _calls, _elastic, _runtime, _torch, _world
from .._core._errors import AsyncRPCError, CancelledError, WorkerUnreachableError
from .._core._execution import Kind, classify
from . import _timeline

__all__ = ("Trace", "outgoing", "recording", "trace", "worker_label")

_CLOCK_SAMPLES = 5
_ABANDON_S = 10.0  # how long a world's end waits for a dropped recording's profiler to stop


class _Recorder:
    """This worker's half of a trace: the profiler (on a thread of its own) and call spans."""

    def __init__(self, session: str) -> None:
        self.session = session
        self.spans: list[dict[str, Any]] = []  # list.append is atomic: no lock needed
        self.threads: dict[int, str] = {}
        self._started = threading.Event()
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self._text = ""
        self._export = True  # False: stopped by the world's end, nobody reads the trace
        self.unregister: Callable[[], object] = lambda: None  # its members' callback
        # torch's profiler is started and stopped on one thread; RPC calls may not be.
        self._thread = threading.Thread(target=self._record, name="asyncrpc-trace", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise AsyncRPCError(f"torch's profiler did not start: {self._error}") from self._error

    def finish(self) -> str:
        self._stop.set()
        self._stopped.wait()
        if self._error is not None:
            raise AsyncRPCError(f"torch's profiler failed: {self._error}") from self._error
        return self._text

    def abandon(self) -> None:
        """Stop the profiler without exporting its trace (its world ended); never raises."""
        self._export = False
        self._stop.set()
        self._stopped.wait(_ABANDON_S)

    def _record(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        try:
            config = _torch.profiler_config()
            activities = [ProfilerActivity.CPU]
            # A worker that never touched CUDA keeps it off (and CUDA uninitialized).
            if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
                activities.append(ProfilerActivity.CUDA)
            prof = profile(activities=activities, experimental_config=config)
            prof.start()
        except BaseException as exc:  # reported by start() to the caller
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self._stop.wait()
        try:
            prof.stop()
            if not self._export:
                return
            with tempfile.TemporaryDirectory(prefix="asyncrpc-trace-") as folder:
                path = pathlib.Path(folder, "trace.json")
                prof.export_chrome_trace(str(path))
                self._text = path.read_text()
        except BaseException as exc:  # reported by finish() to the caller
            self._error = exc
        finally:
            self._stopped.set()

    def add(self, span: dict[str, Any], thread: tuple[int, str]) -> None:
        self.threads.setdefault(*thread)
        self.spans.append({**span, "tid": thread[0]})

    def member(self, event: Any) -> None:
        """A change of the world's members, marked on this worker's timeline."""
        kind = type(event).__name__  # Joined, Left, Replaced
        why = getattr(event, "reason", "")
        text = f"{event.name} {kind.lower()}" + (f" ({why})" if why else "")
        now = time.time_ns()
        self.add({"kind": "member", "name": text, "start": now, "end": now, "id": 0},
                 _this_thread())  # fmt: skip


class _Recording:
    """This worker's trace state in its world (a part): the recorder while one records.

    Call ids count here too: a trace's ids are unique within the world that
    recorded it, which is all that joining a call's two ends needs.
    """

    def __init__(self) -> None:
        self.recorder: _Recorder | None = None
        self.lock = threading.Lock()  # one begin or finish at a time
        self.ids = itertools.count(1)

    def close(self) -> None:
        """The world ends: a recording left open stops, and calls are no longer traced."""
        with self.lock:
            recorder, self.recorder = self.recorder, None
            if recorder is not None:
                _calls.set_outgoing_hook(None)
        if recorder is not None:
            recorder.unregister()
            recorder.abandon()


def _recording() -> _Recording:
    return _runtime.part(_Recording)


def _span(kind: str, name: str, start: int, **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "name": name, "start": start, "end": time.time_ns(), **extra}


def _this_thread() -> tuple[int, str]:
    return threading.get_native_id(), threading.current_thread().name


class _Traced:
    """A function sent while tracing: records its run on the callee under the call's id."""

    def __init__(self, fn: Callable[..., Any], call_id: int, caller: str) -> None:
        self.fn = self.__wrapped__ = fn
        self.call_id = call_id
        self.caller = caller
        self.is_async = classify(fn) is Kind.ASYNC

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        recorder = _recording().recorder
        if recorder is None:
            return self.fn(*args, **kwargs)
        start, thread = time.time_ns(), _this_thread()
        label = f"{_label(self.fn)} <- {self.caller}"

        def record(deferred: bool, outcome: str) -> None:
            span = _span("run", label, start, id=self.call_id, deferred=deferred, outcome=outcome)
            recorder.add(span, thread)

        try:
            result = self.fn(*args, **kwargs)
        except BaseException as exc:
            record(False, _describe(exc))
            raise
        if inspect.iscoroutine(result):  # an undecorated async def: ends when it does
            return _recorded(result, record)
        if isinstance(result, Future) and self.is_async:
            result.add_done_callback(lambda done: record(True, outcome_of(done)))
        else:
            record(False, "ok")
        return result


async def _recorded(coro: Coroutine[Any, Any, Any], record: Callable[[bool, str], None]) -> Any:
    outcome = "ok"
    try:
        return await coro
    except BaseException as exc:
        outcome = _describe(exc)
        raise
    finally:
        record(True, outcome)


def outcome_of(done: Future[Any]) -> str:
    """How a finished call ended, for its span: "ok", "cancelled: ...", or the error."""
    try:
        done.value()
    except BaseException as exc:
        return _describe(exc)
    return "ok"


def _describe(error: BaseException) -> str:
    first = (str(error).strip().splitlines() or [""])[0]
    if isinstance(error, (CancelledError, asyncio.CancelledError)):
        return f"cancelled: {first}" if first else "cancelled"
    return f"{type(error).__name__}: {first}"


def _label(fn: object) -> str:
    if isinstance(fn, torch.jit.ScriptFunction):
        return f"{fn.name}()"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return f"{name or type(fn).__name__}()"


def recording() -> bool:
    """True while this worker records a trace."""
    return _recording().recorder is not None


def outgoing(
    to: str, fn: Callable[..., Any]
) -> tuple[Callable[..., Any], Callable[[Any], None] | None]:
    """While tracing: the function to send in place of `fn`, and a callback for the reply.

    Outside a trace: `fn` itself and no callback, so untraced calls cost nothing more.
    """
    state = _recording()
    recorder = state.recorder
    if recorder is None:
        return fn, None
    start, thread = time.time_ns(), _this_thread()
    if isinstance(fn, torch.jit.ScriptFunction):
        call_id = 0  # sent by name to TorchScript: the callee's side cannot be marked
        sent: Callable[..., Any] = fn
    else:
        call_id = (_world.current_context().rank << 32) + next(state.ids)
        sent = _Traced(fn, call_id, worker_label(_world.current_context()))
    label = f"-> {to}: {_label(fn)}"

    def replied(done: Any) -> None:
        outcome = outcome_of(done)
        recorder.add(_span("call", label, start, id=call_id, to=to, outcome=outcome), thread)

    return sent, replied


def worker_label(ctx: _world.Context) -> str:
    """How the trace names a worker: `worker3`, or `worker3 (attempt 1)` for a replacement.

    A worker replaced in a world that heals (restart="worker") runs under its
    name again; its attempt tells its events from those of the process before.
    """
    return f"{ctx.name} (attempt {ctx.attempt})" if ctx.attempt > 0 else ctx.name


def _boot_id() -> str:
    try:
        return pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return f"pid-{os.getpid()}"


def _begin(session: str) -> dict[str, Any]:
    state = _recording()
    with state.lock:
        if state.recorder is not None:
            raise AsyncRPCError(
                f"{_world.current_context().name} is already recording a trace "
                f"({state.recorder.session}); close it before opening another"
            )
        recorder = _Recorder(session)
        recorder.start()
        state.recorder = recorder
        _calls.set_outgoing_hook(outgoing)
        if _world.current_world("asyncrpc.trace()").members is not None:  # joins and leaves
            recorder.unregister = _elastic.on_members(recorder.member)
    return {"boot": _boot_id(), "pid": os.getpid()}


def _now() -> int:
    return time.time_ns()


def _finish(session: str) -> dict[str, Any]:
    state = _recording()
    with state.lock:
        recorder = state.recorder
        if recorder is None or recorder.session != session:
            raise AsyncRPCError(f"no trace {session} is recording on this worker")
        state.recorder = None
        _calls.set_outgoing_hook(None)
    recorder.unregister()
    text = recorder.finish()
    threads = dict(recorder.threads)
    for thread in threading.enumerate():
        if thread.native_id is not None:
            threads.setdefault(thread.native_id, thread.name)
    return {
        "trace": text, "spans": recorder.spans, "threads": threads, "pid": os.getpid(),
        "label": worker_label(_world.current_context()),
    }  # fmt: skip


def _clock_offset(name: str, here_boot: str, there_boot: str) -> int:
    """Nanoseconds to subtract from `name`'s clock to read the caller's clock."""
    if there_boot == here_boot:
        return 0  # one kernel, one clock
    samples = []
    for _ in range(_CLOCK_SAMPLES):
        sent = time.time_ns()
        there = int(_torch.rpc_sync(_world.target(name), _now))
        back = time.time_ns()
        samples.append((back - sent, there - (sent + back) // 2))
    return min(samples)[1]  # the shortest round trip bounds the error best


class Trace:
    """The result of `asyncrpc.trace`: where the merged trace went, and what it holds.

    Example::

        with asyncrpc.trace("run.json") as t:
            model(x)
        print(t.path, t.workers, len(t.events))
    """

    def __init__(self, path: pathlib.Path, workers: Sequence[str]) -> None:
        self.path = path
        self.workers = tuple(workers)
        self.events: list[dict[str, Any]] = []

    def __repr__(self) -> str:
        return f"Trace({str(self.path)!r}, workers={self.workers}, events={len(self.events)})"


@contextmanager
def trace(
    path: str | os.PathLike[str], *, workers: Sequence[str] | None = None
) -> Iterator[Trace]:
    """Record every worker with torch's profiler; on exit write one merged trace to `path`.

    The file opens in Perfetto (ui.perfetto.dev) or chrome://tracing: a
    process per worker (named by worker name; a worker replaced in a world
    that heals as `worker3 (attempt 1)`) with its threads, clocks
    aligned, each call made through asyncrpc as a span on the caller with an
    arrow to its run on the callee. `workers` limits it to some workers (the
    caller is always included). Render a picture with `asyncrpc.render_trace`.

    Example::

        with asyncrpc.trace("ensemble.json"):
            ensemble(x)
        asyncrpc.render_trace("ensemble.json", "ensemble.png")
    """
    ctx = _world.current_context()
    names = _traced_workers(ctx, workers)
    target = pathlib.Path(path)
    if not target.parent.is_dir():
        raise FileNotFoundError(f"cannot write the trace to {str(target)!r}: no such folder")
    session = f"{ctx.name}-{os.getpid()}-{next(_recording().ids)}"
    result = Trace(target, names)
    started: list[str] = []
    offsets: dict[str, int] = {}
    try:
        info = _begin_everywhere(session, names, ctx.name, started)
        here = info[ctx.name]["boot"]
        offsets = {n: _clock_offset(n, here, info[n]["boot"]) for n in names}
        yield result
    finally:
        parts = _collect(session, started, ctx.name)
        if len(offsets) == len(names):
            # Written even when the body raised: the timeline up to a failure helps most.
            result.events = _timeline.merge(names, parts, offsets)
            _timeline.write(target, result.events, names, offsets)


def _begin_everywhere(
    session: str, names: list[str], me: str, started: list[str]
) -> dict[str, dict[str, Any]]:
    """Start recording on every worker at once; `started` lists those that did."""
    info = {me: _begin(session)}  # first: if this one fails, nothing else started
    started.append(me)
    pending = {n: _torch.rpc_async(_world.target(n), _begin, args=(session,))
               for n in names if n != me}  # fmt: skip
    failures = []
    for name, fut in pending.items():
        try:
            info[name] = dict(fut.wait())
            started.append(name)
        except Exception as exc:  # the others must still be stopped by the caller
            failures.append(exc)
    if failures:
        raise failures[0]
    return info


def _traced_workers(ctx: _world.Context, workers: Sequence[str] | None) -> list[str]:
    members = _elastic.members()  # an elastic world's members now
    if workers is None:
        return list(members)
    if isinstance(workers, str):
        raise TypeError(f"workers must be a list of names, got the string {workers!r}")
    unknown = [w for w in workers if w not in members]
    if unknown:
        raise ValueError(f"workers {unknown} are not in this world; its workers: {members}")
    return [n for n in members if n in workers or n == ctx.name]


def _collect(session: str, started: list[str], me: str) -> dict[str, dict[str, Any]]:
    # A world ended inside the trace took its recording with it: say so, as a call would.
    _world.current_world("asyncrpc.trace()")
    futures = {n: _torch.rpc_async(_world.target(n), _finish, args=(session,))
               for n in started if n != me}  # fmt: skip
    parts = {me: _finish(session)} if me in started else {}
    for name, fut in futures.items():
        try:
            parts[name] = fut.wait()
        except (WorkerUnreachableError, RuntimeError):
            if name in _elastic.members():
                raise
            # It left the world while the trace recorded: its recording left with it.
            parts[name] = {"trace": "", "spans": [], "threads": {}, "pid": -1,
                           "label": f"{name} (left during the trace: not recorded)"}  # fmt: skip
    return parts
