"""The lifetimes of put values, as a property, in a world that heals (hypothesis, stateful).

    python tests/programs/objects_lifetime.py [EXAMPLES] [STEPS]

worker0 drives a random sequence of steps against a model of who holds
which ref: a worker puts a value (the driver takes the ref), the driver
passes a ref to a worker that keeps it, the driver or a keeper drops one,
a worker is killed (SIGKILL, at most once per example: each costs a heal;
its replacement joins under the same name), and every ref held is read. After
each step:

- each worker keeps exactly the values put there, since it last started,
  that a ref somewhere still holds (`asyncrpc-top`'s count, eventually:
  torch drops a value once the owner hears of the last delete);
- every ref reads as the value it was put with, or, when its owner was
  killed since, raises ObjectLostError naming that owner.

Then thousands of puts and drops, and each worker's memory (RSS) and
count come back to where they were. Prints one line per check, "FAILED"
in any that fails.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

import asyncrpc

WORKERS = ("worker1", "worker2", "worker3")
KEPT: dict[int, asyncrpc.ObjectRef[torch.Tensor]] = {}  # on each worker: the refs it keeps
HEALED = threading.Semaphore(0)
LIVES = dict.fromkeys(WORKERS, 0)  # on the driver: how often each worker was replaced
NEXT = [0]
KILLED = [0]


def check(name: str, ok: bool, detail: object = "") -> None:
    print(f"{name}: {'ok' if ok else f'FAILED {detail}'}", flush=True)


# ---- on the workers --------------------------------------------------------------------


def put_here(n: int, size: int = 256) -> asyncrpc.ObjectRef[torch.Tensor]:
    return asyncrpc.put(torch.full((size,), float(n)))


def keep(i: int, refs: list[asyncrpc.ObjectRef[torch.Tensor]]) -> None:
    KEPT[i] = refs[0]


def drop(i: int) -> None:
    del KEPT[i]


def kept_here() -> int:
    from asyncrpc._core import _activity

    gc.collect()
    return _activity.held()["kept"]


def rss_mb() -> float:
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def read(refs: list[asyncrpc.ObjectRef[torch.Tensor]]) -> str:
    try:
        return f"value {float(asyncrpc.get(refs[0], timeout=30)[0])}"
    except asyncrpc.ObjectLostError as exc:
        return f"lost {exc.name}"


# ---- the driver ------------------------------------------------------------------------


class Lifetimes(RuleBasedStateMachine):
    """The model: each ref's owner, value, the owner's life it was put in, who holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, asyncrpc.ObjectRef[torch.Tensor]] = {}  # the driver's
        self.put_in: dict[int, tuple[str, int, int]] = {}  # i -> (owner, life, value)
        self.keepers: dict[int, set[str]] = {}  # i -> workers keeping it
        self.lives = dict(LIVES)  # the workers' lives so far (kills in earlier examples)
        self.next = NEXT[0]
        self.kills_left = 1

    def teardown(self) -> None:  # nothing of this example stays for the next
        for i, keepers in self.keepers.items():
            for worker in keepers:
                asyncrpc.rpc_sync(worker, drop, args=(i,))
        self.refs.clear()

    @rule(owner=st.sampled_from(WORKERS))
    def put(self, owner: str) -> None:
        i, self.next = self.next, self.next + 1
        NEXT[0] = self.next  # refs of earlier examples never share a number
        self.refs[i] = asyncrpc.rpc_sync(owner, put_here, args=(i,))
        self.put_in[i] = (owner, self.lives[owner], i)
        self.keepers[i] = set()

    @rule(data=st.data(), to=st.sampled_from(WORKERS))
    def pass_on(self, data: st.DataObject, to: str) -> None:
        if not self.refs:
            return
        i = data.draw(st.sampled_from(sorted(self.refs)))
        owner, life, _ = self.put_in[i]
        if life == self.lives[owner]:
            asyncrpc.rpc_sync(to, keep, args=(i, [self.refs[i]]))
            self.keepers[i].add(to)
            return
        try:  # its owner died: refused as it is sent, naming the owner
            asyncrpc.rpc_sync(to, keep, args=(i, [self.refs[i]]))
        except asyncrpc.ObjectLostError as exc:
            assert exc.name == owner, (exc.name, owner)
        else:
            raise AssertionError(f"a ref of {owner}, killed since, was passed on")

    @rule(data=st.data())
    def drop_mine(self, data: st.DataObject) -> None:
        if self.refs:
            del self.refs[data.draw(st.sampled_from(sorted(self.refs)))]

    @rule(data=st.data())
    def drop_kept(self, data: st.DataObject) -> None:
        held = sorted((i, w) for i, ws in self.keepers.items() for w in ws)
        if held:
            i, worker = data.draw(st.sampled_from(held))
            asyncrpc.rpc_sync(worker, drop, args=(i,))
            self.keepers[i].discard(worker)

    @rule(victim=st.sampled_from(WORKERS))
    def kill(self, victim: str) -> None:
        if self.kills_left == 0:  # one per example at most: each costs a heal (seconds)
            return
        self.kills_left -= 1
        KILLED[0] += 1
        os.kill(asyncrpc.rpc_sync(victim, os.getpid), signal.SIGKILL)
        assert HEALED.acquire(timeout=90), f"{victim} was not replaced"
        self.lives[victim] += 1
        LIVES[victim] += 1
        for keepers in self.keepers.values():
            keepers.discard(victim)  # what it kept died with it

    def _alive(self, i: int) -> bool:
        return i in self.refs or bool(self.keepers.get(i))

    @invariant()
    def each_worker_keeps_exactly_what_a_ref_holds(self) -> None:
        for worker in WORKERS:
            owned = sum(
                1
                for i, (owner, life, _) in self.put_in.items()
                if owner == worker and life == self.lives[worker] and self._alive(i)
            )
            deadline = time.monotonic() + 20
            while (now := asyncrpc.rpc_sync(worker, kept_here)) != owned:
                if time.monotonic() > deadline:
                    model = {i: (self.put_in[i], i in self.refs, sorted(self.keepers[i]))
                             for i in self.put_in}  # fmt: skip
                    message = f"{worker} keeps {now}, refs hold {owned}: {model} {self.lives}"
                    print(message, flush=True)
                    raise AssertionError(message)
                # A ref refused as it was sent (its owner died) is held by its error's
                # frames, a cycle, until gc runs here as it would in any program.
                gc.collect()
                time.sleep(0.05)

    @invariant()
    def every_ref_reads_its_value_or_names_its_lost_owner(self) -> None:
        for i, ref in self.refs.items():
            owner, life, value = self.put_in[i]
            reader = WORKERS[i % len(WORKERS)]
            try:
                got = asyncrpc.rpc_sync(reader, read, args=([ref],))
            except asyncrpc.ObjectLostError as exc:  # a lost ref is refused as it is sent
                got = f"lost {exc.name}"
            want = f"value {float(value)}" if life == self.lives[owner] else f"lost {owner}"
            assert got == want, (i, owner, got, want)


def flat_over_many_puts(rounds: int) -> None:
    """Thousands of puts passed on and dropped: counts and memory come back."""
    before = {w: asyncrpc.rpc_sync(w, rss_mb) for w in WORKERS}
    for n in range(rounds):
        owner, keeper = WORKERS[n % 3], WORKERS[(n + 1) % 3]
        ref = asyncrpc.rpc_sync(owner, put_here, args=(n, 16_384))  # 64 KiB each
        asyncrpc.rpc_sync(keeper, keep, args=(n, [ref]))
        asyncrpc.rpc_sync(keeper, drop, args=(n,))
        del ref
    deadline = time.monotonic() + 30
    while any(asyncrpc.rpc_sync(w, kept_here) for w in WORKERS) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.1)
    kept = {w: asyncrpc.rpc_sync(w, kept_here) for w in WORKERS}
    check(f"{rounds} puts passed on and dropped: nothing kept", not any(kept.values()), kept)
    grown = {w: asyncrpc.rpc_sync(w, rss_mb) - before[w] for w in WORKERS}
    check(f"{rounds} puts of 64 KiB: memory grew < 32 MB", max(grown.values()) < 32, grown)


def main(ctx: asyncrpc.Context, examples: int, steps: int) -> None:
    if ctx.rank != 0:
        return
    asyncrpc.on_replaced(lambda replaced: HEALED.release())
    # No shrinking: a failing sequence is reported as it ran (each replay would kill again).
    chosen = settings(
        max_examples=examples, stateful_step_count=steps, deadline=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate], database=None,
    )  # fmt: skip
    try:
        run_state_machine_as_test(Lifetimes, settings=chosen)
    except Exception as exc:
        check("lifetimes follow the refs", False, f"{type(exc).__name__}: {exc}")
    else:
        check("lifetimes follow the refs", True)
    check("workers killed on the way", KILLED[0] > 0, KILLED[0])
    print(f"{KILLED[0]} workers killed, {NEXT[0]} puts", flush=True)
    flat_over_many_puts(2000)


if __name__ == "__main__":
    arguments: list[Any] = [int(a) for a in sys.argv[1:3]] or [10, 12]
    asyncrpc.run(main, world_size=4, restart="worker", max_restarts=100, args=tuple(arguments))
