"""A world that heals in place, held to a model by a hypothesis state machine.

    python tests/programs/heal_model.py [max_examples] [steps]

Starts `asyncrpc.run(main, world_size=4, restart="worker")`. worker0 runs
the machine of tests/programs/heal_model_machine.py: random calls (sync and
in flight), spawns and handle calls on worker1..3, and SIGKILLs of them,
waiting or not for their replacements. worker0 is never killed.

What the workers run is here: each call or object creation notes its call id
in the process's list and appends it to `<dir>/<pid>.ids` as it runs, so the
ids a killed process ran are known too. Exits 0 when every example kept the
model; otherwise 1, with the falsifying example and what was seen printed.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any

import asyncrpc

DIR_VARIABLE = "HEAL_MODEL_DIR"  # where each process writes the ids it ran
RESULT = "result"  # the file worker0 writes its verdict to, in that directory
WORLD_SIZE = 4
MAX_RESTARTS = 100_000  # the model's kills only: a long run makes thousands
END_S = 45.0  # the world ends within this once worker0's main returned

faulthandler.register(signal.SIGUSR1)  # every process: `kill -USR1` prints where it is

_ran: list[int] = []
_ran_lock = threading.Lock()


def _note(call_id: int) -> None:
    """Record that the call `call_id` runs here: in this process's list and in its file."""
    path = os.path.join(os.environ[DIR_VARIABLE], f"{os.getpid()}.ids")
    with _ran_lock:
        _ran.append(call_id)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{call_id}\n".encode())  # one write: a kill leaves whole lines
        finally:
            os.close(fd)


def record(call_id: int, before: float = 0.0, after: float = 0.0) -> tuple[int, int, int]:
    """Run the call `call_id` here (after `before` s, replying `after` s later)."""
    time.sleep(before)
    _note(call_id)
    time.sleep(after)
    return os.getpid(), asyncrpc.current_context().attempt, call_id


def record_stream(call_id: int, n: int) -> Any:
    """A generator run once here (its call id noted as it starts) that yields `n` items."""
    _note(call_id)
    for i in range(n):
        yield os.getpid(), asyncrpc.current_context().attempt, call_id, i


async def relay(target: str, call_id: int) -> tuple[int, int, int]:
    """A nested call: on this worker, `record` on `target`, awaited (an async def)."""
    got: tuple[int, int, int] = await asyncrpc.rpc_async(target, record, args=(call_id,),
                                                         timeout=20)  # fmt: skip
    return got


def lend_use(handle: asyncrpc.RemoteObject[Counter], call_id: int, k: int) -> Any:
    """Call a Counter through a handle lent to this worker."""
    return handle.call("add", call_id, k)


def usage() -> dict[str, Any]:
    """This process's descriptors, threads and sockets left in CLOSE-WAIT (with their ports)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    close_wait, ports = 0, []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[9] in inodes and fields[3] == "08":
                    close_wait += 1  # local -> remote port: which side of whose pipe
                    ports.append("->".join(str(int(f.rsplit(":", 1)[1], 16)) for f in fields[1:3]))
    with open("/proc/self/status") as status:
        threads = next(int(line.split()[1]) for line in status if line.startswith("Threads:"))
    from asyncrpc._core._torch import _listener  # where torch publishes its address

    return {"fds": len(os.listdir("/proc/self/fd")), "threads": threads,
            "close_wait": close_wait, "close_wait_ports": ports,
            "listens_on": _listener.port()}  # fmt: skip


def ran() -> tuple[int, list[int]]:
    """This process's pid and the ids of the calls it ran, in order."""
    with _ran_lock:
        return os.getpid(), list(_ran)


class Counter:
    """An object of a worker's process whose every call is noted as it runs."""

    def __init__(self, call_id: int) -> None:
        _note(call_id)
        self.n = 0

    def add(self, call_id: int, k: int) -> tuple[int, int, int, int]:
        _note(call_id)
        self.n += k
        return os.getpid(), asyncrpc.current_context().attempt, call_id, self.n


def main(ctx: asyncrpc.Context, examples: int, steps: int) -> None:
    if ctx.rank != 0:
        return  # serves calls until worker0's main returns too
    verdict = os.path.join(os.environ[DIR_VARIABLE], RESULT)
    if ctx.attempt > 0:
        with open(verdict, "a") as out:
            out.write(f"worker0 was replaced (attempt {ctx.attempt}): it must never die\n")
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import heal_model_machine

    problem = heal_model_machine.check(
        examples,
        steps,
        record=record,
        ran=ran,
        counter=Counter,
        directory=os.environ[DIR_VARIABLE],
        record_stream=record_stream,
        relay=relay,
        lend_use=lend_use,
        usage=usage,
    )
    with open(verdict, "a") as out:
        out.write(problem or "ok\n")


def _watch_the_end(directory: str, ended: threading.Event) -> None:
    """Exit 1 when the world has not ended `END_S` s after worker0 wrote its verdict."""
    path = os.path.join(directory, RESULT)
    while not os.path.exists(path):
        if ended.wait(0.1):
            return
    if ended.wait(END_S):
        return
    with open(path) as verdict:
        print(f"heal model FAILED: the world did not end {END_S} s after worker0's verdict "
              f"(worker0 said: {verdict.read().strip()})", flush=True)  # fmt: skip
    if os.getpgrp() == os.getpid():  # a group of its own: every process says where it is
        os.killpg(os.getpgrp(), signal.SIGUSR1)
        time.sleep(2.0)
    shutil.rmtree(directory, ignore_errors=True)
    os._exit(1)  # the workers stop themselves when this process ends


def _pids_last(examples: int, steps: int) -> None:
    """Exit 2 when pids could wrap during the run: the model tells processes apart by pid.

    Each replacement takes about 30 pids (its threads count), a kill step about one
    replacement in three; Linux's default pid_max (32768) is reached after ~1000 kills.
    """
    try:
        with open("/proc/sys/kernel/pid_max") as limit:
            pid_max = int(limit.read())
    except OSError:
        return
    if examples * steps * 30 > pid_max:  # a pid is reused once all the others were
        print(f"heal model: {examples} x {steps} steps could use every pid below pid_max "
              f"({pid_max}), and the model tells processes apart by pid; raise "
              f"/proc/sys/kernel/pid_max, or run fewer steps", flush=True)  # fmt: skip
        sys.exit(2)


class _Kept:
    """This process's stderr, also kept: the supervisor's account of each death."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.parts = stream, []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return int(self.stream.write(text))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _run_once(examples: int, steps: int) -> str:
    """One world, the machine on worker0; its verdict ("ok\n" when the model held)."""
    with tempfile.TemporaryDirectory(prefix="heal-model-") as directory:
        os.environ[DIR_VARIABLE] = directory  # the workers inherit it, replacements too
        ended = threading.Event()
        threading.Thread(target=_watch_the_end, args=(directory, ended), daemon=True).start()
        try:
            asyncrpc.run(
                main, world_size=WORLD_SIZE, args=(examples, steps), max_restarts=MAX_RESTARTS,
                restart="worker", rpc_timeout=20,
            )  # fmt: skip
        finally:
            ended.set()
        path = os.path.join(directory, RESULT)
        return open(path).read() if os.path.exists(path) else "worker0 wrote no verdict\n"


# A replacement killed as it connects can make torch's TensorPipe close a member's
# listener; that member then ends (exit code 76) and is replaced (docs: launching.md).
# The machine runs on worker0, so worker0's replacement leaves a run that says
# nothing: it runs once more; a second such end fails.
_LISTENER_CLOSED = "ended (exit code 76"

if __name__ == "__main__":
    examples = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    _pids_last(examples, steps)
    kept = sys.stderr = _Kept(sys.stderr)
    started = time.monotonic()
    for run in range(2):
        result = _run_once(examples, steps)
        listener = "worker0 was replaced" in result and _LISTENER_CLOSED in "".join(kept.parts)
        if result == "ok\n" or not listener or run == 1:
            break
        print("heal model: worker0's listener was closed by a replacement killed as it "
              "joined (a documented rare cost); this run says nothing, so it runs again",
              flush=True)  # fmt: skip
        kept.parts.clear()
    print(f"heal model: {time.monotonic() - started:.1f} s", flush=True)
    if result != "ok\n":
        print(f"heal model FAILED:\n{result}", flush=True)
        sys.exit(1)
    print("heal model: every example kept the model", flush=True)
