"""Peer liveness: heartbeats in the store the world already has (launched and `init` worlds).

A launcher stops the workers on its own node when one dies, but nothing tells
the workers on other nodes, and torch's RPC only notices a dead peer when a
call to it fails. So every launched worker beats in the world's store and
watches everyone else's beat, with or without calls in flight::

    worker r (thread "asyncrpc-liveness", every `interval` s)
      |--- add beat/r, 1 ------------------------> store (node 0)
      |<-- beats of every rank, failed, left/* ----|
      |    a beat unchanged for `timeout` s, and that rank has not left:
      |--- compare_set failed = "<who, where, why>"   (the first report wins)
      `--> print the report, exit 1: this node's launcher ends (or restarts) too

A worker that raises writes the same `failed` record itself (`report`), and
one that finishes marks `left/r` before it stops beating. If the store itself
is gone (node 0 ended), the world is over and every worker leaves.

In a world joined with `init` (processes the program manages) a failure is
only recorded: calls to the dead peer fail on their own, and a graceful
shutdown, which would otherwise wait for it forever, raises instead
(`meet_to_leave`): every worker counts itself leaving in the store, and the
wait for the others ends with the first failure seen.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from . import _polling
from ._errors import describe_exit
from ._torch import PrefixStore, Store

__all__ = ["Liveness", "describe", "leave_world", "report_exits"]

INTERVAL_S = 0.5
TIMEOUT_S = 3.0
_ALL_LEAVING = "every worker is leaving"  # `meet_to_leave` met them all
# Raised by a store operation when the process hosting the store has ended.
_STORE_GONE = (RuntimeError, dist.DistNetworkError)


def _space(store: Store, tag: str) -> Store:
    """The keys of one attempt's liveness: beats, node descriptions, failed, left, seen."""
    return PrefixStore(f"asyncrpc/{tag}live/", store)


def describe(name: str, rank: int) -> str:
    """How a report names a worker: name, rank, node and process id."""
    return f"worker {name!r} (rank {rank}, node {socket.gethostname()}, pid {os.getpid()})"


class Liveness:
    """Beats for this worker and watches the others' beats until `stop`."""

    def __init__(
        self,
        store: Store,
        rank: int,
        names: tuple[str, ...],
        tag: str,
        *,
        interval: float = INTERVAL_S,
        timeout: float = TIMEOUT_S,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.space = _space(store, tag)
        self.rank, self.names = rank, names
        self.interval, self.timeout = interval, timeout
        self.on_failure = on_failure or leave_world
        self.failure: str | None = None  # the first failure seen, once one is
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="asyncrpc-liveness", daemon=True)
        self.space.set(f"node/{rank}", describe(names[rank], rank))
        self.space.add(f"beat/{rank}", 1)

    def start(self) -> Liveness:
        self._thread.start()
        return self

    def report(self, why: str, defer: bool = False) -> str:
        """Record this worker's own failure (best effort); returns the record that won.

        With `defer`, first wait up to `timeout` s for another record (the cause).
        """
        if defer:
            _wait_for(self.space, ["failed"], self.timeout)
        return _claim(self.space, f"{describe(self.names[self.rank], self.rank)} {why}")

    def stop(self, left: bool = True) -> None:
        """Stop beating; with `left`, peers know this worker ended on purpose."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        if left:
            try:
                self.space.set(f"left/{self.rank}", "1")
            except _STORE_GONE:
                pass  # the store's host has already ended: nobody is left to tell

    def _run(self) -> None:
        ranks = [r for r in range(len(self.names)) if r != self.rank]
        beats = {f"beat/{r}": r for r in ranks}
        last: dict[int, tuple[bytes, float]] = {}
        for key in beats:
            self.space.add(key, 0)  # create it, so multi_get never waits for a key
        while not self._stop.wait(self.interval):
            try:
                self.space.add(f"beat/{self.rank}", 1)
                record = self._check(beats, last)
            except _STORE_GONE as error:
                if self._stop.is_set():
                    return
                record = f"the world's store is gone ({error}); node 0 has ended"
            if record is not None:
                with contextlib.suppress(*_STORE_GONE):
                    self.space.set(f"seen/{self.rank}", "1")  # the reporting launcher waits
                self.failure = record
                self.on_failure(record)
                return

    def meet_to_leave(self, timeout: float = 0) -> str | None:
        """Count this worker leaving; wait until every worker is, or a failure is seen.

        Returns the failure (a peer stopped beating: killed, or hung), or None
        when all are leaving. `timeout` > 0 bounds the wait (then None: the
        shutdown that follows reports its own timeout); 0 waits while peers live.
        """

        def met() -> str | None:
            if int(self.space.add("leaving", 0)) >= len(self.names):
                return _ALL_LEAVING
            return self.failure

        try:
            self.space.add("leaving", 1)
            seen = _polling.within(met, timeout if timeout > 0 else None)
        except _STORE_GONE:
            return None  # the store's host has left: the world is over for everyone
        return None if seen is _ALL_LEAVING else seen

    def _check(self, beats: dict[str, int], last: dict[int, tuple[bytes, float]]) -> str | None:
        if self.space.check(["failed"]):
            return self.space.get("failed").decode()
        now = time.monotonic()
        for value, rank in zip(self.space.multi_get(list(beats)), beats.values(), strict=True):
            seen, since = last.get(rank, (b"", now))
            if value != seen:
                last[rank] = (value, now)
            elif now - since > self.timeout and not self.space.check([f"left/{rank}"]):
                where = self.space.get(f"node/{rank}").decode()
                silent = f"stopped beating {now - since:.1f} s ago (killed, or hung)"
                return _claim(self.space, f"{where} {silent}")
        return None


def _claim(space: Store, record: str) -> str:
    """Write `record` as the world's failure unless one is there; returns the one that won."""
    try:
        return space.compare_set("failed", "", record).decode()
    except _STORE_GONE:
        return record  # the store ended with node 0: nobody is left to tell


def report_exits(
    store: Store, tag: str, failed: list[tuple[int, int, int]], elsewhere: list[int]
) -> None:
    """A launcher's report of its workers' exits: to stderr, and to the world's store.

    The launcher on node 0 hosts the store and ends right after this: it first
    gives the workers of ranks `elsewhere` (other nodes) up to `timeout` s to read it.
    """
    space = _space(store, tag)
    for rank, pid, exitcode in failed:
        try:
            key = f"node/{rank}"
            who = space.get(key).decode() if space.check([key]) else f"rank {rank} (pid {pid})"
        except _STORE_GONE:
            who = f"rank {rank} (pid {pid})"
        record = f"{who} {describe_exit(exitcode)}"
        first = _claim(space, record)
        if first == record:
            print(f"asyncrpc: {record}", file=sys.stderr, flush=True)
        elif exitcode != -signal.SIGTERM:  # SIGTERM: stopped by a launcher after `first`
            print(f"asyncrpc: {record}, after {first}", file=sys.stderr, flush=True)

    # Whoever wrote the record (this launcher, or a worker whose `main` raised,
    # which records its own failure before it exits), the other nodes' workers
    # must read it before the store ends with this launcher: else they see only
    # that the store is gone.
    if failed and elsewhere:
        _wait_for(space, [f"seen/{rank}" for rank in elsewhere], TIMEOUT_S)


def _wait_for(space: Store, keys: list[str], timeout: float) -> None:
    """Poll until every key is in the store, at most `timeout` s (or until the store ends)."""
    with contextlib.suppress(*_STORE_GONE):
        _polling.within(lambda: space.check(keys), timeout)


def leave_world(record: str) -> None:
    """Print `record` and end this process at once (a launched world's failure)."""
    print(f"asyncrpc: {record}; this worker leaves the world", file=sys.stderr, flush=True)
    sys.stdout.flush()
    # The main thread may be blocked in torch (a call, the shutdown barrier).
    os._exit(1)
