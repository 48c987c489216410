"""The model of a world that heals in place, as a hypothesis state machine (run in worker0).

tests/programs/heal_model.py starts the world and calls `check` on worker0.
The machine calls worker1..3 (sync, and in flight), spawns Counters on them
and calls those, and SIGKILLs them (the replacement's process too, right
after it starts, at times), waiting or not for the replacement. Per worker
the model knows the attempt that answers for its name now, its pid, whether
the replacement has surely joined, and which objects live on which process.

Held after every step: a call returns its own id and the attempt the model
expects, or raises `WorkerUnreachableError` (only while its worker is being
replaced, or when its process was killed while it was in flight); a call to
an object of a killed process raises `ObjectLostError` once the replacement
joined; no other exception, and no wait past a bound. At each example's end:
no call id ran twice anywhere (the ids each process ran, dead ones too, are
in files per pid), a call that returned ran exactly once, on the process
whose pid it returned, one refused with "nothing was sent" never ran, and
every object of a live process holds the count the model predicts.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import hypothesis.strategies as st
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

import asyncrpc

WORKERS = ("worker1", "worker2", "worker3")  # worker0 runs the machine: never killed
KILLABLE = ("worker1", "worker2")
SURVIVOR = "worker3"  # never killed: it serves, relays and holds lent handles
FD_SLACK = 8  # descriptors a survivor may hold beyond its first example's (pipes to replacements)
CALL_S = 10.0  # each call's timeout
LISTENER_CLOSED = "exit code 76"  # a Replaced.reason: torch closed its listener
CLOSE_WAIT_S = 5.0  # how long a dead process's pipe may take to close after its heal
HANG_S = CALL_S + 5.0  # a Future not done by then hangs
JOIN_S = 15.0  # a replacement joins within this
DEATH_S = 5.0  # a SIGKILLed process is gone within this
NOT_SENT = "nothing was sent"
RAN_ONCE = -1  # the expectation of a call that ran once, on a process not known here
NEVER = 0  # ... of a call that must not have run
MAYBE = -2  # ... of a call that may have run (once at most)


class Shared:
    """What lasts across examples: the workers' code, ids, events, pids seen."""

    record: Callable[..., Any]
    ran: Callable[[], tuple[int, list[int]]]
    counter: type
    directory: str
    record_stream: Callable[..., Any]
    relay: Callable[..., Any]
    lend_use: Callable[..., Any]
    usage: Callable[[], dict[str, int]]
    baseline: ClassVar[dict[str, dict[str, int]]] = {}  # worker0's and the survivor's, at start
    survivor_pid = 0
    next_id = 0
    attempts: ClassVar[dict[str, int]] = dict.fromkeys(WORKERS, 0)  # the model's, at the last end
    clean = True  # the last example ended with its checks passed
    known: ClassVar[set[int]] = set()  # every pid seen (a newborn replacement is none of these)
    events: ClassVar[list[asyncrpc.Replaced]] = []
    changed = threading.Condition()
    log: ClassVar[list[str]] = []
    stats: ClassVar[collections.Counter[str]] = collections.Counter()  # steps and outcomes
    # Restarts no kill of the model's made: the worker ended itself, its listener closed.
    restarts_of_own: ClassVar[collections.Counter[str]] = collections.Counter()

    @classmethod
    def seen(cls, event: asyncrpc.Replaced) -> None:
        with cls.changed:
            cls.events.append(event)
            cls.changed.notify_all()

    @classmethod
    def closed_listener(cls, name: str, attempt: int) -> bool:
        """Whether `name`'s attempt replaced a process that ended as torch closed its listener.

        No kill of the model's: the worker ended itself (exit code 76), and
        the world replaced it (a process killed as it connected to it, say).
        """
        with cls.changed:
            cls.changed.wait_for(
                lambda: any(e[:3] == (name, WORKERS.index(name) + 1, attempt) for e in cls.events),
                1.0,
            )
            return any(e.name == name and e.attempt == attempt and LISTENER_CLOSED in e.reason
                       for e in cls.events)  # fmt: skip

    failure: str | None = None  # the first failure: what broke, and the example's steps

    @classmethod
    def failed(cls, what: str) -> None:
        if cls.failure is None:
            cls.failure = f"{what}\nthe failing example's steps:\n" + "\n".join(cls.log)

    @classmethod
    def new_id(cls) -> int:
        cls.next_id += 1
        return cls.next_id


@dataclass
class Worker:
    """The model of one worker: the attempt that answers for its name now, and its pid."""

    name: str
    attempt: int
    joined: bool = True  # False from a kill until a call (or event) shows the replacement
    pids: dict[int, int] = field(default_factory=dict)  # attempt -> pid
    # A newborn was killed while another worker's death was still being handled: the
    # supervisor may have stopped that newborn itself and started it again under the
    # same attempt (a joiner it stops is no death of its own), which the model cannot
    # tell from the one it killed. Then the next answer may come one attempt short.
    retried: bool = False

    @property
    def pid(self) -> int | None:
        return self.pids.get(self.attempt)


@dataclass
class Pending:
    """A call in flight: sent to `worker` while `attempt` answered for it."""

    fut: Any
    worker: str
    attempt: int
    call_id: int
    may_fail: bool  # sent while being replaced, or its process was killed since


@dataclass
class Obj:
    """A Counter spawned on `worker`'s process of `attempt`."""

    handle: Any
    worker: str
    attempt: int
    created: int  # the call id of its creation (spawn does not wait for it)
    n: int = 0
    lost: bool = False
    unsure: bool = False  # spawned while its worker was replaced: maybe onto the dead process
    void: bool = False  # it was: its calls fail, not necessarily with ObjectLostError


def _outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """("value", v) or ("unreachable", error); any other exception propagates."""
    try:
        return "value", call()
    except asyncrpc.WorkerUnreachableError as exc:
        return "unreachable", exc


def _waited(fut: Any) -> tuple[str, Any]:
    deadline = time.monotonic() + HANG_S
    while not fut.done():
        assert time.monotonic() < deadline, f"a call's Future hung past {HANG_S} s"
        time.sleep(0.002)
    return _outcome(fut.wait)


def _state(pid: int) -> str | None:
    """The process's state letter (R, S, Z...), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return fields[0]


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


def _kill(pid: int) -> None:
    """SIGKILL `pid` and wait until it is dead (gone, or a zombie)."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + DEATH_S
    while _state(pid) not in (None, "Z", "X"):
        assert time.monotonic() < deadline, f"pid {pid} lived {DEATH_S} s past SIGKILL"
        time.sleep(0.001)


def _children(parent: int) -> list[int]:
    """The processes whose parent is `parent` now."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and _parent(int(e)) == parent]


def _where_everyone_is() -> None:
    """SIGUSR1 to the supervisor and every worker: each prints its stacks (faulthandler)."""
    server = os.getppid()
    for pid in [_parent(server) or server, *_children(server)]:
        try:
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            continue
    time.sleep(2.0)


def _newborn(known: set[int], timeout: float) -> int | None:
    """A live child of the forkserver (worker0's parent) that no pid in `known` is."""
    server = os.getppid()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in _children(server):
            if pid not in known and _state(pid) not in (None, "Z", "X"):
                return pid
        time.sleep(0.001)
    return None


def _files() -> dict[int, list[int]]:
    """The ids each process ran, by pid, from their files."""
    found: dict[int, list[int]] = {}
    for entry in os.listdir(Shared.directory):
        if entry.endswith(".ids"):
            with open(os.path.join(Shared.directory, entry)) as ids:
                lines = ids.read().split("\n")
            found[int(entry[:-4])] = [int(line) for line in lines[:-1]]  # whole lines only
    return found


def _step(rule_function: Callable[..., None]) -> Callable[..., None]:
    """Log the step; a failing one marks the example broken (teardown then checks nothing)."""

    @functools.wraps(rule_function)
    def run(self: BaseModel, **data: Any) -> None:
        self.note(f"{rule_function.__name__}({', '.join(f'{k}={v!r}' for k, v in data.items())})")
        Shared.stats[rule_function.__name__] += 1
        try:
            rule_function(self, **data)
        except BaseException:
            self.broken = True
            Shared.failed(f"{rule_function.__name__}: {traceback.format_exc()}")
            raise

    return run


class BaseModel(RuleBasedStateMachine):
    """Random calls, spawns and kills on worker1..3 of a world that heals; held to the model."""

    def __init__(self) -> None:
        super().__init__()
        Shared.log = []
        self.broken = False
        self.workers: dict[str, Worker] = {}
        self.pending: list[Pending] = []
        self.objects: list[Obj] = []
        self.ids: dict[int, int] = {}  # call id -> pid it ran on / RAN_ONCE / NEVER / MAYBE
        assert Shared.failure is None, "an example failed: the world is not the model's"
        Shared.stats["examples"] += 1
        try:
            for name in WORKERS:
                self._meet(name)
        except BaseException:
            self.broken = True
            Shared.failed(f"the example's start: {traceback.format_exc()}")
            raise

    def note(self, text: str) -> None:
        Shared.log.append(text)

    # ---- what the model expects of each outcome ---------------------------------------

    def _meet(self, name: str) -> None:
        """Learn `name`'s attempt and pid at an example's start (after the last one's end)."""
        value = self._poll_value(name)
        pid, attempt, _ = value
        before = Shared.attempts[name]
        while attempt > before and Shared.clean and Shared.closed_listener(name, before + 1):
            before += 1  # a restart of its own between two examples
            Shared.restarts_of_own[name] += 1
        assert attempt == before or (not Shared.clean and attempt > before), (
            f"{name} answers with attempt {attempt} at an example's start; the model "
            f"ended the last one at attempt {before}"
        )
        self.workers[name] = Worker(name, attempt, pids={attempt: pid})
        Shared.known.add(pid)
        if name == SURVIVOR:
            Shared.survivor_pid = Shared.survivor_pid or pid

    def _poll_value(self, name: str) -> tuple[int, int, int]:
        """Call `name` until it answers (bounded), every call checked as the model says."""
        deadline = time.monotonic() + JOIN_S
        while True:
            call_id = Shared.new_id()
            call = functools.partial(
                asyncrpc.rpc_sync, name, Shared.record, args=(call_id,), timeout=CALL_S
            )
            kind, got = _outcome(call)
            if kind == "value":
                return got  # type: ignore[no-any-return]
            self._refused(call_id, got, f"a call to {name}")
            assert time.monotonic() < deadline, f"{name} did not answer within {JOIN_S} s"
            time.sleep(0.005)

    def _refused(self, call_id: int, error: BaseException, what: str) -> None:
        assert type(error) is asyncrpc.WorkerUnreachableError, (
            f"{what} (id {call_id}) raised {type(error).__name__}, not WorkerUnreachableError: "
            f"{error}"
        )
        self.ids[call_id] = NEVER if NOT_SENT in str(error) else MAYBE
        Shared.stats["refused, nothing sent" if NOT_SENT in str(error) else "unreachable"] += 1

    def _returned(self, worker: Worker, attempt: int, call_id: int, got: Any) -> None:
        """Check a call's value: its own id, from the process of `attempt`."""
        pid, answered, echoed = got[:3]
        assert echoed == call_id, f"call {call_id} to {worker.name} returned id {echoed}"
        if answered > worker.attempt >= attempt:
            self._catch_up(worker, answered)
            attempt = max(attempt, worker.attempt)
        if worker.retried and attempt == worker.attempt and answered == attempt - 1:
            worker.attempt = attempt = answered  # the supervisor's own start again, not ours
            worker.pids[answered] = pid
            Shared.stats["joiner started again by the supervisor"] += 1
        worker.retried = False
        assert answered == attempt, (
            f"call {call_id} to {worker.name} was answered by attempt {answered}; the model "
            f"expects attempt {attempt} (the worker's model: {worker})"
        )
        known = worker.pids.setdefault(attempt, pid)
        assert known == pid, f"attempt {attempt} of {worker.name} is pid {known}, not {pid}"
        Shared.known.add(pid)
        if attempt == worker.attempt:
            worker.joined = True
        self.ids[call_id] = pid

    def _sync_call(self, worker: Worker, before: float = 0.0, after: float = 0.0) -> str:
        call_id = Shared.new_id()
        args = (call_id, before, after)
        kind, got = _outcome(
            lambda: asyncrpc.rpc_sync(worker.name, Shared.record, args=args, timeout=CALL_S)
        )
        if kind == "value":
            self._returned(worker, worker.attempt, call_id, got)
        else:
            assert not worker.joined, (
                f"call {call_id} to {worker.name} failed, but its process (attempt "
                f"{worker.attempt}) lives and has joined: {got!r}"
            )
            self._refused(call_id, got, f"call to {worker.name}")
        self.note(f"  -> {kind}: {got!r}"[:200])
        return kind

    # ---- rules ---------------------------------------------------------------------------

    @rule(index=st.integers(0, 2), after=st.sampled_from([0.0, 0.0, 0.01]))
    @_step
    def call_sync(self, index: int, after: float) -> None:
        self._sync_call(self.workers[WORKERS[index]], after=after)

    @rule(
        index=st.integers(0, 2),
        before=st.sampled_from([0.0, 0.02, 0.2]),
        after=st.sampled_from([0.0, 0.02, 0.2]),
    )
    @_step
    def call_async(self, index: int, before: float, after: float) -> None:
        worker = self.workers[WORKERS[index]]
        call_id = Shared.new_id()
        args = (call_id, before, after)
        kind, fut = _outcome(
            lambda: asyncrpc.rpc_async(worker.name, Shared.record, args=args, timeout=CALL_S)
        )
        if kind == "unreachable":  # refused at once, at the call
            assert not worker.joined, f"rpc_async to {worker.name} (joined) raised {fut!r}"
            self._refused(call_id, fut, f"rpc_async to {worker.name}")
            return
        self.pending.append(Pending(fut, worker.name, worker.attempt, call_id, not worker.joined))

    @rule(index=st.integers(0, 20))  # no preconditions: what is drawn never depends on outcomes
    @_step
    def settle(self, index: int) -> None:
        if self.pending:
            self._settle(self.pending.pop(index % len(self.pending)))

    def _settle(self, call: Pending) -> None:
        worker = self.workers[call.worker]
        kind, got = _waited(call.fut)
        self.note(f"  settled {call.call_id} -> {kind}: {got!r}"[:200])
        if kind == "value":
            self._returned(worker, call.attempt, call.call_id, got)
            return
        assert call.may_fail, (
            f"call {call.call_id} to {call.worker} (attempt {call.attempt}, joined, never "
            f"killed while in flight) failed: {got!r}"
        )
        self._refused(call.call_id, got, f"call in flight to {call.worker}")

    @rule(index=st.integers(0, 2))
    @_step
    def spawn(self, index: int) -> None:
        worker = self.workers[WORKERS[index]]
        call_id = Shared.new_id()
        kind, got = _outcome(lambda: asyncrpc.spawn(worker.name, Shared.counter, call_id))
        self.note(f"  -> {kind}: {got!r}"[:200])
        if kind == "unreachable":
            assert not worker.joined, f"spawn on {worker.name} (joined) failed: {got!r}"
            self._refused(call_id, got, f"spawn on {worker.name}")
            return
        # spawn sends the creation and returns: it may never run if the process dies first
        handle = got.options(timeout=CALL_S)
        self.objects.append(
            Obj(handle, worker.name, worker.attempt, call_id, unsure=not worker.joined)
        )
        self.ids[call_id] = MAYBE

    @rule(index=st.integers(0, 20), k=st.integers(0, 5))
    @_step
    def handle_call(self, index: int, k: int) -> None:
        if self.objects:
            self._handle_call(self.objects[index % len(self.objects)], k)

    def _handle_call(self, obj: Obj, k: int) -> None:
        worker = self.workers[obj.worker]
        call_id = Shared.new_id()
        kind, got = _outcome(lambda: obj.handle.call("add", call_id, k))
        self.note(f"  -> {kind}: {got!r}"[:200])
        if obj.unsure and kind == "unreachable":  # it went to the dead process: lost
            obj.lost, obj.unsure, obj.void = True, False, True
            self.ids[call_id] = NEVER if NOT_SENT in str(got) else MAYBE
            Shared.stats[f"unsure object: {type(got).__name__}"] += 1
            return
        obj.unsure = False  # answered (or lost for sure): the model knows where it lives
        if obj.lost:
            assert kind == "unreachable", f"an object of a killed process answered: {got!r}"
            if worker.joined and not obj.void:
                assert isinstance(got, asyncrpc.ObjectLostError), (
                    f"the object of {obj.worker}'s killed attempt {obj.attempt} raised "
                    f"{type(got).__name__} after attempt {worker.attempt} joined: {got}"
                )
            self.ids[call_id] = NEVER
            Shared.stats[f"lost object: {type(got).__name__}"] += 1
            return
        assert kind == "value", (
            f"Counter on {obj.worker} (attempt {obj.attempt}, alive) failed: {got!r}"
        )
        self._returned(worker, obj.attempt, call_id, got)
        self.ids[obj.created] = got[0]  # it answers: its creation ran there, once
        assert got[3] == obj.n + k, f"Counter on {obj.worker} says {got[3]}, not {obj.n + k}"
        obj.n = got[3]

    @rule(
        index=st.integers(0, 1),
        wait=st.sampled_from(["none", "event", "poll"]),
        newborn=st.sampled_from([None, None, 0.0, 0.03, 0.1]),
        quiet=st.booleans(),
    )
    @_step
    def kill(self, index: int, wait: str, newborn: float | None, quiet: bool) -> None:
        worker = self.workers[KILLABLE[index]]
        if quiet:  # no call in flight anywhere: the OOM killer's case
            while self.pending:
                self._settle(self.pending.pop())
        if worker.pid is None and self._sync_call(worker) != "value":
            return  # still being replaced: its pid is not known yet
        if newborn is not None:
            for other in WORKERS:  # every process alive is known: the newborn is the new one
                if other != worker.name and self.workers[other].pid is None:
                    self._sync_until_joined(self.workers[other])
        pid = worker.pid
        assert pid is not None
        if _state(pid) in (None, "Z", "X") and Shared.closed_listener(
            worker.name, worker.attempt + 1
        ):  # it ended itself meanwhile (a newborn killed as it connected closed its listener)
            self._catch_up(worker, worker.attempt + 1)
            return
        _kill(pid)
        self._killed(worker)
        if newborn is not None:
            self._kill_newborn(worker, newborn)
        if wait == "event":
            self._wait_event(worker)
        elif wait == "poll":
            self._sync_until_joined(worker)

    def _killed(self, worker: Worker) -> None:
        """The process of `worker.attempt` is dead: its objects are lost, its calls may fail."""
        for obj in self.objects:
            if obj.worker == worker.name and obj.attempt == worker.attempt:
                obj.lost = True
        for call in self.pending:
            if call.worker == worker.name and call.attempt == worker.attempt:
                call.may_fail = True
        worker.attempt += 1
        worker.joined = False
        Shared.stats["processes killed"] += 1
        self.note(f"  killed: {worker.name} now expects attempt {worker.attempt}")

    def _catch_up(self, worker: Worker, answered: int) -> None:
        """Restarts the model did not make: workers whose listener torch closed (exit code 76)."""
        while worker.attempt < answered:
            if not Shared.closed_listener(worker.name, worker.attempt + 1):
                return  # not one: the caller's checks say what the model expected
            self._killed(worker)
            Shared.restarts_of_own[worker.name] += 1
            Shared.stats["restarted: its listener closed"] += 1

    def _kill_newborn(self, worker: Worker, delay: float) -> None:
        """Kill the replacement's process too, `delay` s after it appears."""
        pid = _newborn(Shared.known, JOIN_S)
        if pid is None:  # the supervisor (the forkserver's parent) and the workers say where
            _where_everyone_is()
        assert pid is not None, f"no replacement of {worker.name} started within {JOIN_S} s"
        Shared.known.add(pid)
        time.sleep(delay)
        worker.pids[worker.attempt] = pid
        _kill(pid)
        Shared.stats["newborns killed"] += 1
        self._killed(worker)
        worker.retried = True

    def _wait_event(self, worker: Worker) -> None:
        want = (worker.name, WORKERS.index(worker.name) + 1, worker.attempt)
        with Shared.changed:
            met = Shared.changed.wait_for(
                lambda: any(event[:3] == want for event in Shared.events), JOIN_S
            )
        assert met, f"no on_replaced event {want} within {JOIN_S} s: {Shared.events}"
        worker.joined = True

    def _sync_until_joined(self, worker: Worker) -> None:
        deadline = time.monotonic() + JOIN_S
        while self._sync_call(worker) != "value":
            assert time.monotonic() < deadline, f"{worker.name} did not rejoin in {JOIN_S} s"
            time.sleep(0.005)

    @invariant()
    def the_survivor_keeps_its_process(self) -> None:
        survivor = self.workers[SURVIVOR]
        if Shared.restarts_of_own[SURVIVOR]:  # it ended itself, its listener closed
            return
        assert survivor.attempt == 0 and survivor.pids == {0: Shared.survivor_pid}, survivor
        assert Shared.survivor_pid not in (None, 0) and _state(Shared.survivor_pid) not in (
            None, "Z", "X"), f"{SURVIVOR} (pid {Shared.survivor_pid}) died"  # fmt: skip

    @invariant()
    def events_follow_kills(self) -> None:
        with Shared.changed:
            events = list(Shared.events)
        assert len(set(events)) == len(events), f"an on_replaced event came twice: {events}"
        for event in events:
            assert event.rank == WORKERS.index(event.name) + 1, event
            model = self.workers[event.name].attempt
            assert 1 <= event.attempt <= model or LISTENER_CLOSED in event.reason, (
                f"{event}: the model is at attempt {model}"
            )

    # ---- the example's end -----------------------------------------------------------

    def teardown(self) -> None:
        Shared.clean = False
        self.note("teardown()")
        try:
            self._end()
        except BaseException:
            Shared.failed(f"teardown: {traceback.format_exc()}")
            raise
        Shared.clean = not self.broken

    def _end(self) -> None:
        if self.broken:
            for call in self.pending:  # bounded: each call has its timeout
                _waited(call.fut)
            return
        for call in self.pending:
            self._settle(call)
        for worker in self.workers.values():
            if not worker.joined:
                self._sync_until_joined(worker)
        for obj in self.objects:
            if not obj.lost:
                self._handle_call(obj, 0)  # its count, as the model says
        self._check_ids()
        self._check_usage()
        Shared.attempts = {name: worker.attempt for name, worker in self.workers.items()}

    def _check_usage(self) -> None:
        """worker0's and the survivor's descriptors and sockets: none grows per heal.

        One exception, documented (docs/launching.md, "Healing in place"):
        TensorPipe may keep an accepted connection of a replacement killed
        during its own join in CLOSE-WAIT, one socket (and descriptor) each
        time. Such a socket is on the worker's listening port; at most one per
        newborn killed (`_kill_newborn`) may stay. Any other may not.
        """
        for name in ("worker0", SURVIVOR):
            # A worker's event loop (a thread, an epoll descriptor and a socket pair) is
            # made once, by the first coroutine it runs: part of the baseline, not growth.
            asyncrpc.rpc_sync(name, _start_loop, timeout=CALL_S)
            now = asyncrpc.rpc_sync(name, Shared.usage, timeout=CALL_S)
            deadline = time.monotonic() + CLOSE_WAIT_S
            # A heal closes the dead process's pipe by a probe that fails: it may
            # still be on its way as the replacement joins. None may stay for good.
            while _unexplained(now) and time.monotonic() < deadline:
                time.sleep(0.05)
                now = asyncrpc.rpc_sync(name, Shared.usage, timeout=CALL_S)
            first = Shared.baseline.setdefault(name, now)
            kept = _accepted(now)
            assert not _unexplained(now), (
                f"{name} holds sockets in CLOSE-WAIT: {now} (accepted connections of "
                f"newborns killed as they joined, allowed: {Shared.stats['newborns killed']})"
            )
            assert now["fds"] <= first["fds"] + FD_SLACK + kept, f"{name}: {first} -> {now}"
            assert now["threads"] <= first["threads"] + 2, f"{name}: {first} -> {now}"
            Shared.stats["usage checked"] += 1
            if kept:
                Shared.stats["accepted sockets of newborns kept (TensorPipe)"] = kept

    def _check_ids(self) -> None:
        files = _files()
        counts = collections.Counter(i for ids in files.values() for i in ids)
        twice = sorted(i for i, n in counts.items() if n > 1)
        assert not twice, f"call ids that ran twice: {twice} (by pid: {files})"
        where = {i: pid for pid, ids in files.items() for i in ids}
        for call_id, expect in self.ids.items():
            ran = where.get(call_id)
            if expect == NEVER:
                assert ran is None, f"call {call_id}, refused ({NOT_SENT}), ran on pid {ran}"
            elif expect == RAN_ONCE:
                assert ran is not None, f"call {call_id} returned but never ran"
            elif expect != MAYBE:
                assert ran == expect, f"call {call_id} answered from pid {expect}, ran on {ran}"
        for worker in self.workers.values():  # each live process's own list agrees
            pid, ids = asyncrpc.rpc_sync(worker.name, Shared.ran, timeout=CALL_S)
            assert ids == files.get(pid, []), f"{worker.name} (pid {pid}): {ids} vs its file"


async def _start_loop() -> None:
    """Run on a worker: its event loop runs from now on."""
    await asyncio.sleep(0)


def _accepted(usage: dict[str, Any]) -> int:
    """Sockets in CLOSE-WAIT on the worker's listening port: connections it accepted."""
    ports = [entry.split("->")[0] for entry in usage["close_wait_ports"]]
    return sum(1 for local in ports if int(local) == usage["listens_on"])


def _unexplained(usage: dict[str, Any]) -> int:
    """Sockets in CLOSE-WAIT beyond one accepted connection per newborn killed as it joined."""
    allowed = min(_accepted(usage), Shared.stats["newborns killed"])
    return int(usage["close_wait"]) - allowed


def check(
    examples: int,
    steps: int,
    *,
    record: Callable[..., Any],
    ran: Callable[[], tuple[int, list[int]]],
    counter: type,
    directory: str,
    record_stream: Callable[..., Any],
    relay: Callable[..., Any],
    lend_use: Callable[..., Any],
    usage: Callable[[], dict[str, int]],
) -> str | None:
    """Run the machine; None when every example kept the model, else what went wrong."""
    Shared.record, Shared.ran, Shared.counter = record, ran, counter
    Shared.directory = directory
    Shared.record_stream, Shared.relay, Shared.lend_use = record_stream, relay, lend_use
    Shared.usage = usage
    Shared.known.add(os.getpid())
    unregister = asyncrpc.on_replaced(Shared.seen)
    try:
        from heal_model_traffic import HealModel  # the base model's rules and the traffic's

        # Hypothesis leaves some rules out of each example (swarm testing): rarely, every
        # example of a run leaves `kill` out, and the run says nothing of a heal. Then it
        # runs again, at most twice more (each run's examples are fresh draws).
        for _ in range(3):
            run_state_machine_as_test(
                HealModel,
                settings=settings(
                    max_examples=examples,
                    stateful_step_count=steps,
                    deadline=None,
                    database=None,
                    phases=[Phase.generate],  # no shrinking: each run kills real processes
                    suppress_health_check=list(HealthCheck),
                ),
            )
            if Shared.stats["processes killed"] or Shared.failure is not None:
                break
    except Exception:
        Shared.failed(f"hypothesis: {traceback.format_exc()}")
    finally:
        unregister()
    print(f"heal model steps: {dict(sorted(Shared.stats.items()))}", flush=True)
    if Shared.failure is not None:
        print(f"heal model: worker0 found:\n{Shared.failure}", flush=True)
    return Shared.failure
