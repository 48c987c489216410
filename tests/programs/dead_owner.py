"""A handle whose owner is killed: calls fail fast, naming the owner; the rest keep working.

This process is worker0 of a 3-worker world started with asyncrpc.init;
worker1 and worker2 are spawned helpers. worker2 owns a Counter and is
killed with SIGKILL while a call to it is in flight.
"""

import os
import signal
import time

import asyncrpc

from helpers import start_world


@asyncrpc.actor(concurrency_groups={"admin": 1})
class Counter:
    def __init__(self) -> None:
        self.value = 0

    def slow(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.value

    @asyncrpc.method(concurrency_group="admin")  # answers while `slow` runs
    def pid(self) -> int:
        return os.getpid()


def whoami() -> str:
    return asyncrpc.current_context().name


def report(label: str, fut_or_call: object) -> None:
    started = time.monotonic()
    try:
        fut_or_call() if callable(fut_or_call) else fut_or_call.wait()  # type: ignore[attr-defined]
        print(f"{label}: no error")
    except Exception as exc:
        took = time.monotonic() - started
        print(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0]} ({took:.1f} s)")


if __name__ == "__main__":
    _, helpers = start_world(3, rpc_timeout=20)
    counter = asyncrpc.spawn("worker2", Counter)
    in_flight = counter.options(timeout=10).call_async("slow", 30.0)
    os.kill(counter.call("pid"), signal.SIGKILL)
    report("in flight", in_flight)
    report("new call", lambda: counter.options(timeout=10).call("slow", 0.0))
    print("survivor still serves:", asyncrpc.rpc_sync("worker1", whoami))
    started = time.monotonic()
    asyncrpc.shutdown(graceful=False)
    print(f"shutdown took {time.monotonic() - started:.1f} s")
    for proc in helpers:
        proc.kill()
