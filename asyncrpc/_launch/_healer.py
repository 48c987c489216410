"""Replacing a dead worker in place (`restart="worker"`): the supervisor's or launcher's side.

The supervisor saw one of its workers die. Before a replacement may join
torch's group (under a torch name of its own, `name:<id>`), every other
member must hear of the dead process and the store must stop listing it
(`_core._membership` has the members' side)::

    Healer.replace(rank, why)
      state: heals + 1 (refused once the world is ending), restarts + 1 <= K
      side channel ──"member gone <seq> <id> <name> <why>"──> every other member
      wait for their acks (bounded: a member that died too is healed next)
      store: "<torch name>-<id>," off torch's list, holding the group's token as
             torch's joins do (a token a dead process held is released)
      -> Joining(fresh torch id, tag, replacement=True): start the new process with it
    Healer.started(): state: heals - 1

`K` (max_restarts) bounds the replacements of the whole world: the count
lives in the store, so launchers on several nodes share it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from .._core import _membership, _polling, _records, _torch, _watcher
from .._core._membership import Joining
from .._core._torch import PrefixStore, Store

__all__ = ("Healer",)

# How long survivors get to forget a dead member. Generous: a replacement that joins
# before a survivor has forgotten the dead process finds torch's agent there still
# listing the name, and on a loaded machine a survivor's watcher may wait seconds
# for a core and the GIL. One that dies meanwhile is not waited for (`Healer.running`).
_ACK_S = 30.0
_NONE_ALIVE = "-1"  # spawned/<name> while no process of it lives
_ENDING_EVERY_S = 0.1  # how often a wait for acks looks whether the world ends


class Healer:
    """Replaces this supervisor's dead workers under their names, up to `max_restarts` in all."""

    def __init__(
        self, store: Store, tag: str, names: tuple[str, ...], max_restarts: int, used: int = 0
    ) -> None:
        self.root = store
        self.tag = tag
        self.names = list(names)  # every rank's name: grows as workers are added (_changes)
        self.size = len(names)  # as the world formed: torch ids below it are first processes
        self.max_restarts = max_restarts
        self.space = _membership.heal_space(store, tag)
        self.started_again = used  # restarts spent before this store, as the world formed
        if used:
            self.space.add("restarts", used)
        self.side = PrefixStore(f"asyncrpc/{tag}/side/", store)
        self.rpc = PrefixStore(f"asyncrpc/{tag}/rpc/", store)  # as the workers' agents see it
        self.attempts = {name: 0 for name in names}
        # The torch id each name's process was given: its rank at first, then fresh ids.
        self.ids = {name: rank for rank, name in enumerate(names)}
        self.count = 0  # the world's replacements so far, this supervisor's last included
        self.retry: set[str] = set()  # replacements stopped before they joined: start again
        # Whether the process started last for a name still runs, as the supervisor or
        # launcher that started it sees it (True for names another node runs).
        self.alive: Callable[[str], bool] = lambda name: True

    def formed(self) -> bool:
        """True once every member has known the others (a `main` may run; see `_membership`).

        Before, a death cannot be healed: the others wait in the world's start
        for the dead process itself. Nothing has run yet, so the world starts again.
        """
        return _records.formed(self.space, tuple(self.names[: self.size]))

    def ending(self) -> bool:
        """True once every member's `main` is done and the world ends (no more heals)."""
        return bool(_records.read_state(self.space)["ending"])

    def replace(self, rank: int, why: str, alive: set[str]) -> Joining | None:
        """Forget worker `rank`'s dead process everywhere; how its replacement joins.

        None when the world may not heal: `max_restarts` replacements were
        made, or every `main` is done and the world is ending. `alive`: the
        names whose processes still run (their acks are waited for, while
        they run: `running`).
        """
        name = self.names[rank]
        retry = name in self.retry  # not a death of its own: neither counted nor an attempt
        self.retry.discard(name)
        if not retry:
            self.count = int(self.space.add("restarts", 1))
            if self.count > self.max_restarts:
                return None
        if not _records.begin_heal(self.space, name):
            return None
        try:
            self.space.set(f"spawned/{name}", _NONE_ALIVE)  # its process is dead (_is_dead)
            old = self.ids[name]
            seq = int(self.space.add("seq", 1))
            text = _membership.gone_message(name, old, seq, " ".join(why.split()))
            self._tell(text, alive - {name})
            self._wait_for_acks(seq, alive - {name})
            self._forget(name, old)
            fresh = self.fresh_id()
            self.ids[name] = fresh
            self.space.set(f"spawned/{name}", str(fresh))  # the process that answers for it next
        except BaseException:
            _records.end_heal(self.space)
            raise
        if not retry:
            self.attempts[name] += 1
        return Joining(fresh, self.tag, replacement=True, size=self.size)

    def fresh_id(self) -> int:
        """A torch id no process of this world had before (a replacement's, an added member's)."""
        return self.size - 1 + int(self.space.add("ids", 1))

    def add(self, name: str) -> Joining:
        """Make `name` a member (a new rank): how its first process joins torch's group."""
        fresh = self.fresh_id()
        self.names.append(name)
        self.attempts[name], self.ids[name] = 0, fresh
        self.space.set(f"spawned/{name}", str(fresh))
        return Joining(fresh, self.tag, replacement=True, size=self.size)

    def refresh(self) -> None:
        """Take in the members added since this healer was made (by another node's launcher).

        Under `asyncrpc-launch --elastic` node 0's launcher adds the workers;
        the others learn their names and ids from the store when they heal.
        """
        names = _records.read_names(self.space, 1.0)
        for name in names[len(self.names) :]:
            self.names.append(name)
            self.attempts[name] = 0
            published = self._published(name)
            key = f"spawned/{name}"
            spawned = int(self.space.get(key).decode()) if self.space.check([key]) else -1
            self.ids[name] = spawned if spawned >= 0 else (published or self.size)

    def tell(self, kind: str, name: str, why: str, names: set[str]) -> None:
        """Tell `names` that `name` is leaving or has left (`kind`); wait for their acks."""
        seq = int(self.space.add("seq", 1))
        text = _membership.gone_message(name, self.ids[name], seq, " ".join(why.split()), kind)
        self._tell(text, names)
        self._wait_for_acks(seq, names)

    def forget(self, name: str) -> None:
        """Take `name`'s process off torch's list of the group's members (it has ended)."""
        self.space.set(f"spawned/{name}", _NONE_ALIVE)
        self._forget(name, self.ids[name])

    def stop(self, name: str) -> None:
        """The supervisor stopped `name`'s replacement before it joined: start it again."""
        self.retry.add(name)
        self.space.set(f"spawned/{name}", _NONE_ALIVE)

    def forget_stopped(self, name: str) -> None:
        """Take `name`'s replacement, stopped (`stop`) and killed as it joined, off torch's list.

        At once, not when its death is healed: another replacement started
        meanwhile would find it listed (if its join got that far) and fail on
        it, and each failure stopped the other's join again.
        """
        self._forget(name, self.ids[name])

    def _forget(self, name: str, old: int) -> None:
        """Take `name`'s process `old` (torch id) off torch's list of the group's members."""
        # A process that died before it published its group joined a fresh
        # interpreter's first group, if any.
        key = f"group/{name}"
        prefix = self.space.get(key).decode() if self.space.check([key]) else "rpc_prefix_0"
        dead = _membership.torch_name(name, old, self.size)
        _torch.forget_member(PrefixStore(prefix, self.rpc), dead, old,
                             functools.partial(self._is_dead, old), _ACK_S)  # fmt: skip

    def _is_dead(self, forgotten: int, torch_name: str) -> bool:
        """Whether the process torch knows as `torch_name` died (or is `forgotten`).

        Each name has one live process at most: the one spawned last for it
        (`spawned/<name>` in the store, shared by the launchers of every node;
        its rank before any heal; none while it is being replaced or was
        stopped). Any other process of that name is dead, and so is that one
        once it ended (`alive`): a joiner that failed holds the token it
        took for good, also before the supervisor has handled its death.
        """
        name, _, tail = torch_name.partition(":")
        if name not in self.names:
            return False  # not a member's: a launcher's own edit, alive
        torch_id = int(tail) if tail.isdigit() else self.names.index(name)
        key = f"spawned/{name}"
        latest = int(self.space.get(key)) if self.space.check([key]) else self.names.index(name)
        if torch_id == forgotten or torch_id != latest:
            return True
        return not self.alive(name)  # `latest` is a live id: the store says no more

    def running(self, name: str) -> bool:
        """Whether the process started last for `name` may still run.

        False once it ended (`alive`, where this supervisor started it), or
        once a supervisor began to replace or stopped it (`spawned/<name>`).
        """
        if not self.alive(name):
            return False
        key = f"spawned/{name}"
        return not (self.space.check([key]) and self.space.get(key).decode() == _NONE_ALIVE)

    def joining(self) -> set[str]:
        """The names whose replacement was started but has not joined yet (published its id).

        torch's join of a dynamic group calls every listed member; one that
        died meanwhile makes the join fail, and torch's own clean-up of a failed
        join then waits for the token the join holds: the joiner never ends.
        The supervisor stops these replacements when another member dies, and
        starts them again (`retry`: neither counted nor a new attempt).
        """
        return {
            name for name in self.names
            if self.ids[name] >= self.size and self._published(name) != self.ids[name]
        }  # fmt: skip

    def _published(self, name: str) -> int | None:
        key = f"id/{name}"
        return int(self.space.get(key).decode()) if self.space.check([key]) else None

    def started(self) -> None:
        """The replacement of the last `replace` has been started (or failed to start)."""
        _records.end_heal(self.space)

    def _tell(self, text: str, names: set[str]) -> None:
        for name in sorted(names):
            key = f"id/{name}"
            if self.space.check([key]):  # one that has not joined yet has nothing to forget
                _watcher.send_request(self.side, int(self.space.get(key).decode()), text)

    def _wait_for_acks(self, seq: int, names: set[str]) -> None:
        """Wait (bounded: `_ACK_S`) until each of `names` acked, died, or the world ends."""
        waiting = {name: f"{seq}/ack/{name}" for name in names}
        next_look = [time.monotonic() + _ENDING_EVERY_S]

        def acked() -> bool:
            for name, key in list(waiting.items()):
                if self.space.check([key]) or not self.running(name):
                    del waiting[name]
            if waiting and time.monotonic() >= next_look[0]:
                next_look[0] = time.monotonic() + _ENDING_EVERY_S
                return self.ending()  # every main returned: members end, none need wait
            return not waiting

        _polling.within(acked, _ACK_S)  # one that never acks is healed next, if it died
