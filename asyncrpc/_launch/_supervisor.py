"""`asyncrpc.run`: one script, run embedded or under a launcher.

Under torchrun (or `asyncrpc-launch`) every process already is a worker, so
`run` joins the world and calls `main`. Without a launcher, the calling
process becomes a supervisor: it hosts the rendezvous store on loopback,
spawns the workers and watches them::

    python script.py  (supervisor: store on 127.0.0.1:<free port>)
       |-- spawn --> worker0: init -> main(ctx) -> shutdown --.
       |-- spawn --> worker1: init -> main(ctx) -> shutdown --+-- exit codes,
       |-- spawn --> worker2: init -> main(ctx) -> shutdown --'   tracebacks (pipe)
       `-- first failure: stop the rest, raise WorkerFailedError naming the worker

Under a launcher, every worker beats in the world's store and watches the
others (`_liveness`): a worker that raises, a death its launcher saw, or a
silent peer ends the world on every node, or restarts it (the launcher's
--max-restarts). Embedded, the supervisor restarts it (`max_restarts`)::

    node 0: worker1 killed --agent: failed="worker1 ... SIGKILL"--> store
    node 1: worker2, worker3 <--liveness thread, every 0.5 s-- store -> exit 1
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from .._core import _context, _devices, _rendezvous
from .._core._errors import WorkerFailedError
from .._core._membership import Joining
from . import _child, _forkserver, _healer, _replacing, _spares
from ._launched import launched, run_launched

__all__ = ("run",)

_GRACE_S = 3.0  # how long survivors get to exit on their own after a failure


def run(
    main: Callable[..., object],
    world_size: int | None = None,
    *,
    args: tuple[Any, ...] = (),
    roles: Mapping[str, int] | None = None,
    max_restarts: int = 0,
    restart: str | None = None,
    elastic: bool = False,
    max_world_size: int | None = None,
    **options: Any,
) -> None:
    """Run `main(ctx, *args)` on every worker of a world, then shut RPC down cleanly.

    Under a launcher the process joins the launcher's world; otherwise `run`
    starts `world_size` local worker processes itself (`main` must then be
    defined at module level, behind ``if __name__ == "__main__":``). If a worker
    raises or dies, the others are stopped and `WorkerFailedError` names it;
    with `max_restarts=N` the world is started again instead, up to N times
    (same names; `ctx.attempt` counts the restarts, so `main` can resume from
    its own checkpoint). With `restart="worker"` only the worker that died is
    replaced, under its name and rank, while the others keep running with
    their state (docs: "Healing in place"); `ctx.attempt` then counts that
    worker's own restarts. Under a launcher, the launcher restarts:
    `asyncrpc-launch --max-restarts N [--restart worker]`. With `elastic=True`
    (and in every world that heals) members may add and remove workers while
    it runs (`asyncrpc.add_workers`, `asyncrpc.remove_workers`), up to
    `max_world_size` at once (None: no bound). Options (`num_worker_threads`,
    `rpc_timeout`, ...): see `Settings`. Example::

        def main(ctx):
            print(ctx.name, "of", ctx.world_size)

        if __name__ == "__main__":
            asyncrpc.run(main, world_size=3)
    """
    _check_main(main)
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}; write args=(x,)")
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise ValueError(
            f"max_restarts must be an int >= 0, got {max_restarts!r}; "
            "e.g. max_restarts=2 starts the world at most 3 times"
        )
    _check_restart(restart)
    _check_elastic(elastic, max_world_size, restart, max_restarts)
    if restart == "worker" and max_restarts < 1 and not launched():
        raise ValueError(
            f"restart='worker' replaces dead workers at most max_restarts times, got "
            f"max_restarts={max_restarts}; pass max_restarts=K with K >= 1"
        )
    settings = _context.Settings.from_options(options)
    if restart == "worker" or elastic:
        _devices.refuse_changing(settings.devices, settings.device_maps)
    size = _context.resolve_world_size(world_size, roles)
    if launched():
        run_launched(main, args, size, roles, settings, restart)
        return
    if size is None:
        raise ValueError(
            "asyncrpc.run needs world_size=N (or roles=...) to start a local world; "
            "under a launcher it takes the launcher's"
        )
    names = _context.names_for(size, roles)
    _devices.check_embedded(settings.devices, settings.device_maps, names, list(roles or ()))
    if max_world_size is not None and size > max_world_size:
        raise ValueError(
            f"world_size={size} is above max_world_size={max_world_size}; raise "
            f"max_world_size, or start fewer workers"
        )
    if restart == "worker" or elastic:
        _run_healing(main, args, size, roles, settings, max_restarts, max_world_size, elastic)
        return
    for attempt in range(max_restarts + 1):
        # Survivors get a grace period to report their own failure, unless the
        # world is about to start again: then they are stopped at once.
        grace = _GRACE_S if attempt == max_restarts else 0.0
        failure = _run_embedded(main, args, size, roles, settings, attempt, grace)
        if failure is None:
            return
        if attempt == max_restarts:
            if max_restarts:
                failure.add_note(f"the world was started {attempt + 1} times; every run failed")
            raise failure
        print(
            f"asyncrpc: {failure.summary()}; restarting the world "
            f"(restart {attempt + 1} of {max_restarts})",
            file=sys.stderr,
            flush=True,
        )


def _run_healing(
    main: Callable[..., object],
    args: tuple[Any, ...],
    size: int,
    roles: Mapping[str, int] | None,
    settings: _context.Settings,
    max_restarts: int,
    max_world_size: int | None = None,
    elastic: bool = False,
) -> None:
    """`restart="worker"`: one world healing in place, started again while it forms.

    An elastic world that does not heal is one with no restarts to spend.

    A worker that dies before every member is ready (no `main` has run) cannot
    be replaced in place: the others wait for it in the world's start. The
    world starts again, counted against `max_restarts`.
    """
    used = 0
    while True:
        try:
            heal = (max_restarts, used, max_world_size, elastic)
            failure = _run_embedded(main, args, size, roles, settings, 0, _GRACE_S, heal)
        except _replacing.Unformed as unformed:
            failure, used = unformed.failure, used + 1
            if used > max_restarts:
                failure.add_note(
                    f"the world was started again {max_restarts} times as it started "
                    f"(max_restarts={max_restarts}); this failure, while it started, ended it"
                )
                raise failure from None
            print(
                f"asyncrpc: while the world was starting, before any main ran: "
                f"{failure.summary()}; starting the world again (restart {used} of "
                f"{max_restarts})",
                file=sys.stderr,
                flush=True,
            )
            continue
        if failure is not None:
            raise failure
        return


def _check_restart(restart: object) -> None:
    if restart not in (None, "world", "worker"):
        raise ValueError(
            f"restart must be 'world' (start every worker again, the default) or 'worker' "
            f"(replace only the worker that died, the others keep their state), got {restart!r}"
        )


def _check_elastic(
    elastic: object, max_world_size: object, restart: str | None, max_restarts: int
) -> None:
    if not isinstance(elastic, bool):
        raise TypeError(f"elastic must be True or False, got {elastic!r}")
    if max_world_size is not None and (
        not isinstance(max_world_size, int) or isinstance(max_world_size, bool)
        or max_world_size < 1
    ):  # fmt: skip
        raise ValueError(
            f"max_world_size must be a positive int or None (no bound), got {max_world_size!r}"
        )
    if max_world_size is not None and not elastic and restart != "worker":
        raise ValueError(
            "max_world_size bounds a world that grows: pass elastic=True (or "
            "restart='worker') with it"
        )
    if elastic and restart != "worker" and max_restarts:
        raise ValueError(
            f"an elastic world restarts worker by worker, not as a whole: with "
            f"max_restarts={max_restarts} pass restart='worker' too (a dead worker is then "
            f"replaced in place), or drop max_restarts"
        )


def _check_main(main: object) -> None:
    if getattr(main, "__module__", None) == "__mp_main__":
        # This process is a worker importing the script (multiprocessing names it
        # __mp_main__): the script called run at import, not under the guard.
        raise RuntimeError(
            "asyncrpc.run was called again while a worker process imported your script: "
            "the script calls it at import; put the call under "
            'if __name__ == "__main__": so that only the process you started runs it'
        )
    if not callable(main):
        raise TypeError(
            f"asyncrpc.run expects a function main(ctx), got {type(main).__name__} {main!r}; "
            f"pass the function itself: asyncrpc.run(main, world_size=N)"
        )
    qualname = getattr(main, "__qualname__", "")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise TypeError(
            f"main must be a module-level function so that worker processes can import "
            f"it, got {qualname!r}; define it with def at the top level of your script"
        )


def _run_embedded(
    main: Callable[..., object],
    args: tuple[Any, ...],
    world_size: int,
    roles: Mapping[str, int] | None,
    settings: _context.Settings,
    attempt: int,
    grace: float,
    heal: tuple[int, int, int | None, bool] | None = None,
) -> WorkerFailedError | None:
    """One world of local workers.

    `heal`: (max_restarts, used, max_world_size, elastic): replace dead
    workers in place, at most max_restarts times in all, `used` of them spent
    on earlier starts; members may add workers (`_changes`), up to
    max_world_size; `elastic` (asked for): the next add starts from a spare.
    """
    host = "127.0.0.1"
    # Pickled here, loaded in the worker's own try: a worker that cannot load them
    # sends the reason back instead of dying in multiprocessing's start-up.
    payload = _child.pickled_main(main, args)
    store = _rendezvous.host_store(host, 0, settings.init_timeout)
    names = list(_context.names_for(world_size, roles))  # grows as workers are added
    roles_now = dict(roles or {})
    spawner = _forkserver.spawner(settings.start_method)
    procs: list[BaseProcess] = []
    errors: list[multiprocessing.connection.Connection] = []
    outputs = _child.caller_output() if settings.start_method == "forkserver" else (None, None)
    # Each worker reads `alive` until this process ends, however it ends (SIGKILL
    # too): then the read sees the end of the pipe, and the worker stops itself.
    alive, held = spawner.Pipe(duplex=False)
    environ = dict(os.environ)
    healer = _healer.Healer(store, "0", tuple(names), *heal[:2]) if heal is not None else None
    if healer is not None:
        names = healer.names

    def assign(rank: int, attempt: int, joining: Joining | None) -> tuple[Any, ...]:
        """Worker `rank`'s own part of its spec (a spare is given only this, `_spares`)."""
        return (rank, len(names), names[rank], host, store.port, settings, roles_now or None,
                attempt, joining)  # fmt: skip

    def spawn(rank: int, attempt: int, joining: Joining | None) -> tuple[BaseProcess, Connection]:
        reader, writer = spawner.Pipe(duplex=False)
        spec = (*assign(rank, attempt, joining), environ, outputs, alive)
        proc = spawner.Process(
            target=_child.worker, args=(payload, spec, writer), name=names[rank]
        )
        # Listed before it starts: a Ctrl-C inside start() (the worker may already
        # run) must still stop it, or multiprocessing's exit would wait for it.
        procs.append(proc)
        with _forkserver.dies_with_this_process():
            proc.start()
        writer.close()
        return proc, reader

    def retire(proc: BaseProcess) -> None:
        procs.remove(proc)
        proc.close()

    try:
        for rank in range(world_size):
            joining = Joining(rank, "0", replacement=False) if healer is not None else None
            errors.append(spawn(rank, attempt, joining)[1])
        if healer is None or heal is None:
            _child.close_outputs(outputs)  # every worker has its own copy by now
            alive.close()
            return _supervise(procs, errors, names, grace)
        current = procs[:]  # by rank; `procs` keeps every process started, to stop them
        # A process that ended is dead before this loop has handled its end.
        healer.alive = lambda name: _replacing.runs(current[names.index(name)])
        spares = None
        if heal[3]:  # elastic=True: the next add starts from a spare
            spares = _spares.Spares(spawner, payload, (environ, outputs, alive), procs,
                                    healer.formed)  # fmt: skip
        healing = _replacing.Healing(
            healer, spawn, {}, {}, retire, [], {},
            lambda r, a, j: spares.take(assign(r, a, j)) if spares is not None else None,
            spares.refill if spares is not None else lambda: None,
        )  # fmt: skip
        changes = _replacing.changes_for(healing, heal[2], roles_now, current, errors)
        healing.changes.append(changes)
        try:
            return _supervise(current, errors, names, grace, healing)
        finally:
            changes.close()
            if spares is not None:
                spares.close()
    except BaseException:
        _stop(procs)
        raise
    finally:
        _child.close_outputs(outputs)
        if not alive.closed:
            alive.close()
        held.close()


_WAKE_S = 0.25  # how often the supervisor's wait returns, to take a Ctrl-C


def _supervise(
    procs: list[BaseProcess],
    errors: list[multiprocessing.connection.Connection],
    names: Sequence[str],
    grace: float,
    healing: _replacing.Healing | None = None,
) -> WorkerFailedError | None:
    running: dict[object, int] = healing.running if healing is not None else {}
    running.update({proc.sentinel: rank for rank, proc in enumerate(procs)})
    changes = healing.changes[0] if healing is not None and healing.changes else None
    failures: list[WorkerFailedError] = []
    deadline = None
    while running or (healing is not None and healing.later and not failures):
        # Never an endless wait: a Ctrl-C the kernel hands to another thread (torch's
        # store runs some here) does not interrupt this one; Python raises it here
        # only once the wait returns.
        timeout = _wake_after(deadline, healing)
        waits = list(running) + ([changes.woken] if changes is not None else [])
        ready = multiprocessing.connection.wait(waits, max(0.0, timeout))  # type: ignore[arg-type]
        if changes is not None and changes.woken in ready:
            changes.drain()  # served below
        ended = [running.pop(s) for s in ready if s in running]
        exited = sorted(ended, key=lambda r: _signal_first(procs[r]))
        for rank in exited:
            procs[rank].join()
            failure = _failure(rank, names[rank], procs[rank], errors[rank])
            if changes is not None and not failures and _replacing.changed(changes, rank, failure):
                healing.retire(procs[rank])  # type: ignore[union-attr]  # changes: healing
                errors[rank].close()
                continue
            if procs[rank].exitcode == 0 and (healing is None or healing.healer.ending()):
                continue
            if healing is not None and not failures:
                if _replacing.heal(healing, rank, failure, procs, errors, running):
                    continue
            failures.append(failure)
            if healing is not None:
                healing.later.clear()  # the world fails: nothing more starts
        if healing is not None and not failures:
            _replacing.start_due(healing, procs, errors, running)
        if healing is not None and changes is not None and not failures:
            _replacing.serve(healing, procs)
        if failures and deadline is None:
            deadline = time.monotonic() + grace
        if deadline is not None and time.monotonic() >= deadline and running:
            _stop([procs[r] for r in running.values()])
            running.clear()
    return _report(failures)


def _wake_after(deadline: float | None, healing: _replacing.Healing | None) -> float:
    """How long the supervisor's wait may last: until the grace ends or a start is due."""
    now = time.monotonic()
    wake = [now + _WAKE_S] + ([deadline] if deadline is not None else [])

    wake += [when for when, _ in healing.later.values()] if healing is not None else []
    return min(wake) - now


def _signal_first(proc: BaseProcess) -> int:
    proc.join()
    return 0 if (proc.exitcode or 0) < 0 else 1


def _failure(
    rank: int, name: str, proc: BaseProcess, errors: multiprocessing.connection.Connection
) -> WorkerFailedError:
    text = ""
    if errors.poll():
        try:
            text = str(errors.recv())
        except (EOFError, OSError):
            text = ""
    return WorkerFailedError(name, rank, proc.exitcode, text)


def _report(failures: list[WorkerFailedError]) -> WorkerFailedError | None:
    if not failures:
        return None
    first = failures[0]
    for other in failures[1:]:
        first.add_note(f"also failed afterwards: {other.name!r} (rank {other.rank})")
    return first


def _stop(procs: list[BaseProcess]) -> None:
    procs = [proc for proc in procs if proc.pid is not None]  # started (see _run_embedded)
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
