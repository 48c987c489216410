"""A launched world for the launcher's own tests (tests/test_launch.py).

    asyncrpc-launch --nproc-per-node 2 tests/programs/launch_signals.py [--hold-gil]
        [--raise-rank R] [--exit]
    python tests/programs/launch_signals.py --world 2 --exit     (embedded)

Each worker prints `WORKER <rank> <pid> threads=<intra-op threads>` in one
write, then waits: it sleeps, or with --hold-gil sums a huge range in one C
call that never lets the GIL go; with --exit it returns at once. With
--raise-rank R, worker R raises `ExampleFailure` after a second (every worker
has reached its wait); the others wait.
"""

import argparse
import os
import sys
import time

import torch

import asyncrpc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from remote_errors import ExampleFailure


def main(ctx: asyncrpc.Context, hold_gil: bool, raise_rank: int, leave: bool) -> None:
    os.write(1, f"WORKER {ctx.rank} {os.getpid()} threads={torch.get_num_threads()}\n".encode())
    if leave:
        return
    if ctx.rank == raise_rank:
        time.sleep(1.0)  # let every peer reach its wait
        raise ExampleFailure(f"{ctx.name} could not load its shard")
    if hold_gil:
        sum(range(10**12))  # no Python thread of this worker runs until it returns
    time.sleep(300)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--hold-gil", action="store_true")
    parser.add_argument("--raise-rank", type=int, default=-1)
    parser.add_argument("--exit", action="store_true")
    parser.add_argument("--world", type=int, default=None)
    opts = parser.parse_args()
    asyncrpc.run(main, opts.world, args=(opts.hold_gil, opts.raise_rank, opts.exit))
