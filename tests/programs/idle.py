"""A world that writes each worker's pid to $PIDS_DIR, then idles until $RELEASE exists."""

import os
import pathlib
import time

import asyncrpc


def main(ctx: asyncrpc.Context) -> None:
    pathlib.Path(os.environ["PIDS_DIR"], ctx.name).write_text(str(os.getpid()))
    release = pathlib.Path(os.environ["RELEASE"])
    deadline = time.monotonic() + 60
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    asyncrpc.run(main, world_size=3)
