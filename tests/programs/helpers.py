"""What the test programs share, each piece defined once: `from helpers import pid, Counter`.

A program runs as a script (`python tests/programs/x.py`), so this folder is first on
its sys.path, and the workers it starts (forked, spawned, or launched by
asyncrpc-launch or torchrun) find this module the same way. What crosses to a worker
(`pid`, `Counter`, `count`, `serve`) is pickled by reference, as `helpers.pid`: the
worker imports this module by that name. tests/conftest.py puts this folder on the
tests' path too: its `free_port` and its `world`'s helper processes come from here.

asyncrpc is imported only where a world is started, so a program that uses torch's RPC
alone (failed_join.py) imports nothing of asyncrpc through this module.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    import asyncrpc

__all__ = (
    "Counter", "count", "ctrl_c_as_in_a_terminal", "error_of", "fail", "free_port", "pid",
    "serve", "start_world",
)  # fmt: skip


def free_port() -> int:
    """A TCP port on loopback that is free now (a world's master port, a store's)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ctrl_c_as_in_a_terminal() -> None:
    """Ctrl-C (SIGINT) raises KeyboardInterrupt here, as in a terminal's foreground, also
    when the tests run in the background: a shell without job control starts its
    background jobs with SIGINT ignored, every process under them inherits that, and
    Python then installs no handler of its own."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pid() -> int:
    """This process's id; called on a worker, the worker's (to kill it, or tell it apart)."""
    return os.getpid()


class Counter:
    """An object with state on a worker: `add(k)` adds `k` (1 by default), returns the total."""

    def __init__(self) -> None:
        self.n = 0

    def add(self, k: int = 1) -> int:
        self.n += k
        return self.n


def count(n: int) -> Iterator[int]:
    """A stream's producer: 0, 1, ..., n - 1."""
    yield from range(n)


def error_of(fn: Callable[[], object]) -> list[str]:
    """`[type name, message]` of what `fn()` raises, or `["none", ""]` (a row of a report)."""
    try:
        fn()
    except Exception as exc:  # what a user would catch
        return [type(exc).__name__, str(exc)]
    return ["none", ""]


def fail(text: str) -> NoReturn:
    """A program's check failed: say so (`FAILED text`) and exit 1."""
    print(f"FAILED {text}", flush=True)
    sys.exit(1)


def serve(rank: int, world_size: int, port: int, rpc_timeout: float) -> None:
    """A helper worker of `start_world`'s world: it only serves calls."""
    import asyncrpc

    asyncrpc.init(rank=rank, world_size=world_size, master_port=port, rpc_timeout=rpc_timeout)
    asyncrpc.shutdown()  # graceful: serves calls until worker0 shuts down too


def start_world(world_size: int, rpc_timeout: float) -> tuple[asyncrpc.Context, list[BaseProcess]]:
    """This process as worker0 of a world over loopback started with asyncrpc.init.

    The other workers are spawned helper processes that serve calls (`serve`); a killed
    one does not end the world. Returns worker0's context and the helpers, for the
    caller to end after its shutdown.
    """
    import asyncrpc

    port = free_port()
    spawner = multiprocessing.get_context("spawn")
    helpers = [
        spawner.Process(target=serve, args=(rank, world_size, port, rpc_timeout))
        for rank in range(1, world_size)
    ]
    for proc in helpers:
        proc.start()
    ctx = asyncrpc.init(rank=0, world_size=world_size, master_port=port, rpc_timeout=rpc_timeout)
    return ctx, helpers
