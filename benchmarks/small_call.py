"""Where a small call's time goes: from a bare TCP ping-pong up to asyncrpc.rpc_sync.

Each layer is measured in the same run, the ways alternated round by round,
and the difference between neighbours is what that layer adds::

    1. TCP ping-pong, 40 bytes, two Python processes on loopback   (the floor)
    2. torch rpc_sync of a builtin (torch.add): TensorPipe + the agent, no Python on the callee
    3. torch rpc_sync of a Python function: + pickling and Python on the agent's threads
    4. asyncrpc.rpc_sync of the same function: + asyncrpc's layer
    and, in this process only: pickling one call and unpickling it

Then what a Python function's time over the builtin's is made of: the same
three calls (2, 3, 4) in worlds that differ in one thing, each world started
afresh every round, the worlds alternated round by round:

    thread states kept     asyncrpc's default: each RPC thread keeps its Python state
    thread states not kept keep_thread_states=False: a new one each time a thread takes the GIL
    switch interval 0.1 ms / 50 ms   sys.setswitchinterval on both workers (Python's: 5 ms)
    4 RPC threads          num_worker_threads=4 (default 16)

For every call, the scheduler's view of both workers, read from /proc
(schedstat and status of every thread): CPU used per call, time spent
runnable but waiting for a core, and context switches per call, by thread.

    python benchmarks/small_call.py [--calls 500] [--rounds 5] [--json PATH]

--json PATH also writes every figure printed, with the run's date, machine,
versions and command line (benchmarks/run_record.py).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.rpc as rpc
from profile_small_call import thread_role
from torch.distributed.rpc import api as rpc_api
from torch.distributed.rpc.internal import PythonUDF

import asyncrpc

import run_record

_MESSAGE = b"x" * 40
CALLS = ("2. torch rpc_sync, builtin torch.add", "3. torch rpc_sync, Python function",
         "4. asyncrpc.rpc_sync, Python function")  # fmt: skip
# name -> (Settings options, switch interval or None)
WORLDS: dict[str, tuple[dict[str, Any], float | None]] = {
    "thread states kept (default)": ({}, None),
    "thread states not kept": ({"keep_thread_states": False}, None),
    "switch interval 0.1 ms": ({}, 1e-4),
    "switch interval 50 ms": ({}, 0.05),
    "4 RPC threads": ({"num_worker_threads": 4}, None),
}


def echo(x: torch.Tensor) -> torch.Tensor:
    return x


_SERVER = """
import socket, sys
with socket.create_server(("127.0.0.1", 0)) as server:
    print(server.getsockname()[1], flush=True)
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while data := conn.recv(64):
            conn.sendall(data)
"""


def _ping_pong() -> tuple[Callable[[], object], Callable[[], None]]:
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    sock = socket.create_connection(("127.0.0.1", int(server.stdout.readline())))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def once() -> object:
        sock.sendall(_MESSAGE)
        return sock.recv(64)

    def close() -> None:
        sock.close()
        server.wait(10)

    return once, close


def _pickling(x: torch.Tensor) -> tuple[Callable[[], object], Callable[[], object]]:
    pickler = rpc_api._default_pickler
    payload, tensors = pickler.serialize(PythonUDF(echo, (x,), {}))
    return (
        lambda: pickler.serialize(PythonUDF(echo, (x,), {})),
        lambda: pickler.deserialize(payload, tensors),
    )


def thread_times() -> dict[str, list[int]]:
    """Per thread role of this process: [cpu ns, runnable-waiting ns, switches]."""
    roles: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    pid = os.getpid()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            cpu, wait, _ = map(int, Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split())
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        switches = sum(
            int(line.split()[1]) for line in status.splitlines() if "ctxt_switches" in line
        )
        role = thread_role(comm, int(tid) == pid)
        for i, value in enumerate((cpu, wait, switches)):
            roles[role][i] += value
    return dict(roles)


def _timed(way: Callable[[], object], calls: int) -> dict[str, Any]:
    """Run `way` `calls` times: seconds per call and both workers' thread times per call."""
    before = [thread_times(), rpc.rpc_sync("worker1", thread_times)]
    start = time.perf_counter()
    for _ in range(calls):
        way()
    seconds = (time.perf_counter() - start) / calls
    after = [thread_times(), rpc.rpc_sync("worker1", thread_times)]
    sides = {}
    for side, old, new in zip(("caller", "callee"), before, after, strict=True):
        sides[side] = {
            role: [(v - w) / calls for v, w in zip(values, old.get(role, [0, 0, 0]), strict=True)]
            for role, values in new.items()
        }
    return {"seconds": seconds, "threads": sides}


def measure_world(ctx: asyncrpc.Context, world: str, calls: int, out: str) -> None:
    """On worker0: time the three calls (and, in the first world, the other layers)."""
    if ctx.rank != 0:
        return
    switch = WORLDS[world][1]
    if switch is not None:
        sys.setswitchinterval(switch)
        rpc.rpc_sync("worker1", sys.setswitchinterval, args=(switch,))
    x = torch.ones(16)
    ways: dict[str, Callable[[], object]] = {
        CALLS[0]: lambda: rpc.rpc_sync("worker1", torch.add, args=(x, 1)),
        CALLS[1]: lambda: rpc.rpc_sync("worker1", echo, args=(x,)),
        CALLS[2]: lambda: asyncrpc.rpc_sync("worker1", echo, args=(x,)),
    }
    close = None
    if world == next(iter(WORLDS)):
        ping, close = _ping_pong()
        pickle_call, unpickle_call = _pickling(x)
        ways = {"1. TCP ping-pong, 40 B (floor)": ping, **ways}
        ways["   pickling one call (caller)"] = pickle_call
        ways["   unpickling one call (callee)"] = unpickle_call
    for way in ways.values():
        for _ in range(20):  # warm-up
            way()
    found = {name: _timed(way, calls) for name, way in ways.items()}
    if close is not None:
        close()
    with open(out, "a") as file:
        file.write(json.dumps({"world": world, "ways": found}) + "\n")


def figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Every figure `report` prints: layers, worlds and threads (medians over rounds)."""
    samples: dict[tuple[str, str], list[dict[str, Any]]] = collections.defaultdict(list)
    for row in rows:
        for name, found in row["ways"].items():
            samples[row["world"], name].append(found)
    us = {
        key: statistics.median(s["seconds"] for s in found) * 1e6 for key, found in samples.items()
    }
    threads = {
        f"{world}, {name[3:]}": _threads(samples[world, name])
        for world in list(WORLDS)[:2]
        for name in CALLS[:2]
        if (world, name) in samples
    }
    return {"layers": _layers(us), "worlds": _worlds(us), "threads": threads}


def _layers(us: dict[tuple[str, str], float]) -> dict[str, dict[str, float]]:
    """Each layer of the default world: us per call, what it adds, its share of step 4."""
    first = next(iter(WORLDS))
    names = [name for world, name in us if world == first]
    layers = {}
    for i, name in enumerate(names):
        adds = us[first, name] - us[first, names[i - 1]] if 0 < i < 4 else us[first, name]
        share = adds / us[first, names[3]]
        layers[name] = {"us": us[first, name], "adds_us": adds, "of_step_4": share}
    return layers


def _worlds(us: dict[tuple[str, str], float]) -> dict[str, dict[str, float]]:
    """Each world's three calls (us) and their ratios to the builtin's."""
    worlds = {}
    for world in WORLDS:
        if (world, CALLS[0]) in us:
            b, p, a = (us[world, name] for name in CALLS)
            worlds[world] = {
                "builtin_us": b,
                "python_us": p,
                "asyncrpc_us": a,
                "python_over_builtin": p / b,
                "asyncrpc_over_builtin": a / b,
            }
    return worlds


def _threads(found: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Side -> thread role -> median CPU us, runnable-waiting us, switches per call."""
    sides = {}
    for side in ("caller", "callee"):
        roles = sorted({role for s in found for role in s["threads"][side]})
        sides[side] = {}
        for role in roles:
            values = [s["threads"][side].get(role, [0, 0, 0]) for s in found]
            cpu, wait, switches = (statistics.median(v[i] for v in values) for i in range(3))
            sides[side][role] = {"cpu_us": cpu / 1e3, "wait_us": wait / 1e3, "switches": switches}
    return sides


def report(found: dict[str, Any]) -> None:
    """Print the layer table, the world table and the thread breakdown (from `figures`)."""
    head = "layer (states kept, the default)"
    print(f"{head:<46}{'us per call':>12}{'adds (us)':>11}{'of step 4':>11}")
    for name, f in found["layers"].items():
        print(f"{name:<46}{f['us']:>12.1f}{f['adds_us']:>11.1f}{f['of_step_4']:>10.1%}")
    print(f"\n{'world':<30}{'builtin':>9}{'Python':>9}{'asyncrpc':>10}"
          f"{'Python/builtin':>16}{'asyncrpc/builtin':>18}")  # fmt: skip
    for world, f in found["worlds"].items():
        b, p, a = f["builtin_us"], f["python_us"], f["asyncrpc_us"]
        print(f"{world:<30}{b:>9.0f}{p:>9.0f}{a:>10.0f}{p / b:>15.2f}x{a / b:>17.2f}x")
    print("\nper call, by thread (median): CPU us / runnable-waiting us / context switches")
    for name, sides in found["threads"].items():
        print(f"{name}:")
        print(_threads_line(sides))


def _threads_line(sides: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = []
    for side, roles in sides.items():
        parts = [
            f"{role} {t['cpu_us']:.0f}/{t['wait_us']:.0f}/{t['switches']:.1f}"
            for role, t in roles.items()
            if t["cpu_us"] > 2 or t["switches"] > 0.05
        ]
        lines.append(f"  {side}: " + ", ".join(parts))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", metavar="PATH", help="also write this run's figures here")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.jsonl")
        for _ in range(opts.rounds):
            for world, (options, _) in WORLDS.items():
                asyncrpc.run(measure_world, world_size=2, args=(world, opts.calls, out), **options)
        rows = [json.loads(line) for line in Path(out).read_text().splitlines()]
    found = figures(rows)
    report(found)
    if opts.json:
        options = {"calls": opts.calls, "rounds": opts.rounds}
        run_record.write(opts.json, {"benchmark": "small_call", "options": options, **found})


if __name__ == "__main__":
    main()
