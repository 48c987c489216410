"""What runs in a worker process an embedded world forks: main's payload, output, parent.

The supervisor pickles `main` and its args once (`pickled_main`) and hands
each worker a copy of the caller's stdout and stderr (`caller_output`);
the worker (`worker`, a forkserver's child) takes them, joins the world,
runs `main` and sends its traceback back on failure::

    supervisor: pickled_main(main, args), caller_output() ──spec──> forkserver
    forkserver ── fork ──> worker(payload, spec, errors):
        die with the parent; take the caller's environment and output;
        load main ─> _world.start ─> main(ctx, *args) ─> rank 0: its result, pickled,
        into the world's store (`RESULT_KEY`: `asyncrpc.run` returns it) ─> _world.shutdown
        ─> RETURNED ──errors pipe──> supervisor (an exit 0 without it: a death)
        on failure: traceback ──errors pipe──> supervisor; exit 1 (77: a replacement's
        join another member refused, `_core._healing.start_failed_exit`)
"""

from __future__ import annotations

import functools
import io
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from .._core import _healing, _world
from . import _parent

__all__ = (
    "KILL_AFTER_S",
    "RESULT_KEY",
    "RETURNED",
    "caller_output",
    "close_outputs",
    "pickled_main",
    "spare",
    "worker",
)

KILL_AFTER_S = 2.0  # from SIGTERM to SIGKILL: the supervisor's stop, and a worker's own
# Sent on the errors pipe once `main` returned and the world was left: the supervisor
# tells a worker that ended its run from one that exited 0 while its world still ran.
RETURNED = "asyncrpc: main returned, the world was left"
# Where rank 0 leaves what its main returned, in the world's store (hosted by the
# supervisor): b"P" and the value pickled, or b"E" and why it could not be pickled.
RESULT_KEY = "asyncrpc/main-result"


def caller_output() -> tuple[Connection | None, ...]:
    """The caller's stdout and stderr, as objects multiprocessing hands to a worker.

    A worker forked from the warm interpreter has that interpreter's output;
    given these, it writes where the caller writes now, sharing the file's
    offset as a spawned worker would (a Connection is passed as its file).
    """
    outputs: list[Connection | None] = []
    for fd in (1, 2):
        try:
            outputs.append(Connection(os.dup(fd), readable=False))
        except OSError:  # closed: the worker keeps what it has
            outputs.append(None)
    return tuple(outputs)


def close_outputs(outputs: tuple[Connection | None, ...]) -> None:
    for output in outputs:
        if output is not None and not output.closed:
            output.close()


def _write_to(outputs: tuple[Connection | None, ...]) -> None:
    for fd, stream, output in zip((1, 2), (sys.stdout, sys.stderr), outputs, strict=True):
        if output is not None:
            if stream is not None:  # None: the script was started with that stream closed
                stream.flush()
            os.dup2(output.fileno(), fd)
            output.close()


def pickled_main(main: Callable[..., object], args: tuple[Any, ...]) -> bytes:
    buffer = io.BytesIO()
    pickler = _MainFinder(buffer)
    try:
        pickler.dump((main, args))
    except Exception as exc:
        raise TypeError(
            f"asyncrpc.run sends main and args to each worker process, but they cannot be "
            f"pickled ({type(exc).__name__}: {exc}); pass module-level functions and "
            f"classes, and plain data or tensors as args"
        ) from exc
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if pickler.found and not (script and os.path.isfile(script)):  # python -c, "<stdin>"
        raise TypeError(
            f"asyncrpc.run starts worker processes that import main and args by name, but "
            f"{', '.join(sorted(pickler.found))} is defined in a program that has no file "
            f"(python -c, a script read from stdin, a notebook or the interactive prompt), "
            f"which they cannot import; "
            f"put main (and what args holds) in a .py file and run that file, or import "
            f"them from a module (in a notebook: %%writefile my_world.py, then "
            f"`from my_world import main`)"
        )
    return buffer.getvalue()


class _MainFinder(pickle.Pickler):
    """Pickles as usual, noting every function, class or instance's class of `__main__`."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self.found: set[str] = set()

    def reducer_override(self, obj: Any) -> Any:
        # Functions and classes by their own name; any other object by its class's.
        named = obj if hasattr(obj, "__qualname__") else type(obj)
        if getattr(named, "__module__", None) == "__main__":
            self.found.add(str(named.__qualname__))
        return NotImplemented


def _load_main(payload: bytes) -> tuple[Callable[..., object], tuple[Any, ...]]:
    try:
        main, args = pickle.loads(payload)
    except Exception as exc:
        raise RuntimeError(
            f"this worker could not load main and args from the script "
            f"({type(exc).__name__}: {exc}); a worker imports the script as a module, so "
            f"define main and everything in args at its top level, not under "
            f'`if __name__ == "__main__":`'
        ) from exc
    return main, args


def worker(
    payload: bytes, spec: tuple[Any, ...], errors: multiprocessing.connection.Connection
) -> None:
    parent = os.getppid()  # the forkserver, or this process's spawner
    # The worker's own assignment, then what every worker's spec shares (`spare`).
    (
        rank,
        world_size,
        name,
        host,
        port,
        settings,
        roles,
        attempt,
        joining,
        environ,
        outputs,
        alive,
    ) = spec
    _parent.die_with_parent(parent)  # the kernel's signal: needs no GIL
    _watch_parent(alive)
    # Forked from the warm interpreter, a worker has that interpreter's environment and
    # output: take the caller's as they are now, as a spawned worker would.
    os.environ.clear()
    os.environ.update(environ)
    _write_to(outputs)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=host,
        MASTER_PORT=str(port),
    )
    started = False
    try:
        main, args = _load_main(payload)
        ctx = _world.start(
            rank,
            world_size,
            name,
            host,
            port,
            settings,
            roles=roles,
            hosts_store=False,
            attempt=attempt,
            joining=joining,
            end_process=functools.partial(_end_now, errors),
        )
        started = True
        try:
            result = main(ctx, *args)
            if ctx.rank == 0:
                _keep_result(result, ctx.name)
        except BaseException:
            _world.shutdown(graceful=False)
            raise
        _world.shutdown()
        errors.send(RETURNED)  # an exit 0 without it is a death (os._exit(0), say)
    except BaseException:
        text = traceback.format_exc()
        errors.send(text)
        sys.stdout.flush()
        sys.stderr.flush()
        # A failed agent can leave threads that block a normal interpreter exit.
        os._exit(1 if started else _healing.start_failed_exit(joining, text))


def _keep_result(result: object, name: str) -> None:
    """Rank 0's `main` returned `result`: leave it for the supervisor (`asyncrpc.run`)."""
    try:
        kept = b"P" + pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        kind = f"{type(result).__module__}.{type(result).__qualname__}"
        why = (
            f"asyncrpc.run returns what rank 0's main returned, but {name}'s main returned a "
            f"{kind}, which cannot be pickled to cross to the process that called run "
            f"({type(exc).__name__}: {exc}); return plain data or tensors from main (or save "
            f"the object there and return where it is)"
        )
        kept = b"E" + why.encode()
    _world.current_store().set(RESULT_KEY, kept)  # type: ignore[arg-type]  # bytes: torch takes them


def _end_now(errors: multiprocessing.connection.Connection) -> None:
    """End this worker at once, as if it had left the world (`_world.start`'s `end_process`).

    A removed worker whose leave only calls their callers cancelled still
    hold: torch's agent would wait for them (a sync function runs on).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    errors.send(RETURNED)
    os._exit(0)


def spare(
    payload: bytes,
    fixed: tuple[Any, ...],
    assignment: Connection,
    errors: multiprocessing.connection.Connection,
) -> None:
    """A worker forked ahead of need (`_spares`): wait for its spec, then be that worker.

    `fixed`: (environ, outputs, alive), the spec's parts every worker shares;
    the assignment is the rest (`worker`'s spec begins with it).
    """
    _parent.die_with_parent(os.getppid())
    try:
        assigned = assignment.recv()
    except (EOFError, OSError):  # the world ended before it was needed
        os._exit(0)
    assignment.close()
    multiprocessing.current_process().name = assigned[2]  # as a worker started for it is named
    worker(payload, (*assigned, *fixed), errors)


def _watch_parent(alive: Connection) -> None:
    """Stop this worker as the supervisor would (SIGTERM, then SIGKILL) once it has ended.

    A worker's parent is the forkserver, which outlives a killed supervisor
    while its workers live; the pipe `alive` ends with the supervisor itself.
    """

    def watch() -> None:
        try:
            alive.recv_bytes()  # nothing is ever sent: this returns when the writer is gone
        except (EOFError, OSError):
            pass
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(KILL_AFTER_S)  # a program's own SIGTERM handler had its chance
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="asyncrpc-parent-watch", daemon=True).start()
