"""A launched worker: `asyncrpc.run` under torchrun or `asyncrpc-launch`.

Every process already is a worker: it joins the launcher's world, runs
`main` and leaves. What it adds to the program, and nothing else:

- it ends with its launcher (`_parent`), even while holding the GIL;
- a failure anywhere ends it too (`_liveness`); when its own `main` raises
  first, it records that in the world's store and in torch's error file,
  so the launcher's summary names it as the root cause;
- a SIGINT (the launcher's Ctrl-C) ends it as an uncaught Ctrl-C ends
  Python, without the traceback: the launcher says it once.

Under `asyncrpc-launch --restart worker` (`_nodes`) the world heals: the
worker joins as its launcher says (ASYNCRPC_JOINING, a `Joining`), and a
failure elsewhere does not end it; its launcher replaces a worker that dies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from .._core import _context, _healing, _init, _world
from .._core._environ import RESTART_VARIABLE
from .._core._errors import WorkerUnreachableError
from .._core._liveness import Liveness, describe, leave_world
from .._core._membership import Joining
from . import _parent

__all__ = (
    "JOINING_VARIABLE",
    "NAME_VARIABLE",
    "RESTART_VARIABLE",
    "joining_from_env",
    "launched",
    "run_launched",
)

JOINING_VARIABLE = "ASYNCRPC_JOINING"  # --restart worker: "<torch id>,<tag>,<0|1>[,<size>]"
NAME_VARIABLE = "ASYNCRPC_NAME"  # --elastic: an added worker's name (its rank is a new one)


def launched() -> bool:
    """True when a launcher (torchrun, asyncrpc-launch) started this process as a worker."""
    return all(os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def run_launched(
    main: Callable[..., object],
    args: tuple[Any, ...],
    world_size: int | None,
    roles: Mapping[str, int] | None,
    settings: _context.Settings,
    restart: str | None = None,
) -> Any:
    """Join the launcher's world, run `main` and leave; what this worker's `main` returned."""
    _check_restart(restart)
    _parent.watch_launcher()  # asyncrpc-launch's workers end with it, SIGKILL included
    joining = joining_from_env()
    options = _as_options(settings)
    # An added worker (asyncrpc-launch --elastic) has a rank past the size the world
    # formed with, which the program's world_size= was checked against then.
    name = os.environ.get(NAME_VARIABLE) or None
    try:
        ctx = _init.init(world_size=world_size, roles=roles, joining=joining, name=name, **options)
    except KeyboardInterrupt:
        _interrupted()
    except BaseException:
        text = traceback.format_exc()
        code = _healing.start_failed_exit(joining, text)
        if code != 1:  # its launcher starts it again in a moment (`_replacing`)
            print(text, file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(code)
        raise
    if joining is not None:
        return _run_healing(main, ctx, args)
    # The world's liveness (keyed by attempt, as torchrun's agent keys its reports):
    # launched, a failure anywhere ends this worker too.
    live = _world.current_liveness()
    assert live is not None
    live.on_failure = leave_world
    if live.failure is not None:
        leave_world(live.failure)
    try:
        result = main(ctx, *args)
    except KeyboardInterrupt:
        _interrupted()
    except BaseException as error:
        _report_raised(ctx, live, error)
        live.stop(left=False)
        # Peers may still wait on this worker: leave without the shutdown barrier.
        _world.shutdown(graceful=False)
        raise
    # The graceful shutdown waits for every peer without a deadline: keep
    # beating and watching through it, so a peer dying now ends this one too.
    _world.shutdown()
    live.stop()
    return result


def _run_healing(main: Callable[..., object], ctx: _context.Context, args: tuple[Any, ...]) -> Any:
    """`main` in a world that heals: a failure elsewhere is its launcher's to heal, not ours."""
    try:
        try:
            result = main(ctx, *args)
        except BaseException:
            # This worker dies; its launcher replaces it. Peers may still wait on it.
            _world.shutdown(graceful=False)
            raise
        _world.shutdown()  # serves calls until every worker's main is done (the world ends)
    except KeyboardInterrupt:  # the launcher's Ctrl-C, also while this worker serves
        _interrupted()
    return result


def joining_from_env() -> Joining | None:
    """How this worker joins a world that heals (ASYNCRPC_JOINING), or None."""
    raw = os.environ.get(JOINING_VARIABLE, "")
    if not raw:
        return None
    try:
        torch_id, tag, replacement, *size = raw.split(",")
        return Joining(int(torch_id), tag, replacement == "1", int(size[0]) if size else 0)
    except (ValueError, IndexError):
        raise ValueError(
            f"environment variable {JOINING_VARIABLE}={raw!r} is not "
            f"'<torch id>,<tag>,<0|1>[,<size>]'; "
            f"asyncrpc-launch --restart worker sets it for each worker: leave it unset"
        ) from None


def _check_restart(restart: str | None) -> None:
    """Refuse a `run(restart=...)` that its launcher does not do: the launcher decides."""
    # Only asyncrpc-launch says how it restarts (torchrun with asyncrpc's rendezvous doesn't).
    by_asyncrpc = bool(os.environ.get(RESTART_VARIABLE))
    launcher = os.environ.get(RESTART_VARIABLE) or "world"
    if restart == "worker" and not by_asyncrpc:
        raise ValueError(
            "asyncrpc.run(restart='worker') was called under torchrun, whose agent restarts "
            "every worker of the world when one fails; launch with asyncrpc-launch "
            "--max-restarts K --restart worker instead (or run the script itself: "
            "python script.py)"
        )
    if restart is not None and by_asyncrpc and restart != launcher:
        raise ValueError(
            f"asyncrpc.run(restart={restart!r}) disagrees with its launcher, started with "
            f"asyncrpc-launch --restart {launcher}: the launcher restarts the workers; pass "
            f"--restart {restart} to asyncrpc-launch, or drop restart= from asyncrpc.run"
        )


def _report_raised(ctx: _context.Context, live: Liveness, error: BaseException) -> None:
    """Record `error` as this worker's failure; the root cause also writes torch's error file.

    torchrun's agent names as "Root Cause" the failure with the earliest
    error file (`_torch.watch_agent_failures` puts it first): only the worker
    whose record won, whose `main` raised first, writes one.
    """
    # A call that failed because its peer died is a consequence: give the
    # launcher that saw the death the first word.
    lost_peer = isinstance(error, WorkerUnreachableError)
    # This worker ends on its own now: its liveness, which reads the record written
    # next, must not end it first (before the error file is written).
    live.on_failure = _leaving_anyway
    why = f"raised {type(error).__name__}: {error}"
    record = live.report(why, defer=lost_peer)
    print(f"asyncrpc: {record}", file=sys.stderr, flush=True)
    first = record == f"{describe(ctx.name, ctx.rank)} {why}"
    if first and os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        with contextlib.suppress(OSError):
            ErrorHandler().record_exception(error)


def _leaving_anyway(record: str) -> None:
    """A failure seen while this worker already reports its own and leaves."""


def _interrupted() -> NoReturn:
    """End a launched worker that a SIGINT (its launcher's Ctrl-C) interrupted, quietly.

    As Python ends on an uncaught Ctrl-C (killed by SIGINT, which the
    launcher reports), without the traceback: the launcher says it was
    interrupted, once. The world is left as a killed worker leaves it.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1.0)  # the signal arrives within it
    os._exit(130)


def _as_options(settings: _context.Settings) -> dict[str, Any]:
    return {f: getattr(settings, f) for f in settings.__dataclass_fields__}
