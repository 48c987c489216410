"""Who is in a world that heals: members replaced under their names, and what calls see.

In a world started with `restart="worker"` torch's RPC group is dynamic:
every process joins with a torch id of its own, and a dead worker's
replacement joins with a fresh id (an id torch saw once is never reused).
Survivors never drop a dead process from torch's group: torch still holds
work for it after its death (RRef fork and delete notices in its retry
queue, which point at the group's entry for it; dropping the entry while
they wait made survivors crash). So the name torch knows a process by is
taken for good: a first process joins under the member's name, each
replacement under `name:<torch id>` (`torch_name`), and asyncrpc's verbs
map the member's name to the process that answers for it now. The
supervisor (or launcher) that saw the death drives the heal::

    supervisor (hosts the store)          survivor (watcher thread)            replacement
    worker3 (id 3) died
      side channel: "member gone ..." ───> worker3 is being replaced: calls to
                                           it fail named, its objects (id 3's
                                           RRefs) are lost; torch's pipe to id 3
                                           is closed (a probe that fails)
      <── ack ────────────────────────────
      store: worker3 (id 3) off torch's list of members
      spawn worker3, id 7, attempt 1 ─────────────────────────────────────> joins torch's group
                                                                             as "worker3:7"
                                           <── welcome(worker3, 7, 1) (RPC) ── before main
                                           on_replaced callbacks (a thread)     main(ctx)

Calls to a worker while it is replaced fail at once with
`WorkerUnreachableError` naming it (they never wait, and never run twice);
calls through a handle or RRef to an object the dead process held raise
`ObjectLostError`, also after the heal, and so does sending such a handle
or RRef to anyone. `Members` is the world's record of this;
`Members.check_call`, `check_owner` and `info` are what calls consult.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from torch.futures import Future

from . import _events, _torch
from ._errors import AsyncRPCError, ObjectLostError, WorkerLeftError, WorkerUnreachableError
from ._torch import PrefixStore

if TYPE_CHECKING:
    from ._torch import Store, WorkerInfo

__all__ = [
    "HEAL_PREFIX",
    "LEAVING",
    "LEFT",
    "Joined",
    "Joining",
    "Left",
    "Members",
    "Replaced",
    "gone_message",
    "heal_prefix",
    "heal_space",
    "parse_gone",
    "torch_name",
    "trim_heap",
]

HEAL_PREFIX = "heal/"  # under the world's key space: asyncrpc/<tag>/heal/


def heal_prefix(tag: str) -> str:
    """Where the members' records of the world `tag` lie in its store."""
    return f"asyncrpc/{tag}/{HEAL_PREFIX}"


def heal_space(store: Store, tag: str) -> Store:
    """The members' records of the world `tag` (keys below), as a store of their own."""
    return PrefixStore(heal_prefix(tag), store)


_GONE = "member gone"
LEAVING, LEFT = "member leaving", "member left"  # remove_workers: told, then gone
_CALLBACK_JOIN_S = 5.0
# The keys of the world's records in its store: see `_records`.


class Joining(NamedTuple):
    """How a worker joins a world that heals (given by its supervisor or launcher).

    `torch_id`: its id in torch's group (its rank at first; fresh for a
    replacement). `tag`: the world's key space. `replacement`: it replaces a
    dead worker, or was added to the world (the others already run; it does
    not wait for them).
    """

    torch_id: int
    tag: str
    replacement: bool
    # The world's size as it formed: torch ids below it are first processes (0: this
    # worker's world_size). An added member is a `replacement` of no one.
    size: int = 0


class Replaced(NamedTuple):
    """A worker of this world was replaced: its `name`, `rank` and `attempt` (1 for the first).

    What `asyncrpc.on_replaced` callbacks receive. `reason`: how the process
    it replaces ended, as its supervisor saw it ("was killed by SIGKILL",
    "ended (exit code 76: ... whose listener torch had closed ..."); "died"
    where this worker joined while it was being replaced, "" where it did
    not hear of the death.
    """

    name: str
    rank: int
    attempt: int
    reason: str = ""


def torch_name(name: str, torch_id: int, size: int) -> str:
    """The name torch's group knows member `name`'s process `torch_id` by (a world of `size`).

    A first process (its torch id is its rank) joins under the member's own
    name, a replacement (a fresh id, `size` or more) under `name:<id>`: torch
    keeps every process it saw under its name (see the module's docstring).
    """
    return name if torch_id < size else f"{name}:{torch_id}"


def trim_heap() -> None:
    """Give the heap's free pages back to the system (glibc's `malloc_trim`; elsewhere nothing).

    A heal frees what torch held for the dead process's connections, calls
    and RRefs, but glibc keeps freed pages in its arenas for reuse; under
    load a survivor's resident memory then drifts up by about 0.1 MB a heal
    (measured here). Called once per heal, once the replacement has joined:
    about 2 ms.
    """
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def gone_message(name: str, torch_id: int, seq: int, why: str, kind: str = _GONE) -> str:
    """The side-channel text telling a survivor that `name` (torch id) died.

    `kind` LEAVING: `name` is being removed (`why`: by whom); LEFT: it has left.
    """
    return f"{kind} {seq} {torch_id} {name} {why}"


def parse_gone(text: str) -> tuple[str, int, int, str, str] | None:
    """(kind, seq, torch id, name, why) of a `gone_message`, or None for other texts."""
    for kind in (_GONE, LEAVING, LEFT):
        if text.startswith(kind + " "):
            seq, torch_id, name, why = text[len(kind) + 1 :].split(" ", 3)
            return kind, int(seq), int(torch_id), name, why
    return None


class Joined(NamedTuple):
    """A worker joined this elastic world (`asyncrpc.add_workers`): its `name` and `rank`."""

    name: str
    rank: int


class Left(NamedTuple):
    """A worker left this elastic world: its `name`, `rank` and `reason`.

    `reason`: "removed by worker0", or how a worker that died ended, as its
    supervisor saw it ("it ended unasked (was killed by SIGKILL)").
    """

    name: str
    rank: int
    reason: str


class Members:
    """This worker's view of a healing world's members: ids, attempts, who is being replaced.

    `names`: every member known here, in rank order, those that left
    included (their calls fail with `WorkerLeftError`); `size`: the world's
    size as it formed (torch ids below it are first processes, `torch_name`).
    """

    def __init__(
        self,
        names: tuple[str, ...],
        ids: dict[str, int],
        attempt: dict[str, int],
        size: int = 0,
        ranks: dict[str, int] | None = None,
    ):
        self.names = names
        self.size = size or len(names)
        self.ranks = dict(ranks) if ranks is not None else {n: r for r, n in enumerate(names)}
        self.left: dict[str, str] = {}  # name -> who removed it (it may still be leaving)
        self.ids = dict(ids)  # name -> torch id of the process that answers now
        self.attempts = dict(attempt)  # name -> its attempt (0: the first process)
        self.replacing: dict[str, str] = {}  # name -> why it is being replaced
        self.lost: dict[int, str] = {}  # torch id of a dead process -> its name
        self.callbacks: list[Callable[[Replaced], object]] = []
        self.replaced_failures = _events.CallbackFailures("on_replaced")
        self.me = ""  # this worker's name (`here`)
        self.events = _events.Events()  # `asyncrpc.on_members`: in the order learnt here
        # `remove_workers(..., wait=False)`: the names still to leave, all asked, its Future.
        self._waits: list[tuple[set[str], tuple[str, ...], Future[tuple[str, ...]]]] = []
        # Run with a dead process's torch id once it is known dead (what this worker
        # serves for it: a stream's producer, say).
        self.gone_hooks: list[Callable[[int], None]] = []
        self.busy_probes: list[Callable[[], int]] = []  # see `on_busy`
        self.lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        # torch's WorkerInfo per process (torch id): a process's entry never goes stale.
        self._infos: dict[int, WorkerInfo] = {}

    def info(self, name: str) -> WorkerInfo:
        """torch's WorkerInfo of the process that answers for `name` now."""
        torch_id = self.ids[name]
        found = self._infos.get(torch_id)
        if found is None:
            found = self._infos[torch_id] = _torch.worker_info(
                torch_name(name, torch_id, self.size)
            )
        return found

    def on_busy(self, probe: Callable[[], int]) -> None:
        """Count `probe()` (what this worker still serves: open streams) in `busy` (once)."""
        with self.lock:
            if probe not in self.busy_probes:
                self.busy_probes.append(probe)

    def busy(self) -> int:
        """What this worker serves beside running calls (a removed one leaves at 0)."""
        return sum(probe() for probe in list(self.busy_probes))

    def on_gone(self, hook: Callable[[int], None]) -> None:
        """Have `hook(torch id)` run once a member's process is known dead (once per hook)."""
        with self.lock:
            if hook not in self.gone_hooks:
                self.gone_hooks.append(hook)

    def name_of(self, torch_id: int) -> str | None:
        """The member whose process `torch_id` answers now (None: dead, or never a member)."""
        for name, now in list(self.ids.items()):
            if now == torch_id and name not in self.replacing:
                return name
        return None

    def missed(self, known: set[int]) -> None:
        """A replacement's start: members whose process torch's group lacks are being replaced.

        A replacement that joins while another member is being replaced finds
        that member's dead process already off torch's list (`known`: the
        torch ids its agent knows); until that member's own replacement
        welcomes it, calls to it fail as "being replaced".
        """
        with self.lock:
            for name, torch_id in self.ids.items():
                if torch_id not in known and name not in self.left:
                    self.lost.setdefault(torch_id, name)
                    self.replacing.setdefault(name, "died")

    def live(self) -> tuple[str, ...]:
        """The members now, in rank order: those that left (or are leaving) are not."""
        return tuple(name for name in self.names if name not in self.left)

    def check_call(self, name: str, continuing: bool = False) -> None:
        """Raise `WorkerUnreachableError` for a call to `name` while it is being replaced.

        `WorkerLeftError` once it is being removed from the world; but a call
        `continuing` one it runs (a stream's next pull) reaches it until it has left.
        """
        left = self.left.get(name)
        if left is not None and continuing:
            if self.ids.get(name) not in self.lost:
                return  # still leaving: it finishes what it runs
            raise WorkerLeftError(
                f"worker {name!r} left the world ({left}) while this stream from it was open; "
                f"the items it had sent were delivered, and the stream ends here",
                name,
            )
        if left is not None:
            raise WorkerLeftError(
                f"worker {name!r} left the world ({left}); calls to it fail (nothing was "
                f"sent, so nothing ran): call one of asyncrpc.members() instead",
                name,
            )
        why = self.replacing.get(name)
        if why is not None:
            raise WorkerUnreachableError(
                f"worker {name!r} {why} and is being replaced; calls to it fail until its "
                f"replacement has joined (nothing was sent, so nothing ran): retry, or "
                f"wait for it with asyncrpc.on_replaced",
                name,
            )

    def check_owner(self, owner_id: int, what: str) -> None:
        """Raise `ObjectLostError` when `what` lived in process `owner_id` (torch's id), dead."""
        name = self.lost.get(owner_id)
        if name is not None and name in self.left:
            raise ObjectLostError(
                f"{what} lived on worker {name!r}, which left the world ({self.left[name]}): "
                f"create the object again on one of asyncrpc.members()",
                name,
            )
        if name is not None:
            now = self.attempts.get(name, 0) + (name in self.replacing)
            raise ObjectLostError(
                f"{what} lived on worker {name!r}, whose process died; its replacement "
                f"(attempt {now}) starts without it: create the object there again "
                f"(asyncrpc.on_replaced tells when the replacement is up)",
                name,
            )

    def gone(self, name: str, torch_id: int, why: str) -> bool:
        """Record that the process `torch_id` of `name` died; False if it was seen already."""
        with self.lock:
            # A process of `name` not known here: a replacement stopped as it joined.
            known = self.ids.get(name) == torch_id or name in self.replacing
            if torch_id in self.lost or not known:
                return False
            self.lost[torch_id] = name
            # The first death's reason: a replacement stopped or refused as it joined
            # is no news of the member (`Replaced.reason`, the callers' errors).
            self.replacing.setdefault(name, why)
            return True

    def joined(
        self, name: str, torch_id: int, attempt: int, rank: int = -1
    ) -> Replaced | Joined | None:
        """Record `name`'s replacement (torch id, attempt); the event, or None if stale.

        Stale too: the welcome of a process already known dead (killed as it
        welcomed the members, its news came first). A name not known here
        (`rank`: its rank) is a member added to the world: `Joined`.
        """
        with self.lock:
            if self.attempts.get(name, -1) >= attempt or torch_id in self.lost:
                return None
            if name not in self.ranks:
                return self._add(name, torch_id, rank)
            old = self.ids.get(name)
            if old is not None and old != torch_id:
                self.lost.setdefault(old, name)
            self.ids[name], self.attempts[name] = torch_id, attempt
            reason = self.replacing.pop(name, "")
            return Replaced(name, self.ranks[name], attempt, reason)

    def _add(self, name: str, torch_id: int, rank: int) -> Joined:
        self.ranks[name] = rank
        self.names = tuple(sorted(self.ranks, key=self.ranks.__getitem__))
        self.ids[name], self.attempts[name] = torch_id, 0
        return Joined(name, rank)

    def leaving(self, name: str, reason: str) -> bool:
        """`name` is being removed (`reason`: by whom): calls to it fail from now on."""
        with self.lock:
            if name not in self.ranks or name in self.left:
                return False
            self.left[name] = reason
            return True

    def departed(self, name: str, torch_id: int, why: str) -> Left | None:
        """`name`'s process (torch id) has left: its objects are lost; the event, once.

        The removals waiting for it (`wait_left`) complete once every worker
        they asked for has left, after this `Left` went to the callbacks.
        """
        with self.lock:
            if name not in self.ranks or torch_id in self.lost:
                return None
            self.lost[torch_id] = name
            self.left.setdefault(name, why)
            done = []
            for pending, names, fut in self._waits:
                pending.discard(name)
                if not pending:
                    done.append((names, fut))
            self._waits = [wait for wait in self._waits if wait[0]]
            event = Left(name, self.ranks[name], self.left[name])
        self.events.put(event)  # the callbacks hear the event first, then the Futures complete
        for names, fut in done:
            self.events.call(functools.partial(fut.set_result, names))
        return event

    def has_left(self, name: str) -> bool:
        """Whether `name` has left the world (not only: is leaving)."""
        return name in self.left and self.ids.get(name) in self.lost

    def wait_left(self, names: tuple[str, ...]) -> Future[tuple[str, ...]]:
        """A Future that completes with `names` once each has left (on `events`' thread)."""
        fut: Future[tuple[str, ...]] = Future()
        with self.lock:
            pending = {name for name in names if not self.has_left(name)}
            if pending:
                self._waits.append((pending, names, fut))
        if not pending:
            fut.set_result(names)
        return fut

    def announce(self, event: Replaced | Joined) -> None:
        """Run the `on_replaced` callbacks for `event` on a thread of their own.

        Every event also goes to the `on_members` callbacks (`_events`); a
        `Left` goes there from `departed`.
        """
        self.events.put(event)
        if not isinstance(event, Replaced):
            return
        callbacks = list(self.callbacks)
        if not callbacks:
            return
        thread = threading.Thread(
            target=_run_callbacks, args=(callbacks, event, self.replaced_failures),
            name="asyncrpc-on-replaced", daemon=True,
        )  # fmt: skip
        with self.lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def here(self, name: str) -> None:
        """This worker is `name`: its callbacks' failures say where they ran."""
        self.me = name
        self.events.failures.worker = self.replaced_failures.worker = name

    def stop(self) -> None:
        """Wait (bounded) for callbacks still running; the world is ending.

        A removal still waiting (`wait_left`) fails: this worker no longer hears.
        """
        with self.lock:
            waits, self._waits = self._waits, []
        for pending, names, fut in waits:
            error = AsyncRPCError(
                f"remove_workers({', '.join(map(repr, names))}, wait=False): the world of "
                f"worker {self.me!r} ended before {sorted(pending)} had left, so it hears of "
                f"no departure any more: wait for the Future before that worker's main returns"
            )
            fail = functools.partial(fut.set_exception, error)  # type: ignore[arg-type]  # torch's stub
            if not self.events.call(fail):
                fail()
        self.events.stop()
        with self.lock:
            threads, self._threads = self._threads, []
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(_CALLBACK_JOIN_S)


def _run_callbacks(
    callbacks: list[Callable[[Replaced], object]],
    event: Replaced,
    failures: _events.CallbackFailures,
) -> None:
    for callback in callbacks:
        failures.call(callback, event)  # type: ignore[arg-type]
