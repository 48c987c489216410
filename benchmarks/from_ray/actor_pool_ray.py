"""An actor pool feeding a learner, in Ray as its docs teach it (the port: examples/from_ray/).

Rollout actors in a `ray.util.ActorPool` play episodes of a contextual
bandit (each step an observation; one of four actions is right, as a fixed
hidden rule says) with the policy weights they are given; a `Learner` actor
takes each iteration's episodes, makes one policy-gradient step and returns
the new weights (an ObjectRef the next rollouts take as they are) and its
stats. Episode seeds are fixed, so a run prints the same numbers each time.

    python benchmarks/from_ray/actor_pool_ray.py   # needs Ray: pip install 'asyncrpc[bench]'
"""

import ray
import torch
from ray.util import ActorPool
from torch import nn

ITERATIONS = 10
EPISODES = 16  # per iteration
STEPS = 64  # per episode
NUM_ACTORS = 2
OBS, ACTIONS = 8, 4


def make_policy():
    torch.manual_seed(0)
    return nn.Linear(OBS, ACTIONS)


@ray.remote
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


@ray.remote
class Learner:
    def __init__(self):
        self.policy = make_policy()
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=0.05)

    def get_weights(self):
        return self.policy.state_dict()

    @ray.method(num_returns=2)
    def update(self, episodes):
        obs, actions, rewards = (torch.cat(parts) for parts in zip(*episodes, strict=True))
        logp = torch.log_softmax(self.policy(obs), dim=1).gather(1, actions[:, None]).squeeze(1)
        loss = -((rewards - rewards.mean()) * logp).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return self.policy.state_dict(), (rewards.mean().item(), loss.item())


if __name__ == "__main__":
    ray.init()
    learner = Learner.remote()
    pool = ActorPool([RolloutWorker.remote() for _ in range(NUM_ACTORS)])
    weights = learner.get_weights.remote()
    for i in range(ITERATIONS):
        seeds = range(i * EPISODES, (i + 1) * EPISODES)
        episodes = list(pool.map(lambda actor, seed: actor.rollout.remote(weights, seed), seeds))  # noqa: B023
        weights, stats = learner.update.remote(episodes)
        reward, loss = ray.get(stats)
        print(f"iteration {i}: mean reward {reward:.4f}, loss {loss:+.4f}")
    ray.shutdown()
