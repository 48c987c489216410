"""Worlds started with `devices`, on a machine with or without CUDA.

    python tests/programs/devices.py cpu-workers   # every worker named, each "cpu"
    python tests/programs/devices.py healing       # restart="worker", worker1 given CUDA
    python tests/programs/devices.py healing-cpu   # restart="worker", devices="cpu"

Prints one JSON line: what worker0 saw (calls made, devices each worker
published), or the error that ended the world.
"""

from __future__ import annotations

import json
import sys

import torch

import asyncrpc


def published() -> dict[str, str]:
    """What each worker said its devices are, read from the world's store."""
    from asyncrpc._core import _runtime
    from asyncrpc._core._torch import PrefixStore

    world = _runtime.running_world()
    assert world is not None and world.store is not None
    space = PrefixStore(f"asyncrpc/{world.tag}/devices/", world.store)
    return {name: space.get(name).decode() for name in world.context.names}


def main(ctx: asyncrpc.Context) -> None:
    if ctx.rank != 0:
        return
    total = asyncrpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
    print(json.dumps({"sum": float(total.sum()), "published": published()}), flush=True)


if __name__ == "__main__":
    scenario = sys.argv[1]
    try:
        if scenario == "cpu-workers":
            asyncrpc.run(main, world_size=2, devices={"worker0": "cpu", "worker1": "cpu"})
        elif scenario == "healing":
            asyncrpc.run(main, world_size=2, restart="worker", max_restarts=1,
                         devices={"worker1": "cuda"})  # fmt: skip
        elif scenario == "healing-cpu":
            asyncrpc.run(main, world_size=2, restart="worker", max_restarts=1, devices="cpu")
    except Exception as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
        raise SystemExit(1) from None
