"""Worlds that grow and shrink while they run (`elastic=True`), for tests/test_elastic.py.

    ELASTIC_DIR=<dir> python tests/programs/elastic_world.py SCENARIO

SCENARIO:
  basic    adds and removes with mixed traffic (handles, RRefs, streams, Batch, relays):
           names, ranks, contexts, events, errors, a busy worker's call finishing
  failjoin an added worker that dies as it starts: named error, nothing left behind
  timeout  an added worker slower than add_workers' timeout: JoinTimeoutError, none left
  stuck    a removed worker whose main never returns: stopped at the timeout, its
           running call fails with WorkerLeftError
  heal     elastic and healing: an added worker killed is replaced under its name
  dump     asyncrpc-dump of a world that grew and shrank
  traced   a trace open while a worker joins and another leaves
  edges    a timeout shorter than the supervisor's answer; the supervisor's fds over
           adds and removes; a removed worker whose main never returns (the world ends)
  fixed    a world that does not grow: the verbs say so

worker0 drives each world and prints one JSON object a line (`emit`).
Workers obey files in ELASTIC_DIR: `die-<name>` (exit 5 as it starts),
`slow-<name>` (start 30 s late), and write `pid-<name>` as they start.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import pathlib
import signal
import sys
import threading
import time
from typing import Any

import torch

import asyncrpc

from helpers import count, error_of

DIR = pathlib.Path(os.environ.get("ELASTIC_DIR", "."))
EVENTS: list[list[Any]] = []
BOUND_S = 30.0  # no wait of this program is longer


def _at_start() -> None:
    """A worker imports this script before it joins: obey the files that name it."""
    name = multiprocessing.current_process().name
    if name == "MainProcess":
        return
    (DIR / f"pid-{name}").write_text(str(os.getpid()))
    if (DIR / f"die-{name}").exists():
        os._exit(5)
    if (DIR / f"slow-{name}").exists():
        time.sleep(30)


_at_start()


def emit(check: str, **values: Any) -> None:
    print(json.dumps({"check": check, **values}), flush=True)


class Actor:
    def __init__(self) -> None:
        self.steps = 0

    def step(self, x: int) -> int:
        self.steps += 1
        return x + 1


def whoami() -> list[Any]:
    ctx = asyncrpc.current_context()
    return [ctx.name, ctx.rank, ctx.world_size, list(ctx.names), ctx.role, os.getpid()]


def seen_members() -> list[str]:
    return list(asyncrpc.members())


def seen_events() -> list[list[Any]]:
    return EVENTS


def relay(to: str) -> list[Any]:
    return asyncrpc.rpc_sync(to, whoami)


def slow(seconds: float) -> str:
    time.sleep(seconds)
    return "done"


def count_slowly(n: int) -> Any:
    for i in range(n):
        time.sleep(0.05)
        yield i


def stubborn() -> None:
    """Remove this worker, then go on running anyway (its main ignores stopping())."""
    asyncrpc.remove_workers(asyncrpc.current_context().name)


def descriptors(pid: int) -> collections.Counter[str]:
    """What `pid` holds open, by kind (pipe, socket, anon_inode:..., or the path)."""
    held: collections.Counter[str] = collections.Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            held[os.readlink(f"/proc/{pid}/fd/{fd}").split(":[")[0]] += 1
        except OSError:
            continue  # closed while read
    return held


def settled_descriptors(
    pid: int, quiet: float = 2.0, most: float = 6.0, enough: int | None = None
) -> collections.Counter[str]:
    """What `pid` holds once its count stopped falling for `quiet` s: a removed worker's
    pipes and store socket close only as it exits, seconds late on a loaded machine;
    a leak stays. With `enough`, it waits (up to `most` s) until the count is at most
    that instead: a removed worker may take longer than `quiet` to exit under load."""
    fewest = descriptors(pid)
    calm_since = started = time.monotonic()
    while time.monotonic() - started < most and (
        fewest.total() > enough if enough is not None else time.monotonic() - calm_since < quiet
    ):
        time.sleep(0.1)
        now = descriptors(pid)
        if now.total() < fewest.total():
            fewest, calm_since = now, time.monotonic()
    return fewest


def remove_self() -> None:
    asyncrpc.remove_workers(asyncrpc.current_context().name)


def _record(event: Any) -> None:
    EVENTS.append([type(event).__name__, *event])


def _wait_for(check: Any, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("a wait of the program timed out")
        time.sleep(0.02)


def basic(ctx: asyncrpc.Context) -> None:
    before = list(asyncrpc.members())
    started = time.perf_counter()
    added = asyncrpc.add_workers(2)
    took = time.perf_counter() - started
    emit("add", before=before, added=list(added), took=took, after=list(asyncrpc.members()),
         peer=asyncrpc.rpc_sync("worker1", seen_members),
         contexts=[asyncrpc.rpc_sync(n, whoami) for n in added],
         relay=asyncrpc.rpc_sync("worker1", relay, args=("worker3",)))  # fmt: skip
    # Traffic of every kind to the new members.
    handle = asyncrpc.spawn("worker2", Actor)
    rref = asyncrpc.remote("worker2", torch.ones, args=((3,),))
    with asyncrpc.Batch() as batch:
        futs = [batch.rpc_async(n, torch.add, args=(torch.ones(2), 1)) for n in added]
    emit("traffic", step=handle.call("step", 1), rref=rref.to_here().tolist(),
         stream=list(asyncrpc.stream("worker3", count, args=(5,))),
         batch=[f.wait().tolist() for f in futs])  # fmt: skip
    started = time.perf_counter()
    asyncrpc.remove_workers("worker2")
    took = time.perf_counter() - started
    emit("remove", took=took, after=list(asyncrpc.members()),
         peer=asyncrpc.rpc_sync("worker1", seen_members),
         call=error_of(lambda: asyncrpc.rpc_sync("worker2", whoami)),
         handle=error_of(lambda: handle.call("step", 1)),
         rref=error_of(lambda: rref.to_here()),
         nested=error_of(lambda: asyncrpc.rpc_sync("worker1", relay, args=("worker2",))),
         again=error_of(lambda: asyncrpc.remove_workers("worker2")))  # fmt: skip
    busy = asyncrpc.rpc_async("worker3", slow, args=(1.5,))
    streamed: list[Any] = []
    stream = asyncrpc.stream("worker3", count_slowly, args=(10,), window=2)
    streamed.append(next(stream))
    reader = threading.Thread(target=lambda: streamed.extend(stream), name="reader")
    reader.start()
    time.sleep(0.3)  # both run there
    asyncrpc.remove_workers("worker3")
    reader.join(BOUND_S)
    emit("busy", result=busy.wait(), streamed=streamed, after=list(asyncrpc.members()))
    actors = asyncrpc.add_workers(1, role="actor")
    emit("role", added=list(actors), context=asyncrpc.rpc_sync(actors[0], whoami),
         full=error_of(lambda: asyncrpc.add_workers(2)),
         bad=error_of(lambda: asyncrpc.add_workers(0)),
         unknown=error_of(lambda: asyncrpc.remove_workers("nobody")))  # fmt: skip
    asyncrpc.rpc_sync(actors[0], remove_self)  # it removes itself: returns at once
    # Events arrive on a thread of their own, on every member: wait for the last one.
    _wait_for(lambda: any(e[0] == "Left" and e[1] == actors[0] for e in EVENTS))
    _wait_for(lambda: any(e[0] == "Left" and e[1] == actors[0]
                          for e in asyncrpc.rpc_sync("worker1", seen_events)))  # fmt: skip
    emit("events", mine=EVENTS, peer=asyncrpc.rpc_sync("worker1", seen_events),
         after=list(asyncrpc.members()))  # fmt: skip


def failjoin(ctx: asyncrpc.Context) -> None:
    (DIR / "die-worker2").write_text("")
    error = error_of(lambda: asyncrpc.add_workers(1))
    after = list(asyncrpc.members())
    added = asyncrpc.add_workers(1)
    emit("failjoin", error=error, after=after, added=list(added),
         answer=asyncrpc.rpc_sync(added[0], whoami)[0])  # fmt: skip


def timeout(ctx: asyncrpc.Context) -> None:
    (DIR / "slow-worker2").write_text("")
    started = time.perf_counter()
    error = error_of(lambda: asyncrpc.add_workers(1, timeout=2))
    took = time.perf_counter() - started
    pid = int((DIR / "pid-worker2").read_text())
    time.sleep(0.5)
    emit("timeout", error=error, took=took, after=list(asyncrpc.members()),
         alive=os.path.exists(f"/proc/{pid}"))  # fmt: skip


def stuck(ctx: asyncrpc.Context) -> None:
    added = asyncrpc.add_workers(1)
    busy = asyncrpc.rpc_async(added[0], slow, args=(20,))
    time.sleep(0.3)
    started = time.perf_counter()
    asyncrpc.remove_workers(added[0], timeout=1)
    took = time.perf_counter() - started
    emit("stuck", took=took, call=error_of(busy.wait), after=list(asyncrpc.members()))


def heal(ctx: asyncrpc.Context) -> None:
    added = asyncrpc.add_workers(1)
    pid = asyncrpc.rpc_sync(added[0], whoami)[5]
    os.kill(pid, signal.SIGKILL)
    _wait_for(lambda: any(e[0] == "Replaced" for e in EVENTS))
    emit("heal", events=EVENTS, answer=asyncrpc.rpc_sync(added[0], whoami),
         after=list(asyncrpc.members()))  # fmt: skip


def dump(ctx: asyncrpc.Context) -> None:
    import subprocess

    asyncrpc.add_workers(2)
    asyncrpc.remove_workers("worker2")
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    command = [sys.executable, "-m", "asyncrpc._inspect._dump", "--world", address, "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    emit("dump", code=done.returncode, dump=json.loads(done.stdout or "{}"), err=done.stderr)


def traced(ctx: asyncrpc.Context) -> None:
    path = DIR / "trace.json"
    with asyncrpc.trace(path) as recorded:
        asyncrpc.rpc_sync("worker1", whoami)
        added = asyncrpc.add_workers(1)  # joins while the trace records
        asyncrpc.rpc_sync(added[0], whoami)
        asyncrpc.remove_workers("worker1")  # leaves while the trace records
    events = json.loads(path.read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    marks = [[processes[e["pid"]], e["name"]] for e in events
             if e.get("ph") == "i" and e.get("cat") == "asyncrpc"]  # fmt: skip
    with asyncrpc.trace(DIR / "again.json") as again:  # the members now are recorded
        asyncrpc.rpc_sync(added[0], whoami)
    emit("traced", workers=list(recorded.workers), processes=sorted(processes.values()),
         marks=sorted(marks), again=list(again.workers))  # fmt: skip


def edges(ctx: asyncrpc.Context) -> None:
    tiny = error_of(lambda: asyncrpc.add_workers(1, timeout=0.005))
    after_tiny = list(asyncrpc.members())
    parent = int(os.environ["ELASTIC_PARENT"])
    for _ in range(3):  # what the first changes open (threads, spares) is not growth
        asyncrpc.remove_workers(*asyncrpc.add_workers(1))
    before = settled_descriptors(parent)
    for _ in range(12):
        asyncrpc.remove_workers(*asyncrpc.add_workers(1))
    after = settled_descriptors(parent, most=30.0, enough=before.total())
    grown = after.total() - before.total()
    kinds = {k: after.get(k, 0) - before.get(k, 0) for k in {*after, *before}}
    ignoring = asyncrpc.add_workers(1, role="stubborn")[0]
    asyncrpc.rpc_sync(ignoring, stubborn)  # removed; its main never returns
    emit(
        "edges",
        tiny=tiny,
        after_tiny=after_tiny,
        grown=grown,
        grown_by_kind={k: n for k, n in kinds.items() if n},
        members=list(asyncrpc.members()),
    )


def fixed(ctx: asyncrpc.Context) -> None:
    emit("fixed", members=list(asyncrpc.members()),
         add=error_of(lambda: asyncrpc.add_workers(1)),
         remove=error_of(lambda: asyncrpc.remove_workers("worker1")),
         watch=error_of(lambda: asyncrpc.on_members(print)))  # fmt: skip


SCENARIOS = {
    f.__name__: f for f in (basic, failjoin, timeout, stuck, heal, dump, traced, edges, fixed)
}


def main(ctx: asyncrpc.Context, scenario: str) -> None:
    if scenario != "fixed":
        asyncrpc.on_members(_record)
    if ctx.name == "worker0":
        SCENARIOS[scenario](ctx)
        return
    if ctx.role == "stubborn":
        while True:  # ignores stopping(): the world ends without it
            time.sleep(0.05)
    if ctx.role == "actor" or (scenario == "stuck" and ctx.rank >= 2):
        while scenario == "stuck" or not asyncrpc.stopping():
            time.sleep(0.05)


if __name__ == "__main__":
    which = sys.argv[1]
    os.environ["ELASTIC_PARENT"] = str(os.getpid())  # the supervisor: workers read its fds
    options: dict[str, Any] = {"elastic": which != "fixed", "max_world_size": 4}
    if which in ("heal", "failjoin", "timeout"):
        # Healing worlds are elastic too, without spares: these workers obey orders at
        # import, where a spare has no name yet (elastic=True forks one ahead).
        options = {"restart": "worker", "max_restarts": 2, "max_world_size": 4}
    if which == "fixed":
        options = {}
    asyncrpc.run(main, world_size=2, args=(which,), **options)
