"""Membership changes the members of an elastic embedded world ask of its supervisor.

A member's `add_workers` or `remove_workers` (`_core/_elastic`) writes a
request to the world's store; a thread of the supervisor's
(`asyncrpc-requests`) blocks on the next request's key and wakes the
supervisor's loop through a pipe, which serves it (`Changes.serve`) and
answers in the store::

    member                       store (asyncrpc/0/heal/)          supervisor
    add_workers(2)  ── requests + 1, request/<id> ──────────────>  Changes.serve: names += new
                                                                   ones, each started with a
                    <── reply/<id> {"names": [...]} ────────────   fresh torch id
    waits for joined/<name>: the new worker sets it once every member knows it

    remove_workers("w2") ── request/<id> ───────────────────────>  state: left += w2 (the end
                                                                   no longer waits for it);
                                                                   "member leaving" to the others,
                                                                   then to w2 (acks)
                          w2: stopping() is True; it leaves when its main returns
                          (or is killed at its timeout)
                                                                   Changes.exited: off torch's
                                                                   list, "member left" (acks)
    waits for left/w2  <────────────────────────────────────────  left/w2

An added worker that ends before it joined failed to join: it leaves the
same way, and `failed/<name>` says why.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import threading
import time
from collections.abc import Callable
from typing import Any

from .._core import _membership, _records
from .._core._membership import Joining
from ._healer import Healer

__all__ = ("Changes",)

_FOREVER = datetime.timedelta(days=365)
_CLOSE_S = 2.0  # how long the world's end waits for the requests' thread


class Changes:
    """The requests of an elastic world's members, served by the supervisor that started it.

    `start(rank, joining, node)`: start the worker of a new rank (on `node`,
    None: the supervisor's own). `alive()`: the names whose processes run
    and have joined (they hear of every change). `roles`: each role's count,
    grown as workers of a role are added. `nodes()`: the nodes that may
    start workers (`asyncrpc-launch --elastic`: its launchers; else {0}).
    """

    def __init__(
        self,
        healer: Healer,
        max_world_size: int | None,
        roles: dict[str, int],
        start: Callable[[int, Joining, int | None], None],
        alive: Callable[[], set[str]],
        nodes: Callable[[], set[int]] = lambda: {0},
    ) -> None:
        self.healer = healer
        self.space = healer.space
        self.max_world_size = max_world_size
        self.roles = roles
        self.start = start
        self.alive = alive
        self.nodes = nodes
        self.handled = 0  # requests served, in the order their ids were taken
        # name -> (when it is killed if still running, who removed it)
        self.removing: dict[str, tuple[float, str]] = {}
        self.adding: set[str] = set()  # added, not known to have joined yet
        self.space.set("elastic", json.dumps({"max_world_size": max_world_size}))
        # Readable when a request may have come: in the supervisor's wait.
        self.woken, self._wake = multiprocessing.Pipe(duplex=False)
        self._waiter = threading.Thread(
            target=self._wait_for_requests, args=(self.space.clone(),),  # type: ignore[attr-defined]
            name="asyncrpc-requests", daemon=True,
        )  # fmt: skip
        self._waiter.start()

    def _wait_for_requests(self, space: Any) -> None:
        """Block on each next request's key in turn; wake the supervisor for each."""
        number = 1
        while True:
            try:
                space.wait([f"request/{number}"], _FOREVER)
                stop = json.loads(space.get(f"request/{number}").decode())["op"] == "stop"
                self._wake.send_bytes(b"1")
            except Exception:  # the store or the supervisor's end of the pipe is gone
                return
            if stop:
                return
            number += 1

    def close(self) -> None:
        """Stop the requests' thread (a request of its own ends it), then the pipe."""
        rid = int(self.space.add("requests", 1))
        self.space.set(f"request/{rid}", json.dumps({"op": "stop"}))
        self._waiter.join(_CLOSE_S)
        self.woken.close()
        self._wake.close()

    def drain(self) -> None:
        """Take the wake-ups the pipe holds (the loop serves every request there is)."""
        while self.woken.poll():
            self.woken.recv_bytes()

    def serve(self) -> None:
        """Serve the requests written since the last turn, in order."""
        count = int(self.space.add("requests", 0))
        while self.handled < count:
            key = f"request/{self.handled + 1}"
            if not self.space.check([key]):  # its id is taken, its text not written yet
                return
            self.handled += 1
            request = json.loads(self.space.get(key).decode())
            try:
                reply = self._serve(request)
            except Exception as exc:  # the member raises it; the world goes on
                reply = {"error": f"{type(exc).__name__}: {exc}", "kind": "failed"}
            self.space.set(f"reply/{self.handled}", json.dumps(reply))

    def _serve(self, request: dict[str, Any]) -> dict[str, Any]:
        if request["op"] == "stop":
            return {"ok": True}
        if request["op"] == "add":
            return self._add(int(request["count"]), request.get("role"), request.get("node"))
        if request["op"] == "exited":  # another node's launcher saw one of its workers end
            name, how = str(request["name"]), str(request["how"])
            if not self.exited(name, how):
                self.lost(name, how)
            return {"ok": True}
        return self._remove(list(request["names"]), str(request["by"]), float(request["timeout"]))

    def _add(self, count: int, role: str | None, node: int | None) -> dict[str, Any]:
        nodes = self.nodes()
        if node is not None and node not in nodes:
            return {
                "kind": "node",
                "error": f"node={node} is not a node of this world that can start workers "
                f"(those are {sorted(nodes)}); leave node= out to start them on the caller's",
            }
        live = _records.live_names(self.space)
        limit = self.max_world_size
        if limit is not None and len(live) + count > limit:
            return {
                "kind": "full",
                "error": f"the world has {len(live)} workers and max_world_size={limit}, so "
                f"{count} more would make {len(live) + count}; nothing was started: remove "
                f"workers first, or start the world with a larger max_world_size "
                f"(asyncrpc-launch: --max-world-size)",
            }
        if not _records.begin_change(self.space):
            return {"kind": "ending", "error": "every main has returned: the world is ending"}
        try:
            new = []
            for _ in range(count):
                rank, name = len(self.healer.names), self._name(role)
                new.append((rank, name, self.healer.add(name)))
                if role is not None:
                    self.roles[role] = self.roles.get(role, 0) + 1
            # Before the change is counted out: a member that ends its main now waits
            # for the new ones (`meet_to_end`).
            self.space.set("names", json.dumps(self.healer.names))
            for rank, name, joining in new:
                self.adding.add(name)
                self.start(rank, joining, node)
        finally:
            _records.end_heal(self.space)
        return {"names": [name for _, name, _ in new]}

    def _name(self, role: str | None) -> str:
        """The next name of `role`'s numbering (`actor4`), or `worker<rank>` without one."""
        taken = set(self.healer.names)
        if role is None:
            index, prefix = len(self.healer.names), "worker"
        else:
            prefix = role
            index = sum(1 for n in taken if n.startswith(role) and n[len(role) :].isdigit())
        while f"{prefix}{index}" in taken:
            index += 1
        return f"{prefix}{index}"

    def _remove(self, names: list[str], by: str, timeout: float) -> dict[str, Any]:
        live = set(_records.live_names(self.space))
        gone = [name for name in names if name not in live]
        if gone:
            return {
                "kind": "unknown",
                "error": f"{gone} are not members of the world now (it has {sorted(live)})",
            }
        now, why = time.monotonic(), f"removed by {by}"
        for name in names:
            self.removing[name] = (now + timeout, why)
        hearing = self.alive() - set(names)
        for name in names:  # everyone else first: no call reaches it once it stops
            self.healer.tell(_membership.LEAVING, name, why, hearing)
        # Then the end stops waiting for its main, and one waiting for the end leaves.
        _records.mark_left(self.space, names)
        for name in names:
            self.healer.tell(_membership.LEAVING, name, why, {name} & self.alive())
        return {"ok": True}

    def due(self) -> list[str]:
        """The removed workers whose time to leave has passed: the supervisor kills them.

        All of them once the world ends: it does not wait for them.
        """
        now = time.monotonic()
        due = [name for name, (when, _) in self.removing.items() if when <= now]
        if len(due) < len(self.removing) and _records.read_state(self.space)["ending"]:
            return list(self.removing)
        return due

    def exited(self, name: str, how: str) -> bool:
        """A worker's process ended: True if that was a change (it left, or failed to join).

        `how`: how it ended, for a worker that failed to join.
        """
        joined = self.space.check([f"joined/{name}"])
        if name in self.removing:
            self._left(name, self.removing.pop(name)[1])
            return True
        if name not in self.adding or name in self.healer.retry:
            return False  # a member's death: healed, or the world fails
        self.adding.discard(name)
        if joined:
            return False
        _records.mark_left(self.space, [name])
        self._gone(name, "it failed to join")
        self.space.set(f"failed/{name}", how)
        return True

    def lost(self, name: str, how: str) -> None:
        """A member's process ended unasked where it is not replaced: it left the world.

        Under `asyncrpc-launch --elastic`, an added worker (and any worker of a
        world that does not heal) that dies leaves; `how`: how it ended.
        """
        if name not in _records.live_names(self.space):
            return  # it left already
        _records.mark_left(self.space, [name])
        self._left(name, f"it ended unasked ({how})")

    def _left(self, name: str, why: str) -> None:
        """`name` left (`why`): forgotten, every member told, and `left/<name>` says when."""
        self._gone(name, why)
        self.space.set(f"left/{name}", json.dumps({"at": time.time(), "why": why}))

    def _gone(self, name: str, why: str) -> None:
        self.healer.forget(name)
        self.healer.tell(_membership.LEFT, name, why, self.alive() - {name})
