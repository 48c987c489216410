"""asyncrpc-dump, asyncrpc-top and the trace name a replaced worker with its attempt.

    python tests/programs/inspect_heal.py TRACE_PATH

A world of three that heals (restart="worker"). worker0 kills worker1 and
waits for its replacement (attempt 1), whose main calls `hold` on worker0
and waits there; meanwhile worker0 runs `asyncrpc-dump --json`,
`asyncrpc-dump` and `asyncrpc-top --once --json` against the world and
prints what they say, then traces a call to worker1 into TRACE_PATH. The
test reads the printed lines (DUMP_JSON, DUMP_TEXT, TOP_JSON) and the trace.
Run it with XDG_RUNTIME_DIR and TMPDIR of its own, so that the commands find
this world alone.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import asyncrpc

from helpers import pid

_held = threading.Event()
_release = threading.Event()


def hold() -> str:
    """Run on worker0 for the replacement: waits until worker0 has looked at the world."""
    _held.set()
    _release.wait(30)
    return "released"


def attempt() -> int:
    return asyncrpc.current_context().attempt


def command(name: str, *args: str) -> str:
    path = pathlib.Path(sys.executable).parent / name
    done = subprocess.run([str(path), *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise SystemExit(f"{name} {args} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def replace_worker1() -> None:
    os.kill(asyncrpc.rpc_sync("worker1", pid), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if asyncrpc.rpc_sync("worker1", attempt) == 1:
                return
        except asyncrpc.WorkerUnreachableError:
            pass  # being replaced
        time.sleep(0.02)
    raise SystemExit("worker1 was not replaced within 30 s")


def look(trace_path: str) -> None:
    if not _held.wait(30):
        raise SystemExit("the replacement never called worker0")
    try:
        print("DUMP_JSON " + json.dumps(json.loads(command("asyncrpc-dump", "--json"))))
        print("DUMP_TEXT " + json.dumps(command("asyncrpc-dump")))
        print("TOP_JSON " + json.dumps(json.loads(command("asyncrpc-top", "--once", "--json"))))
    finally:
        _release.set()
    with asyncrpc.trace(trace_path):
        asyncrpc.rpc_sync("worker1", attempt)
    print("TRACED", flush=True)


def main(ctx: asyncrpc.Context) -> None:
    if ctx.name == "worker1" and ctx.attempt == 1:
        print(f"worker1 (attempt 1) got {asyncrpc.rpc_sync('worker0', hold)}", flush=True)
    if ctx.rank != 0:
        return
    replace_worker1()
    print("REPLACED", flush=True)
    look(sys.argv[1])


if __name__ == "__main__":
    asyncrpc.run(main, world_size=3, max_restarts=1, restart="worker")
    print("WORLD ENDED", flush=True)
