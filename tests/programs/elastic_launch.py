"""Elastic worlds under `asyncrpc-launch --elastic`, for tests/test_elastic_launch.py.

    asyncrpc-launch --elastic --nproc-per-node 2 tests/programs/elastic_launch.py grow
    asyncrpc-launch --elastic --nnodes 2 ... elastic_launch.py nodes STATUS_FILE

SCENARIO:
  grow   one node: add_workers (new interpreters) with calls, a handle and a stream on
         them, remove_workers of one running a call, events, the launcher's errors, an
         added worker killed (it leaves), then worker1, a first worker (it leaves too)
  nodes  node 0 waits for a node that joins (--join) with 2 workers, calls every
         member, then writes "ready" to STATUS_FILE; the test sends SIGTERM to node 1's
         launcher, whose workers leave (stopping() turns True there); node 0 sees them
         go, checks the rest still answer, and prints its result

worker0 prints one JSON line `RESULT {...}`; every worker whose `asyncrpc.run`
returns prints `RAN <what it returned>` (its own main's result).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import sys
import threading
import time
from typing import Any

import asyncrpc

from helpers import Counter, count, error_of

BOUND_S = 60.0
EVENTS: list[list[Any]] = []
LOCK = threading.Lock()


def whoami() -> list[Any]:
    ctx = asyncrpc.current_context()
    return [ctx.name, ctx.rank, ctx.world_size, os.environ.get("ASYNCRPC_NODE"), os.getpid()]


def slow(seconds: float) -> str:
    time.sleep(seconds)
    return "finished"


def _record(event: Any) -> None:
    with LOCK:
        EVENTS.append([type(event).__name__, event.name, getattr(event, "reason", "")])


def _wait_for(check: Any, seconds: float = BOUND_S) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {seconds} s; members {asyncrpc.members()}, {EVENTS}")
        time.sleep(0.02)


def grow(ctx: asyncrpc.Context) -> dict[str, Any]:
    started = time.perf_counter()
    added = asyncrpc.add_workers(2)
    add_s = time.perf_counter() - started
    who = {name: asyncrpc.rpc_sync(name, whoami) for name in added}
    handle = asyncrpc.spawn(added[0], Counter)
    handle.call("add", 2)
    streamed = list(asyncrpc.stream(added[1], count, args=(3,)))
    running = asyncrpc.rpc_async(added[1], slow, args=(1.0,))
    time.sleep(0.2)
    asyncrpc.remove_workers(added[1])
    out = {
        "added": list(added),
        "add_s": add_s,
        "who": who,
        "handle": handle.call("add", 3),
        "stream": streamed,
        "running": running.wait(),
        "after": error_of(lambda: asyncrpc.rpc_sync(added[1], whoami)),
        "members": list(asyncrpc.members()),
        "full": error_of(lambda: asyncrpc.add_workers(1, node=7)),
    }
    _wait_for(lambda: any(e[0] == "Left" for e in EVENTS))
    victim = asyncrpc.add_workers(1)[0]  # killed: an added worker that dies leaves
    os.kill(asyncrpc.rpc_sync(victim, whoami)[4], signal.SIGKILL)
    _wait_for(lambda: any(e[0] == "Left" and e[1] == victim for e in EVENTS))
    out["killed"] = next(e for e in EVENTS if e[0] == "Left" and e[1] == victim)
    out["after_kill"] = error_of(lambda: asyncrpc.rpc_sync(victim, whoami))
    out["members_after_kill"] = list(asyncrpc.members())
    # A first worker (not rank 0) that dies leaves as well, without --max-restarts.
    os.kill(asyncrpc.rpc_sync("worker1", whoami)[4], signal.SIGKILL)
    _wait_for(lambda: any(e[0] == "Left" and e[1] == "worker1" for e in EVENTS))
    out["first_killed"] = next(e for e in EVENTS if e[0] == "Left" and e[1] == "worker1")
    out["members_after_first"] = list(asyncrpc.members())
    out["events"] = EVENTS
    return out


def nodes(ctx: asyncrpc.Context, status: str) -> dict[str, Any]:
    _wait_for(lambda: len(asyncrpc.members()) >= 6)
    names = asyncrpc.members()
    who = {name: asyncrpc.rpc_sync(name, whoami) for name in names}
    added = asyncrpc.add_workers(1, node=1)  # started by node 1's launcher
    who[added[0]] = asyncrpc.rpc_sync(added[0], whoami)
    pathlib.Path(status).write_text("ready")
    on_node_1 = sorted(n for n, w in who.items() if w[3] == "1")
    _wait_for(lambda: {e[1] for e in EVENTS if e[0] == "Left"} >= set(on_node_1))
    rest = [n for n in asyncrpc.members() if n != ctx.name]
    return {
        "who": who,
        "on_node_1": on_node_1,
        "left": sorted(e[1:] for e in EVENTS if e[0] == "Left"),
        "after": error_of(lambda: asyncrpc.rpc_sync(on_node_1[0], whoami)),
        "rest": {n: asyncrpc.rpc_sync(n, whoami)[0] for n in rest},
        "members": list(asyncrpc.members()),
    }


def main(ctx: asyncrpc.Context, scenario: str, *rest: str) -> str:
    asyncrpc.on_members(_record)
    if ctx.rank == 0:
        result = grow(ctx) if scenario == "grow" else nodes(ctx, *rest)
        print("RESULT " + json.dumps(result), flush=True)
        return f"the result of {ctx.name}"
    if os.environ.get("ASYNCRPC_NODE") == "1":  # preempted later: leaves when told
        deadline = time.monotonic() + BOUND_S
        while not asyncrpc.stopping() and time.monotonic() < deadline:
            time.sleep(0.05)
        print(f"{ctx.name} on {socket.gethostname()} stopping", file=sys.stderr, flush=True)
    return f"the result of {ctx.name}"


if __name__ == "__main__":
    print("RAN", asyncrpc.run(main, args=tuple(sys.argv[1:])), flush=True)
