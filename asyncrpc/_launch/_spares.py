"""A worker forked ahead of need: an elastic world's next `add_workers` starts warm.

Forking a worker through the forkserver and starting it takes about 15 ms
of an add's 50 here; a spare has done that already and waits, blocked on a
pipe, for the spec that makes it a worker (its rank, name, how it joins)::

    supervisor                              spare (forked once the world formed)
      Spares.refill() ── fork ─────────────> die with the parent; wait on `assignment`
      add_workers: Spares.take(spec) ─spec─> name itself, then `_child.worker` as any
      Spares.refill() ── fork ─> the next spare
      the world's end: Spares.close() ─EOF─> exit 0 (it never became a worker)

Only in worlds started with `elastic=True`; a spare costs one idle process
(about 13 MiB PSS here). Like every worker, it imports the script as it
starts (multiprocessing does), but before it has a name: a script that
reads `multiprocessing.current_process().name` at import sees
"asyncrpc-spare" there. A spare that dies before it is needed (the script
fails at import, say) ends the spares: adds then start workers the plain
way, which reports why they fail.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, NamedTuple

from . import _child, _forkserver

__all__ = ("Spares",)

_JOIN_S = 2.0  # how long the world's end waits for a spare to go
# After a spare was taken, the next is forked this much later: a fork beside the
# new worker's join slows it (two cores here), and adds come in bursts.
_REFILL_AFTER_S = 0.3


class _Spare(NamedTuple):
    proc: BaseProcess
    assignment: Connection  # the spec goes here
    errors: Connection  # its traceback comes back here, as a worker's


class Spares:
    """Spare workers of one embedded world (none or one at a time)."""

    def __init__(
        self,
        spawner: Any,
        payload: bytes,
        fixed: tuple[Any, ...],
        procs: list[BaseProcess],
        formed: Callable[[], bool],
    ) -> None:
        self.spawner = spawner
        self.payload = payload
        self.fixed = fixed  # what every worker's spec shares: environ, outputs, alive
        self.procs = procs  # every process started, to stop them (the supervisor's)
        self.formed = formed
        self.ready: list[_Spare] = []
        self.closed = False
        self._formed = False
        self._not_before = 0.0

    def refill(self) -> None:
        """Fork a spare if there is none (once the world has formed: its start comes first)."""
        if self.ready and not self.ready[0].proc.is_alive():
            self.close()  # it died unasked: no more spares in this world
        if self.closed or self.ready or time.monotonic() < self._not_before:
            return
        if not self._formed:
            self._formed = self.formed()
            if not self._formed:
                return
        assignment, sending = self.spawner.Pipe(duplex=False)
        reader, writer = self.spawner.Pipe(duplex=False)
        proc = self.spawner.Process(
            target=_child.spare, args=(self.payload, self.fixed, assignment, writer),
            name="asyncrpc-spare",
        )  # fmt: skip
        self.procs.append(proc)
        with _forkserver.dies_with_this_process():
            proc.start()
        writer.close()
        assignment.close()
        self.ready.append(_Spare(proc, sending, reader))

    def take(self, assignment: tuple[Any, ...]) -> tuple[BaseProcess, Connection] | None:
        """Make a spare the worker `assignment` says; its process and errors pipe (None: none)."""
        self._not_before = time.monotonic() + _REFILL_AFTER_S
        while self.ready:
            spare = self.ready.pop()
            try:
                alive = spare.proc.is_alive()
                if alive:
                    spare.assignment.send(assignment)
            except (OSError, ValueError):
                alive = False
            spare.assignment.close()
            if alive:
                return spare.proc, spare.errors
            spare.errors.close()
            self._forget(spare.proc)
            self.closed = True  # it died unasked: no more spares in this world
        return None

    def _forget(self, proc: BaseProcess) -> None:
        proc.join(_JOIN_S)
        if proc in self.procs:
            self.procs.remove(proc)
        if not proc.is_alive():
            proc.close()

    def close(self) -> None:
        """The world ends: each spare sees its pipe end and exits."""
        self.closed = True
        for spare in self.ready:
            spare.assignment.close()
        for spare in self.ready:
            self._forget(spare.proc)
            spare.errors.close()
        self.ready.clear()
