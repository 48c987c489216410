"""A load run across two hosts whose link delays and drops packets (tc netem).

worker0 keeps `--in-flight` calls going to the workers on the other host,
`--calls` in all, each with a timeout of `--timeout` s. Every call must end
one way or the other: its own number back, or a named error. worker0 prints
``RESULT {json}`` with the counts and anything lost, duplicated or wrong.
"""

from __future__ import annotations

import collections
import json
import sys
import threading
import time

import asyncrpc

_runs: collections.Counter[int] = collections.Counter()
_lock = threading.Lock()


def echo(i: int, payload: bytes = b"") -> int:
    with _lock:
        _runs[i] += 1
    return i


def runs() -> dict[int, int]:
    with _lock:
        return dict(_runs)


def option(name: str, default: float) -> float:
    return float(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def load(ctx: asyncrpc.Context) -> dict[str, object]:
    calls, in_flight, timeout = (
        int(option("--calls", 400)),
        int(option("--in-flight", 32)),
        option("--timeout", 10),
    )
    payload = b"x" * int(option("--payload", 0))
    targets = [n for n in ctx.names if n not in ("worker0", "worker1")]
    results: dict[int, object] = {}
    errors: collections.Counter[str] = collections.Counter()
    slots = threading.Semaphore(in_flight)
    done = threading.Event()
    started = time.monotonic()

    counting = threading.Lock()

    def finish(i: int, fut: object) -> None:
        try:
            value, failure = fut.wait(), None  # type: ignore[attr-defined]
        except Exception as error:  # counted by the type it was named
            value, failure = None, type(error).__name__
        with counting:
            if failure is None:
                results[i] = value
            else:
                errors[failure] += 1
            if len(results) + sum(errors.values()) == calls:
                done.set()
        slots.release()

    for i in range(calls):
        slots.acquire()
        fut = asyncrpc.rpc_async(
            targets[i % len(targets)], echo, args=(i, payload), timeout=timeout
        )
        fut.add_done_callback(lambda f, i=i: finish(i, f))
    ended = done.wait(timeout * 3 + 60)
    seconds = time.monotonic() - started
    executed: collections.Counter[int] = collections.Counter()
    for name in targets:
        for i, n in asyncrpc.rpc_sync(name, runs, timeout=60).items():
            executed[int(i)] += n
    return {
        "calls": calls,
        "ended": ended,
        "ok": len(results),
        "failed": dict(errors),
        "wrong": sum(1 for i, v in results.items() if v != i),
        "lost": calls - len(results) - sum(errors.values()),
        "executed_twice": sum(1 for n in executed.values() if n > 1),
        "seconds": round(seconds, 2),
    }


def main(ctx: asyncrpc.Context) -> None:
    if ctx.name == "worker0":
        print("RESULT " + json.dumps(load(ctx)), flush=True)


if __name__ == "__main__":
    asyncrpc.run(main, rpc_timeout=60)
