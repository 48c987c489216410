"""A handle's call whose argument the owner cannot unpickle; then the handle's next calls.

The call never reaches the object's mailbox, so its number there is given back:
the handle's next calls run. torch's own state is not put right (the RRef forked
for that message is never confirmed, and torch's shutdown waits 100 s for it, as
with torch's own verbs): both processes end here without a shutdown. Prints one
line, ``RESULT {json}``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import sys
import time

import asyncrpc


class Unreadable:
    """Pickles here; its __setstate__ raises where it is unpickled."""

    def __getstate__(self) -> dict[str, int]:
        return {"x": 1}

    def __setstate__(self, state: dict[str, int]) -> None:
        raise ValueError("cannot rebuild Unreadable here")


class Store:
    def put(self, x: object) -> str:
        return "ran"


def serve(port: int, done: multiprocessing.synchronize.Event) -> None:
    asyncrpc.init(rank=1, world_size=2, master_port=port, init_timeout=30)
    done.wait(60)
    os._exit(0)


def check(port: int) -> dict[str, object]:
    asyncrpc.init(rank=0, world_size=2, master_port=port, init_timeout=30)
    store = asyncrpc.spawn("worker1", Store)
    seen: dict[str, object] = {}
    for verb in ("call", "call_async"):
        try:
            if verb == "call":
                store.call("put", Unreadable())
            else:
                store.call_async("put", Unreadable()).wait()
            seen[verb] = "ran"
        except asyncrpc.SerializationError as exc:
            seen[verb] = str(exc).split(" (")[0]
        started = time.monotonic()
        seen[f"next after {verb}"] = store.options(timeout=10).call("put", 1)
        seen[f"next after {verb} s"] = round(time.monotonic() - started, 2)
    return seen


if __name__ == "__main__":
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    fork = multiprocessing.get_context("fork")
    done = fork.Event()
    other = fork.Process(target=serve, args=(port, done))
    other.start()
    try:
        print("RESULT " + json.dumps(check(port)), flush=True)
    finally:
        done.set()
        other.join(10)
        sys.stdout.flush()
        os._exit(0)
