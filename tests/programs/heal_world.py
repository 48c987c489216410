"""Worlds that heal in place (`restart="worker"`), for tests/test_heal.py.

    HEAL_DIR=<dir> python tests/programs/heal_world.py SCENARIO [COUNT MAX_RESTARTS]

SCENARIO:
  basic    one death: what survivors, in-flight calls, lost objects and callbacks see
  deaths   every way a worker can die, rank 0 included, each healed
  faults   deaths during a heal: a second death, a replacement dying as it starts
  churn    COUNT kills in a row (max_restarts=MAX_RESTARTS), the survivors' usage
           before and after; COUNT > MAX_RESTARTS: the last kill ends the world
  start    worker0's first calls reach peers slowed as they start (a GIL hog there):
           every peer knows the members when any main runs
  formed   every worker says its attempt (deaths ordered at import: the world's start);
           formed 0 MAX_RESTARTS
  world    restart="world": the whole world starts again, as before

The driving worker prints one JSON object a line (`emit`); the workers share
files in HEAL_DIR: `runs` (one line per execution of `noted`), `mains` (one
line per start of `main`) and instructions to die (`obey`, `_die_at_import`).
"""

from __future__ import annotations

import faulthandler
import json
import multiprocessing
import os
import pathlib
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

import asyncrpc

from helpers import ctrl_c_as_in_a_terminal

DIR = pathlib.Path(os.environ.get("HEAL_DIR", "."))
BOUND_S = 30.0  # no wait of this program is longer: a hang fails the test, named
STATE: dict[str, Any] = {}  # a worker's Python state
EVENTS: list[asyncrpc.Replaced] = []  # on_replaced events seen by this worker
ORDERS: queue.Queue[str] = queue.Queue()  # what `main` is told to do next (deaths)


def _die_at_import() -> None:
    """A worker process imports this script before it joins the world: die or wait here.

    `die-import-<name>` (consumed; it may hold a count): exit 5 before joining.
    `kill-import-<name>` (consumed; it holds a delay in seconds): SIGKILL then,
    as it joins.
    `slow-import`: start 1 s later, so that a replacement stays "being
    replaced" a while. `hog-start`: a thread hogs the GIL as it starts.
    """
    name = multiprocessing.current_process().name  # the worker's name, set before the import
    order = DIR / f"die-import-{name}"
    if order.exists():  # it holds how many times (none: once)
        text = order.read_text()
        times = int(text) if text.isdigit() else 1
        if times > 1:
            order.write_text(str(times - 1))
        else:
            order.unlink()
        os._exit(5)
    if (DIR / "slow-import").exists() and name.startswith("worker"):
        time.sleep(1.0)
    if (DIR / "hog-start").exists() and name not in ("worker0", "MainProcess"):
        _hog_the_gil(3.0)
    order = DIR / f"kill-import-{name}"
    if order.exists():  # SIGKILL this process that many seconds on, as it joins (consumed)
        delay = float(order.read_text())
        order.unlink()
        threading.Timer(delay, os.kill, args=(os.getpid(), signal.SIGKILL)).start()


def _hog_the_gil(seconds: float) -> None:
    """Slow this process's start: a thread that holds the GIL 50 ms at a time."""

    def hog() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sum(range(1000))

    sys.setswitchinterval(0.05)
    threading.Thread(target=hog, name="gil-hog", daemon=True).start()


faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hang's stacks, on demand
if __name__ != "__main__":
    _die_at_import()


def emit(**record: Any) -> None:
    os.write(1, (json.dumps(record) + "\n").encode())


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def add(self, k: int) -> int:
        self.n += k
        return self.n

    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.n

    def count(self) -> Any:
        yield from range(3)


def pid() -> int:
    return os.getpid()


def attempt() -> int:
    return asyncrpc.current_context().attempt


def rank() -> int:
    return asyncrpc.current_context().rank


def noted(key: str, seconds: float) -> int:
    """Record one execution of this call (in `runs`), then sleep."""
    with open(DIR / "runs", "a") as runs:
        runs.write(key + "\n")
    time.sleep(seconds)
    return os.getpid()


def runs(key: str) -> int:
    path = DIR / "runs"
    return path.read_text().splitlines().count(key) if path.exists() else 0


def setup_state() -> str:
    STATE["mark"] = f"{asyncrpc.current_context().name}-{os.getpid()}"
    STATE["tensor"] = torch.arange(10.0)
    return str(STATE["mark"])


def get_state() -> tuple[str, float]:
    return str(STATE["mark"]), float(STATE["tensor"].sum())


def listen() -> None:
    asyncrpc.on_replaced(EVENTS.append)


def listening() -> bool:
    return bool(STATE.get("listening"))


def events() -> list[list[Any]]:
    return [list(event) for event in EVENTS]


def ping_back() -> int:
    """A survivor's call to another survivor (worker0), from an RPC."""
    return asyncrpc.rpc_sync("worker0", pid)


def order(kind: str) -> None:
    ORDERS.put(kind)


def main_done() -> bool:
    return bool(STATE.get("main-done"))


def kill_caller(caller: int) -> None:
    os.kill(caller, signal.SIGKILL)


def usage() -> dict[str, int]:
    """This process's resident memory (kB), threads and open file descriptors."""
    fields = dict(
        line.split(":", 1) for line in pathlib.Path("/proc/self/status").read_text().splitlines()
    )
    return {
        "rss_kb": int(fields["VmRSS"].split()[0]),
        "threads": int(fields["Threads"]),
        "fds": len(os.listdir("/proc/self/fd")),
    }


def until_attempt(name: str, want: int) -> list[str]:
    """Call `name` until its process is attempt `want` (or later); the errors meanwhile."""
    errors: list[str] = []
    deadline = time.monotonic() + BOUND_S
    while True:
        try:
            if asyncrpc.rpc_sync(name, attempt, timeout=10) >= want:
                return errors
        except asyncrpc.WorkerUnreachableError as exc:
            errors.append(str(exc))
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} was not replaced (attempt {want}) in {BOUND_S} s")
        time.sleep(0.005)


def wait_for(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {BOUND_S} s")
        time.sleep(0.01)


def outcome(run: Callable[[], object]) -> dict[str, Any]:
    """How `run()` ended: the exception's type and name, and how long it took."""
    start = time.monotonic()
    try:
        run()
    except Exception as exc:
        return {"error": type(exc).__name__, "name": getattr(exc, "name", None),
                "message": str(exc)[:300], "s": time.monotonic() - start}  # fmt: skip
    return {"error": None, "s": time.monotonic() - start}


def obey(ctx: asyncrpc.Context) -> None:
    """At main's start: `die-<name>-<attempt>` (consumed) says how to die here, if at all."""
    with open(DIR / "mains", "a") as mains:
        mains.write(f"{ctx.name} {ctx.attempt} {ctx.rank}\n")
    path = DIR / f"die-{ctx.name}-{ctx.attempt}"
    if not path.exists():
        return
    what = path.read_text()
    path.unlink()
    if what == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "raise":
        raise RuntimeError(f"heal test: {ctx.name} failed at attempt {ctx.attempt}")
    if what == "call-kill":  # worker0 kills this process while it serves the call
        asyncrpc.rpc_sync("worker0", kill_caller, args=(os.getpid(),))
        time.sleep(BOUND_S)


def started(name: str, attempt: int) -> bool:
    path = DIR / "mains"
    return path.exists() and any(
        line.split()[:2] == [name, str(attempt)] for line in path.read_text().splitlines()
    )


# ---- basic: one death, everything the survivors see -------------------------------------


def lost_verbs(handle: asyncrpc.RemoteObject[Counter], rref: Any) -> dict[str, Any]:
    verbs: dict[str, Callable[[], object]] = {
        "call": lambda: handle.call("add", 1),
        "call_async": lambda: handle.call_async("add", 1).wait(),
        "call_remote": lambda: handle.call_remote("add", 1).to_here(),
        "stream": lambda: list(handle.stream("count")),
        "to_here": handle.to_here,
        "rpc_sync_proxy": lambda: handle.rpc_sync().add(1),
        "owner": lambda: handle.owner,
        "rref_to_here": lambda: rref.to_here(),
        "failed_to_here": partial(failed_to_here, rref),
    }
    return {verb: outcome(run) for verb, run in verbs.items()}


def failed_to_here(rref: Any) -> None:
    """As a to_here that failed while its owner's process died, then read: its name.

    The process may be gone from torch's agent by then; the name must still come.
    """
    from asyncrpc._core import _hooks

    raise _hooks.HOOKS.name_rref(RuntimeError("to_here failed"), rref)


def basic(ctx: asyncrpc.Context) -> None:
    if ctx.rank != 0:
        listen()  # from main: a world's start is over when main runs
        STATE["listening"] = True
        return  # serve until worker0's main returns
    seen: list[asyncrpc.Replaced] = []
    other: list[asyncrpc.Replaced] = []
    asyncrpc.on_replaced(seen.append)
    asyncrpc.on_replaced(other.append)()  # unregistered at once
    wait_for(partial(asyncrpc.rpc_sync, "worker1", listening), "worker1's on_replaced")
    mark = asyncrpc.rpc_sync("worker1", setup_state)
    kept = asyncrpc.spawn("worker1", Counter)
    kept.call("add", 5)
    lost = asyncrpc.spawn("worker2", Counter)
    lost.call("add", 1)
    rref = asyncrpc.remote("worker2", Counter)
    tensor = torch.arange(6.0)
    victim = asyncrpc.rpc_sync("worker2", pid)
    inflight = asyncrpc.rpc_async("worker2", noted, args=("inflight", 60))
    inflight_handle = lost.call_async("nap", 60)
    wait_for(lambda: runs("inflight") == 1, "the call in flight started")
    (DIR / "slow-import").touch()
    os.kill(victim, signal.SIGKILL)
    died = {"rpc_async": outcome(inflight.wait), "handle": outcome(inflight_handle.wait)}
    errors, lost_during = [], None
    deadline = time.monotonic() + BOUND_S
    while True:
        try:
            replacement = asyncrpc.rpc_sync("worker2", noted, args=("during", 0))
            break
        except asyncrpc.WorkerUnreachableError as exc:
            errors.append({"name": exc.name, "message": str(exc)})
            if "being replaced" in str(exc) and lost_during is None:
                lost_during = lost_verbs(lost, rref)
        assert time.monotonic() < deadline, "worker2 was not replaced"
        time.sleep(0.002)
    (DIR / "slow-import").unlink()
    wait_for(lambda: bool(seen), "on_replaced on worker0")
    wait_for(lambda: bool(asyncrpc.rpc_sync("worker1", events)), "on_replaced on worker1")
    time.sleep(0.1)
    emit(
        check="basic",
        died=died,
        errors=errors,
        lost_during=lost_during,
        lost_after=lost_verbs(lost, rref),
        runs={"inflight": runs("inflight"), "during": runs("during")},
        attempts={name: asyncrpc.rpc_sync(name, attempt) for name in ctx.names},
        rank=asyncrpc.rpc_sync("worker2", rank),
        replaced=replacement != victim,
        counter=kept.call("add", 1),
        state=list(asyncrpc.rpc_sync("worker1", get_state)) == [mark, 45.0],
        tensor=float(tensor.sum()),
        ping=asyncrpc.rpc_sync("worker1", ping_back) == os.getpid(),
        events={
            "worker0": [list(e) for e in seen],
            "worker1": asyncrpc.rpc_sync("worker1", events),
            "unregistered": [list(e) for e in other],
        },
    )


# ---- deaths: each way to die, each healed ------------------------------------------------

STEPS = [
    ("worker1", "SIGKILL"),
    ("worker1", "SIGTERM"),
    ("worker1", "exit3"),
    ("worker1", "raise"),
    ("worker1", "exit0"),
    ("worker1", "after-return"),
    ("worker0", "SIGKILL"),
]


def deaths(ctx: asyncrpc.Context) -> None:
    if ctx.rank != 2:
        while True:
            kind = ORDERS.get()
            if kind == "return":
                STATE["main-done"] = True
                return
            if kind in ("exit3", "exit0"):
                os._exit(int(kind[-1]))
            if kind == "raise":
                raise RuntimeError(f"heal test: {ctx.name} raised at attempt {ctx.attempt}")
    for name, kind in STEPS:
        victim, before = asyncrpc.rpc_sync(name, pid), asyncrpc.rpc_sync(name, attempt)
        start = time.monotonic()
        if kind.startswith("SIG"):
            os.kill(victim, getattr(signal, kind))
        elif kind == "after-return":
            asyncrpc.rpc_sync(name, order, args=("return",))
            wait_for(partial(asyncrpc.rpc_sync, name, main_done), f"{name}'s main returned")
            time.sleep(0.2)  # in shutdown: serving until every main returned
            start = time.monotonic()
            os.kill(victim, signal.SIGKILL)
        else:  # the order's reply may not come back: main dies as it gets it
            asyncrpc.rpc_async(name, order, args=(kind,))
        until_attempt(name, before + 1)
        wait_for(partial(started, name, before + 1), f"{name}'s main ran again")
        emit(check="death", kind=kind, name=name, attempt=asyncrpc.rpc_sync(name, attempt),
             rank=asyncrpc.rpc_sync(name, rank), new_pid=asyncrpc.rpc_sync(name, pid) != victim,
             s=time.monotonic() - start)  # fmt: skip
    for name in ("worker0", "worker1"):
        asyncrpc.rpc_sync(name, order, args=("return",))


# ---- faults: deaths during a heal ---------------------------------------------------------


def kill(name: str) -> int:
    before = asyncrpc.rpc_sync(name, attempt)
    os.kill(asyncrpc.rpc_sync(name, pid), signal.SIGKILL)
    return before


def faults(ctx: asyncrpc.Context) -> None:
    if ctx.rank != 0:
        return
    kept = asyncrpc.spawn("worker1", Counter)
    kept.call("add", 5)

    start = time.monotonic()  # a second death while the first is being replaced
    (DIR / "slow-import").touch()
    kill("worker2")
    wait_for(lambda: _being_replaced("worker2"), "worker2 being replaced")
    kill("worker3")
    until_attempt("worker2", 1)
    until_attempt("worker3", 1)
    (DIR / "slow-import").unlink()
    emit(check="fault", fault="second-death-during-heal", s=time.monotonic() - start)

    start = time.monotonic()  # two deaths at once
    kill("worker2")
    kill("worker3")
    until_attempt("worker2", 2)
    until_attempt("worker3", 2)
    emit(check="fault", fault="two-at-once", s=time.monotonic() - start)

    for name, when, how in [
        ("worker2", 3, "import"),  # the replacement exits before it joins
        ("worker3", 3, "kill"),  # it kills itself as its main starts
        ("worker2", 5, "raise"),  # its main raises on its first line
        ("worker3", 5, "call-kill"),  # it is killed during its main's first call
    ]:
        start = time.monotonic()
        path = DIR / (f"die-import-{name}" if how == "import" else f"die-{name}-{when}")
        path.write_text(how)
        kill(name)
        until_attempt(name, when + 1)
        emit(check="fault", fault=how, name=name, attempt=asyncrpc.rpc_sync(name, attempt),
             consumed=not path.exists(), s=time.monotonic() - start)  # fmt: skip
    emit(check="faults-end", counter=kept.call("add", 1),
         attempts={name: asyncrpc.rpc_sync(name, attempt) for name in ctx.names})  # fmt: skip


def _being_replaced(name: str) -> bool:
    try:
        asyncrpc.rpc_sync(name, attempt)
    except asyncrpc.WorkerUnreachableError as exc:
        return "being replaced" in str(exc)
    return False


# ---- churn: kills in a row; what the survivors keep -----------------------------------------


def churn(ctx: asyncrpc.Context, count: int, max_restarts: int) -> None:
    if ctx.rank != 0:
        return
    seen: list[asyncrpc.Replaced] = []
    asyncrpc.on_replaced(seen.append)
    kept = asyncrpc.spawn("worker1", Counter)
    kept.call("add", 5)
    asyncrpc.rpc_sync("worker1", listen)
    before = {"worker0": usage(), "worker1": asyncrpc.rpc_sync("worker1", usage)}
    for i in range(min(count, max_restarts)):
        name = "worker2" if i < 5 or i % 2 else "worker3"
        start = time.monotonic()
        want = kill(name) + 1
        until_attempt(name, want)
        emit(check="churn", i=i, name=name, attempt=want, s=time.monotonic() - start)
    wait_for(lambda: len(seen) == min(count, max_restarts), "every on_replaced event")
    time.sleep(0.3)  # the callbacks' threads end
    after = {"worker0": usage(), "worker1": asyncrpc.rpc_sync("worker1", usage)}
    emit(check="usage", before=before, after=after, counter=kept.call("add", 1),
         events=len(seen), events1=len(asyncrpc.rpc_sync("worker1", events)))  # fmt: skip
    if count > max_restarts:
        emit(check="final-kill", pid=os.getpid())
        kill("worker2")
        time.sleep(BOUND_S)  # the supervisor stops this worker


# ---- start: first calls to peers that start slowly --------------------------------------


def start(ctx: asyncrpc.Context) -> None:
    if ctx.rank != 0:
        return
    first = {name: outcome(partial(asyncrpc.rpc_sync, name, listen)) for name in ctx.names[1:]}
    emit(check="start", first=first)


def formed(ctx: asyncrpc.Context, *_: int) -> None:
    emit(check="formed", name=ctx.name, attempt=ctx.attempt)


# ---- world: restart="world" as before -------------------------------------------------------


def exit3() -> None:
    os._exit(3)


def whole(ctx: asyncrpc.Context) -> None:
    emit(check="world", name=ctx.name, attempt=ctx.attempt)
    STATE["listening"] = True  # this main has started
    if ctx.rank == 0 and ctx.attempt == 0:
        wait_for(partial(asyncrpc.rpc_sync, "worker1", listening), "worker1's main started")
        emit(check="on_replaced", outcome=outcome(lambda: asyncrpc.on_replaced(print)))
        asyncrpc.rpc_async("worker1", exit3)
        time.sleep(BOUND_S)  # the supervisor stops this worker to start the world again


def main(ctx: asyncrpc.Context, scenario: str, *args: int) -> None:
    if scenario != "world":
        obey(ctx)
    scenarios = {"basic": basic, "deaths": deaths, "faults": faults, "churn": churn,
                 "start": start, "formed": formed, "world": whole}  # fmt: skip
    scenarios[scenario](ctx, *args)


if __name__ == "__main__":
    ctrl_c_as_in_a_terminal()  # the SIGINT test's signal stands for a user's Ctrl-C
    scenario = sys.argv[1]
    numbers = tuple(int(arg) for arg in sys.argv[2:])
    if scenario == "world":
        asyncrpc.run(main, world_size=2, args=(scenario,), max_restarts=1, restart="world")
    else:
        size = {"basic": 3, "deaths": 3}.get(scenario, 4)
        if scenario == "start":
            (DIR / "hog-start").touch()
        restarts = {"basic": 1, "deaths": len(STEPS), "faults": 12, "start": 1}.get(
            scenario, numbers[1] if numbers else 0
        )
        asyncrpc.run(main, world_size=size, args=(scenario, *numbers), max_restarts=restarts,
                     restart="worker", rpc_timeout=60)  # fmt: skip
    print("world ended", flush=True)
