"""A replacement whose join a member refused, as either supervisor sees it.

    python tests/programs/refused_join.py FOLDER
    asyncrpc-launch --nproc-per-node 3 --max-restarts 2 --restart worker \
        tests/programs/refused_join.py FOLDER

worker0 kills worker2 once. worker2's replacement ends twice as a replacement
whose join another member refused ends (exit code 77, what
`_core._healing.start_failed_exit` gives torch's ECONNREFUSED), before it
joins; its supervisor (embedded, or the launcher) starts it again each time,
neither a restart nor an attempt of its own, and the third start joins.
worker0 prints `RESULT {json}`.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import signal
import sys
import time

import asyncrpc
from asyncrpc._core._errors import JOIN_REFUSED_EXIT

REFUSALS = 2


def _refuse_once_more(folder: pathlib.Path) -> None:
    """In worker2's replacement, before it joins: end as a refused join, `REFUSALS` times."""
    ours = os.environ.get("RANK") == "2" or multiprocessing.current_process().name == "worker2"
    if not ours or not (folder / "killed").exists():
        return
    refused = folder / "refused"
    count = int(refused.read_text()) if refused.exists() else 0
    if count < REFUSALS:
        refused.write_text(str(count + 1))
        os._exit(JOIN_REFUSED_EXIT)


if len(sys.argv) > 1:  # a worker importing the script (embedded), or running it (launched)
    _refuse_once_more(pathlib.Path(sys.argv[-1]))


def info() -> tuple[int, int]:
    return os.getpid(), asyncrpc.current_context().attempt


def main(ctx: asyncrpc.Context, folder: str) -> None:
    if ctx.rank != 0:
        return
    first_pid, _ = asyncrpc.rpc_sync("worker2", info)
    (pathlib.Path(folder) / "killed").write_text("1")
    os.kill(first_pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        try:
            pid, attempt = asyncrpc.rpc_sync("worker2", info, timeout=5)
            break
        except asyncrpc.WorkerUnreachableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    refused = int((pathlib.Path(folder) / "refused").read_text())
    print("RESULT " + json.dumps({"attempt": attempt, "new_pid": pid != first_pid,
                                  "refused": refused}), flush=True)  # fmt: skip


if __name__ == "__main__":
    asyncrpc.run(main, world_size=3, args=(sys.argv[1],), max_restarts=2, restart="worker")
