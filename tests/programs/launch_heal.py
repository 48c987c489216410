"""A world that heals under `asyncrpc-launch --restart worker`: worker0 has a worker killed.

    asyncrpc-launch --nproc-per-node 4 --max-restarts 2 --restart worker \\
        launch_heal.py --victim worker2 [--kills N] [--hold S]

Every worker prints ``WORKER <name> attempt=<n> pid=<pid>``. worker0 keeps a
tensor of its own and a counter object on another survivor, then has the
victim SIGKILL itself (by a call: it may run on another host) `--kills`
times, each time waiting for its replacement (`asyncrpc.on_replaced`).
Then it prints ``RESULT {json}``: the replacement events, the victim's
attempt as it says, the survivors' state and whether their processes are
the same. With ``--hold S`` worker0 only sleeps S seconds (for signals).
With ``--exit-at-start RANK`` that worker exits (code 3) before it joins.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import sys
import time

import torch

import asyncrpc

from helpers import Counter


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def whoami() -> tuple[int, int]:
    return os.getpid(), asyncrpc.current_context().attempt


def heal(ctx: asyncrpc.Context, victim: str, kills: int) -> dict[str, object]:
    events: queue.Queue[asyncrpc.Replaced] = queue.Queue()
    asyncrpc.on_replaced(events.put)
    keeper = next(name for name in ctx.names[1:] if name != victim)
    counter = asyncrpc.spawn(keeper, Counter)
    counter.call("add", 5)
    mine = torch.arange(4.0)
    before = {name: asyncrpc.rpc_sync(name, whoami)[0] for name in ctx.names}
    replaced = []
    for _ in range(kills):
        try:
            asyncrpc.rpc_sync(victim, die)
        except asyncrpc.WorkerUnreachableError:
            pass  # the call was in flight at the death
        event = events.get(timeout=60)
        replaced.append([event.name, event.rank, event.attempt])
    after = {name: asyncrpc.rpc_sync(name, whoami) for name in ctx.names}
    survivors = [name for name in ctx.names if name != victim]
    return {
        "replaced": replaced,
        "victim_attempt": after[victim][1],
        "victim_pid_changed": after[victim][0] != before[victim],
        "survivors_same": all(after[n][0] == before[n] for n in survivors),
        "counter": counter.call("add", 1),
        "tensor": mine.sum().item(),
    }


def main(ctx: asyncrpc.Context, victim: str, kills: int, hold: float) -> None:
    print(f"WORKER {ctx.name} attempt={ctx.attempt} pid={os.getpid()}", flush=True)
    if ctx.rank != 0:
        return  # serves calls until every main is done
    if hold:
        time.sleep(hold)
        return
    print("RESULT " + json.dumps(heal(ctx, victim, kills)), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--victim", default="worker2")
    parser.add_argument("--kills", type=int, default=1)
    parser.add_argument("--hold", type=float, default=0.0)
    parser.add_argument("--exit-at-start", type=int, default=None)
    opts = parser.parse_args()
    if opts.exit_at_start is not None and os.environ["RANK"] == str(opts.exit_at_start):
        os._exit(3)
    asyncrpc.run(main, args=(opts.victim, opts.kills, opts.hold), restart="worker", rpc_timeout=30)
    sys.exit(0)
