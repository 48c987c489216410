"""The warm interpreter an embedded world forks its workers from (multiprocessing's forkserver).

Where it is safe, the warm interpreter is a fork of the calling process
itself (`here`): it has imported torch and asyncrpc already, so a world's
first worker forks within milliseconds of `asyncrpc.run`. Its workers
import the script as a forkserver's do (what the script imported comes as
the caller has it).
Elsewhere it is multiprocessing's own forkserver, a second interpreter that
imports torch, its RPC layer and asyncrpc once (`PRELOAD`, about a second).
Either way every worker, restart and replacement is a fork of it, made by
multiprocessing's forkserver loop::

    supervisor ── asyncrpc.run: safe here? ──yes──> fork of this process ──┐ the warm
        │                                   └─no──> python: PRELOAD ────────┤ interpreter: dies
        │                                                                   │ with the supervisor
        └── each worker: fork ──> worker: dies with the warm interpreter from its first
                                  instruction (`_forking`: the heap frozen before each fork)

Safe here: Linux, Python 3.11 to 3.13 (whose forkserver loop this takes
over), no other Python thread, CUDA not initialized, and a fork of this
process can run torch's parallel ops: a process that has started GNU
OpenMP's thread pool (any large torch op) cannot fork (its child hangs at
its first parallel op), and a fork probes that once (`_pool_survives`).

multiprocessing keeps the forkserver's socket in a folder of its own under
TMPDIR, and a socket's path must fit AF_UNIX's 107 bytes: under a deep TMPDIR
the folder is made in a short one instead (`spawner`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.util
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import types
import warnings
from collections.abc import Iterator
from multiprocessing import connection, forkserver, resource_tracker
from typing import Any

from .._core import _runtime
from .._core._errors import AsyncRPCError
from . import _forking, _parent

__all__ = ("PRELOAD", "dies_with_this_process", "here", "spawner")

# What the warm interpreter imports once, before it forks any worker. Not the script:
# a script that runs torch ops when imported would start OpenMP's thread pool in the
# warm interpreter, and workers forked from it hang at their first parallel op.
PRELOAD = ("torch", "torch.distributed.rpc", "asyncrpc", "asyncrpc._launch._forking")
_PROBE_S = 1.0  # how long a probing fork's parallel op may take: a hung one never ends

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


@contextlib.contextmanager
def here(method: str) -> Iterator[bool]:
    """For the block, the warm interpreter is a fork of this process, where that is safe.

    Yields whether it is. The fork ends with the block (once every worker
    forked from it has ended too). Example::

        with here(settings.start_method):
            world = LocalWorld(...)  # its workers fork from this process's own copy
    """
    pid = _fork_here() if method == "forkserver" else None
    try:
        yield pid is not None
    finally:
        if pid is not None:
            _end_here(pid)


def _fork_here() -> int | None:
    """Start the fork of this process that serves multiprocessing's forkserver requests."""
    server: Any = forkserver._forkserver
    if server._forkserver_pid is not None or not _safe_here():
        return None
    _fit_socket_folder()
    resource_tracker.ensure_running()
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    parent = os.getpid()
    pid = _fork()
    if pid == 0:  # the warm interpreter: multiprocessing's forkserver loop, never returning
        code = 1
        try:
            os.close(alive_w)
            _forking.install(parent)
            # Each worker imports the script, as a forkserver's does (`__mp_main__`): it
            # runs what the script runs at import, and not what the caller ran since.
            sys.modules["__main__"] = types.ModuleType("__main__")
            forkserver.main(listener.fileno(), alive_r, [])
        except SystemExit:  # every holder of `alive` has closed it
            code = 0
        finally:
            os._exit(code)
    os.close(alive_r)
    listener.close()
    server._forkserver_address, server._forkserver_alive_fd = address, alive_w
    server._forkserver_pid = pid
    return pid


def _end_here(pid: int) -> None:
    """Close this process's hold on the fork of itself, and reap it once it has ended."""
    server: Any = forkserver._forkserver
    if server._forkserver_pid != pid:
        return
    os.close(server._forkserver_alive_fd)
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
    try:
        os.kill(pid, signal.SIGKILL)  # its workers have ended: nothing is left for it to fork
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):  # reaped already (a SIGCHLD handler's)
        pass


def _safe_here() -> bool:
    """Whether this process may serve as the warm interpreter (see the module's docstring)."""
    if not sys.platform.startswith("linux") or not (3, 11) <= sys.version_info < (3, 14):
        return False
    if threading.active_count() != 1 or threading.current_thread() is not threading.main_thread():
        return False
    if len(sys._current_frames()) != 1:  # a thread of `_thread` that `threading` does not count
        return False
    if _runtime.SLOT.pool_started:
        return False
    import torch

    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return False
    if not _pool_survives(torch):
        _runtime.SLOT.pool_started = True  # for good: OpenMP's pool never ends
        return False
    return True


def _pool_survives(torch: Any) -> bool:
    """Whether a fork of this process runs a parallel torch op: False if it hangs in it."""
    if len(os.listdir("/proc/self/task")) == 1:  # no thread at all, OpenMP's none either
        return True
    parent = os.getpid()
    pid = _fork()
    if pid == 0:
        try:
            _parent.die_with_parent(parent)
            torch.set_num_threads(2)
            torch.ones(1 << 17).exp_()  # above torch's grain: one parallel region
        finally:
            os._exit(0)
    deadline = time.monotonic() + _PROBE_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return False


def _fork() -> int:
    """os.fork, this process's buffered output written first (or each child writes it again)."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # None: the script was started with that stream closed
            stream.flush()
    with warnings.catch_warnings():
        # Python 3.12+ warns of any thread: here only idle native ones (OpenBLAS's).
        warnings.filterwarnings("ignore", message=".*fork", category=DeprecationWarning)
        return os.fork()
