"""A world across two hosts: worker0 checks calls, chains and RRefs that cross them.

Started by tests/test_hosts.py under asyncrpc-launch, once per host (network
namespace), 2 workers per host. worker0 prints one line, ``RESULT {json}``;
with ``--fail`` it raises instead, once the others wait in shutdown.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

import asyncrpc
from asyncrpc._core import _net

T = TypeVar("T")


def where() -> tuple[str, str]:
    """This worker's name and the address it reaches the rendezvous host from."""
    master = os.environ["MASTER_ADDR"]
    return asyncrpc.current_context().name, _net.local_address_towards(master, 0)


def listeners() -> list[str]:
    """Local addresses of this network namespace's listening TCP sockets."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    found.append(_address(fields[1].split(":")[0]))
    return found


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return ".".join(str(b) for b in reversed(raw))
    return "ipv6:" + hex_address


@asyncrpc.async_execution
async def relay(path: list[str], x: torch.Tensor) -> tuple[list[tuple[str, str]], torch.Tensor]:
    """Add one here, then hand on to the next worker of `path` without blocking a thread."""
    here = where()
    if len(path) == 1:
        return [here], x + 1
    trail, y = await asyncrpc.rpc_async(path[1], relay, args=(path[1:], x + 1))
    return [here, *trail], y


@asyncrpc.async_execution
def async_add_chained(to: str, x: torch.Tensor, y: int, z: int) -> torch.futures.Future:
    """The reference tutorial's chained add: x + y on `to`, then + z here."""
    return asyncrpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)


class Tally:
    """A small owner-side object that remembers who touched it."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def touch(self, caller: tuple[str, str]) -> int:
        self.seen.append(caller)
        return len(self.seen)

    def history(self) -> list[tuple[str, str]]:
        return self.seen


def touch_from_here(tally: asyncrpc.RemoteObject[Tally]) -> int:
    return int(tally.call("touch", where()))


def summarize(events: list[dict[str, Any]]) -> dict[str, object]:
    """Processes of a merged trace, and whether every run lies inside its call."""
    spans = [e for e in events if e.get("cat") == "asyncrpc" and e["ph"] == "X"]
    calls = {e["args"]["call"]: e for e in spans if e["args"]["kind"] == "call"}
    runs = {e["args"]["call"]: e for e in spans if e["args"]["kind"] == "run"}
    inside = [
        calls[i]["ts"] <= run["ts"] and run["ts"] + run["dur"] <= calls[i]["ts"] + calls[i]["dur"]
        for i, run in runs.items()
    ]
    processes = sorted(e["args"]["name"] for e in events if e["name"] == "process_name")
    flows = sum(e["ph"] == "s" for e in events)
    return {"processes": processes, "pairs": len(inside), "inside": all(inside), "flows": flows}


def on_every_worker(ctx: asyncrpc.Context, fn: Callable[[], T]) -> dict[str, T]:
    replies = asyncrpc.gather([asyncrpc.rpc_async(n, fn) for n in ctx.names]).wait()
    return dict(zip(ctx.names, replies, strict=True))


def check(ctx: asyncrpc.Context) -> dict[str, object]:
    path = ["worker2", "worker1", "worker3"]  # host 1, host 0, host 1
    with tempfile.TemporaryDirectory() as folder:
        with asyncrpc.trace(pathlib.Path(folder, "relay.json")) as trace:
            trail, total = asyncrpc.rpc_sync(path[0], relay, args=(path, torch.zeros(2)))
        timeline = summarize(trace.events)
    chained = asyncrpc.rpc_sync(
        "worker2", async_add_chained, args=("worker1", torch.ones(2), 1, 1)
    )
    tally = asyncrpc.spawn("worker3", Tally)  # made from host 0, lives on host 1
    tally.call("touch", where())
    for name in ("worker1", "worker2"):
        asyncrpc.rpc_sync(name, touch_from_here, args=(tally,))
    return {
        "hosts": on_every_worker(ctx, where),
        "relay": {"trail": trail, "total": total.tolist()},
        "chained": chained.tolist(),
        "trace": timeline,
        "rref": {"owner": tally.owner, "seen": tally.call("history")},
        "listeners": on_every_worker(ctx, listeners),
    }


def main(ctx: asyncrpc.Context) -> None:
    if ctx.rank != 0:
        return
    if "--fail" in sys.argv:
        time.sleep(2)  # the other workers are waiting in shutdown by now
        raise RuntimeError("worker0 fails on purpose")
    print("RESULT " + json.dumps(check(ctx)), flush=True)


if __name__ == "__main__":
    asyncrpc.run(main)
