"""Where a small call's time goes: from a bare TCP ping-pong up to asyncrpc.rpc_sync.

Each layer is measured in the same run, the ways alternated round by round,
and the difference between neighbours is what that layer adds::

    1. TCP ping-pong, 40 bytes, two Python processes on loopback   (the floor)
    2. torch rpc_sync of a builtin (torch.add): TensorPipe + the agent, no Python on the callee
    3. torch rpc_sync of a Python function: + pickling and the callee's GIL
    4. asyncrpc.rpc_sync of the same function: + asyncrpc's layer
    and, in this process only: pickling one call and unpickling it

    python benchmarks/small_call.py [--calls 500] [--rounds 5]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed.rpc as rpc
from torch.distributed.rpc import api as rpc_api
from torch.distributed.rpc.internal import PythonUDF

import asyncrpc

_MESSAGE = b"x" * 40


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


def main(ctx: asyncrpc.Context, opts: argparse.Namespace) -> None:
    if ctx.rank != 0:
        return
    x = torch.ones(16)
    ping, close = _ping_pong()
    pickle_call, unpickle_call = _pickling(x)
    layers: dict[str, Callable[[], object]] = {
        "1. TCP ping-pong, 40 B (floor)": ping,
        "2. torch rpc_sync, builtin torch.add": lambda: rpc.rpc_sync(
            "worker1", torch.add, args=(x, 1)
        ),
        "3. torch rpc_sync, Python function": lambda: rpc.rpc_sync("worker1", echo, args=(x,)),
        "4. asyncrpc.rpc_sync, Python function": lambda: asyncrpc.rpc_sync(
            "worker1", echo, args=(x,)
        ),
        "   pickling one call (caller)": pickle_call,
        "   unpickling one call (callee)": unpickle_call,
    }
    for way in layers.values():
        way()
    samples: dict[str, list[float]] = {name: [] for name in layers}
    for _ in range(opts.rounds):
        for name, way in layers.items():
            start = time.perf_counter()
            for _ in range(opts.calls):
                way()
            samples[name].append((time.perf_counter() - start) / opts.calls)
    close()
    medians = {name: statistics.median(s) for name, s in samples.items()}
    names = list(medians)
    print(f"{'layer':<42}{'us per call':>12}{'adds (us)':>11}{'of step 4':>11}")
    for i, name in enumerate(names):
        adds = medians[name] - medians[names[i - 1]] if 0 < i < 4 else medians[name]
        share = adds / medians[names[3]]
        print(f"{name:<42}{medians[name] * 1e6:>12.1f}{adds * 1e6:>11.1f}{share:>10.1%}")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    return parser.parse_args()


if __name__ == "__main__":
    asyncrpc.run(main, world_size=2, args=(_parse(),))
