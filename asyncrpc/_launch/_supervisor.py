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

import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from .._core import _context, _devices
from .._core._errors import WorkerFailedError
from . import _forkserver, _local
from ._healing_world import HealingWorld, Unformed
from ._launched import launched, run_launched
from ._local import LocalWorld

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
) -> Any:
    """Run `main(ctx, *args)` on every worker of a world, then shut RPC down; rank 0's result.

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
    `max_world_size` at once (None: no bound); there a worker that dies
    leaves the world (`asyncrpc.Left` on every member), but for rank 0, whose
    death ends it. Options (`num_worker_threads`, `rpc_timeout`, ...): see
    `Settings`.

    Returns what rank 0's `main` returned (in a world that healed rank 0: its
    last replacement's), pickled across from the worker's process; a value
    that cannot be pickled raises `TypeError` naming its type, once the world
    has ended. Under a launcher every worker calls `run`, and each gets what
    its own `main` returned. Example::

        def main(ctx):
            return f"{ctx.name} of {ctx.world_size}"

        if __name__ == "__main__":
            print(asyncrpc.run(main, world_size=3))  # worker0 of 3
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
        return run_launched(main, args, size, roles, settings, restart)
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
    with _forkserver.here(settings.start_method):  # workers fork from this process's copy
        if restart == "worker" or elastic:
            return _run_healing(main, args, size, roles, settings, max_restarts,
                                max_world_size, elastic)  # fmt: skip
        return _run_restarting(main, args, size, roles, settings, max_restarts)


def _run_restarting(
    main: Callable[..., object],
    args: tuple[Any, ...],
    size: int,
    roles: Mapping[str, int] | None,
    settings: _context.Settings,
    max_restarts: int,
) -> Any:
    """A world started again as a whole after a failure, up to `max_restarts` times."""
    for attempt in range(max_restarts + 1):
        # Survivors get a grace period to report their own failure, unless the
        # world is about to start again: then they are stopped at once.
        grace = _GRACE_S if attempt == max_restarts else 0.0
        failure, result = _run_embedded(main, args, size, roles, settings, attempt, grace)
        if failure is None:
            return result
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
    raise AssertionError("unreachable: the last attempt returns or raises")


def _run_healing(
    main: Callable[..., object],
    args: tuple[Any, ...],
    size: int,
    roles: Mapping[str, int] | None,
    settings: _context.Settings,
    max_restarts: int,
    max_world_size: int | None = None,
    elastic: bool = False,
) -> Any:
    """`restart="worker"`: one world healing in place, started again while it forms.

    Returns what rank 0's `main` returned.

    An elastic world that does not heal is one with no restarts to spend.

    A worker that dies before every member is ready (no `main` has run) cannot
    be replaced in place: the others wait for it in the world's start. The
    world starts again, counted against `max_restarts`.
    """
    used = 0
    while True:
        try:
            heal = (max_restarts, used, max_world_size, elastic)
            failure, result = _run_embedded(main, args, size, roles, settings, 0, _GRACE_S, heal)
        except Unformed as unformed:
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
        return result


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
) -> tuple[WorkerFailedError | None, Any]:
    """One world of local workers; the failure that ended it, if any, and rank 0's result.

    `heal`: (max_restarts, used, max_world_size, elastic): replace dead
    workers in place, at most max_restarts times in all, `used` of them spent
    on earlier starts; members may add workers (`_changes`), up to
    max_world_size; `elastic` (asked for): the next add starts from a spare.
    """
    world = LocalWorld(main, args, world_size, roles, settings)
    try:
        if heal is None:
            for rank in range(world_size):
                world.spawn(rank, attempt, None)
            world.handed_out()
            failure = _supervise(world, grace)
        else:
            healing = HealingWorld(world, *heal)
            try:
                healing.start_all()
                failure = healing.supervise(grace)
            finally:
                healing.close()
        # What rank 0 returned crosses once the world has ended well (TypeError: it could not).
        return failure, (world.result() if failure is None else None)
    except BaseException:
        _local.stop(world.started)
        raise
    finally:
        world.close()


def _supervise(world: LocalWorld, grace: float) -> WorkerFailedError | None:
    """Watch a world that does not heal: the first failure stops the others after `grace`."""
    running: dict[object, int] = {p.sentinel: rank for rank, p in enumerate(world.procs)}
    failures: list[WorkerFailedError] = []
    deadline = None
    while running:
        ended, _ = _local.wait(running, [], _local.wake_after(deadline))
        for sentinel in [s for s, rank in running.items() if rank in ended]:
            del running[sentinel]
        for rank in sorted(ended, key=lambda r: _local.signal_first(world.procs[r])):
            failure = world.failure(rank)  # None: main returned, and it left the world
            if failure is not None:
                failures.append(failure)
        if failures and deadline is None:
            deadline = time.monotonic() + grace
        if deadline is not None and time.monotonic() >= deadline and running:
            _local.stop([world.procs[rank] for rank in running.values()])
            running.clear()
    return _local.report(failures)
