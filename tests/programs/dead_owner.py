"""A handle whose owner is killed: calls fail fast, naming the owner; the rest keep working.

This process is worker0 of a 3-worker world started with asyncrpc.init;
worker1 and worker2 are spawned helpers. worker2 owns a Counter and is
killed with SIGKILL while a call to it is in flight.
"""

import multiprocessing
import os
import signal
import socket
import time

import asyncrpc


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def slow(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.value

    def pid(self) -> int:
        return os.getpid()


def whoami() -> str:
    return asyncrpc.current_context().name


def serve(rank: int, port: int) -> None:
    asyncrpc.init(rank=rank, world_size=3, master_port=port, rpc_timeout=20)
    asyncrpc.shutdown()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def report(label: str, fut_or_call: object) -> None:
    started = time.monotonic()
    try:
        fut_or_call() if callable(fut_or_call) else fut_or_call.wait()  # type: ignore[attr-defined]
        print(f"{label}: no error")
    except Exception as exc:
        took = time.monotonic() - started
        print(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0]} ({took:.1f} s)")


if __name__ == "__main__":
    port = free_port()
    spawner = multiprocessing.get_context("spawn")
    helpers = [spawner.Process(target=serve, args=(r, port)) for r in (1, 2)]
    for proc in helpers:
        proc.start()
    asyncrpc.init(rank=0, world_size=3, master_port=port, rpc_timeout=20)
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
