"""Dying with the parent: an embedded world's processes, and a launcher's workers.

A worker's Python thread that watches its parent (`_supervisor`) cannot
run while the worker holds the GIL in a long C call (`sum(range(10**10))`);
the kernel's parent-death signal needs no GIL. Linux only: elsewhere
nothing is set and the watching threads alone stop workers::

    supervisor dies ──(PR_SET_PDEATHSIG, set as the warm interpreter starts)──> warm
                        interpreter (`_forking`): SIGTERM, it dies ──(PR_SET_PDEATHSIG,
                        set in each worker as it is forked)──> workers
    asyncrpc-launch dies ──(PR_SET_PDEATHSIG, set when the worker imports this)──> workers

Importing this module does nothing, except in a worker a launcher started:
the launcher (`asyncrpc-launch`, or torchrun's agent with the asyncrpc
rendezvous) names itself in ASYNCRPC_LAUNCHER_PID, and the worker imports this module with
`import asyncrpc`, before its script runs anything else of asyncrpc's. A
worker whose launcher has already ended by then (killed while the worker
imported torch) ends at once, as it would have with the launcher.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time

__all__ = ("LAUNCHER_VARIABLE", "PARENT_VARIABLE", "die_with_parent", "watch_launcher")

PARENT_VARIABLE = "ASYNCRPC_FORKSERVER_PARENT"
LAUNCHER_VARIABLE = "ASYNCRPC_LAUNCHER_PID"
KILL_AFTER_S = 2.0  # from SIGTERM to SIGKILL, as a supervisor stops its workers
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Have the kernel send SIGTERM to this process when `parent` (its parent) ends."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it ended before the signal was asked for
        os.kill(os.getpid(), signal.SIGTERM)


def launched_by() -> int | None:
    """The pid of the launcher that started this process as a worker, or None."""
    named = os.environ.get(LAUNCHER_VARIABLE, "")
    parent = os.getppid()
    return parent if named == str(parent) else None


def watch_launcher() -> None:
    """In a launcher's worker: once the launcher has ended, SIGTERM, then SIGKILL, this worker.

    The parent-death signal is a SIGTERM, which a program's own handler may
    take (and then go on); this thread ends the worker as a supervisor would.
    """
    launcher = launched_by()
    if launcher is None:
        return

    def watch() -> None:
        _wait_for_end(launcher)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(KILL_AFTER_S)  # a program's own SIGTERM handler had its chance
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="asyncrpc-launcher-watch", daemon=True).start()


def _wait_for_end(pid: int) -> None:
    try:
        handle = os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux 5.3+: ask once a second
        while os.getppid() == pid:
            time.sleep(1.0)
        return
    try:
        select.select([handle], [], [])  # readable once the process has ended
    finally:
        os.close(handle)


def _launcher_gone() -> bool:
    """A launcher's worker whose launcher ended before it imported asyncrpc (orphaned).

    The worker's parent is then no longer the launcher it names; a process
    the worker starts has the worker as its parent, and the launcher alive.
    """
    named = os.environ.get(LAUNCHER_VARIABLE, "")
    if not named.isdigit() or int(named) == os.getppid():
        return False
    try:
        os.kill(int(named), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's: not ours to judge
        return False
    return False


if launched_by() is not None:  # a launcher's worker (not a process that worker starts)
    die_with_parent(os.getppid())
elif _launcher_gone():  # it ended as this worker started (killed, or stopped by a signal)
    print(
        f"asyncrpc: this worker's launcher (pid {os.environ[LAUNCHER_VARIABLE]}) ended "
        f"before it started; it ends too",
        file=sys.stderr,
        flush=True,
    )
    os.kill(os.getpid(), signal.SIGTERM)
