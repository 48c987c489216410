"""The learner loop of docs/launching.md, as written, while its actors die under mixed traffic.

    python tests/programs/heal_learner.py [KILLS] [STEPS]

"Healing in place" in docs/launching.md shows a learner: `main` spawns an
`Actor` on every other worker, re-spawns it from `on_replaced`, and skips an
actor whose call raises `WorkerUnreachableError`. That block (the fragment
that defines `respawn`) runs here unchanged: this program gives it what it
leaves to the reader (`Actor`, `learn`, `steps`) and runs its `main` on
worker0, in a world of four that heals. Beside the loop, worker0 runs four
threads of tests/programs/heal_load.py's mixed traffic against the actors,
and a killer that SIGKILLs an actor KILLS times (each time once the one
before was replaced, paced by the loop's progress). Prints `heal learner:
{json}`: the steps the loop made, the rollouts it learned from, the kills,
and the traffic's outcomes.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import sys
import threading
import time
from typing import Any

import torch

import asyncrpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import heal_load

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "launching.md"
ACTORS = ("worker1", "worker2", "worker3")
HEAL_S = 30.0
LEARNED: list[int] = []  # the steps of the rollouts the loop learned from


def fragment() -> str:
    """The docs' learner: the fragment of launching.md that defines `respawn`."""
    blocks = re.findall(r"<!-- fragment -->\n```python\n(.*?)```", DOCS.read_text(), re.DOTALL)
    found = [block for block in blocks if "def respawn" in block]
    assert len(found) == 1, f"expected one learner fragment in {DOCS}, found {len(found)}"
    return found[0]


class Actor:
    """What the docs' learner calls: `rollout(step)` on each actor."""

    def rollout(self, step: int) -> torch.Tensor:
        return torch.full((8,), float(step))


def learn(rollout: torch.Tensor) -> None:
    LEARNED.append(int(rollout[0]))


# The docs' block, executed as written: its `main` is the learner.
DOCS_BLOCK: dict[str, Any] = {"__name__": "docs_learner", "asyncrpc": asyncrpc,
                              "Actor": Actor, "learn": learn}  # fmt: skip
exec(compile(fragment(), str(DOCS), "exec"), DOCS_BLOCK)


def main(ctx: asyncrpc.Context, kills: int, steps: int) -> None:
    if ctx.rank != 0:
        return  # an actor: serves calls
    if ctx.attempt > 0:
        print(f"heal learner FAILED: the learner was replaced (attempt {ctx.attempt})", flush=True)
        return
    DOCS_BLOCK["steps"] = steps
    tally = heal_load.Tally()
    threads = [
        threading.Thread(
            target=heal_load.traffic,
            args=(ctx, tally, i, ACTORS, ctx.name),
            name=f"traffic-{i}",
            daemon=True,
        )
        for i in range(4)
    ]
    done = threading.Event()
    killed: list[float] = []
    killer = threading.Thread(target=_kill, args=(kills, steps, done, killed), name="killer")
    for thread in [*threads, killer]:
        thread.start()
    started = time.monotonic()
    DOCS_BLOCK["main"](ctx)  # the docs' learner loop
    seconds = time.monotonic() - started
    done.set()
    heal_load.stop()
    for thread in [*threads, killer]:
        thread.join(60)
    summary = {
        "steps": steps,
        "learned": len(LEARNED),
        "last_step": max(LEARNED, default=-1),
        "kills": len(killed),
        "seconds": round(seconds, 1),
        "traffic": {"ok": dict(tally.ok), "named": dict(tally.named), "bare": tally.bare},
    }
    print("heal learner: " + json.dumps(summary), flush=True)


def _kill(kills: int, steps: int, done: threading.Event, killed: list[float]) -> None:
    """SIGKILL an actor `kills` times, round robin, paced by the loop's progress.

    Kill k comes once the loop has reached step (k + 1) * steps / (kills + 2),
    and once the actor killed before it was replaced.
    """
    every = steps / (kills + 2)
    for k in range(kills):
        while max(LEARNED, default=-1) < (k + 1) * every:
            if done.wait(0.005):
                return
        name = ACTORS[k % len(ACTORS)]
        try:
            victim = heal_load._pid_of(name)  # waits while it is replaced
            os.kill(victim, signal.SIGKILL)
            killed.append(time.monotonic())
            # One death at a time: with every actor away at once, the loop would
            # skip its remaining steps in a blink (that is what the docs' loop does).
            while heal_load._pid_of(name) == victim:
                time.sleep(0.005)
        except asyncrpc.WorkerUnreachableError:
            return


if __name__ == "__main__":
    kills = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 1500
    asyncrpc.run(main, world_size=4, args=(kills, steps), max_restarts=kills + 10,
                 restart="worker", rpc_timeout=heal_load.CALL_S)  # fmt: skip
