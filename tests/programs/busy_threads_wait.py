"""A cycle of waits through busy RPC threads that ends by itself: a wait, not a deadlock.

    python tests/programs/busy_threads_wait.py SECONDS [RELEASE]

worker0 has 2 RPC threads. worker1 calls `slow(SECONDS)` on worker0 (it
sleeps, holding one, for SECONDS or until the file RELEASE exists), then
`f()` there (it holds the other), which waits on
`g()` on worker1, which waits on `h()` on worker0: queued, as both of
worker0's threads are busy. The graph has a cycle, f -> g -> worker0's queue
-> f, but the queue empties once `slow()` returns, and then h, g and f end.
worker1 prints WAITING once h() is queued, and the results when all ended;
hang reports are on after 2 s.
"""

import logging
import os
import sys
import time

import asyncrpc

_slept = [0.0]


def slow(seconds: float, release: str | None) -> str:
    _slept[0] = time.time()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:  # holds one of worker0's two RPC threads meanwhile
        if release is not None and os.path.exists(release):
            break
        time.sleep(0.05)
    return "slow done"


def slow_started() -> float:
    return _slept[0]


def h() -> str:
    return "h done"


def g() -> str:
    return asyncrpc.rpc_async("worker0", h).wait()  # holds a thread of worker1 meanwhile


def f() -> str:
    return asyncrpc.rpc_async("worker1", g).wait()  # holds worker0's other thread


def main(ctx: asyncrpc.Context, seconds: float, release: str | None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if ctx.rank == 1:
        slept = asyncrpc.rpc_async("worker0", slow, args=(seconds, release))
        while not asyncrpc.rpc_sync("worker0", slow_started):
            time.sleep(0.05)
        waited = asyncrpc.rpc_async("worker0", f)
        time.sleep(1.0)  # f() reaches g(), and g() queues h() on worker0
        print("WAITING", flush=True)
        print(f"RESULTS {slept.wait()} {waited.wait()}", flush=True)


if __name__ == "__main__":
    asyncrpc.run(
        main,
        world_size=2,
        args=(float(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None),
        num_worker_threads=2,
        rpc_timeout=120,
        hang_report_after=2,
    )
