"""An embedded world whose workers wait: its parent is then killed by the test.

    python tests/programs/parent_dies.py [--hold-gil]

Each worker prints `WORKER <rank> <pid>` and sleeps, or with --hold-gil
sums a huge range in one C call that never lets the GIL go; the parent
prints `PARENT <pid>` first.
"""

import faulthandler
import os
import signal
import sys
import time

import asyncrpc

from helpers import ctrl_c_as_in_a_terminal


def main(ctx: asyncrpc.Context, hold_gil: bool) -> None:
    # One write per line: the workers share the parent's output.
    os.write(1, f"WORKER {ctx.rank} {os.getpid()}\n".encode())
    if hold_gil:
        sum(range(10**12))  # no Python thread of this worker runs until it returns
    time.sleep(300)


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1)  # the test asks for the stacks of a parent stuck
    ctrl_c_as_in_a_terminal()  # the test's SIGINT stands for a user's Ctrl-C
    print(f"PARENT {os.getpid()}", flush=True)
    asyncrpc.run(main, world_size=3, args=("--hold-gil" in sys.argv,))
