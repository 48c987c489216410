"""A command that returns while a thread of it still waits in torch's store client.

    python tests/programs/store_thread_exit.py plain|run_command

The store's process is killed while the thread waits on it, as when a world
ends under `asyncrpc-top`. `plain` ends the way a Python program does (the
interpreter's teardown: torch's C++ then aborts the process); `run_command`
ends the way the inspecting commands do.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
import threading
import time

import torch.distributed as dist

from asyncrpc._inspect._worlds import run_command

SERVE = (
    "import time, torch.distributed as d; "
    "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
    "print(s.port, flush=True); time.sleep(60)"
)


def command(argv: list[str] | None) -> None:
    server = subprocess.Popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    port = int(server.stdout.readline())

    def wait() -> None:
        client = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30)
        )
        try:
            client.wait(["never"])
        except Exception:
            pass

    threading.Thread(target=wait, daemon=True).start()
    time.sleep(0.5)
    server.kill()
    server.wait()
    print("answered", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "plain":
        command(None)
        sys.exit(0)
    run_command(command, None)
