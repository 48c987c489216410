"""A join of torch's dynamic group that meets a dead member: how long its failure takes.

    python tests/programs/failed_join.py fast|torch

worker "a" hosts the group; "b" joins and is SIGKILLed (it stays on the
group's list, as a member that died mid-heal does); then "c" joins. torch's
join fails on "b", and its graceful shutdown waits for the join's own token
until the store's timeout (RPC_TIMEOUT_S); with `_torch.failing_fast()`
("fast") it fails at once. Prints `failed join: {json}` (seconds, error).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import sys
import time
from typing import Any

import torch.distributed.rpc as rpc

from helpers import free_port

RPC_TIMEOUT_S = 20.0


def options(port: int) -> rpc.TensorPipeRpcBackendOptions:
    return rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=RPC_TIMEOUT_S
    )


def member(name: str, rank: int, port: int, ready: Any, alive: Any) -> None:
    rpc.init_rpc(name, rank=rank, rpc_backend_options=options(port))
    ready.send(True)
    try:  # nothing is sent: this returns when the test's process has ended
        alive.recv()
    except EOFError:
        pass
    os._exit(0)  # no leave: the test ends here


def main(way: str) -> None:
    import faulthandler

    from asyncrpc._core import _torch

    faulthandler.dump_traceback_later(30, exit=True)
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    started = []
    # Pipes, not Events: a process killed while it waits on an Event leaves it stuck.
    alive, _keep = ctx.Pipe(duplex=False)  # `_keep` closes with this process: "a" ends
    for rank, name in enumerate(("a", "b")):
        ready, said = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=member, args=(name, rank, port, said, alive), daemon=True)
        proc.start()
        assert ready.poll(60), f"{name} did not join"
        started.append(proc)
    os.kill(started[1].pid or 0, signal.SIGKILL)
    started[1].join()
    began = time.monotonic()
    error = ""
    try:
        with _torch.failing_fast() if way == "fast" else contextlib.nullcontext():
            rpc.init_rpc("c", rank=2, rpc_backend_options=options(port))
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    seconds = time.monotonic() - began
    print("failed join: " + json.dumps({"seconds": round(seconds, 2), "error": error}), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
