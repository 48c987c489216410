"""Rank 0 keeps calling worker1 while every worker writes its pid to $PIDS_DIR."""

import os
import pathlib
import time

import asyncrpc


def work(x: int) -> int:
    time.sleep(0.01)
    return x + 1


def main(ctx: asyncrpc.Context) -> None:
    pathlib.Path(os.environ["PIDS_DIR"], ctx.name).write_text(str(os.getpid()))
    if ctx.rank == 0:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            asyncrpc.rpc_sync("worker1", work, args=(1,))
    else:
        time.sleep(60)


if __name__ == "__main__":
    asyncrpc.run(main, world_size=3, rpc_timeout=20)
