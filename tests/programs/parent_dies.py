"""An embedded world whose workers wait: its parent is then killed by the test.

    python tests/programs/parent_dies.py

Each worker prints `WORKER <rank> <pid>` and sleeps; the parent prints
`PARENT <pid>` first.
"""

import os
import time

import asyncrpc


def main(ctx: asyncrpc.Context) -> None:
    # One write per line: the workers share the parent's output.
    os.write(1, f"WORKER {ctx.rank} {os.getpid()}\n".encode())
    time.sleep(300)


if __name__ == "__main__":
    print(f"PARENT {os.getpid()}", flush=True)
    asyncrpc.run(main, world_size=3)
