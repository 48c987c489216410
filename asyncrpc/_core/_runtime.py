"""Where process state lives: one `Runtime` per world, each module's part in it.

Every module that keeps state for the world it serves (calls in flight,
cancel keys, producers of streams, torch's patches, the trace being
recorded...) defines one small class for it, a *part*, and reaches its
instance through `part(Kind)`. Nothing of a world hangs from a module's
globals: ending the world (`end`) closes every part, newest first, and
drops the runtime, so the next world starts from nothing::

    module code ──part(Calls)──> SLOT.runtime ──> {Calls: Calls(), Activity: ...}
                                      │
    shutdown ──> end() ──> each part's close(), newest first ──> a fresh Runtime

A part is made on first use, in a world asyncrpc started or one torch's
`rpc.init_rpc` started (the drop-in layer), and even before any world (a
trace recorded from the start). Its class takes no arguments; a `close()`
method, if it has one, stops what it started (threads, watchers) and must
not raise.

What is not a world's hangs from the same slot: `THREAD`, what each thread
is doing now (the call it runs, whether it drives a coroutine), and
`SLOT`'s process-wide settings. Process-lifetime caches that hold nothing
of a world (the kinds of callables, failure subclasses made per remote
type) stay in their modules; docs/design.md lists them.
"""

from __future__ import annotations

import contextvars
import gc
import threading
from typing import Any, TypeVar

__all__ = ("SLOT", "TASK_CALL", "THREAD", "Runtime", "end", "part", "running_world")

P = TypeVar("P")


class Runtime:
    """The state of one world: the world itself, and each part, made on first use.

    `world`: the `_world.World` asyncrpc started, or torch's world once
    adopted (`adopted`: torch's agent and the World read from it).
    """

    __slots__ = ("__weakref__", "_lock", "adopted", "closed", "parts", "world")

    def __init__(self) -> None:
        self.parts: dict[type[Any], Any] = {}
        self.world: Any = None
        self.adopted: tuple[object, Any] | None = None
        self.closed = False
        self._lock = threading.Lock()

    def make(self, kind: type[P]) -> P:
        """The instance of `kind` in this runtime, made now if it is not yet."""
        with self._lock:  # two threads' first use makes one part, not two
            found = self.parts.get(kind)
            if found is None:
                found = self.parts[kind] = kind()
            return found

    def close(self) -> None:
        """Close every part that can be, newest first (the reverse of their making); once."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            made = list(self.parts.values())
        for made_part in reversed(made):
            close = getattr(made_part, "close", None)
            if close is not None:
                close()


class _Process:
    """The one place process state hangs from: the runtime of the world now, and settings.

    `lock`: worlds start and end under it, one at a time. `shut_down`: the
    last world ended by `shutdown` (errors say so). `log_unwaited`: failures
    nobody read are logged (`_unwaited`), in every world of this process.
    `warned_unregistered`: this process has said once that it runs without a
    registration for asyncrpc-dump (`_registry`). `frozen_at_import`: how
    many objects were frozen (`gc.freeze`) when asyncrpc was imported: 0, or
    a few hundred that Python 3.12 freezes as it starts; a world freezes the
    heap only if no program froze it since (`_world`). None in a process a
    warm interpreter forked (`_forking`): it froze them, and no program ran
    here since (counting them would walk every object: 12 ms). `pool_started`: a
    fork of this process hangs in torch's parallel ops (it started OpenMP's
    thread pool), so embedded worlds fork from a forkserver (`_forkserver`).
    """

    __slots__ = (
        "frozen_at_import", "lock", "log_unwaited", "pool_started", "runtime", "shut_down",
        "warned_unregistered",
    )  # fmt: skip

    def __init__(self) -> None:
        self.runtime = Runtime()
        self.lock = threading.Lock()
        self.shut_down = False
        self.log_unwaited = False
        self.warned_unregistered = False
        self.pool_started = False
        self.frozen_at_import: int | None = gc.get_freeze_count()  # read: nothing changes


class _Thread(threading.local):
    """What one thread is doing now (each thread sees its own; these are the defaults).

    `call`: the `_cancel.Running` call it runs (a coroutine on the world's
    loop has its own, `TASK_CALL`). `asked`/`made`: a reply the
    function it runs made early (`_execution`). `replying`: the torch id of
    the caller whose reply torch pickles on this thread now (`_execution`),
    so an RRef in it crosses as `_forks` says.
    """

    call: Any = None
    asked = False
    made: Any = None
    replying: int | None = None


SLOT = _Process()
THREAD = _Thread()
# The call a coroutine on the world's event loop runs for: many share the loop's
# thread, so each Task carries its own (`_execution` sets it in the Task's context).
TASK_CALL: contextvars.ContextVar[Any] = contextvars.ContextVar("asyncrpc_call", default=None)


def running_world() -> Any:
    """The world asyncrpc started or adopted, if one runs now (None: none, or not adopted yet).

    Untyped here, the lowest layer, which knows no `World`: above `_world`,
    `_world.running()` gives it typed; a module below `_world` names what it
    reads of it in a small `Protocol` of its own (`_hooks`, `_failures`,
    `_healing`), so no module imports a higher one, not even for a type.

    Example (below `_world`)::

        class _Healing(Protocol):
            members: Members | None

        world: _Healing | None = _runtime.running_world()
        if world is not None and world.members is not None:  # a world that heals
            ...
    """
    return SLOT.runtime.world


def part(kind: type[P]) -> P:
    """This world's instance of `kind`, made on its first use.

    Example (in a module that keeps state)::

        class Producers:
            def __init__(self) -> None:
                self.open: dict[int, Producer] = {}

        def producers() -> Producers:
            return _runtime.part(Producers)
    """
    try:
        return SLOT.runtime.parts[kind]  # type: ignore[no-any-return]
    except KeyError:
        return SLOT.runtime.make(kind)


def end(runtime: Runtime | None = None) -> None:
    """End a world's state (the current one by default): close its parts, then a fresh one.

    Closed first, while the world is still visible: what a part's `close`
    runs (a stream generator's `finally`) may still ask for its context.
    Ending twice is ending once; ending a runtime that is no longer current
    only closes it.
    """
    ended = SLOT.runtime if runtime is None else runtime
    ended.close()
    if SLOT.runtime is ended:
        SLOT.runtime = Runtime()
