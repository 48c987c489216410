"""Two worlds in a row in one process share nothing, and the first leaves nothing behind.

Each world (one worker, over loopback) runs the traffic that makes state:
calls, a cancelled `async def`, a stream left open, a handle, a trace hook,
an RRef. After its shutdown:

- no module-level name in any `asyncrpc` module refers to the world, its
  runtime or any of the runtime's parts (read before any collection);
- once collected, none of them is alive (weak references).

The second world's runtime and parts are new objects. Prints one line per
check; exits non-zero at the first failure.

    python tests/programs/two_worlds.py
"""

from __future__ import annotations

import gc
import sys
import time
import weakref
from typing import Any

import torch

import asyncrpc
from asyncrpc._core import _runtime

from helpers import Counter, count, fail


async def slow() -> None:
    await torch.futures.Future()  # never completes: only a cancel ends it


def traffic() -> None:
    """What a world's state is made of: one of each kind of call."""
    assert asyncrpc.rpc_sync("worker0", torch.add, args=(torch.ones(2), 1)).sum().item() == 4
    counter = asyncrpc.spawn("worker0", Counter)
    assert counter.call("add", 2) == 2
    fut = asyncrpc.rpc_async("worker0", slow)
    time.sleep(0.1)
    assert asyncrpc.cancel(fut)
    stream = asyncrpc.stream("worker0", count, args=(100,))
    assert next(iter(stream)) == 0  # left open: the world's end closes it
    rref = asyncrpc.remote("worker0", torch.zeros, args=((2,),))
    assert rref.to_here().shape == (2,)


def world_objects() -> dict[str, Any]:
    """The running world, its runtime and every part the traffic made."""
    runtime = _runtime.SLOT.runtime
    found: dict[str, Any] = {"world": _runtime.running_world(), "runtime": runtime}
    for kind, part in runtime.parts.items():
        found[f"part {kind.__module__}.{kind.__qualname__}"] = part
    return found


def module_level_refs(objects: dict[str, Any]) -> list[str]:
    """Module-level names of asyncrpc that refer to one of `objects` (directly)."""
    ids = {id(obj): name for name, obj in objects.items()}
    found = []
    for module_name, module in sorted(sys.modules.items()):
        if not module_name.startswith("asyncrpc"):
            continue
        for attr, value in vars(module).items():
            if id(value) in ids:
                found.append(f"{module_name}.{attr} -> {ids[id(value)]}")
    return found


def one_world() -> dict[str, weakref.ref[Any]]:
    asyncrpc.init(rank=0, world_size=1, master_port=0, intra_op_threads=1)
    traffic()
    objects = world_objects()
    if len(objects) < 6:
        fail(f"the traffic made too few parts to check: {sorted(objects)}")
    refs = {name: weakref.ref(obj) for name, obj in objects.items()}
    asyncrpc.shutdown()
    left = module_level_refs(objects)
    if left:
        fail(f"after shutdown, module-level names refer to the ended world: {left}")
    print(f"no module-level name refers to the ended world ({len(objects)} objects)", flush=True)
    del objects
    return refs


def main() -> None:
    first = one_world()
    for _ in range(3):
        gc.collect()
    alive = sorted(name for name, ref in first.items() if ref() is not None)
    if alive:
        referrers = [type(r).__name__ for name in alive for r in gc.get_referrers(first[name]())]
        fail(f"after shutdown and a collection, still alive: {alive} (held by {referrers})")
    print(f"nothing of the first world is alive ({len(first)} objects)", flush=True)
    second = one_world()
    shared = sorted(set(first) & set(second))
    if not shared or "runtime" not in shared:
        fail(f"the second world made different kinds of state: {sorted(second)}")
    print(f"the second world made its own {len(second)} objects, sharing none", flush=True)
    print("two worlds OK", flush=True)


if __name__ == "__main__":
    main()
