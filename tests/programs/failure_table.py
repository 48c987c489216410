"""Every failure through every verb: the same error each time, naming the worker.

This process is worker0 of a 3-worker world started with asyncrpc.init (so a
killed worker does not end the world); worker1 and worker2 are spawned
helpers. The world's timeout is 1 s. Prints one row per failure and one
column per verb, each cell the type of the error that reached the caller,
then `mismatches: N` (0 when every cell is the expected type, names the
worker and, for an error raised remotely, is also a RemoteError and a
RuntimeError carrying the remote traceback). The last row kills worker2.

    python tests/programs/failure_table.py
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

import asyncrpc

from helpers import pid, start_world

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from remote_errors import HoldsALock, Rejected

TIMEOUT_S = 1.0


def lookup() -> int:
    return {"a": 1}["missing"]


def divide() -> float:
    return 1 / 0


def open_missing() -> None:
    open("/nonexistent/asyncrpc-table")


def asyncrpc_error() -> None:
    raise asyncrpc.NotAFutureError("a remote asyncrpc error")


def rejected() -> None:
    raise Rejected("too big", 413)


def unpicklable_error() -> None:
    raise HoldsALock()


def local_class_error() -> None:
    class Local(Exception):
        pass

    raise Local("a class defined in a function")


async def fails_after_await() -> None:
    await asyncrpc.rpc_async(asyncrpc.current_context().name, pid)
    raise ValueError("raised after an await")


def sleep_long() -> int:
    time.sleep(2.5 * TIMEOUT_S)
    return 0


def lock() -> threading.Lock:
    return threading.Lock()


def identity(x: object) -> object:
    return x


def as_stream(func: Callable[..., Any], *args: Any) -> Any:
    """A generator of one item: what `func` returns (the stream verb's producer)."""
    yield func(*args)


async def as_async_stream(func: Callable[..., Any], *args: Any) -> Any:
    yield await func(*args)


def slow_stream() -> Any:
    yield 0
    time.sleep(60)  # its worker is killed meanwhile
    yield 1


class Runner:
    """A remote object that runs what it is given (the handle verbs' target)."""

    def run(self, func: Callable[..., Any], *args: Any) -> Any:
        return func(*args)

    async def run_async(self, func: Callable[..., Any], *args: Any) -> Any:
        return await func(*args)


TROUBLES: list[Callable[[], Any]] = [
    lookup,
    divide,
    open_missing,
    asyncrpc_error,
    rejected,
    unpicklable_error,
    local_class_error,
    fails_after_await,
    sleep_long,
    lock,
]


class Trouble(torch.nn.Module):
    """An Ensemble member whose forward runs TROUBLES[code], or returns its input."""

    def forward(self, code: Any) -> Any:
        if not isinstance(code, torch.Tensor):
            return code
        result = TROUBLES[int(code)]()
        return asyncio.run(result) if inspect.iscoroutine(result) else result


def first(outputs: list[Any]) -> Any:
    return outputs[0]


REMOTE = True  # raised by the remote function: also RemoteError, with its traceback
FAILURES: list[tuple[str, Any, tuple[Any, ...], type[BaseException], bool]] = [
    # name, function (or Ensemble input), arguments, expected type, raised remotely
    ("remote KeyError", lookup, (), KeyError, REMOTE),
    ("remote ZeroDivisionError", divide, (), ZeroDivisionError, REMOTE),
    ("remote OSError", open_missing, (), FileNotFoundError, REMOTE),
    ("remote asyncrpc error", asyncrpc_error, (), asyncrpc.NotAFutureError, REMOTE),
    ("remote error with a two-argument __init__", rejected, (), Rejected, REMOTE),
    ("remote error that cannot be pickled", unpicklable_error, (),
     asyncrpc.SerializationError, REMOTE),
    ("remote error of a local class", local_class_error, (),
     asyncrpc.SerializationError, REMOTE),
    ("async def raising after an await", fails_after_await, (), ValueError, REMOTE),
    ("timeout", sleep_long, (), asyncrpc.CallTimeoutError, False),
    ("unpicklable argument (lambda)", identity, (lambda: 1,), asyncrpc.SerializationError,
     False),
    ("unpicklable argument (lock)", identity, (threading.Lock(),), asyncrpc.SerializationError,
     False),
    ("unpicklable result", lock, (), asyncrpc.SerializationError, False),
]  # fmt: skip
VERBS = [
    "rpc_sync",
    "rpc_async().wait()",
    "rpc_async().value()",
    "await rpc_async()",
    "remote().to_here()",
    "call",
    "call_async",
    "call_remote",
    "rpc_sync() proxy",
    "rpc_async() proxy",
    "call_all",
    "Ensemble",
    "Batch",
    "stream",
]


def _value_when_done(fut: torch.futures.Future[Any]) -> Any:
    done = threading.Event()
    fut.add_done_callback(lambda _: done.set())
    done.wait(30)
    return fut.value()


async def _awaited(fut: torch.futures.Future[Any]) -> Any:
    return await fut


def _batched(to: str, func: Any, args: tuple[Any, ...]) -> Any:
    with asyncrpc.Batch() as batch:
        fut = batch.rpc_async(to, func, args=args)
    return fut.wait()


def _producer_of(func: Any) -> Callable[..., Any]:
    return as_async_stream if inspect.iscoroutinefunction(func) else as_stream


def through(verb: str, to: str, func: Any, args: tuple[Any, ...]) -> Any:
    """Run one call `func(*args)` on `to` through one verb, and read its result."""
    calls: dict[str, Callable[[], Any]] = {
        "rpc_sync": lambda: asyncrpc.rpc_sync(to, func, args=args),
        "rpc_async().wait()": lambda: asyncrpc.rpc_async(to, func, args=args).wait(),
        "rpc_async().value()": lambda: _value_when_done(asyncrpc.rpc_async(to, func, args=args)),
        "await rpc_async()": lambda: asyncio.run(_awaited(asyncrpc.rpc_async(to, func, args))),
        "remote().to_here()": lambda: asyncrpc.remote(to, func, args=args).to_here(),
        "Batch": lambda: _batched(to, func, args),
        "stream": lambda: list(asyncrpc.stream(to, _producer_of(func), args=(func, *args))),
    }
    if verb in calls:
        return calls[verb]()
    if verb == "Ensemble":
        ens = asyncrpc.Ensemble(Trouble, 1, workers=[to], combine=first)
        code = torch.tensor(TROUBLES.index(func)) if func in TROUBLES else args[0]
        return ens(code)
    runner = asyncrpc.spawn(to, Runner)
    method = "run_async" if inspect.iscoroutinefunction(func) else "run"
    handle_calls: dict[str, Callable[[], Any]] = {
        "call": lambda: runner.call(method, func, *args),
        "call_async": lambda: runner.call_async(method, func, *args).wait(),
        "call_remote": lambda: runner.call_remote(method, func, *args).to_here(),
        "rpc_sync() proxy": lambda: getattr(runner.rpc_sync(), method)(func, *args),
        "rpc_async() proxy": lambda: getattr(runner.rpc_async(), method)(func, *args).wait(),
        "call_all": lambda: asyncrpc.call_all([runner], method, func, *args).wait(),
    }
    return handle_calls[verb]()


def outcome(
    run: Callable[[], Any], expected: type[BaseException], worker: str, remote: bool = False
) -> str:
    try:
        run()
    except BaseException as exc:
        text = f"{exc}\n{exc!r}"
        ok = isinstance(exc, expected) and worker in text
        if remote:  # also RemoteError and RuntimeError, with where and the traceback
            ok = ok and isinstance(exc, RuntimeError) and isinstance(exc, asyncrpc.RemoteError)
            ok = ok and f"On worker '{worker}'" in text and ", line " in text
        return type(exc).__name__ if ok else f"!{type(exc).__name__}: {exc!s:.300}"
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


def _killed_row() -> list[str]:
    # Everything that will call the killed worker is made while it lives.
    runner = asyncrpc.spawn("worker2", Runner)
    ens = asyncrpc.Ensemble(Trouble, 1, workers=["worker2"], combine=first)
    rref = asyncrpc.remote("worker2", identity, args=(1,))
    items = asyncrpc.stream("worker2", slow_stream)
    assert next(items) == 0
    os.kill(asyncrpc.rpc_sync("worker2", pid), signal.SIGKILL)
    time.sleep(0.5)
    to = "worker2"
    dead: dict[str, Callable[[], Any]] = {
        "rpc_sync": lambda: asyncrpc.rpc_sync(to, identity, args=(1,)),
        "rpc_async().wait()": lambda: asyncrpc.rpc_async(to, identity, args=(1,)).wait(),
        "rpc_async().value()": lambda: _value_when_done(asyncrpc.rpc_async(to, identity, (1,))),
        "await rpc_async()": lambda: asyncio.run(_awaited(asyncrpc.rpc_async(to, identity, (1,)))),
        "remote().to_here()": lambda: rref.to_here(),
        "call": lambda: runner.call("run", identity, 1),
        "call_async": lambda: runner.call_async("run", identity, 1).wait(),
        "call_remote": lambda: runner.call_remote("run", identity, 1).to_here(),
        "rpc_sync() proxy": lambda: runner.rpc_sync().run(identity, 1),
        "rpc_async() proxy": lambda: runner.rpc_async().run(identity, 1).wait(),
        "call_all": lambda: asyncrpc.call_all([runner], "run", identity, 1).wait(),
        "Ensemble": lambda: ens(1),
        "Batch": lambda: _batched(to, identity, (1,)),
        "stream": lambda: list(items),
    }
    return [outcome(dead[v], asyncrpc.WorkerUnreachableError, to) for v in VERBS]


def _row(
    func: Any, args: tuple[Any, ...], expected: type[BaseException], remote: bool
) -> list[str]:
    """One failure through every verb, on worker1: the type of each error that came back."""

    def cell(verb: str) -> str:
        return outcome(lambda: through(verb, "worker1", func, args), expected, "worker1", remote)

    if func is not sleep_long:
        return [cell(verb) for verb in VERBS]
    # Each verb waits out the world's timeout: they wait at once, not one after another.
    # worker1 has 16 RPC threads, enough for every sleeper and the handles made meanwhile.
    with ThreadPoolExecutor(len(VERBS)) as pool:
        cells = list(pool.map(cell, VERBS))
    time.sleep(2.5 * TIMEOUT_S)  # the sleepers end: worker1's threads are free again
    return cells


def main() -> int:
    rows = [
        (name, _row(func, args, expected, remote))
        for name, func, args, expected, remote in FAILURES
    ]
    unknown = [
        outcome(lambda v=v: through(v, "worker9", identity, (1,)), asyncrpc.UnknownWorkerError,
                "worker9")
        for v in VERBS
    ]  # fmt: skip
    rows.append(("unknown worker", unknown))
    rows.append(("killed worker", _killed_row()))
    bad = table(rows)
    print(f"mismatches: {bad}", flush=True)
    return bad


if __name__ == "__main__":
    _, helpers = start_world(3, rpc_timeout=TIMEOUT_S)
    try:
        mismatches = main()
    finally:
        asyncrpc.shutdown(graceful=False)
        for proc in helpers:
            proc.kill()
    sys.exit(1 if mismatches else 0)
