"""A learner's mixed traffic against actors killed over and over, in a world that heals.

    python tests/programs/heal_load.py KILLS [THREADS] [SEED]

`asyncrpc.run(main, world_size=5, restart="worker")`: worker0 is the referee
(it kills and measures), worker1 and worker2 are the survivors (the learner's
side: THREADS threads each), worker3 and worker4 the victims (actors). Each
survivor thread mixes, against the victims: `rpc_async`, `remote` +
`to_here`, handles (`spawn` + `call`, `call_async`, `call_remote`,
`stream`), `stream`, `Batch`, nested `async def` relays (a victim calls the
other survivor back, or an object of a survivor through a handle it was
passed), handles passed as arguments to the other survivor, a victim's
RRef of a torch operator handed to the other survivor at once (before its
owner confirmed it), and survivor-to-survivor calls (counted on both sides).

worker0 SIGKILLs a victim KILLS times, alternating, most with calls in
flight and every fourth with the survivors' traffic paused (no call in
flight: the OOM killer's case), and waits for each replacement. After each
heal it reads every survivor's pid, attempt, fds, sockets (CLOSE-WAIT
too), threads and RSS. At the end it prints one line, `heal load: {json}`,
with what was seen; tests/test_heal_load.py holds it to what the docs
promise. Every failure a survivor's thread sees is kept by type; one that
is not a `WorkerUnreachableError` (ObjectLostError included) is kept whole.

Two knobs, for measuring by hand: HEAL_LOAD_NO_KILL=1 runs the same rounds
and traffic without a death (the control for memory), and
HEAL_LOAD_SETTLE_S=N reads the survivors once more N s after the traffic
stopped (what torch still holds once its retries ran out). HEAL_LOAD_CHANNELS
picks TensorPipe's channels (`basic`; asyncrpc's default otherwise).
"""

from __future__ import annotations

import collections
import faulthandler
import functools
import gc
import json
import os
import random
import signal
import sys
import threading
import time
import traceback
from typing import Any

import torch

import asyncrpc

SURVIVORS = ("worker1", "worker2")
VICTIMS = ("worker3", "worker4")
WORLD_SIZE = 5
HEAL_S = 30.0  # a replacement joins within this
CALL_S = 20.0  # every call's timeout: a call that times out is a failure here
KINDS = ("rpc_async", "remote", "handle", "call_async", "call_remote", "handle_stream",
         "stream", "batch", "relay", "lend", "call_back", "peer", "pass_rref")  # fmt: skip

faulthandler.register(signal.SIGUSR1, all_threads=True)

# ---- what every worker serves ---------------------------------------------------------

STATE: dict[str, Any] = {"served": 0, "stop": False, "paused": False, "in_flight": 0}
LOCK = threading.Lock()


def pid() -> int:
    return os.getpid()


def attempt() -> int:
    return asyncrpc.current_context().attempt


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def served() -> int:
    """A survivor's count of the survivor-to-survivor calls it served."""
    with LOCK:
        STATE["served"] += 1
        return int(STATE["served"])


def count_up(n: int) -> Any:
    yield from range(n)


async def relay(survivor: str, x: torch.Tensor) -> torch.Tensor:
    """On a victim: call a survivor back, then answer (a nested async def call)."""
    back = await asyncrpc.rpc_async(survivor, double, args=(x,))
    return back + 1


def use_rref(rref: Any) -> Any:
    """Read an RRef passed as an argument (one a victim owns)."""
    return rref.to_here()


def use_handle(handle: asyncrpc.RemoteObject[Actor]) -> int:
    """Call the object of `handle` here (a handle passed as an argument)."""
    return int(handle.call("step", 1))


class Actor:
    """An actor's object: steps counted, rollouts streamed, a survivor's objects called."""

    def __init__(self) -> None:
        self.steps = 0

    def step(self, k: int) -> int:
        self.steps += k
        return self.steps

    def rollout(self, n: int) -> Any:
        for i in range(n):
            yield torch.full((4,), float(i))

    def call_back(self, handle: asyncrpc.RemoteObject[Actor]) -> int:
        """Call a survivor's object through a handle (a victim holds a survivor's RRef)."""
        return int(handle.call("step", 1))


def usage() -> dict[str, int]:
    """This process's pid, attempt, fds, sockets (and those in CLOSE-WAIT), threads, RSS."""
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    close_wait = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[9] in inodes and fields[3] == "08":
                close_wait += 1
    rrefs = torch._C._distributed_rpc._rref_context_get_debug_info()
    return {
        "rrefs": {key: int(value) for key, value in rrefs.items()},
        "objects": len(gc.get_objects()),
        "pid": os.getpid(),
        "attempt": asyncrpc.current_context().attempt,
        "fds": len(os.listdir("/proc/self/fd")),
        "sockets": len(inodes),
        "close_wait": close_wait,
        "threads": int(status["Threads"]),
        "rss_kb": int(status["VmRSS"].split()[0]),
    }


def pause(on: bool) -> int:
    """Pause (or resume) this survivor's traffic; the calls it has in flight."""
    STATE["paused"] = on
    return int(STATE["in_flight"])


def stop() -> None:
    STATE["stop"] = True


# ---- a survivor's traffic -------------------------------------------------------------


class Tally:
    """A survivor's outcomes: ok per kind, named failures per type, bare failures whole."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ok: collections.Counter[str] = collections.Counter()
        self.named: collections.Counter[str] = collections.Counter()
        self.bare: list[str] = []
        self.peer_calls = 0

    def failed(self, kind: str, exc: BaseException) -> None:
        with self.lock:
            if isinstance(exc, asyncrpc.WorkerUnreachableError):
                self.named[type(exc).__name__] += 1
            elif len(self.bare) < 20:
                text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                self.bare.append(f"{kind}: {text[:600]}")
            else:
                self.bare.append("...")
                del self.bare[20:]


def traffic(
    ctx: asyncrpc.Context,
    tally: Tally,
    seed: int,
    victims: tuple[str, ...] = VICTIMS,
    other: str | None = None,
) -> None:
    """One thread's mixed calls against `victims` until `stop()` (`other`: a survivor)."""
    rng = random.Random(seed)
    if other is None:
        other = SURVIVORS[1 - SURVIVORS.index(ctx.name)]
    mine = asyncrpc.spawn(ctx.name, Actor).options(timeout=CALL_S)  # lent to victims
    handles: dict[str, asyncrpc.RemoteObject[Actor]] = {}
    x = torch.ones(3)
    kinds = tuple(os.environ.get("HEAL_LOAD_KINDS", "").split(",")) if os.environ.get(
        "HEAL_LOAD_KINDS") else KINDS  # fmt: skip
    while not STATE["stop"]:
        if STATE["paused"]:
            time.sleep(0.005)
            continue
        kind = rng.choice(kinds)
        victim = rng.choice(victims)
        with LOCK:
            STATE["in_flight"] += 1
        try:
            _one(kind, victim, victims, other, mine, handles, x, tally)
            with tally.lock:
                tally.ok[kind] += 1
        except Exception as exc:  # every failure is counted by what it is
            tally.failed(kind, exc)
            if isinstance(exc, asyncrpc.ObjectLostError):
                handles.pop(victim, None)
        finally:
            with LOCK:
                STATE["in_flight"] -= 1


def _handle(handles: dict[str, Any], victim: str) -> asyncrpc.RemoteObject[Actor]:
    if victim not in handles:
        handles[victim] = asyncrpc.spawn(victim, Actor).options(timeout=CALL_S)
    return handles[victim]


def _one(
    kind: str,
    victim: str,
    victims: tuple[str, ...],
    other: str,
    mine: asyncrpc.RemoteObject[Actor],
    handles: dict[str, Any],
    x: torch.Tensor,
    tally: Tally,
) -> None:
    if kind == "rpc_async":
        assert torch.equal(asyncrpc.rpc_async(victim, double, args=(x,), timeout=CALL_S).wait(),
                           x * 2)  # fmt: skip
    elif kind == "remote":
        rref = asyncrpc.remote(victim, double, args=(x,), timeout=CALL_S)
        assert torch.equal(rref.to_here(CALL_S), x * 2)
    elif kind == "handle":
        _handle(handles, victim).call("step", 1)
    elif kind == "call_async":
        _handle(handles, victim).call_async("step", 1).wait()
    elif kind == "call_remote":
        _handle(handles, victim).call_remote("step", 1).to_here(CALL_S)
    elif kind == "handle_stream":
        assert len(list(_handle(handles, victim).stream("rollout", 5))) == 5
    elif kind == "stream":
        assert list(asyncrpc.stream(victim, count_up, args=(6,), window=2)) == list(range(6))
    elif kind == "batch":
        with asyncrpc.Batch(timeout=CALL_S) as batch:
            futs = [batch.rpc_async(v, double, args=(x,)) for v in (*victims, other)]
        errors = []
        for fut in futs:
            try:
                fut.wait()
            except Exception as exc:  # each call of a Batch fails on its own
                errors.append(exc)
        if errors:
            raise errors[0]
    elif kind == "relay":
        out = asyncrpc.rpc_sync(victim, relay, args=(other, x), timeout=CALL_S)
        assert torch.equal(out, x * 2 + 1)
    elif kind == "lend":  # a victim's object, used by the other survivor through its handle
        asyncrpc.rpc_sync(other, use_handle, args=(_handle(handles, victim),), timeout=CALL_S)
    elif kind == "call_back":  # a victim calls this survivor's object through a handle
        _handle(handles, victim).call("call_back", mine)
    elif kind == "pass_rref":  # a victim's RRef of an operator, handed on at once
        rref = asyncrpc.remote(victim, torch.add, args=(x, 1), timeout=CALL_S)
        got = asyncrpc.rpc_sync(other, use_rref, args=(rref,), timeout=CALL_S)
        assert torch.equal(got, x + 1)
    elif kind == "peer":
        asyncrpc.rpc_sync(other, served, timeout=CALL_S)
        with tally.lock:
            tally.peer_calls += 1


def survive(ctx: asyncrpc.Context, threads: int, seed: int) -> dict[str, Any]:
    tally = Tally()
    workers = [
        threading.Thread(
            target=traffic, args=(ctx, tally, seed * 100 + i), name=f"traffic-{i}", daemon=True
        )
        for i in range(threads)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return {"ok": dict(tally.ok), "named": dict(tally.named), "bare": tally.bare,
            "peer_calls": tally.peer_calls}  # fmt: skip


RESULTS: dict[str, Any] = {}


def result() -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while "done" not in RESULTS and time.monotonic() < deadline:
        time.sleep(0.01)
    return RESULTS


# ---- the referee ----------------------------------------------------------------------


def referee(ctx: asyncrpc.Context, kills: int, seed: int) -> None:
    rng = random.Random(seed)
    events: list[asyncrpc.Replaced] = []
    changed = threading.Condition()

    def seen(event: asyncrpc.Replaced) -> None:
        with changed:
            events.append(event)
            changed.notify_all()

    asyncrpc.on_replaced(seen)
    first = {name: asyncrpc.rpc_sync(name, usage) for name in SURVIVORS}
    rounds: list[dict[str, Any]] = []
    heal_s: list[float] = []
    started = time.monotonic()
    for k in range(kills):
        victim = VICTIMS[k % 2]
        quiet = k % 4 == 3
        if quiet:
            _pause_traffic(True)
        victim_pid = _pid_of(victim)
        time.sleep(rng.uniform(0.0, 0.05))
        before = len([e for e in events if e.name == victim])
        killed_at = time.monotonic()
        if os.environ.get("HEAL_LOAD_NO_KILL"):  # the same traffic and rounds, no deaths
            time.sleep(0.15)
            rounds.append(
                {name: asyncrpc.rpc_sync(name, usage, timeout=CALL_S) for name in SURVIVORS}
            )
            if quiet:
                _pause_traffic(False)
            continue
        os.kill(victim_pid, signal.SIGKILL)
        with changed:
            replaced = functools.partial(_replaced_again, events, victim, before)
            if not changed.wait_for(replaced, HEAL_S):
                raise AssertionError(f"{victim} was not replaced within {HEAL_S} s (kill {k})")
        heal_s.append(time.monotonic() - killed_at)
        if quiet:
            _pause_traffic(False)
        try:
            rounds.append({name: asyncrpc.rpc_sync(name, usage, timeout=CALL_S)
                           for name in SURVIVORS})  # fmt: skip
            brief = {n: (r["fds"], r["sockets"], r["threads"]) for n, r in rounds[-1].items()}
            print(f"heal load round {k}: healed in {heal_s[-1]:.2f} s at "
                  f"{time.monotonic() - started:.1f} s; {brief}", flush=True)  # fmt: skip
        except asyncrpc.WorkerUnreachableError as exc:  # a survivor died: the end of it
            rounds.append({"error": str(exc)[:300]})
        if any(e.name in SURVIVORS for e in events) or "error" in rounds[-1]:
            break
    for name in SURVIVORS:
        _until_replaced(name)
        asyncrpc.rpc_sync(name, stop, timeout=CALL_S)
    tallies = {name: asyncrpc.rpc_sync(name, result, timeout=90) for name in SURVIVORS}
    settle_s = float(os.environ.get("HEAL_LOAD_SETTLE_S", "0"))
    if settle_s:  # quiet, then read again: what torch still holds once its retries ran out
        time.sleep(settle_s)
        rounds.append({name: asyncrpc.rpc_sync(name, usage, timeout=CALL_S) for name in SURVIVORS})
    served_counts = {
        name: asyncrpc.rpc_sync(name, _served_count, timeout=CALL_S) for name in SURVIVORS
    }
    heal_s.sort()
    summary = {
        "kills": kills,
        "seconds": round(time.monotonic() - started, 1),
        "heal_median_s": round(heal_s[len(heal_s) // 2], 3) if heal_s else None,
        "heal_max_s": round(heal_s[-1], 3) if heal_s else None,
        "first": first,
        "rounds": rounds,
        "tallies": tallies,
        "served": served_counts,
        "replaced": sorted({e.name for e in events}),
    }
    print("heal load: " + json.dumps(summary), flush=True)


def _replaced_again(events: list[asyncrpc.Replaced], name: str, before: int) -> bool:
    return len([e for e in events if e.name == name]) > before


def _served_count() -> int:
    return int(STATE["served"])


def _until_replaced(name: str) -> None:
    """Wait until `name` answers (a survivor that died answers once replaced)."""
    _pid_of(name)


def _pid_of(victim: str) -> int:
    deadline = time.monotonic() + HEAL_S
    while True:
        try:
            return int(asyncrpc.rpc_sync(victim, pid, timeout=CALL_S))
        except asyncrpc.WorkerUnreachableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _pause_traffic(on: bool) -> None:
    deadline = time.monotonic() + CALL_S
    while True:
        in_flight = sum(
            asyncrpc.rpc_sync(name, pause, args=(on,), timeout=CALL_S) for name in SURVIVORS
        )
        if not on or in_flight == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the survivors still had {in_flight} calls in flight")
        time.sleep(0.005)


def main(ctx: asyncrpc.Context, kills: int, threads: int, seed: int) -> None:
    if ctx.name in SURVIVORS:
        if ctx.attempt > 0:  # a survivor died: say so where the referee looks
            RESULTS.update({"died": f"{ctx.name} was replaced (attempt {ctx.attempt})",
                            "done": True})  # fmt: skip
            return
        RESULTS.update(survive(ctx, threads, seed))
        RESULTS["done"] = True
        return
    if ctx.rank == 0:
        referee(ctx, kills, seed)


if __name__ == "__main__":
    kills = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    channels = os.environ.get("HEAL_LOAD_CHANNELS")  # e.g. "basic" (default: asyncrpc's)
    options = {"channels": tuple(channels.split(","))} if channels else {}
    asyncrpc.run(
        main, world_size=WORLD_SIZE, args=(kills, threads, seed), max_restarts=kills + 10,
        restart="worker", rpc_timeout=CALL_S, **options,
    )  # fmt: skip
