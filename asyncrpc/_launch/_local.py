"""An embedded world's worker processes: how each starts, ends and is stopped.

`_supervisor` makes one `LocalWorld` per start of a world: it hosts the
world's store on loopback, forks every worker through the warm interpreter
(`_forkserver`) with its spec, and reads each worker's end::

    LocalWorld(main, args, ...): store on 127.0.0.1:<free port>, main pickled once
      spawn(rank, attempt, joining) ── forkserver ──> _child.worker(payload, spec, errors)
      failure(rank) <── errors pipe: its traceback, if it raised (RETURNED: done) ── exit code
      result() <── the store: what rank 0's main returned (`asyncrpc.run` returns it)
      stop(): SIGTERM every process started, SIGKILL 2 s later
      close(): the caller's output and the `alive` pipe (each worker ends with this process)
      quiet(gone): stderr through this process, torch's warnings of departures dropped (`_quiet`)

`procs` and `errors` hold, by rank, the process that answers for a worker
now and its traceback pipe; `started` every process started, to stop them.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import pickle
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from .._core import _context, _rendezvous
from .._core._errors import WorkerFailedError
from .._core._membership import Joining
from . import _child, _forkserver
from ._quiet import Quiet, quieted

__all__ = ("LocalWorld", "report", "runs", "signal_first", "stop", "wake_after")

_WAKE_S = 0.25  # how often a supervisor's wait returns, to take a Ctrl-C


class LocalWorld:
    """The worker processes of one embedded world, on this machine, and how to start one."""

    def __init__(
        self,
        main: Callable[..., object],
        args: tuple[Any, ...],
        world_size: int,
        roles: Mapping[str, int] | None,
        settings: _context.Settings,
    ) -> None:
        self.host = "127.0.0.1"
        # Pickled here, loaded in the worker's own try: a worker that cannot load them
        # sends the reason back instead of dying in multiprocessing's start-up.
        self.payload = _child.pickled_main(main, args)
        self.settings = settings
        self.store = _rendezvous.host_store(self.host, 0, settings.init_timeout)
        self.names = list(_context.names_for(world_size, roles))  # grows as workers are added
        self.roles = dict(roles or {})
        self.spawner = _forkserver.spawner(settings.start_method)
        self.started: list[BaseProcess] = []  # every process started, to stop them
        self.procs: list[BaseProcess] = []  # by rank: the process that answers for it now
        self.errors: list[Connection] = []  # by rank: that process's traceback pipe
        forkserver = settings.start_method == "forkserver"
        self.outputs = _child.caller_output() if forkserver else (None, None)
        self._quiet: Quiet | None = None  # the workers' stderr through this process (`quiet`)
        self._stderr = self.outputs[1]
        # Each worker reads `alive` until this process ends, however it ends (SIGKILL
        # too): then the read sees the end of the pipe, and the worker stops itself.
        self.alive, self._held = self.spawner.Pipe(duplex=False)
        self.environ = dict(os.environ)

    def assign(self, rank: int, attempt: int, joining: Joining | None) -> tuple[Any, ...]:
        """Worker `rank`'s own part of its spec (a spare is given only this, `_spares`)."""
        return (rank, len(self.names), self.names[rank], self.host, self.store.port,
                self.settings, self.roles or None, attempt, joining)  # fmt: skip

    def shared(self) -> tuple[Any, ...]:
        """The part of the spec every worker shares: environment, output, `alive`."""
        return (self.environ, self.outputs, self.alive)

    def spawn(self, rank: int, attempt: int, joining: Joining | None) -> BaseProcess:
        """Start worker `rank`'s process; it answers for `rank` from now (`procs`, `errors`)."""
        reader, writer = self.spawner.Pipe(duplex=False)
        spec = (*self.assign(rank, attempt, joining), *self.shared())
        proc: BaseProcess = self.spawner.Process(
            target=_child.worker, args=(self.payload, spec, writer), name=self.names[rank]
        )
        # Listed before it starts: a Ctrl-C inside start() (the worker may already
        # run) must still stop it, or multiprocessing's exit would wait for it.
        self.started.append(proc)
        with _forkserver.dies_with_this_process():
            proc.start()
        writer.close()
        self.take(rank, proc, reader)
        return proc

    def take(self, rank: int, proc: BaseProcess, errors: Connection) -> None:
        """`proc` answers for `rank` now (a new rank's, or a replacement's)."""
        if rank == len(self.procs):
            self.procs.append(proc)
            self.errors.append(errors)
        else:
            self.procs[rank], self.errors[rank] = proc, errors

    def failure(self, rank: int) -> WorkerFailedError | None:
        """How worker `rank`'s process ended: None once its `main` returned and it left the
        world (`_child.RETURNED`, exit code 0), else the failure: its traceback if it sent
        one, else its exit (an exit 0 without `RETURNED`, `os._exit(0)`, is one too)."""
        proc, errors = self.procs[rank], self.errors[rank]
        proc.join()
        text = ""
        if errors.poll():
            try:
                text = str(errors.recv())
            except (EOFError, OSError):
                text = ""
        if text == _child.RETURNED and proc.exitcode == 0:
            return None
        if text == _child.RETURNED:
            text = ""  # it left the world, then was killed: its exit says how
        return WorkerFailedError(self.names[rank], rank, proc.exitcode, text)

    def result(self) -> object:
        """What rank 0's `main` returned (None if it did not return); raises `TypeError` when
        it could not be pickled there, or `RuntimeError` when it cannot be loaded here."""
        if not self.store.check([_child.RESULT_KEY]):
            return None
        kept = self.store.get(_child.RESULT_KEY)
        if kept[:1] == b"E":
            raise TypeError(kept[1:].decode())
        try:
            return pickle.loads(kept[1:])
        except Exception as exc:
            raise RuntimeError(
                f"asyncrpc.run returns what rank 0's main returned, but this process cannot "
                f"load it ({type(exc).__name__}: {exc}); return plain data or tensors, or "
                f"objects of classes this process can import (defined at the top level of "
                f"the script or in a module)"
            ) from exc

    def retire(self, rank: int) -> None:
        """Let go of worker `rank`'s ended process and its pipe (2 descriptors a process)."""
        proc = self.procs[rank]
        self.started.remove(proc)
        proc.close()
        self.errors[rank].close()

    def quiet(self, gone: Callable[[str], bool]) -> None:
        """Workers started from now write stderr through this process (`_quiet.Quiet`), which
        drops torch's warnings about processes `gone` (torch names; a world that heals or grows).
        """
        if self._stderr is not None and quieted():
            self._quiet = Quiet(self._stderr, gone)
            self.outputs = (self.outputs[0], self._quiet.writer)

    def handed_out(self) -> None:
        """Every worker has its own copy of the output and `alive` by now: close ours."""
        _child.close_outputs(self.outputs)
        self.alive.close()

    def close(self) -> None:
        if self._quiet is not None:  # every worker has ended: what they wrote last first
            self._quiet.close()
        _child.close_outputs((*self.outputs, self._stderr))
        if not self.alive.closed:
            self.alive.close()
        self._held.close()


def runs(proc: BaseProcess) -> bool:
    """Whether `proc` still runs; False once retired (closed), its replacement not started yet."""
    try:
        return proc.is_alive()
    except ValueError:  # closed
        return False


def wake_after(*moments: float | None) -> float:
    """How long a supervisor's wait may last: until the first of `moments`, at most `_WAKE_S`.

    Never an endless wait: a Ctrl-C the kernel hands to another thread (torch's
    store runs some here) does not interrupt this one; Python raises it here
    only once the wait returns.
    """
    now = time.monotonic()
    return max(0.0, min([now + _WAKE_S, *(m for m in moments if m is not None)]) - now)


def signal_first(proc: BaseProcess) -> int:
    """Sort key: a process killed by a signal before one that exited (the cause first)."""
    proc.join()
    return 0 if (proc.exitcode or 0) < 0 else 1


def report(failures: list[WorkerFailedError]) -> WorkerFailedError | None:
    """The first failure, with a note naming each that failed after it."""
    if not failures:
        return None
    first = failures[0]
    for other in failures[1:]:
        first.add_note(f"also failed afterwards: {other.name!r} (rank {other.rank})")
    return first


def stop(procs: list[BaseProcess]) -> None:
    """SIGTERM every started process of `procs`, SIGKILL those left after a grace period."""
    procs = [proc for proc in procs if proc.pid is not None]  # started (see spawn)
    try:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + _child.KILL_AFTER_S
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
    except KeyboardInterrupt:  # Ctrl-C again while they stop: no second traceback, kill now
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(_child.KILL_AFTER_S)


def wait(
    running: Mapping[object, int], extra: list[Connection], timeout: float
) -> tuple[list[int], bool]:
    """Wait for processes of `running` (sentinel -> rank) to end, or `extra` to be readable.

    Returns the ranks that ended, signals first, and whether an `extra` woke it.
    """
    ready = multiprocessing.connection.wait([*running, *extra], timeout)  # type: ignore[list-item]
    ended = [running[s] for s in ready if s in running]
    return ended, any(conn in ready for conn in extra)
