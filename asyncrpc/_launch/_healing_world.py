"""An embedded world that heals or grows, as its supervisor runs it.

`asyncrpc.run(restart="worker")` or `elastic=True`: the supervisor watches
every worker's process and the members' requests, and hands each end to
the heal algorithm (`_replacing.Replacer`, the one a launcher uses too)::

    HealingWorld.supervise(grace):
      wait on every running worker's sentinel and the requests' pipe (`_changes`)
      a worker ended ─> Replacer.ended(Ended(rank, exit code, how, traceback)):
        DONE / LEFT: let it go (elastic=True alone: a death but rank 0's is a LEFT too)
        HEALED: its replacement runs (or soon: start_due)
        UNFORMED: raise Unformed        FAILED: the others get `grace`, then are stopped
      every turn: start_due, serve the members' adds and removes, refill the spare

What this supervisor gives the algorithm (`Supervised`): its processes
(multiprocessing's, `_local.LocalWorld`), the members' changes it serves,
and its healer (`_healer.Healer`, over the world's store).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from .._core._errors import WorkerFailedError, describe_exit
from .._core._membership import Joining, torch_name
from . import _local
from ._changes import Changes
from ._healer import Healer
from ._local import LocalWorld
from ._replacing import Ended, Exit, Replacer, spent
from ._spares import Spares

__all__ = ("HealingWorld", "Unformed")

_KILLED_S = 5.0  # how long a SIGKILLed worker may take to be gone


class Unformed(Exception):
    """A worker died before the healing world had formed: nothing ran, start it again."""

    def __init__(self, failure: WorkerFailedError) -> None:
        super().__init__(failure.summary())
        self.failure = failure


class HealingWorld:
    """The supervisor of one embedded world that heals (or grows): `Supervised` for `Replacer`.

    `max_restarts` replacements in all, `used` of them spent on earlier starts
    of the world; members may add workers up to `max_world_size`; `elastic`
    (asked for): the next add starts from a spare (`_spares`).
    """

    def __init__(
        self,
        world: LocalWorld,
        max_restarts: int,
        used: int,
        max_world_size: int | None,
        elastic: bool,
    ) -> None:
        self.world = world
        self.healer = Healer(world.store, "0", tuple(world.names), max_restarts, used)
        world.names = self.healer.names  # one list: added workers' names too
        self.running: dict[object, int] = {}  # a running process's sentinel -> its rank
        self.replacer = Replacer(self)
        self.spares: Spares | None = None
        self.changes: Changes | None = None
        self.elastic = elastic
        self.max_world_size = max_world_size
        # torch's names of the processes that ended or are leaving, and whether the world
        # ends: torch's warnings about them are dropped from the workers' stderr (`_quiet`).
        self.gone: set[str] = set()
        self.ending = False
        world.quiet(lambda name: self.ending or name in self.gone)

    def start_all(self) -> None:
        """Start the world's first workers; then watch the members' requests."""
        for rank in range(len(self.world.names)):
            self.start(rank, Joining(rank, "0", replacement=False), 0)
        # A process that ended is dead before the loop has handled its end.
        procs, names = self.world.procs, self.healer.names
        self.healer.alive = lambda name: _local.runs(procs[names.index(name)])
        if self.elastic:  # elastic=True: the next add starts from a spare
            world = self.world
            self.spares = Spares(world.spawner, world.payload, world.shared(), world.started,
                                 self.healer.formed)  # fmt: skip
        self.changes = Changes(self.healer, self.max_world_size, self.world.roles, self._add,
                               self._alive)  # fmt: skip

    def close(self) -> None:
        if self.changes is not None:
            self.changes.close()
        if self.spares is not None:
            self.spares.close()

    # ---- what the heal algorithm asks of this supervisor (`Supervised`) ----------------

    def world_ended(self) -> bool:
        return self.healer.ending()

    def left(self, end: Ended) -> bool:
        return self.changes is not None and self.changes.exited(end.name, end.summary)

    def formed_healer(self) -> Healer | None:
        return self.healer if self.healer.formed() else None

    def grows(self) -> bool:
        return self.changes is not None

    def lost(self, end: Ended) -> None:
        assert self.changes is not None
        print(
            f"asyncrpc: {end.summary}; it left the world, which goes on without it (an "
            f"elastic world replaces no worker: pass restart='worker' and max_restarts=K "
            f"to replace dead workers in place)",
            file=sys.stderr,
            flush=True,
        )
        self.changes.lost(end.name, end.how)

    def start(self, rank: int, joining: Joining, attempt: int) -> None:
        proc = self.world.spawn(rank, attempt, joining)
        self.running[proc.sentinel] = rank

    def retire(self, rank: int) -> None:
        self.world.retire(rank)

    def stop_joining(self, names: set[str], stopping: Callable[[str], None]) -> list[str]:
        procs = self.world.procs
        stopped = [rank for rank in self.running.values() if self.healer.names[rank] in names]
        for rank in stopped:
            stopping(self.healer.names[rank])
            procs[rank].kill()
            procs[rank].join(_KILLED_S)  # dead before its name is forgotten
        return [self.healer.names[rank] for rank in stopped]  # their deaths come back

    # ---- the members' changes ---------------------------------------------------------

    def _add(self, rank: int, joining: Joining, node: int | None) -> None:
        """Start an added worker (`Changes`): from a spare if one is ready."""
        warm = None
        if self.spares is not None:
            warm = self.spares.take(self.world.assign(rank, 0, joining))
        if warm is None:
            self.start(rank, joining, 0)
            return
        self.world.take(rank, *warm)
        self.running[warm[0].sentinel] = rank

    def _alive(self) -> set[str]:
        """The members whose processes run and have joined (they hear of every change)."""
        procs, names = self.world.procs, self.healer.names
        running = {names[r] for r in self.running.values() if _local.runs(procs[r])}
        return running - self.healer.joining()

    def _serve(self) -> None:
        """Serve the members' requests; kill the removed workers whose time is up; a spare."""
        assert self.changes is not None
        self.changes.serve()
        for name in self.changes.removing:  # leaving: torch's warnings about it are noise
            self._gone(name)
        if self.spares is not None:
            self.spares.refill()
        for name in self.changes.due():
            proc = self.world.procs[self.healer.names.index(name)]
            if _local.runs(proc):
                proc.kill()

    def _gone(self, name: str) -> None:
        """`name`'s process (as torch knows it) has ended or is leaving (`_quiet`)."""
        healer = self.healer
        self.gone.add(torch_name(name, healer.ids[name], healer.size))

    # ---- the loop ---------------------------------------------------------------------

    def supervise(self, grace: float) -> WorkerFailedError | None:
        """Watch until every worker is done; the failure that ended the world, if any."""
        assert self.changes is not None
        failures: list[WorkerFailedError] = []
        deadline = None
        while self.running or (self.replacer.later and not failures):
            timeout = _local.wake_after(deadline, self.replacer.next_start())
            ended, woken = _local.wait(self.running, [self.changes.woken], timeout)
            if woken:
                self.changes.drain()  # served below
            for sentinel in [s for s, r in self.running.items() if r in ended]:
                del self.running[sentinel]
            procs = self.world.procs
            for rank in sorted(ended, key=lambda r: _local.signal_first(procs[r])):
                failure = self._ended(rank, bool(failures))
                if failure is not None:
                    failures.append(failure)
            if not failures:
                self.replacer.start_due()
                self._serve()
            if failures and deadline is None:
                deadline = time.monotonic() + grace
                self.ending = True  # the failure is reported: torch's words on it are noise
            if deadline is not None and time.monotonic() >= deadline and self.running:
                _local.stop([self.world.procs[r] for r in self.running.values()])
                self.running.clear()
        return _local.report(failures)

    def _ended(self, rank: int, failing: bool) -> WorkerFailedError | None:
        """Worker `rank`'s process ended: None, or the failure it is (`failing`: the world's)."""
        self._gone(self.healer.names[rank])
        failure = self.world.failure(rank)
        if failure is None:  # main returned and it left: the world ends, or it was removed
            failure = WorkerFailedError(self.healer.names[rank], rank, 0)  # for its words
        if failing:  # the world fails already: no change of members, no heal
            done = failure.exitcode == 0 and self.healer.ending()
            return None if done else failure
        code = failure.exitcode if failure.exitcode is not None else 1
        if failure.remote_traceback:  # survivors' errors: "worker 'w2' <how> and is being ..."
            how = failure.summary().split(f"(rank {rank}) ", 1)[-1]
        else:
            how = describe_exit(code)
        end = Ended(rank, failure.name, code, failure.summary(), how, failure.remote_traceback)
        verdict = self.replacer.ended(end)
        self.ending = self.ending or verdict.exit is Exit.DONE
        if verdict.exit is Exit.UNFORMED:
            raise Unformed(failure)  # the supervisor stops every worker; `run` starts again
        if verdict.exit is not Exit.FAILED:
            return None
        healer = self.healer
        if verdict.reason == "spent" and not healer.max_restarts:  # elastic: rank 0 died
            failure.add_note(
                "rank 0 runs the program's driver, so its end ends an elastic world (other "
                "workers that die leave it); pass restart='worker' and max_restarts=K to "
                "replace it in place"
            )
        elif verdict.reason == "spent":
            flag = f"max_restarts={healer.max_restarts}"
            note = spent(healer.max_restarts, healer.started_again, flag)
            failure.add_note(f"{note}; this failure ended it")
        return failure
