"""An actor pool feeding a learner, ported from Ray (Ray's: benchmarks/from_ray/actor_pool_ray.py).

Rollout actors in an `asyncrpc.ActorPool` play episodes of a contextual
bandit (each step an observation; one of four actions is right, as a fixed
hidden rule says) with the policy weights they are given; a `Learner`
object takes each iteration's episodes, makes one policy-gradient step and
returns the new weights and its stats. The classes are Ray's without
`@ray.remote`; same seeds, so it prints the numbers Ray's version prints.

    python examples/from_ray/actor_pool.py
"""

import torch
from torch import nn

import asyncrpc

ITERATIONS = 10
EPISODES = 16  # per iteration
STEPS = 64  # per episode
NUM_ACTORS = 2
OBS, ACTIONS = 8, 4


def make_policy():
    torch.manual_seed(0)
    return nn.Linear(OBS, ACTIONS)


class RolloutWorker:
    def __init__(self):
        self.policy = make_policy()
        self.rule = torch.randn(OBS, ACTIONS, generator=torch.Generator().manual_seed(1234))

    def rollout(self, weights, seed):
        self.policy.load_state_dict(weights)
        gen = torch.Generator().manual_seed(seed)
        obs = torch.randn(STEPS, OBS, generator=gen)
        with torch.no_grad():
            probs = torch.softmax(self.policy(obs), dim=1)
        actions = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        rewards = (actions == (obs @ self.rule).argmax(dim=1)).float()
        return obs, actions, rewards


class Learner:
    def __init__(self):
        self.policy = make_policy()
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=0.05)

    def get_weights(self):
        return self.policy.state_dict()

    def update(self, episodes):
        obs, actions, rewards = (torch.cat(parts) for parts in zip(*episodes, strict=True))
        logp = torch.log_softmax(self.policy(obs), dim=1).gather(1, actions[:, None]).squeeze(1)
        loss = -((rewards - rewards.mean()) * logp).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return self.policy.state_dict(), (rewards.mean().item(), loss.item())


def main(ctx):
    if ctx.rank != 0:
        return  # the other workers hold the actors and serve their calls
    learner = asyncrpc.spawn(None, Learner)
    pool = asyncrpc.ActorPool([asyncrpc.spawn(None, RolloutWorker) for _ in range(NUM_ACTORS)])
    weights = learner.call("get_weights")
    for i in range(ITERATIONS):
        seeds = range(i * EPISODES, (i + 1) * EPISODES)
        episodes = list(
            pool.map(lambda actor, seed: actor.call_async("rollout", weights, seed), seeds)  # noqa: B023
        )
        weights, (reward, loss) = learner.call("update", episodes)
        print(f"iteration {i}: mean reward {reward:.4f}, loss {loss:+.4f}")


if __name__ == "__main__":
    asyncrpc.run(main, world_size=2 + NUM_ACTORS)
