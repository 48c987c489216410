"""Replacing and adding workers in an embedded world that heals or grows: the supervisor's side.

`_supervisor._supervise` watches every worker's process; in a world that
heals (or grows) it hands each end to this module::

    a worker's process ended
      a change of members (`_changes`: it left, or failed to join) -> let it go
      before the world formed                -> Unformed: the world starts again
      a death -> heal(): stop the workers still joining, Healer.replace (every
                 member forgets the dead process), start the replacement
                 (a join another member refused: started again in 0.25 s)
    every turn: start_due (held-back replacements), serve (members' requests)
"""

from __future__ import annotations

import multiprocessing.connection
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import NamedTuple

from .._core import _torch
from .._core._errors import WorkerFailedError, describe_exit
from .._core._membership import Joining
from . import _changes, _healer

__all__ = (
    "Healing",
    "Unformed",
    "changed",
    "changes_for",
    "heal",
    "runs",
    "serve",
    "spent",
    "start_due",
)

_KILLED_S = 5.0  # how long a SIGKILLed worker may take to be gone


class Unformed(Exception):
    """A worker died before the healing world had formed: nothing ran, start it again."""

    def __init__(self, failure: WorkerFailedError) -> None:
        super().__init__(failure.summary())
        self.failure = failure


def spent(max_restarts: int, started_again: int) -> str:
    """The note of a failure past `max_restarts` in a world that heals."""
    if not started_again:
        return (
            f"the world replaced workers {max_restarts} times (max_restarts={max_restarts}); "
            f"this failure ended it"
        )
    return (
        f"the world was started again {started_again} times as it started and replaced "
        f"workers {max_restarts - started_again} times (max_restarts={max_restarts}); "
        f"this failure ended it"
    )


# A replacement whose join a member refused starts again after this: time for that
# member to see its listener closed and end (`_core/_torch/_listener`), up to
# _REFUSED_MAX times in a row uncounted (then counted: a member refusing for good).
_REFUSED_S = 0.25
_REFUSED_MAX = 40


class Healing(NamedTuple):
    """What a supervisor that heals needs: the healer, how to start a worker, what waits."""

    healer: _healer.Healer
    spawn: Callable[[int, int, Joining | None], tuple[BaseProcess, Connection]]
    # Replacements to start later, by rank: (when, how it joins); their refusals in a row.
    later: dict[int, tuple[float, Joining]]
    refusals: dict[int, int]
    # Let go of a process that ended and was replaced (its descriptors: 2 a process).
    retire: Callable[[BaseProcess], None]
    changes: list[_changes.Changes]  # the members' requests to add and remove workers (one)
    running: dict[object, int]  # the supervisor's: a running process's sentinel -> its rank
    # An added worker from a spare (`_spares`), or None (none ready: `spawn` it); refill.
    warm: Callable[[int, int, Joining], tuple[BaseProcess, Connection] | None]
    refill: Callable[[], None]


def changes_for(
    healing: Healing,
    max_world_size: int | None,
    roles: dict[str, int],
    procs: list[BaseProcess],
    errors: list[multiprocessing.connection.Connection],
) -> _changes.Changes:
    """Serve the members' changes: new workers start as the supervisor's loop watches them."""
    healer = healing.healer
    running = healing.running

    def start(rank: int, joining: Joining, node: int | None) -> None:
        warm = healing.warm(rank, 0, joining)
        if warm is None:
            procs.append(None)  # type: ignore[arg-type]  # set by _start at once
            errors.append(None)  # type: ignore[arg-type]
            _start(healing, rank, joining, procs, errors, running)
            return
        procs.append(warm[0])
        errors.append(warm[1])
        running[warm[0].sentinel] = rank

    def alive() -> set[str]:
        return {healer.names[r] for r in running.values() if runs(procs[r])} - healer.joining()

    return _changes.Changes(healer, max_world_size, roles, start, alive)


def changed(changes: _changes.Changes, rank: int, failure: WorkerFailedError) -> bool:
    """Worker `rank` ended as a change of members (it left, or failed to join): let it go."""
    if not changes.exited(changes.healer.names[rank], failure.summary()):
        return False
    if failure.remote_traceback and failure.exitcode != 0:  # it failed to join: say why
        print(failure.remote_traceback.rstrip(), file=sys.stderr, flush=True)
    return True


def serve(healing: Healing, procs: list[BaseProcess]) -> None:
    """Serve the members' requests; kill the removed workers whose time is up; a spare."""
    changes = healing.changes[0]
    changes.serve()
    healing.refill()
    for name in changes.due():
        proc = procs[changes.healer.names.index(name)]
        if runs(proc):
            proc.kill()


def start_due(
    healing: Healing,
    procs: list[BaseProcess],
    errors: list[multiprocessing.connection.Connection],
    running: dict[object, int],
) -> None:
    """Start the replacements held back (`_REFUSED_S`) whose time has come."""
    now = time.monotonic()
    for rank, (when, joining) in sorted(healing.later.items()):
        if when <= now:
            del healing.later[rank]
            _start(healing, rank, joining, procs, errors, running)


def _start(
    healing: Healing,
    rank: int,
    joining: Joining,
    procs: list[BaseProcess],
    errors: list[multiprocessing.connection.Connection],
    running: dict[object, int],
) -> None:
    """Start worker `rank`'s replacement and watch it."""
    name = healing.healer.names[rank]
    procs[rank], errors[rank] = healing.spawn(rank, healing.healer.attempts[name], joining)
    running[procs[rank].sentinel] = rank


def heal(
    healing: Healing,
    rank: int,
    failure: WorkerFailedError,
    procs: list[BaseProcess],
    errors: list[multiprocessing.connection.Connection],
    running: dict[object, int],
) -> bool:
    """Replace worker `rank` in place; False when the world may not heal any more."""
    healer = healing.healer
    if not healer.formed():
        raise Unformed(failure)  # _run_embedded stops every worker; run starts them again
    name = healer.names[rank]
    retry = name in healer.retry  # before `_refused` marks it: its death stops other joiners
    refused = _refused(healing, rank, failure)
    unjoined = healer.joining() - {name}  # they have nothing to forget
    if not retry:  # one stopped as it joined held torch's join token: no joiner saw it
        _stop_joining(healer, unjoined, procs, running)
    alive = {healer.names[r] for r in running.values() if procs[r].is_alive()} - unjoined
    # What the survivors' errors say: "worker 'worker2' <how> and is being replaced".
    if failure.remote_traceback:
        how = failure.summary().split(f"(rank {rank}) ", 1)[-1]
    else:
        how = describe_exit(failure.exitcode)
    joining = healer.replace(rank, how, alive)
    if joining is None:
        if healer.count > healer.max_restarts:
            failure.add_note(spent(healer.max_restarts, healer.started_again))
        return False
    try:
        if failure.remote_traceback and not refused:
            print(failure.remote_traceback.rstrip(), file=sys.stderr, flush=True)
        print(f"asyncrpc: {_heal_line(healer, rank, failure, retry, refused)}",
              file=sys.stderr, flush=True)  # fmt: skip
        healing.retire(procs[rank])
        errors[rank].close()  # read (`_failure`); the replacement gets its own
        if refused:
            healing.later[rank] = (time.monotonic() + _REFUSED_S, joining)
        else:
            _start(healing, rank, joining, procs, errors, running)
    finally:
        healer.started()
    return True


def _refused(healing: Healing, rank: int, failure: WorkerFailedError) -> bool:
    """A replacement whose join a member refused: started again later, not counted.

    That member's listener is closed, and it ends soon to be replaced
    (`_core/_torch/_listener`); a join before then is refused again.
    """
    healer = healing.healer
    name = healer.names[rank]
    joined = name not in healer.joining()
    if joined or not _torch.refused(failure.remote_traceback or ""):
        healing.refusals.pop(rank, None)
        return False
    healing.refusals[rank] = healing.refusals.get(rank, 0) + 1
    if healing.refusals[rank] > _REFUSED_MAX:
        return False
    healer.retry.add(name)  # neither counted nor an attempt of its own
    return True


def _heal_line(
    healer: _healer.Healer, rank: int, failure: WorkerFailedError, retry: bool, refused: bool
) -> str:
    name = healer.names[rank]
    if refused:
        return (
            f"the replacement of worker {name!r} (rank {rank}) could not join: another "
            f"member refused its connection (its listener closed; it ends and is replaced "
            f"too); starting it again in {_REFUSED_S:g} s"
        )
    if retry:
        return (
            f"the replacement of worker {name!r} (rank {rank}) was stopped before it "
            f"joined, as another worker died meanwhile; starting it again"
        )
    return (
        f"{failure.summary()}; replacing it in place "
        f"(restart {healer.count} of {healer.max_restarts})"
    )


def _stop_joining(
    healer: _healer.Healer, joining: set[str], procs: list[BaseProcess], running: dict[object, int]
) -> None:
    """Kill the workers still `joining` (they may wait for the dead one forever), then forget them.

    All killed first: one still joining may hold torch's group token, which the
    forgetting of another would wait for. Their deaths come back through `running`.
    """
    stopped = [other for other in running.values() if healer.names[other] in joining]
    for other in stopped:
        healer.stop(healer.names[other])
        procs[other].kill()
        procs[other].join(_KILLED_S)  # dead before its name is forgotten
    for other in stopped:
        healer.forget_stopped(healer.names[other])


def runs(proc: BaseProcess) -> bool:
    """Whether `proc` still runs; False once retired (closed), its replacement not started yet."""
    try:
        return proc.is_alive()
    except ValueError:  # closed
        return False
