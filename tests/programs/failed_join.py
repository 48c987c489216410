"""A join of torch's dynamic group that meets a dead member: how long its failure takes.

    python tests/programs/failed_join.py fast|torch

worker "a" hosts the group; "b" joins and is SIGKILLed (it stays on the
group's list, as a member that died mid-heal does); then "c" joins. torch's
join fails on "b", and its graceful shutdown waits for the join's own token
until the store's timeout (RPC_TIMEOUT_S); with `_torch.failing_fast()`
("fast") it fails at once. Prints `failed join: {json}` (seconds, error).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import sys
import time

import torch.distributed.rpc as rpc

RPC_TIMEOUT_S = 20.0


def options(port: int) -> rpc.TensorPipeRpcBackendOptions:
    return rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=RPC_TIMEOUT_S
    )


def member(name: str, rank: int, port: int, ready: object, done: object) -> None:
    rpc.init_rpc(name, rank=rank, rpc_backend_options=options(port))
    ready.set()  # type: ignore[attr-defined]
    done.wait(120)  # type: ignore[attr-defined]
    os._exit(0)  # no leave: the test ends here


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(way: str) -> None:
    import faulthandler

    from asyncrpc._core import _torch

    faulthandler.dump_traceback_later(30, exit=True)
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    started, dones = [], []
    for rank, name in enumerate(("a", "b")):
        # One each: notifying an Event that a killed process waits on never returns.
        ready, done = ctx.Event(), ctx.Event()
        dones.append(done)
        proc = ctx.Process(target=member, args=(name, rank, port, ready, done), daemon=True)
        proc.start()
        assert ready.wait(60), f"{name} did not join"
        started.append(proc)
    os.kill(started[1].pid or 0, signal.SIGKILL)
    started[1].join()
    began = time.monotonic()
    error = ""
    try:
        with _torch.failing_fast() if way == "fast" else _noop():
            rpc.init_rpc("c", rank=2, rpc_backend_options=options(port))
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    seconds = time.monotonic() - began
    dones[0].set()
    print("failed join: " + json.dumps({"seconds": round(seconds, 2), "error": error}), flush=True)
    os._exit(0)


class _noop:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    main(sys.argv[1])
