"""The warm interpreter an embedded world forks its workers from (multiprocessing's forkserver).

The first world of a process starts it; it imports torch, its RPC layer and
asyncrpc once (`PRELOAD`), and every worker, restart and replacement after
that is a fork of it::

    supervisor ── start (once) ──> forkserver: imports PRELOAD; dies with the supervisor
        │                             (PR_SET_PDEATHSIG, _parent)
        └── each worker: fork ──────> worker: dies with the forkserver from its first
                                      instruction (at fork, before it imports the script)

multiprocessing keeps the forkserver's socket in a folder of its own under
TMPDIR, and a socket's path must fit AF_UNIX's 107 bytes: under a deep TMPDIR
the folder is made in a short one instead (`spawner`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.util
import os
import tempfile
from collections.abc import Iterator
from typing import Any

from .._core._errors import AsyncRPCError
from . import _parent

__all__ = ("PRELOAD", "dies_with_this_process", "spawner")

# What the warm interpreter imports once, before it forks any worker. Not the script:
# a script that runs torch ops when imported would start OpenMP's thread pool in the
# warm interpreter, and workers forked from it hang at their first parallel op.
PRELOAD = ("torch", "torch.distributed.rpc", "asyncrpc", "asyncrpc._launch._parent")

_AF_UNIX_MAX = 107  # bytes of a socket's path (108 with its NUL)
_LISTENER = len("/listener-XXXXXXXX")  # the socket's name in multiprocessing's folder
_FOLDER = len("/pymp-XXXXXXXX")  # that folder's name under the temporary folder
_SHORT = ("/tmp", "/var/tmp", "/dev/shm")  # where to make that folder if TMPDIR is too deep


def spawner(method: str) -> Any:
    """multiprocessing's context for `method`; a forkserver's preloads `PRELOAD`.

    The forkserver is one per process: the first world starts it, later
    worlds and restarts fork from it at once.
    """
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        _fit_socket_folder()
        context.set_forkserver_preload(list(PRELOAD))  # multiprocessing asks for a list
    return context


def _fit_socket_folder() -> None:
    """Make multiprocessing's folder for sockets short enough for AF_UNIX (once per process).

    multiprocessing makes the folder on first need, under TMPDIR; made here
    first, under a short folder where TMPDIR is too deep, it is the one
    multiprocessing uses from then on.
    """
    deep = len(tempfile.gettempdir()) + _FOLDER + _LISTENER > _AF_UNIX_MAX
    short = next((d for d in _SHORT if os.access(d, os.W_OK | os.X_OK)), None) if deep else None
    before = tempfile.tempdir
    if short is not None:
        tempfile.tempdir = short
    try:
        folder = multiprocessing.util.get_temp_dir()
    finally:
        tempfile.tempdir = before
    if len(folder) + _LISTENER > _AF_UNIX_MAX:
        raise AsyncRPCError(
            f"the folder for the socket of the process that starts the workers, {folder!r} "
            f"({len(folder)} bytes, under TMPDIR), is too deep: a socket's path must fit in "
            f"{_AF_UNIX_MAX} bytes, and none of {', '.join(_SHORT)} is writable here; set "
            f"TMPDIR to a folder of at most {_AF_UNIX_MAX - _FOLDER - _LISTENER} bytes, or "
            f"pass start_method='spawn'"
        )


@contextlib.contextmanager
def dies_with_this_process() -> Iterator[None]:
    """A forkserver started inside the block dies when this process ends (`_parent`)."""
    before = os.environ.get(_parent.PARENT_VARIABLE)
    os.environ[_parent.PARENT_VARIABLE] = str(os.getpid())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_parent.PARENT_VARIABLE, None)
        else:
            os.environ[_parent.PARENT_VARIABLE] = before
