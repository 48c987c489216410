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
import json
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from . import _torch
from ._errors import ObjectLostError, RendezvousError, WorkerUnreachableError
from ._torch import PrefixStore

if TYPE_CHECKING:
    from ._context import Context
    from ._torch import Store, WorkerInfo

__all__ = [
    "HEAL_PREFIX",
    "Joining",
    "Members",
    "Replaced",
    "begin_heal",
    "end_heal",
    "gone_message",
    "heal_prefix",
    "heal_space",
    "meet_to_end",
    "meet_to_stop",
    "parse_gone",
    "publish",
    "read_members",
    "read_names",
    "read_state",
    "torch_name",
    "trim_heap",
    "wait_for_all",
]

HEAL_PREFIX = "heal/"  # under the world's key space: asyncrpc/<tag>/heal/


def heal_prefix(tag: str) -> str:
    """Where the members' records of the world `tag` lie in its store."""
    return f"asyncrpc/{tag}/{HEAL_PREFIX}"


def heal_space(store: Store, tag: str) -> Store:
    """The members' records of the world `tag` (keys below), as a store of their own."""
    return PrefixStore(heal_prefix(tag), store)


_GONE = "member gone"
_CALLBACK_JOIN_S = 5.0
_POLL_S = 0.01
_STOP_S = 30.0  # how long members wait for each other to stop, once every main is done
# Keys, under asyncrpc/<tag>/heal/ in the world's store:
#   names                    every member's name, in rank order (JSON)
#   id/<name>, attempt/<name>, group/<name>   the process that answers for <name> now
#   ready/<name>             <name> knows the members: it may be called (a start's barrier)
#   state                    {"done": {name: attempt}, "healing": n, "ending": bool}:
#                            whose main has returned, heals under way, the world ends
#   <seq>/ack/<name>         <name> has forgotten the process of heal <seq>
#   seq, restarts, ids       the supervisors' counters


class Joining(NamedTuple):
    """How a worker joins a world that heals (given by its supervisor or launcher).

    `torch_id`: its id in torch's group (its rank at first; fresh for a
    replacement). `tag`: the world's key space. `replacement`: it replaces a
    dead worker (the others already run; it does not wait for them).
    """

    torch_id: int
    tag: str
    replacement: bool


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


def gone_message(name: str, torch_id: int, seq: int, why: str) -> str:
    """The side-channel text telling a survivor that `name` (torch id) died."""
    return f"{_GONE} {seq} {torch_id} {name} {why}"


def parse_gone(text: str) -> tuple[int, int, str, str] | None:
    """(seq, torch id, name, why) of a `gone_message`, or None for other texts."""
    if not text.startswith(_GONE + " "):
        return None
    seq, torch_id, name, why = text[len(_GONE) + 1 :].split(" ", 3)
    return int(seq), int(torch_id), name, why


class Members:
    """This worker's view of a healing world's members: ids, attempts, who is being replaced."""

    def __init__(self, names: tuple[str, ...], ids: dict[str, int], attempt: dict[str, int]):
        self.names = names
        self.ids = dict(ids)  # name -> torch id of the process that answers now
        self.attempts = dict(attempt)  # name -> its attempt (0: the first process)
        self.replacing: dict[str, str] = {}  # name -> why it is being replaced
        self.lost: dict[int, str] = {}  # torch id of a dead process -> its name
        self.callbacks: list[Callable[[Replaced], object]] = []
        # Run with a dead process's torch id once it is known dead (what this worker
        # serves for it: a stream's producer, say).
        self.gone_hooks: list[Callable[[int], None]] = []
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
                torch_name(name, torch_id, len(self.names))
            )
        return found

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
                if torch_id not in known:
                    self.lost.setdefault(torch_id, name)
                    self.replacing.setdefault(name, "died")

    def check_call(self, name: str) -> None:
        """Raise `WorkerUnreachableError` for a call to `name` while it is being replaced."""
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

    def joined(self, name: str, torch_id: int, attempt: int) -> Replaced | None:
        """Record `name`'s replacement (torch id, attempt); the event, or None if stale.

        Stale too: the welcome of a process already known dead (killed as it
        welcomed the members, its news came first).
        """
        with self.lock:
            if self.attempts.get(name, -1) >= attempt or torch_id in self.lost:
                return None
            old = self.ids.get(name)
            if old is not None and old != torch_id:
                self.lost.setdefault(old, name)
            self.ids[name], self.attempts[name] = torch_id, attempt
            reason = self.replacing.pop(name, "")
            return Replaced(name, self.names.index(name), attempt, reason)

    def announce(self, event: Replaced) -> None:
        """Run the `on_replaced` callbacks for `event` on a thread of their own."""
        callbacks = list(self.callbacks)
        if not callbacks:
            return
        thread = threading.Thread(
            target=_run_callbacks, args=(callbacks, event), name="asyncrpc-on-replaced",
            daemon=True,
        )  # fmt: skip
        with self.lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def stop(self) -> None:
        """Wait (bounded) for callbacks still running; the world is ending."""
        with self.lock:
            threads, self._threads = self._threads, []
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(_CALLBACK_JOIN_S)


def _run_callbacks(callbacks: list[Callable[[Replaced], object]], event: Replaced) -> None:
    import traceback

    for callback in callbacks:
        try:
            callback(event)
        except Exception:  # one callback's failure must not stop the others
            traceback.print_exc()


# ---- the store protocol: members' side ----------------------------------------------


def publish(space: Store, ctx: Context, torch_id: int, group: str) -> None:
    """Say who answers for `ctx.name` now: its torch id, attempt and group's key prefix."""
    space.set(f"id/{ctx.name}", str(torch_id))
    space.set(f"attempt/{ctx.name}", str(ctx.attempt))
    space.set(f"group/{ctx.name}", group)
    if ctx.attempt == 0:
        space.set("names", json.dumps(list(ctx.names)))


def wait_for_all(space: Store, names: tuple[str, ...], timeout: float, key: str = "id") -> None:
    """Wait until every member has joined torch's group once (a world's start).

    `key="ready"`: until every member knows the others (`mark_ready`), so that
    no call reaches a member still starting. A member that dies before then
    is not replaced in place: the world starts again (`formed`).
    """
    keys = [f"{key}/{name}" for name in names]
    deadline = time.monotonic() + timeout
    while not space.check(keys):
        if time.monotonic() > deadline:
            missing = [n for n, k in zip(names, keys, strict=True) if not space.check([k])]
            raise RendezvousError(
                f"workers {missing} did not join the world within init_timeout={timeout} s; "
                f"they did not start (their own output says why)"
            )
        time.sleep(_POLL_S)


def mark_ready(space: Store, name: str) -> None:
    """`name` knows every member now: calls to it find its `Members` set."""
    space.set(f"ready/{name}", "1")


def formed(space: Store, names: tuple[str, ...]) -> bool:
    """True once every member has been ready once: from then on `main`s may run."""
    return bool(space.check([f"ready/{name}" for name in names]))


def read_names(space: Store, timeout: float) -> tuple[str, ...]:
    """Every member's name in rank order (a replacement learns them from the store)."""
    _wait(space, ["names"], timeout)
    return tuple(json.loads(space.get("names").decode()))


def read_members(space: Store, names: tuple[str, ...]) -> Members:
    """`Members` as the store has them now (ids and attempts of every name)."""
    ids = [int(v) for v in space.multi_get([f"id/{n}" for n in names])]
    attempts = [int(v) for v in space.multi_get([f"attempt/{n}" for n in names])]
    return Members(
        names, dict(zip(names, ids, strict=True)), dict(zip(names, attempts, strict=True))
    )


def meet_to_end(space: Store, ctx: Context, timeout: float = 0) -> bool:
    """Mark `main` done here; wait until every member's is and the world is ending.

    While a member is being replaced its replacement runs `main` again, and
    the world waits for it. False when `timeout` (> 0) passed first.
    """
    deadline = time.monotonic() + timeout if timeout > 0 else None
    _update(space, lambda state: state["done"].update({ctx.name: ctx.attempt}) or state)
    names = set(ctx.names)

    def end(state: dict[str, Any]) -> dict[str, Any] | None:
        if state["ending"] or (names <= set(state["done"]) and state["healing"] == 0):
            state["ending"] = True
            return state
        return None

    while not _update(space, end)["ending"]:
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True


def meet_to_stop(space: Store, count: int, timeout: float = 0) -> None:
    """After `meet_to_end`: wait (bounded) until all `count` members are ready to stop."""
    deadline = time.monotonic() + (timeout if timeout > 0 else _STOP_S)
    space.add("stopping", 1)
    while int(space.add("stopping", 0)) < count and time.monotonic() < deadline:
        time.sleep(_POLL_S)


def _update(
    space: Store, change: Callable[[dict[str, Any]], dict[str, Any] | None]
) -> dict[str, Any]:
    """Apply `change` to the world's state key atomically; the state after (None: unchanged).

    One key holds who is done, how many heals run and whether the world is
    ending, so that each of these moves checks the others in one step.
    """
    while True:
        raw, state = _read(space)
        changed = change(json.loads(json.dumps(state)))
        if changed is None:
            return state
        text = json.dumps(changed, sort_keys=True)
        if space.compare_set("state", raw, text).decode() == text:
            return changed


def _wait(space: Store, keys: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not space.check(keys):
        if time.monotonic() > deadline:
            raise RendezvousError(f"the world's store has no {keys} after {timeout} s")
        time.sleep(_POLL_S)


# ---- the store protocol: the supervisor's side ----------------------------------------


def read_state(space: Store) -> dict[str, Any]:
    """The world's state: `done` (name: attempt), `healing` (a count), `ending`."""
    return _read(space)[1]


def _read(space: Store) -> tuple[str, dict[str, Any]]:
    raw = space.get("state").decode() if space.check(["state"]) else ""
    return raw, (json.loads(raw) if raw else {"done": {}, "healing": 0, "ending": False})


def begin_heal(space: Store, name: str) -> bool:
    """Count a heal of `name` in (its `main` is not done any more); False once the world ends."""

    def begin(state: dict[str, Any]) -> dict[str, Any] | None:
        if state["ending"]:
            return None
        state["done"].pop(name, None)
        state["healing"] += 1
        return state

    return not _update(space, begin)["ending"]


def end_heal(space: Store) -> None:
    """Count the heal out: its replacement has been started (or could not be)."""

    def end(state: dict[str, Any]) -> dict[str, Any]:
        state["healing"] -= 1
        return state

    _update(space, end)
