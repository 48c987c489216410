"""`asyncrpc-launch --elastic`: members added and removed, and nodes that join and leave.

Node 0's launcher serves every member's requests (`_changes.Changes`, as an
embedded supervisor does); a worker is started by the launcher of the node
the request names (the caller's by default), through an order in the store.
Each launcher tells node 0 how its added or removed workers ended::

    worker (node 1): add_workers(2) ── request/<id> {"node": 1} ──> node 0: Changes.serve:
                                                                    names += worker4, worker5
    node 1's launcher <── order/1/<k> [rank, name, torch id, ...] ──
      starts worker4, worker5 (new interpreters, ASYNCRPC_NAME=...)
      they join, welcome every member, set joined/<name>
    node 1: worker4 ended ── request "exited" {worker4, how} ─────> node 0: left, or it failed
                                                                    to join (`Changes.exited`)
    asyncrpc-launch --join HOST:PORT --nproc-per-node 2:
      nodes + 1 -> its node number N; request "add" {count: 2, node: N} -> orders for N
    SIGTERM to node N (N > 0): request "remove" {its workers, by: "node N ... preempted"};
      they leave as removed workers do (stopping() is True there), then the launcher ends 0

An added worker that dies under a launcher leaves the world (`Left`, with
how it ended); it is not replaced. So does a first worker other than rank 0
without --max-restarts (`_replacing.Replacer` decides). Node 0 hosts the
store: its end is the world's end.
"""

from __future__ import annotations

import itertools
import json
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Protocol

from .._core import _records
from .._core._errors import RendezvousError, describe_exit
from .._core._membership import Joining
from .._core._torch import Store
from ._changes import Changes
from ._healer import Healer
from ._plan import Plan
from ._warm import Spare

__all__ = ("JOIN_S", "NodeChanges")


class _Node(Protocol):
    """What this module reads of its launcher's node (`_nodes.Node`, a layer above)."""

    plan: Plan  # `--join` sets its node number
    size: int  # the world's as it formed

    @property
    def heal(self) -> Store: ...  # the world's heal space in the store

    @property
    def space(self) -> Store: ...  # the launchers' own keys

    @property
    def port(self) -> int: ...

    @property
    def tag(self) -> str: ...

    @property
    def first(self) -> int: ...  # the rank of its local worker 0

    @property
    def procs(self) -> list[subprocess.Popen[bytes]]: ...  # its first workers

    def spawn(
        self, rank: int, local: int, joining: Joining, attempt: int, size: int, name: str | None
    ) -> subprocess.Popen[bytes]: ...

    def world_ended(self) -> bool: ...

    def formed_healer(self) -> Healer | None: ...

    def went(self, proc: subprocess.Popen[bytes], name: str) -> None: ...  # ended (`_quiet`)


_KILLS_EVERY_S = 0.25  # how often a launcher looks for its removed workers' kills
JOIN_S = 60.0  # how long `--join` waits for node 0's answer
_LEAVE_S = 60.0  # how long a preempted node's workers get to leave
_POLL_S = 0.05


class NodeChanges:
    """One launcher's side of an elastic world: its added workers, and node 0's serving."""

    def __init__(self, node: _Node, max_world_size: int | None) -> None:
        self.node = node
        self.heal = node.heal
        self.max_world_size = max_world_size
        self.extras: dict[str, subprocess.Popen[bytes]] = {}  # added workers started here
        self.locals: dict[str, int] = {}  # their LOCAL_RANKs: past the first workers' ones
        self.changes: Changes | None = None  # node 0's, once the world formed
        self.orders = 0  # orders taken from order/<node>/
        self.leaving = False  # a signal made this node leave the world
        self.next_kills = 0.0
        # An interpreter started ahead for the next add (`_warm`), once the world formed.
        self.spare = Spare(node.plan.command)
        self.spared = False

    @property
    def me(self) -> int:
        return self.node.plan.node

    def open(self) -> None:
        """Node 0, before its workers start: the world's nodes and size, then that it is elastic.

        `elastic` last: a `--join` reads the others once it sees it.
        """
        self.heal.add("nodes", self.node.plan.nnodes)
        self.heal.set("formed_size", str(self.node.size))
        self.heal.set("elastic", json.dumps({"max_world_size": self.max_world_size}))

    def join(self) -> tuple[int, int]:
        """`--join`: a node number, and node 0 asked for this node's workers.

        Returns (the number, the world's size as it formed).
        """
        if not self.heal.check(["elastic"]):
            raise RendezvousError(
                f"--join {self.node.plan.host}:{self.node.port}: that world was not launched "
                f"with --elastic, so it cannot grow; launch it with asyncrpc-launch --elastic"
            )
        me = int(self.heal.add("nodes", 1)) - 1
        by = f"node {me} ({socket.gethostname()})"
        try:
            reply = self._ask({"op": "add", "count": self.node.plan.nproc, "role": None,
                               "by": by, "node": me})  # fmt: skip
            if "error" in reply:
                raise RendezvousError(f"--join: node 0 did not add this node's workers: "
                                      f"{reply['error']}")  # fmt: skip
        except BaseException:
            # Not a node of the world: no add goes to it, node 0's end does not wait for it.
            self.heal.set(f"gone_node/{me}", "1")
            self.node.space.set(f"left/{me}", "1")
            raise
        return me, int(self.heal.get("formed_size").decode())

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        rid = self._send(request)
        _records.wait_keys(self.heal, [f"reply/{rid}"], JOIN_S,
                           f"node 0's launcher did not answer within {JOIN_S} s")  # fmt: skip
        reply: dict[str, Any] = json.loads(self.heal.get(f"reply/{rid}").decode())
        return reply

    def _send(self, request: dict[str, Any]) -> int:
        rid = int(self.heal.add("requests", 1))
        self.heal.set(f"request/{rid}", json.dumps(request))
        return rid

    def keeps_running(self) -> bool:
        """Whether this launcher still has work with its first workers done: extras, or serving."""
        return bool(self.extras) or (not self.leaving and not self.node.world_ended())

    def turn(self) -> None:
        """One look: serve (node 0), start ordered workers, see added workers end, kills."""
        if self.me == 0:
            self._serve()
        else:
            self._take_orders()
        if not self.spared and not self.leaving and self.node.formed_healer() is not None:
            self.spared = True  # not before: it would slow the world's start
            self.spare.start()
        for name, proc in list(self.extras.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.extras[name]
            self.node.went(proc, name)
            if code != 0 or not self.node.world_ended():
                self.report(name, describe_exit(code))
            else:
                self.dead(name)
        if self.me != 0 and time.monotonic() >= self.next_kills:
            self.next_kills = time.monotonic() + _KILLS_EVERY_S
            for name, proc in self._local().items():
                if proc.poll() is None and self.heal.check([f"kill/{name}"]):
                    proc.kill()  # removed, and past its timeout (node 0 said)

    def _serving(self) -> Changes | None:
        """Node 0's `Changes`, made once the world formed (None before)."""
        if self.changes is None:
            healer = self.node.formed_healer()
            if healer is None:
                return None
            self.changes = Changes(healer, self.max_world_size, {}, self._start, self._alive,
                                   self._nodes)  # fmt: skip
        return self.changes

    def _serve(self) -> None:
        changes = self._serving()
        if changes is None:
            return
        changes.drain()
        changes.serve()
        local = self._local()
        for name in changes.due():
            proc = local.get(name)
            if proc is None:
                self.heal.set(f"kill/{name}", "1")  # its node's launcher kills it
            elif proc.poll() is None:
                proc.kill()

    def _alive(self) -> set[str]:
        assert self.changes is not None
        healer = self.changes.healer  # a removed worker is still told it leaves: not `live_names`
        return {name for name in healer.names if healer.running(name)} - healer.joining()

    def _nodes(self) -> set[int]:
        count = int(self.heal.add("nodes", 0))
        return {n for n in range(count) if not self.heal.check([f"gone_node/{n}"])}

    def _start(self, rank: int, joining: Joining, node: int | None) -> None:
        assert self.changes is not None
        names = self.changes.healer.names
        where = 0 if node is None else node
        if where == self.me:
            self.start(rank, names[rank], joining, len(names))
            return
        number = int(self.heal.add(f"order/{where}/n", 1))
        order = [rank, names[rank], joining.torch_id, joining.size, len(names)]
        self.heal.set(f"order/{where}/{number}", json.dumps(order))

    def _take_orders(self) -> None:
        count = int(self.heal.add(f"order/{self.me}/n", 0))
        while self.orders < count:
            key = f"order/{self.me}/{self.orders + 1}"
            if not self.heal.check([key]):  # its number is taken, its text not written yet
                return
            self.orders += 1
            rank, name, torch_id, size, world_size = json.loads(self.heal.get(key).decode())
            if self.leaving:  # the add fails: none of its workers stays
                self.report(str(name), f"was not started: node {self.me} left the world")
                continue
            joining = Joining(int(torch_id), self.node.tag, True, int(size))
            self.start(int(rank), str(name), joining, int(world_size))

    def start(self, rank: int, name: str, joining: Joining, world_size: int) -> None:
        """Start the added worker `name` (rank `rank`) on this node."""
        taken = {self.locals[n] for n in self.extras}
        local = next(i for i in itertools.count(len(self.node.procs)) if i not in taken)
        self.locals[name] = local
        self.extras[name] = self.node.spawn(rank, local, joining, 0, world_size, name)

    def stop_joining(self, joining: set[str]) -> list[str]:
        """Kill this node's added workers among `joining` (still joining); their names."""
        stopped = []
        for name in sorted(joining & set(self.extras)):
            proc = self.extras.pop(name)
            proc.kill()
            proc.wait()
            self.node.went(proc, name)
            stopped.append(name)
        return stopped

    def _local(self) -> dict[str, subprocess.Popen[bytes]]:
        """This node's worker processes by name, those it started with and those added."""
        names = self._names()
        first = [(names[self.node.first + i], proc) for i, proc in enumerate(self.node.procs)
                 if self.node.first + i < len(names)]  # fmt: skip
        return {**dict(first), **self.extras}

    def took_exit(self, rank: int, code: int) -> bool:
        """One of this node's first workers ended: True if it left the world (reported)."""
        name = self.name_of(rank)
        if name is None:
            return False
        if name in _records.live_names(self.heal) and not self.leaving:
            return False  # a death: healed, or the world fails
        self.report(name, describe_exit(code))
        return True

    def dead(self, name: str) -> None:
        """`name`'s process ended here: node 0 waits for no word from it (`Healer.running`).

        At once, before node 0 hears why: it waits for none from its own dead ones.
        """
        self.heal.set(f"spawned/{name}", "-1")

    def _names(self) -> tuple[str, ...]:
        """Every rank's name given so far; none before the world's names are written."""
        return _records.read_names(self.heal, 1.0) if self.heal.check(["names"]) else ()

    def name_of(self, rank: int) -> str | None:
        """The name of `rank`, or None before it has one."""
        names = self._names()
        return names[rank] if rank < len(names) else None

    def report(self, name: str, how: str) -> None:
        """Tell node 0 that `name`'s process ended (`how`), where it is a change of members."""
        self.dead(name)
        if self.me == 0:
            changes = self._serving()
            if changes is not None and not changes.exited(name, how):
                changes.lost(name, how)
            return
        self._send({"op": "exited", "name": name, "how": how})

    def leave(self, number: int) -> int:
        """A signal asked this node (not node 0) to go: its workers leave the world; 0."""
        self.leaving = True  # from now on, orders are refused (`_take_orders`)
        self.heal.set(f"gone_node/{self.me}", "1")  # and node 0 sends none
        signame = signal.Signals(number).name
        joining = {n for n in self.extras if not self.heal.check([f"joined/{n}"])}
        for name in self.stop_joining(joining):  # still joining: it never becomes a member
            self.report(name, f"was stopped as it joined: node {self.me} left the world")
        live = set(_records.live_names(self.heal)) if self.heal.check(["names"]) else set()
        mine = sorted(n for n, p in self._local().items() if p.poll() is None and n in live)
        why = f"node {self.me} ({socket.gethostname()}), preempted by {signame}"
        # Asked even for none: once node 0 answers, every add it served before has its
        # orders written, and the loop below refuses them.
        self._ask({"op": "remove", "names": mine, "by": why, "timeout": _LEAVE_S})
        self._take_orders()  # refused, each reported: they fail to join
        deadline = time.monotonic() + _LEAVE_S + 5.0
        running = set(range(len(self.node.procs)))
        while (running or self.extras) and time.monotonic() < deadline:
            for local in sorted(running):
                code = self.node.procs[local].poll()
                if code is not None:
                    running.discard(local)
                    self.node.went(self.node.procs[local], self.name_of(self.node.first + local)
                                   or "")  # fmt: skip
                    self.took_exit(self.node.first + local, code)
            self.turn()
            time.sleep(_POLL_S)
        for name, proc in self._local().items():
            if proc.poll() is None:  # past the time to leave (node 0's kill did not come)
                proc.kill()
                proc.wait()
                self.report(name, f"was stopped: it did not leave within {_LEAVE_S} s")
        self.node.space.set(f"left/{self.me}", "1")
        print(f"asyncrpc-launch: node {self.me} ({socket.gethostname()}) was ended by "
              f"{signame}: its workers {mine} left the world, which goes on",
              file=sys.stderr, flush=True)  # fmt: skip
        return 0

    def close(self) -> None:
        self.spare.close()
        if self.changes is not None:
            self.changes.close()
