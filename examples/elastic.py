"""A learner whose actor pool grows while its queue is long and shrinks while it idles.

    python examples/elastic.py

`learner0` is the learner; the world starts with it and one actor
(`actor0`). Work arrives in bursts: each tick puts tasks (episodes to play)
on the learner's queue, and the learner hands each free actor one task at a
time through a handle (`Actor.play`). While the queue holds more than
`PER_ACTOR` tasks per actor it adds actors (`asyncrpc.add_workers(2,
role="actor")`, up to `max_world_size`); once the burst is over and actors
sit idle it removes them, one of them while it still plays an episode
(`asyncrpc.remove_workers`): that episode still finishes and counts. The
learner prints the pool's size as it goes and, at the end, that every task
was played exactly once.
"""

import time
from collections import deque

import torch

import asyncrpc

BURSTS = [0, 24, 0, 0, 0, 0]  # tasks arriving at each tick (a burst, then nothing)
PER_ACTOR = 4  # more queued tasks than this per actor: grow the pool
EPISODE_S = 0.05  # how long an episode takes an actor
MAX_WORLD = 6  # the learner and up to 5 actors


class Actor:
    """Plays episodes; its state is how many it played."""

    def __init__(self) -> None:
        self.played = 0

    def play(self, task: int) -> tuple[int, float]:
        time.sleep(EPISODE_S)  # the environment's time
        self.played += 1
        gen = torch.Generator().manual_seed(task)
        return task, float(torch.randn(4, generator=gen).sum())


class Learner:
    """The queue, the pool of actors, and the results (task -> return)."""

    def __init__(self) -> None:
        self.queue: deque[int] = deque()
        self.actors = {name: asyncrpc.spawn(name, Actor) for name in asyncrpc.members()[1:]}
        self.running: dict[str, torch.futures.Future] = {}
        self.results: dict[int, float] = {}
        self.next_task = 0

    def arrive(self, count: int) -> None:
        self.queue.extend(range(self.next_task, self.next_task + count))
        self.next_task += count

    def grow(self) -> None:
        room = MAX_WORLD - len(asyncrpc.members())
        if len(self.queue) > PER_ACTOR * len(self.actors) and room > 0:
            for name in asyncrpc.add_workers(min(2, room), role="actor"):
                self.actors[name] = asyncrpc.spawn(name, Actor)
            print(f"queue {len(self.queue):2d}: pool grew to {len(self.actors)} actors")

    def shrink(self) -> None:
        if self.queue or len(self.actors) <= 1:
            return
        busy = [name for name in self.actors if name in self.running]
        idle = [name for name in self.actors if name not in self.running]
        # Keep one actor; remove the others, a busy one first: its episode still counts.
        leaving = (busy + idle)[: len(self.actors) - 1]
        asyncrpc.remove_workers(*leaving)
        for name in leaving:
            del self.actors[name]
        print(f"queue  0: pool shrank to {len(self.actors)} actor(s)")

    def dispatch(self) -> None:
        for name, actor in self.actors.items():
            if name not in self.running and self.queue:
                self.running[name] = actor.call_async("play", self.queue.popleft())

    def collect(self) -> None:
        for name, fut in list(self.running.items()):
            if fut.done():
                task, value = fut.wait()
                self.results[task] = value
                del self.running[name]


def main(ctx: asyncrpc.Context) -> None:
    if ctx.role != "learner":
        return  # actors serve calls until the world ends (or they are removed)
    learner = Learner()
    for arriving in BURSTS:
        learner.arrive(arriving)
        learner.grow()
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline or (learner.queue and arriving):
            learner.grow()
            learner.dispatch()
            learner.collect()
            time.sleep(0.005)
        learner.shrink()
    while learner.running:  # the last episodes of the actors that stayed
        learner.collect()
        time.sleep(0.005)
    assert sorted(learner.results) == list(range(learner.next_task)), "a task was lost"
    print(f"{len(learner.results)} tasks played, each once; members at the end:",
          asyncrpc.members())  # fmt: skip


if __name__ == "__main__":
    asyncrpc.run(main, roles={"learner": 1, "actor": 1}, elastic=True, max_world_size=MAX_WORLD)
