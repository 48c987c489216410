"""Dying with the parent: processes of an embedded world end when the supervisor ends.

A worker's Python thread that watches the supervisor (`_supervisor`) cannot
run while the worker holds the GIL in a long C call (`sum(range(10**10))`);
the kernel's parent-death signal needs no GIL. Linux only: elsewhere
nothing is set and the watching thread alone stops workers::

    supervisor dies ──(PR_SET_PDEATHSIG, set when the forkserver imports this)──> forkserver:
                        SIGTERM, it dies ──(PR_SET_PDEATHSIG, set by each worker)──> workers

Importing this module does nothing, except in the forkserver an embedded
world starts: the supervisor names itself in ASYNCRPC_FORKSERVER_PARENT
for that start only, and the forkserver imports this module with its
preloads.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["PARENT_VARIABLE", "die_with_parent"]

PARENT_VARIABLE = "ASYNCRPC_FORKSERVER_PARENT"
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


if os.environ.get(PARENT_VARIABLE) == str(os.getppid()):  # this is that forkserver
    os.environ.pop(PARENT_VARIABLE)
    die_with_parent(os.getppid())
