"""A job that loses a worker to SIGKILL on its first attempt, with no call pending.

    python supervised.py --kill worker1 [--restarts N] [--world 3]   (embedded)
    asyncrpc-launch ... supervised.py --kill worker2                  (launched)

Every worker first checks in with worker0 (so the world is formed), then the
one named by --kill prints ``KILLED <unix time>`` and SIGKILLs itself while
the others sleep: no call is waiting on it, so only supervision can notice.
From the second attempt on, worker0 sums one call per worker and prints
``RESULT {json}``; every worker appends its name and attempt to --journal.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import asyncrpc

_seen: list[str] = []


def check_in(name: str) -> int:
    _seen.append(name)
    return len(_seen)


def rank_of(name: str) -> int:
    return asyncrpc.current_context().names.index(name)


def main(ctx: asyncrpc.Context, kill: str, log: str) -> None:
    if log:
        with open(log, "a") as out:
            out.write(f"{ctx.name} {ctx.attempt}\n")
    asyncrpc.rpc_sync(ctx.names[0], check_in, args=(ctx.name,))
    if ctx.attempt == 0 and kill:
        if ctx.name == kill:
            time.sleep(1.0)  # let every peer reach its sleep
            print(f"KILLED {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)  # far past every test's timeout: only supervision ends this
        return
    if ctx.rank == 0:
        ranks = [asyncrpc.rpc_sync(name, rank_of, args=(name,)) for name in ctx.names]
        print("RESULT " + json.dumps({"attempt": ctx.attempt, "ranks": ranks}), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill", default="")
    parser.add_argument("--restarts", type=int, default=0)
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--journal", default="")
    opts = parser.parse_args()
    asyncrpc.run(
        main,
        opts.world,
        args=(opts.kill, opts.journal),
        max_restarts=opts.restarts,
        rpc_timeout=20,
    )
    sys.exit(0)
