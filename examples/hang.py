"""A world that hangs on purpose, to see what asyncrpc-dump and hang reports say of it.

worker2 calls f() on worker0 twice, which takes both of worker0's RPC
threads (num_worker_threads=2). Each f() waits, holding its thread, for g()
on worker1; g() waits for h() on worker0, which cannot start: no thread of
worker0 is free. worker2's own calls time out (rpc_timeout=30), but f() and
g() never do: torch completes a call's Future, with its reply or its
timeout, on the caller's RPC threads, and those are the blocked ones.

    python examples/hang.py           # hangs until stopped (Ctrl-C); meanwhile, elsewhere:
    asyncrpc-dump                     # every call, its stack, and the cycle
    asyncrpc-top --once               # one row per worker

With hang_report_after=3, worker2 (and worker0, worker1) also log a
WARNING for each call still pending after 3 s, naming where the callee is
and the cycle. `--timeout S` and `--report-after S` change both.
"""

from __future__ import annotations

import argparse
import logging
import threading

import asyncrpc


def h() -> str:
    return "h done"


def g() -> str:
    # A sync wait holds this RPC thread until h() on worker0 answers.
    return asyncrpc.rpc_async("worker0", h).wait()


# Both f() calls hold a thread of worker0 before either goes on: otherwise, on a
# busy machine, the first could reach h() while worker0 still had a free thread.
_both_f = threading.Barrier(2)


def f() -> str:
    _both_f.wait()
    return asyncrpc.rpc_async("worker1", g).wait()


def main(ctx: asyncrpc.Context) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if ctx.rank == 2:
        calls = [asyncrpc.rpc_async("worker0", f) for _ in range(2)]
        try:
            print([call.wait() for call in calls])
        except asyncrpc.CallTimeoutError as error:
            print(f"worker2: {type(error).__name__}: {str(error).splitlines()[0]}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="A world that hangs on purpose.")
    parser.add_argument("--timeout", type=float, default=30.0, help="rpc_timeout, s")
    parser.add_argument("--report-after", type=float, default=3.0, help="hang_report_after, s")
    opts = parser.parse_args()
    asyncrpc.run(
        main,
        world_size=3,
        num_worker_threads=2,
        rpc_timeout=opts.timeout,
        hang_report_after=opts.report_after,
    )
