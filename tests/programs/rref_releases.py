"""In a world that heals, RRefs are dropped on one thread of the world's, and owners free them.

    python tests/programs/rref_releases.py

worker0 makes RRefs on worker1 (`remote`, handles, RRefs returned in calls
and passed to worker2), from 4 threads at once, and drops them. It prints
one line, `releases: {json}`: whether each object was held while used, freed
at its owner once dropped, what stayed held, and the thread that let go.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from typing import Any

import asyncrpc
from asyncrpc._core import _runtime
from asyncrpc._core._torch._releases import Releases

LIVE: weakref.WeakSet[Any] = weakref.WeakSet()
BOUND_S = 30.0


class Box:
    def __init__(self, value: int) -> None:
        self.value = value
        LIVE.add(self)

    def get(self) -> int:
        return self.value


def make(value: int) -> Box:
    return Box(value)


def live() -> int:
    import gc

    gc.collect()
    return len(LIVE)


def made_here(value: int) -> Any:
    return asyncrpc.remote("worker1", make, args=(value,))  # an RRef returned: worker1's


def value_of(rref: Any) -> int:
    return int(rref.to_here().value)


def held() -> int:
    return len(_runtime.part(Releases).held) - 1  # less the mark


def _churn(n: int, start: int) -> None:
    for i in range(start, start + n):
        rref = asyncrpc.remote("worker1", make, args=(i,))
        assert rref.to_here().value == i
        assert asyncrpc.rpc_sync("worker2", value_of, args=(rref,)) == i  # sent on
        returned = asyncrpc.rpc_sync("worker2", made_here, args=(i,))
        assert returned.to_here().value == i
        handle = asyncrpc.spawn("worker1", Box, i)
        assert handle.call("get") == i
        del rref, returned, handle


def _until(check: Any) -> bool:
    deadline = time.monotonic() + BOUND_S
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def main(ctx: asyncrpc.Context) -> None:
    if ctx.rank != 0:
        return
    kept = asyncrpc.remote("worker1", make, args=(-1,))
    kept.to_here()
    seen: dict[str, Any] = {"held_while_used": held() >= 1}
    threads = [threading.Thread(target=_churn, args=(25, 100 * t)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seen["freed"] = _until(lambda: asyncrpc.rpc_sync("worker1", live) == 1)  # `kept` only
    seen["left_held_here"] = held()
    seen["left_held_on_worker2"] = asyncrpc.rpc_sync("worker2", held)
    seen["threads"] = sorted(
        t.name for t in threading.enumerate() if t.name.startswith("asyncrpc-rref")
    )
    seen["kept"] = kept.to_here().value
    del kept
    seen["kept_freed"] = _until(lambda: asyncrpc.rpc_sync("worker1", live) == 0)
    print("releases: " + json.dumps(seen), flush=True)


if __name__ == "__main__":
    asyncrpc.run(main, world_size=3, restart="worker", max_restarts=1)
    print("world ended", flush=True)
