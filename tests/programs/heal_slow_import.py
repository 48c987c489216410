"""A replacement still importing a slow script when its supervisor is stopped (SIGTERM).

    SLOW_DIR=<dir> python tests/programs/heal_slow_import.py

worker0 kills worker1 once; worker1's replacement imports this script for a
minute (it writes `importing-<pid>` in SLOW_DIR first). The test stops the
supervisor meanwhile: no process of the world may outlive it by more than
a few seconds, the one still importing included.
"""

import multiprocessing
import os
import pathlib
import signal
import time

import asyncrpc

DIR = pathlib.Path(os.environ["SLOW_DIR"])
if __name__ != "__main__" and multiprocessing.current_process().name == "worker1":
    if (DIR / "slow").exists():  # a replacement: its import takes a minute
        (DIR / f"importing-{os.getpid()}").write_text("")
        time.sleep(60)


def pid() -> int:
    return os.getpid()


def main(ctx: asyncrpc.Context) -> None:
    if ctx.rank != 0:
        return
    victim = asyncrpc.rpc_sync("worker1", pid)
    (DIR / "slow").write_text("")
    os.kill(victim, signal.SIGKILL)
    time.sleep(120)  # the test stops the world meanwhile


if __name__ == "__main__":
    asyncrpc.run(main, world_size=2, max_restarts=2, restart="worker")
