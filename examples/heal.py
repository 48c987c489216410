"""A learner with actors that survives losing one: the dead actor is replaced in place.

    python examples/heal.py
    asyncrpc-launch --nproc-per-node 4 --max-restarts 2 --restart worker examples/heal.py

worker0 is the learner: it holds the policy (a tensor) and its version, which
counts the learner's steps, and spawns one `Actor` on each of worker1..worker3.
Each step (0, 1, ...) it asks every actor it has for a rollout of the current
policy version and updates the policy from them.

At step 5 worker2's actor crashes in the middle of its rollout (a simulated
crash: it SIGKILLs its own process, as a segfaulting environment or the OOM
killer would). The world heals in place (`restart="worker"`): a new process
takes the name worker2 and runs `main` again with `ctx.attempt == 1`, while the
learner and the other actors keep running with their state. The learner
skips worker2 from the failed call on, and `asyncrpc.on_replaced` tells it
when to spawn the actor there again. At the end every actor, the new one
included, evaluates the final policy, and the learner prints that its state
went on through the crash (one process, one step counter) and how long the
heal took.
"""

import os
import signal
import threading
import time

import torch

import asyncrpc

STEPS = 20
CRASH_STEP = 5
CRASHING = "worker2"
SIZE = 8


class Actor:
    """Plays episodes with a given policy version; `crash_at`: the version it dies at."""

    def __init__(self, seed: int, crash_at: int | None = None) -> None:
        self.seed = seed
        self.crash_at = crash_at

    def rollout(self, version: int) -> tuple[int, torch.Tensor]:
        if version == self.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)  # the simulated crash
        time.sleep(0.02)  # the environment's time
        gen = torch.Generator().manual_seed(self.seed * 1000 + version)
        return version, torch.randn(SIZE, generator=gen)

    def evaluate(self, policy: torch.Tensor) -> float:
        return float(policy.sum())


class Learner:
    """The state that must survive: the policy, its version, the actors it uses."""

    def __init__(self, actor_names: tuple[str, ...]) -> None:
        self.policy = torch.zeros(SIZE)
        self.version = 0
        self.lock = threading.Lock()
        self.actors: dict[str, asyncrpc.RemoteObject[Actor]] = {}
        for rank, name in enumerate(actor_names, start=1):
            crash_at = CRASH_STEP if name == CRASHING else None
            self.actors[name] = asyncrpc.spawn(name, Actor, rank, crash_at)
        self.returned: list[asyncrpc.Replaced] = []  # replaced, not yet reported
        self.back = threading.Event()
        self.crashed_at = self.back_at = 0.0

    def replaced(self, event: asyncrpc.Replaced) -> None:
        """`on_replaced`'s callback (a thread of its own): spawn the actor on the new process."""
        actor = asyncrpc.spawn(event.name, Actor, event.rank)
        actor.call("evaluate", torch.zeros(SIZE))  # the new actor answers: healed
        with self.lock:
            self.actors[event.name] = actor
            self.returned.append(event)
            self.back_at = time.monotonic()
        self.back.set()

    def step(self) -> None:
        """One update from a rollout of every actor; an actor that is gone is skipped."""
        self.report_returned()
        with self.lock:
            actors = dict(self.actors)
        sent_at = time.monotonic()
        calls = {name: actor.call_async("rollout", self.version) for name, actor in actors.items()}
        rollouts = []
        for name, call in calls.items():
            try:
                version, batch = call.wait()
            except asyncrpc.WorkerUnreachableError:  # ObjectLostError is one too
                self.lose(name, actors[name], sent_at)
                continue
            assert version == self.version, (name, version, self.version)
            rollouts.append(batch)
        self.policy += 0.1 * torch.stack(rollouts).mean(0)
        self.version += 1

    def report_returned(self) -> None:
        with self.lock:
            returned, self.returned = self.returned, []
        for event in returned:
            print(
                f"{event.name} was replaced (attempt {event.attempt}); its actor is back",
                flush=True,
            )

    def lose(self, name: str, actor: asyncrpc.RemoteObject[Actor], sent_at: float) -> None:
        """Skip `name` until `on_replaced` gives it back (unless it already has)."""
        with self.lock:
            if self.actors.get(name) is actor:
                del self.actors[name]
            self.crashed_at = sent_at  # the actor died as the call arrived
        print(
            f"step {self.version}: {name} died during its rollout (a simulated crash); "
            f"the call raised WorkerUnreachableError; skipping {name} until it is replaced",
            flush=True,
        )


def main(ctx: asyncrpc.Context) -> None:
    if ctx.rank != 0:
        return  # actors serve calls until the learner is done; a replacement too
    pid = os.getpid()
    learner = Learner(ctx.names[1:])
    asyncrpc.on_replaced(learner.replaced)
    print(f"learner: actors on {', '.join(learner.actors)}", flush=True)
    for _ in range(STEPS):
        learner.step()
    if not learner.back.wait(timeout=60):  # the evaluation needs every actor
        raise RuntimeError(f"{CRASHING} was not replaced within 60 s")
    learner.report_returned()
    scores = {
        name: actor.call("evaluate", learner.policy) for name, actor in learner.actors.items()
    }
    assert len(set(scores.values())) == 1, scores
    print(f"final policy evaluated on {', '.join(sorted(scores))}", flush=True)
    assert os.getpid() == pid and ctx.attempt == 0
    print(
        f"learner state survived: {learner.version} steps, policy v0 -> v{learner.version} "
        f"in one process (attempt {ctx.attempt}), never reset",
        flush=True,
    )
    healed_in = learner.back_at - learner.crashed_at
    print(
        f"the heal took {healed_in:.2f} s (from the crash to the new actor's first answer)",
        flush=True,
    )


if __name__ == "__main__":
    asyncrpc.run(main, world_size=4, max_restarts=2, restart="worker")
