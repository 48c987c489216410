"""Every failure through every verb: the same error type each time, naming the worker.

This process is worker0 of a 3-worker world started with asyncrpc.init (so a
killed worker does not end the world); worker1 and worker2 are spawned
helpers. The world's timeout is 2 s. Prints one row per failure and one
column per verb, each cell the type of the error that reached the caller,
then `mismatches: N` (0 when every cell is the expected type and, where a
worker is involved, names it). The last row kills worker2 with SIGKILL.

    python tests/programs/failure_table.py
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import asyncrpc

TIMEOUT_S = 2.0


def lookup() -> int:
    return {"a": 1}["missing"]


def divide() -> float:
    return 1 / 0


def open_missing() -> None:
    open("/nonexistent/asyncrpc-table")


def asyncrpc_error() -> None:
    raise asyncrpc.NotAFutureError("a remote asyncrpc error")


def sleep_long() -> int:
    time.sleep(3 * TIMEOUT_S)
    return 0


def lock() -> threading.Lock:
    return threading.Lock()


def pid() -> int:
    return os.getpid()


def identity(x: object) -> object:
    return x


class Runner:
    """A remote object that runs what it is given (the handle verbs' target)."""

    def run(self, func: Callable[..., Any], *args: Any) -> Any:
        return func(*args)


TROUBLES: list[Callable[[], Any]] = [
    lookup,
    divide,
    open_missing,
    asyncrpc_error,
    sleep_long,
    lock,
]


class Trouble(torch.nn.Module):
    """An Ensemble member whose forward runs TROUBLES[code], or returns its input."""

    def forward(self, code: Any) -> Any:
        if isinstance(code, torch.Tensor):
            return TROUBLES[int(code)]()
        return code


def first(outputs: list[Any]) -> Any:
    return outputs[0]


FAILURES: list[tuple[str, Any, tuple[Any, ...], type[BaseException]]] = [
    # name, function (or Ensemble input), arguments, expected type
    ("remote KeyError", lookup, (), KeyError),
    ("remote ZeroDivisionError", divide, (), ZeroDivisionError),
    ("remote OSError", open_missing, (), FileNotFoundError),
    ("remote asyncrpc error", asyncrpc_error, (), asyncrpc.NotAFutureError),
    ("timeout", sleep_long, (), asyncrpc.CallTimeoutError),
    ("unpicklable argument (lambda)", identity, (lambda: 1,), asyncrpc.SerializationError),
    ("unpicklable argument (lock)", identity, (threading.Lock(),), asyncrpc.SerializationError),
    ("unpicklable result", lock, (), asyncrpc.SerializationError),
]
VERBS = ["rpc_sync", "rpc_async", "remote", "call", "call_async", "call_all", "Ensemble"]


def through(verb: str, to: str, func: Any, args: tuple[Any, ...]) -> Any:
    """Run one call `func(*args)` on `to` through one verb, and read its result."""
    if verb == "rpc_sync":
        return asyncrpc.rpc_sync(to, func, args=args)
    if verb == "rpc_async":
        return asyncrpc.rpc_async(to, func, args=args).wait()
    if verb == "remote":
        return asyncrpc.remote(to, func, args=args).to_here()
    if verb == "Ensemble":
        ens = asyncrpc.Ensemble(Trouble, 1, workers=[to], combine=first)
        code = torch.tensor(TROUBLES.index(func)) if func in TROUBLES else args[0]
        return ens(code)
    runner = asyncrpc.spawn(to, Runner)
    if verb == "call":
        return runner.call("run", func, *args)
    if verb == "call_async":
        return runner.call_async("run", func, *args).wait()
    return asyncrpc.call_all([runner], "run", func, *args).wait()


def _runs(verb: str, to: str, func: Any, args: tuple[Any, ...]) -> Callable[[], Any]:
    return lambda: through(verb, to, func, args)


def outcome(run: Callable[[], Any], expected: type[BaseException], worker: str) -> str:
    try:
        run()
    except BaseException as exc:
        ok = isinstance(exc, expected)
        named = worker in str(exc) or worker in repr(exc)
        return type(exc).__name__ if ok and named else f"!{type(exc).__name__}: {exc!s:.200}"
    return "!no error"


def table(rows: list[tuple[str, list[str]]]) -> int:
    print("| failure | " + " | ".join(VERBS) + " |")
    print("|---" * (len(VERBS) + 1) + "|")
    for name, cells in rows:
        print(f"| {name} | " + " | ".join(cells) + " |")
    bad = sum(cell.startswith("!") for _, cells in rows for cell in cells)
    for name, cells in rows:
        for verb, cell in zip(VERBS, cells, strict=True):
            if cell.startswith("!"):
                print(f"MISMATCH {name} / {verb}: {cell}", file=sys.stderr)
    return bad


def serve(rank: int, port: int) -> None:
    asyncrpc.init(rank=rank, world_size=3, master_port=port, rpc_timeout=TIMEOUT_S)
    asyncrpc.shutdown()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> int:
    rows = [
        (name, [outcome(_runs(v, "worker1", func, args), expected, "worker1") for v in VERBS])
        for name, func, args, expected in FAILURES
    ]
    unknown = asyncrpc.UnknownWorkerError
    rows.append(
        ("unknown worker", [outcome(_runs(v, "worker9", identity, (1,)), unknown, "worker9")
                            for v in VERBS])
    )  # fmt: skip
    # Everything that will call the killed worker is made while it lives.
    runner = asyncrpc.spawn("worker2", Runner)
    ens = asyncrpc.Ensemble(Trouble, 1, workers=["worker2"], combine=first)
    rref = asyncrpc.remote("worker2", identity, args=(1,))
    victim = asyncrpc.rpc_sync("worker2", pid)
    os.kill(victim, signal.SIGKILL)
    time.sleep(0.5)
    dead: dict[str, Callable[[], Any]] = {
        "rpc_sync": lambda: asyncrpc.rpc_sync("worker2", identity, args=(1,)),
        "rpc_async": lambda: asyncrpc.rpc_async("worker2", identity, args=(1,)).wait(),
        "remote": lambda: rref.to_here(),
        "call": lambda: runner.call("run", identity, 1),
        "call_async": lambda: runner.call_async("run", identity, 1).wait(),
        "call_all": lambda: asyncrpc.call_all([runner], "run", identity, 1).wait(),
        "Ensemble": lambda: ens(1),
    }
    killed = [outcome(dead[v], asyncrpc.WorkerUnreachableError, "worker2") for v in VERBS]
    rows.append(("killed worker", killed))
    bad = table(rows)
    print(f"mismatches: {bad}", flush=True)
    return bad


if __name__ == "__main__":
    port = free_port()
    spawner = multiprocessing.get_context("spawn")
    helpers = [spawner.Process(target=serve, args=(r, port)) for r in (1, 2)]
    for proc in helpers:
        proc.start()
    asyncrpc.init(rank=0, world_size=3, master_port=port, rpc_timeout=TIMEOUT_S)
    try:
        mismatches = main()
    finally:
        asyncrpc.shutdown(graceful=False)
        for proc in helpers:
            proc.kill()
    sys.exit(1 if mismatches else 0)
