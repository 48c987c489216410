"""`asyncrpc-launch --restart worker`: a small supervisor per node that heals its workers in place.

torch's elastic agent restarts its whole worker group when one worker
fails. This launcher replaces only the worker that died, under its name and
rank, while every other worker keeps running with its state (`_healer`
drives a heal through the world's store; `_core._membership` is the
workers' side). One launcher runs per node; node 0's hosts the store::

    node 0: asyncrpc-launch                      node 1: asyncrpc-launch
      store on MASTER_ADDR:PORT <─────────────────── a client of node 0's store
      python script ... (worker0, worker1)          python script ... (worker2, worker3)
        env: RANK, ..., ASYNCRPC_JOINING=0,0,0         env: ..., ASYNCRPC_JOINING=2,0,0
      every 0.05 s: its own workers' exits          worker3 killed:
        worker1 killed:                               Healer.replace(3) -> Joining(fresh id)
          Healer.replace(1) -> Joining(fresh id)      start worker3 again, attempt 1
          start worker1 again, attempt 1            worker2 killed past --max-restarts K:
      every 0.25 s: the store's "failed" <─────────── "failed" = "worker 'worker2' ... SIGKILL"
        -> stop its workers, seen/0, exit 1           stop its workers, seen/1, exit 1
      (node 0 waits for seen/<n>: its store must outlive the others' reads)

A worker that exits 0 once the world ends (the heal state's "ending") is
done; each launcher exits 0 when all of its workers are, and node 0's waits
for the others' left/<n> first, since its store serves their leave. A
signal (Ctrl-C, SIGTERM) stops this node's workers, says so in one line and
exits 128 + the signal; the workers also end with a launcher that is killed
(`_parent`). With --elastic, node 0's launcher also serves the members'
changes and each launcher starts its added workers (`_node_changes`); a
signal to another node's launcher makes its workers leave instead.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch.distributed as dist

from .._core import _membership, _polling, _records, _rendezvous
from .._core._environ import NODE_VARIABLE
from .._core._errors import RendezvousError, describe_exit
from .._core._membership import Joining, torch_name
from .._core._torch import PrefixStore, Store
from . import _parent
from ._healer import Healer
from ._launched import JOINING_VARIABLE, NAME_VARIABLE, RESTART_VARIABLE
from ._node_changes import JOIN_S, NodeChanges
from ._plan import Plan, plan
from ._quiet import Quiet, quieted
from ._replacing import Ended, Exit, Replacer, spent
from ._signals import Signals, Stopped, say_stopped, stop_on_signals, stop_reason

__all__ = ("run",)

TAG = "0"  # the world's key space: one world per launch
_POLL_S = 0.05  # how often a launcher looks at its workers
_STORE_EVERY_S = 0.25  # ... and at the store (a failure on another node)
_LINGER_S = 5.0  # how long node 0 keeps its store for the others to read a failure
_END_WAIT_S = 60.0  # ... and for the other nodes' workers to leave at the end
_KILLED_S = 5.0  # how long a SIGKILLed worker may take to be gone
# Raised by a store operation when node 0's launcher (the store's host) has ended.
_STORE_GONE = (RuntimeError, dist.DistNetworkError)


def run(args: argparse.Namespace, nproc: int) -> int:
    """Run this node's `nproc` workers, healing them in place; the launcher's exit status."""
    chosen = plan(args, nproc)
    node: Node | None = None
    with stop_on_signals() as signals:
        try:
            node = Node(chosen, _store(chosen), signals)
            node.start_all()
            return node.watch()
        except RendezvousError as exc:
            print(f"asyncrpc-launch: {exc}", file=sys.stderr, flush=True)
            return 1
        except Stopped as stop:
            if node is None or (node.plan.join and node.plan.node < 0):  # not in the world
                return say_stopped(stop.number)
            if node.grow is not None and node.plan.node > 0:  # a preemption: leave, gracefully
                return _leave(node, stop.number)
            node.stop_workers(stop.number)
            return node.stopped(stop.number)
        finally:
            if node is not None and node.grow is not None:
                node.grow.close()
            if node is not None:
                node.close()


def _leave(node: Node, number: int) -> int:
    """This node's workers leave the world; if they cannot (node 0 gone), they are stopped."""
    assert node.grow is not None
    try:
        return node.grow.leave(number)
    except (RendezvousError, *_STORE_GONE) as exc:
        print(f"asyncrpc-launch: this node's workers could not leave the world gracefully "
              f"({exc}); they were stopped", file=sys.stderr, flush=True)  # fmt: skip
        node.stop_workers(number)
        with contextlib.suppress(*_STORE_GONE):
            node.space.set(f"left/{node.plan.node}", "1")
        return say_stopped(number)


def _caller_stderr() -> Connection | None:
    """A copy of this launcher's stderr, where `Quiet` writes the workers' (None: closed)."""
    try:
        return Connection(os.dup(2), readable=False)
    except OSError:
        return None


def _store(chosen: Plan) -> Store:
    timeout = 600.0
    if chosen.node == 0 and not chosen.join:
        return _rendezvous.host_store(chosen.host, chosen.port, timeout)
    # `--join`: the world runs already; its node 0 answers within JOIN_S or not at all.
    reach = JOIN_S if chosen.join else timeout
    return _rendezvous.client_store(chosen.host, chosen.port, timeout, reach)


class Node:
    """One launcher's workers, and what it knows of the world through the store."""

    def __init__(self, chosen: Plan, store: Store, signals: Signals) -> None:
        self.plan = chosen
        self.signals = signals
        # Every worker process this launcher started, listed as it starts (`spawn`).
        self.started: list[subprocess.Popen[bytes]] = []
        self.store = store
        self.port = int(getattr(store, "port", chosen.port))  # node 0, port 0: the one bound
        self.heal = _membership.heal_space(store, TAG)
        self.space = PrefixStore(f"asyncrpc/{TAG}/nodes/", store)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.healer: Healer | None = None
        self.first = chosen.node * chosen.nproc  # the rank of local worker 0
        self.size = chosen.nnodes * chosen.nproc  # the world's as it formed (--join: node 0's)
        self.tag = TAG
        self.grow = NodeChanges(self, chosen.max_world_size) if chosen.elastic else None
        self.replacer = Replacer(self)  # what each end of a worker means (`_replacing`)
        self.running: set[int] = set()  # this node's first workers still running, by local
        # The workers' stderr through this launcher (`_quiet`): torch's warnings about the
        # processes that ended here (torch names), the names that left the world (never
        # given again) and, once it ends, any, are dropped.
        self.torch_ids: dict[int, int] = {}  # pid -> torch id, of each worker started here
        self.gone: set[str] = set()
        self.left_names: frozenset[str] = frozenset()
        self.ending = False
        self._stderr = _caller_stderr() if quieted() else None
        self.quiet = None if self._stderr is None else Quiet(self._stderr, self._gone)
        if self.grow is not None and self.quiet is not None:
            self.grow.spare.stderr = self.quiet.writer.fileno()

    def start_all(self) -> None:
        if self.grow is not None and self.plan.join:  # its workers come as node 0 orders
            number, self.size = self.grow.join()
            self.plan = self.plan._replace(node=number)
            self.first = len(self.procs)
            return
        if self.grow is not None and self.plan.node == 0:
            self.grow.open()
        for local in range(self.plan.nproc):
            self.procs.append(self._start(local, Joining(self.first + local, TAG, False), 0))

    def _start(self, local: int, joining: Joining, attempt: int) -> subprocess.Popen[bytes]:
        size = self.size
        return self.spawn(self.first + local, local, joining._replace(size=size), attempt, size)

    def spawn(
        self,
        rank: int,
        local: int,
        joining: Joining,
        attempt: int,
        size: int,
        name: str | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start the worker of `rank` (`name`: an added worker's, with a rank of its own)."""
        env = dict(os.environ)
        env.update(
            RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(size),
            LOCAL_WORLD_SIZE=str(self.plan.nproc), GROUP_RANK=str(self.plan.node),
            ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(size), ROLE_NAME="default",
            MASTER_ADDR=self.plan.host, MASTER_PORT=str(self.port),
            TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT=str(attempt),
            TORCHELASTIC_MAX_RESTARTS=str(self.plan.max_restarts),
            **{RESTART_VARIABLE: "worker", _parent.LAUNCHER_VARIABLE: str(os.getpid()),
               JOINING_VARIABLE: f"{joining.torch_id},{joining.tag},{int(joining.replacement)},"
                                 f"{joining.size}",
               NODE_VARIABLE: str(self.plan.node)},
        )  # fmt: skip
        if name is not None:
            env[NAME_VARIABLE] = name
        with self.signals.held():  # a signal now is raised once it is listed (`stop_workers`)
            proc = self._popen(env, added=name is not None)
            self.started = [p for p in self.started if p.poll() is None] + [proc]  # bounded
        self.torch_ids[proc.pid] = joining.torch_id
        return proc

    def _popen(self, env: dict[str, str], added: bool) -> subprocess.Popen[bytes]:
        if added and self.grow is not None:  # an added worker: the spare, if any
            warm = self.grow.spare.use(env)
            self.grow.spare.start()  # the next one's
            if warm is not None:
                return warm
        # A session of its own: a terminal's Ctrl-C reaches this launcher, which stops them.
        stderr = None if self.quiet is None else self.quiet.writer.fileno()
        return subprocess.Popen(self.plan.command, env=env, start_new_session=True,
                                stderr=stderr)  # fmt: skip

    def watch(self) -> int:
        """Heal this node's workers until each is done; the exit status (0, or 1: failed)."""
        self.running = set(range(len(self.procs)))
        next_look = time.monotonic() + _STORE_EVERY_S
        while self.running or self.replacer.later or self._serving():
            try:
                for local in sorted(self.running):
                    code = self.procs[local].poll()
                    if code is None:
                        continue
                    self.running.discard(local)  # until a replacement runs (`start`)
                    failure = self._ended(local, code)
                    if failure is not None:
                        return self._failed(failure, own=True)
                self.replacer.start_due()
                if self.grow is not None:
                    self.grow.turn()
            except _STORE_GONE as exc:
                return self._failed(self._store_gone(exc), own=False)
            if time.monotonic() >= next_look:
                next_look = time.monotonic() + _STORE_EVERY_S
                self._look_gone()
                elsewhere = self._failure_elsewhere()
                if elsewhere is not None:
                    return self._failed(elsewhere, own=False)
            time.sleep(_POLL_S)
        return self._done()

    def _serving(self) -> bool:
        """Whether this launcher has work with its first workers done: added ones, or serving."""
        return self.grow is not None and self.grow.keeps_running()

    def _ended(self, local: int, code: int) -> str | None:
        """This node's worker `local` ended (`code`): None, or the failure that ends the world."""
        rank, how = self.first + local, describe_exit(code)
        names = self._names()
        self.went(self.procs[local], names[rank] if names else "")
        who = f"{self._describe(local)} {how}"
        end = Ended(rank, names[rank] if names else "", code, who, how)
        verdict = self.replacer.ended(end)
        self.ending = self.ending or verdict.exit is Exit.DONE
        if verdict.exit is Exit.DONE and self.grow is not None:
            self.grow.dead(end.name)  # node 0 waits for no word from it any more
        if verdict.exit is Exit.UNFORMED:
            # The others wait for it in the world's start: nothing ran yet, nothing to heal.
            return (f"{who} while the world was starting (before every worker was ready), "
                    f"which cannot replace it; start the run again")  # fmt: skip
        if verdict.exit is not Exit.FAILED:
            return None
        limit = self.plan.max_restarts
        if verdict.reason == "ending":
            return f"{who} while the world was ending"
        if limit == 0:  # --elastic alone: no restarts
            return (f"{who}, which ends the world (launch with --max-restarts K to "
                    f"replace a dead worker in place)")  # fmt: skip
        return f"{who}; {spent(limit, 0, f'--max-restarts {limit}')}, so this failure ends it"

    # ---- what the heal algorithm asks of this launcher (`_replacing.Supervised`) -------

    def left(self, end: Ended) -> bool:
        return self.grow is not None and self.grow.took_exit(end.rank, end.code)

    def grows(self) -> bool:
        return self.grow is not None

    def lost(self, end: Ended) -> None:
        assert self.grow is not None
        print(f"asyncrpc-launch: {end.summary}; it left the world, which goes on without it "
              f"(launch with --max-restarts K --restart worker to replace dead workers in "
              f"place)", file=sys.stderr, flush=True)  # fmt: skip
        self.grow.report(end.name, end.how)

    def start(self, rank: int, joining: Joining, attempt: int) -> None:
        local = rank - self.first
        self.procs[local] = self._start(local, joining, attempt)
        self.running.add(local)

    def retire(self, rank: int) -> None:
        """Nothing to let go of: a subprocess holds no descriptor of this launcher's."""

    def stop_joining(self, names: set[str], stopping: Callable[[str], None]) -> list[str]:
        """Kill this node's workers still joining: torch's join may wait for the dead one.

        Its first workers' replacements start again (`Healer.retry`: not
        counted); its added workers fail to join (their add raises): none stays.
        """
        assert self.healer is not None
        stopped = []
        for local, proc in enumerate(self.procs):
            name = self.healer.names[self.first + local]
            if name in names and proc.poll() is None:
                stopping(name)
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(_KILLED_S)  # dead before its name is forgotten
                stopped.append(name)
        if self.grow is not None:
            for name in self.grow.stop_joining(names):
                self.grow.report(name, "was stopped as it joined: another worker died meanwhile")
        return stopped

    def formed_healer(self) -> Healer | None:
        """The healer of this node's world once it formed (it replaces and adds), else None."""
        if self.healer is None:
            names = self._names()
            if names is None or not _records.formed(self.heal, names[: self.size]):
                return None
            self._new_healer(names)
        return self.healer

    def _new_healer(self, names: tuple[str, ...]) -> None:
        self.healer = Healer(self.store, TAG, names[: self.size], self.plan.max_restarts)
        self.healer.alive = self._runs
        if len(names) > self.size:  # added since it formed
            self.healer.refresh()

    def world_ended(self) -> bool:
        """True once the world ends, or when it never formed (a script without asyncrpc.run)."""
        return not self.heal.check(["names"]) or bool(_records.read_state(self.heal)["ending"])

    def _describe(self, local: int) -> str:
        rank = self.first + local
        names = self._names()
        where = f"node {socket.gethostname()}, pid {self.procs[local].pid}"
        if not names:  # it died before the world's names were known
            return f"the worker of rank {rank} ({where})"
        return f"worker {names[rank]!r} (rank {rank}, {where})"

    def _names(self) -> tuple[str, ...] | None:
        if self.healer is not None:
            if self.grow is not None:
                self.healer.refresh()  # members another launcher added
            return tuple(self.healer.names)
        if not self.heal.check(["names"]):
            return None
        return _records.read_names(self.heal, 1.0)

    def _runs(self, name: str) -> bool:
        """Whether this node's process for `name` still runs (True for other nodes' names)."""
        assert self.healer is not None
        if self.grow is not None and name in self.grow.extras:
            return self.grow.extras[name].poll() is None
        local = self.healer.names.index(name) - self.first
        return not 0 <= local < len(self.procs) or self.procs[local].poll() is None

    # ---- the workers' stderr (`_quiet`) ------------------------------------------------

    def went(self, proc: subprocess.Popen[bytes], name: str) -> None:
        """`name`'s process `proc`, started here, ended: torch's warnings about it are noise."""
        torch_id = self.torch_ids.pop(proc.pid, None)
        if torch_id is not None and name:
            self.gone.add(torch_name(name, torch_id, self.size))

    def _gone(self, torch: str) -> bool:
        """Whether the process torch knows as `torch` ended or is leaving (`Quiet` asks)."""
        return self.ending or torch in self.gone or torch.partition(":")[0] in self.left_names

    def _look_gone(self) -> None:
        """Read who left the world (removed, preempted, dead), and whether it ends."""
        with contextlib.suppress(*_STORE_GONE):
            state = _records.read_state(self.heal)
            self.left_names = frozenset(state.get("left", ()))
            self.ending = self.ending or bool(state.get("ending"))

    def close(self) -> None:
        """Every worker of this launcher has ended: their last output, then its pipe."""
        if self.quiet is not None:
            self.ending = True  # whatever torch said last is about processes gone
            self.quiet.close()
        if self._stderr is not None:
            self._stderr.close()

    def _failure_elsewhere(self) -> str | None:
        try:
            return self.space.get("failed").decode() if self.space.check(["failed"]) else None
        except _STORE_GONE as exc:
            return self._store_gone(exc)

    def _store_gone(self, exc: BaseException) -> str:
        return (f"the world's store at {self.plan.host}:{self.port} is gone ({exc}); "
                f"node 0's launcher has ended")  # fmt: skip

    def _failed(self, record: str, own: bool) -> int:
        """End this node on a failure: say it in one line, stop the workers, tell the others."""
        with contextlib.suppress(*_STORE_GONE):
            if own:
                self.space.compare_set("failed", "", record)
            self.space.set(f"seen/{self.plan.node}", "1")
        if own:
            print(f"asyncrpc-launch: {record}", file=sys.stderr, flush=True)
        else:
            print(f"asyncrpc-launch: {record}; this node's workers were stopped",
                  file=sys.stderr, flush=True)  # fmt: skip
        self.stop_workers(signal.SIGTERM)
        self._linger("seen", _LINGER_S)
        return 1

    def _done(self) -> int:
        with contextlib.suppress(*_STORE_GONE):
            self.space.set(f"left/{self.plan.node}", "1")
        if self.plan.node == 0 and not self._linger("left", _END_WAIT_S):
            elsewhere = self._failure_elsewhere()
            if elsewhere is not None:
                print(f"asyncrpc-launch: {elsewhere}", file=sys.stderr, flush=True)
                return 1
        return 0

    def _linger(self, what: str, timeout: float) -> bool:
        """Node 0: wait (bounded) until every other node set `what/<node>`; False on a failure."""
        if self.plan.node != 0:
            return True
        nodes = int(self.heal.add("nodes", 0)) if self.grow is not None else self.plan.nnodes
        keys = [f"{what}/{n}" for n in range(1, max(nodes, self.plan.nnodes))]

        def seen() -> str:
            if not keys or self.space.check(keys):
                return "all"
            return "failed" if what == "left" and self.space.check(["failed"]) else ""

        return _polling.within(seen, timeout) != "failed"

    def stopped(self, number: int) -> int:
        """After a signal stopped this node: the other nodes told, one line; 128 + the signal."""
        where = f"asyncrpc-launch on node {self.plan.node} ({socket.gethostname()})"
        with contextlib.suppress(*_STORE_GONE):
            self.space.compare_set("failed", "", f"{where} was {stop_reason(number)}")
        return say_stopped(number)

    def stop_workers(self, number: int) -> None:
        """Send `number` to the workers still running; SIGKILL those left after a grace period.

        Every process this launcher started (`started`), also one a signal
        stopped the launcher from listing among its workers.
        """
        live = [proc for proc in self.started if proc.poll() is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(number)
        deadline = time.monotonic() + _parent.KILL_AFTER_S
        for proc in live:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
