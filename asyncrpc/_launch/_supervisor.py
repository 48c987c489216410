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
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, NamedTuple

from .._core import _context, _rendezvous, _torch
from .._core._errors import WorkerFailedError, describe_exit
from .._core._membership import Joining
from . import _child, _forkserver, _healer
from ._launched import launched, run_launched

__all__ = ("run",)

_GRACE_S = 3.0  # how long survivors get to exit on their own after a failure
_KILLED_S = 5.0  # how long a SIGKILLed worker may take to be gone


def run(
    main: Callable[..., object],
    world_size: int | None = None,
    *,
    args: tuple[Any, ...] = (),
    roles: Mapping[str, int] | None = None,
    max_restarts: int = 0,
    restart: str | None = None,
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
    `asyncrpc-launch --max-restarts N [--restart worker]`. Options (`num_worker_threads`,
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
    if restart == "worker" and max_restarts < 1 and not launched():
        raise ValueError(
            f"restart='worker' replaces dead workers at most max_restarts times, got "
            f"max_restarts={max_restarts}; pass max_restarts=K with K >= 1"
        )
    settings = _context.Settings.from_options(options)
    size = _context.resolve_world_size(world_size, roles)
    if launched():
        run_launched(main, args, size, roles, settings, restart)
        return
    if size is None:
        raise ValueError(
            "asyncrpc.run needs world_size=N (or roles=...) to start a local world; "
            "under a launcher it takes the launcher's"
        )
    if restart == "worker":
        _run_healing(main, args, size, roles, settings, max_restarts)
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


class _Unformed(Exception):
    """A worker died before the healing world had formed: nothing ran, start it again."""

    def __init__(self, failure: WorkerFailedError) -> None:
        super().__init__(failure.summary())
        self.failure = failure


def _run_healing(
    main: Callable[..., object],
    args: tuple[Any, ...],
    size: int,
    roles: Mapping[str, int] | None,
    settings: _context.Settings,
    max_restarts: int,
) -> None:
    """`restart="worker"`: one world healing in place, started again while it forms.

    A worker that dies before every member is ready (no `main` has run) cannot
    be replaced in place: the others wait for it in the world's start. The
    world starts again, counted against `max_restarts`.
    """
    used = 0
    while True:
        try:
            heal = (max_restarts, used)
            failure = _run_embedded(main, args, size, roles, settings, 0, _GRACE_S, heal)
        except _Unformed as unformed:
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


def _spent(max_restarts: int, started_again: int) -> str:
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


def _check_restart(restart: object) -> None:
    if restart not in (None, "world", "worker"):
        raise ValueError(
            f"restart must be 'world' (start every worker again, the default) or 'worker' "
            f"(replace only the worker that died, the others keep their state), got {restart!r}"
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
    heal: tuple[int, int] | None = None,
) -> WorkerFailedError | None:
    """One world of local workers.

    `heal`: (max_restarts, used): replace dead workers in place, at most
    max_restarts times in all, `used` of them spent on earlier starts.
    """
    host = "127.0.0.1"
    # Pickled here, loaded in the worker's own try: a worker that cannot load them
    # sends the reason back instead of dying in multiprocessing's start-up.
    payload = _child.pickled_main(main, args)
    store = _rendezvous.host_store(host, 0, settings.init_timeout)
    names = _context.names_for(world_size, roles)
    spawner = _forkserver.spawner(settings.start_method)
    procs: list[BaseProcess] = []
    errors: list[multiprocessing.connection.Connection] = []
    outputs = _child.caller_output() if settings.start_method == "forkserver" else (None, None)
    # Each worker reads `alive` until this process ends, however it ends (SIGKILL
    # too): then the read sees the end of the pipe, and the worker stops itself.
    alive, held = spawner.Pipe(duplex=False)
    environ = dict(os.environ)
    healer = _healer.Healer(store, "0", names, *heal) if heal is not None else None

    def spawn(rank: int, attempt: int, joining: Joining | None) -> tuple[BaseProcess, Connection]:
        reader, writer = spawner.Pipe(duplex=False)
        spec = (rank, world_size, names[rank], host, store.port, settings, roles, attempt,
                environ, outputs, alive, joining)  # fmt: skip
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
        if healer is None:
            _child.close_outputs(outputs)  # every worker has its own copy by now
            alive.close()
            return _supervise(procs, errors, names, grace)
        current = procs[:]  # by rank; `procs` keeps every process started, to stop them
        # A process that ended is dead before this loop has handled its end.
        healer.alive = lambda name: _runs(current[names.index(name)])
        return _supervise(current, errors, names, grace, _Healing(healer, spawn, {}, {}, retire))
    except BaseException:
        _stop(procs)
        raise
    finally:
        _child.close_outputs(outputs)
        if not alive.closed:
            alive.close()
        held.close()


_WAKE_S = 0.25  # how often the supervisor's wait returns, to take a Ctrl-C
# A replacement whose join a member refused starts again after this: time for that
# member to see its listener closed and end (`_core/_torch/_listener`), up to
# _REFUSED_MAX times in a row uncounted (then counted: a member refusing for good).
_REFUSED_S = 0.25
_REFUSED_MAX = 40


class _Healing(NamedTuple):
    """What a supervisor that heals needs: the healer, how to start a worker, what waits."""

    healer: _healer.Healer
    spawn: Callable[[int, int, Joining | None], tuple[BaseProcess, Connection]]
    # Replacements to start later, by rank: (when, how it joins); their refusals in a row.
    later: dict[int, tuple[float, Joining]]
    refusals: dict[int, int]
    # Let go of a process that ended and was replaced (its descriptors: 2 a process).
    retire: Callable[[BaseProcess], None]


def _supervise(
    procs: list[BaseProcess],
    errors: list[multiprocessing.connection.Connection],
    names: tuple[str, ...],
    grace: float,
    healing: _Healing | None = None,
) -> WorkerFailedError | None:
    running: dict[object, int] = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    failures: list[WorkerFailedError] = []
    deadline = None
    while running or (healing is not None and healing.later and not failures):
        # Never an endless wait: a Ctrl-C the kernel hands to another thread (torch's
        # store runs some here) does not interrupt this one; Python raises it here
        # only once the wait returns.
        timeout = _wake_after(deadline, healing)
        ready = multiprocessing.connection.wait(list(running), max(0.0, timeout))  # type: ignore[arg-type]
        exited = sorted((running.pop(s) for s in ready), key=lambda r: _signal_first(procs[r]))
        for rank in exited:
            procs[rank].join()
            if procs[rank].exitcode == 0 and (healing is None or healing.healer.ending()):
                continue
            failure = _failure(rank, names[rank], procs[rank], errors[rank])
            if healing is not None and not failures:
                if _heal(healing, rank, failure, procs, errors, running):
                    continue
            failures.append(failure)
            if healing is not None:
                healing.later.clear()  # the world fails: nothing more starts
        if healing is not None and not failures:
            _start_due(healing, procs, errors, running)
        if failures and deadline is None:
            deadline = time.monotonic() + grace
        if deadline is not None and time.monotonic() >= deadline and running:
            _stop([procs[r] for r in running.values()])
            running.clear()
    return _report(failures)


def _wake_after(deadline: float | None, healing: _Healing | None) -> float:
    """How long the supervisor's wait may last: until the grace ends or a start is due."""
    now = time.monotonic()
    wake = [now + _WAKE_S] + ([deadline] if deadline is not None else [])
    wake += [when for when, _ in healing.later.values()] if healing is not None else []
    return min(wake) - now


def _start_due(
    healing: _Healing,
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
    healing: _Healing,
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


def _heal(
    healing: _Healing,
    rank: int,
    failure: WorkerFailedError,
    procs: list[BaseProcess],
    errors: list[multiprocessing.connection.Connection],
    running: dict[object, int],
) -> bool:
    """Replace worker `rank` in place; False when the world may not heal any more."""
    healer = healing.healer
    if not healer.formed():
        raise _Unformed(failure)  # _run_embedded stops every worker; run starts them again
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
            failure.add_note(_spent(healer.max_restarts, healer.started_again))
        return False
    try:
        if failure.remote_traceback and not refused:
            print(failure.remote_traceback.rstrip(), file=sys.stderr, flush=True)
        print(f"asyncrpc: {_heal_line(healer, rank, failure, retry, refused)}",
              file=sys.stderr, flush=True)  # fmt: skip
        healing.retire(procs[rank])
        if refused:
            healing.later[rank] = (time.monotonic() + _REFUSED_S, joining)
        else:
            _start(healing, rank, joining, procs, errors, running)
    finally:
        healer.started()
    return True


def _refused(healing: _Healing, rank: int, failure: WorkerFailedError) -> bool:
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


def _runs(proc: BaseProcess) -> bool:
    """Whether `proc` still runs; False once retired (closed), its replacement not started yet."""
    try:
        return proc.is_alive()
    except ValueError:  # closed
        return False


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
