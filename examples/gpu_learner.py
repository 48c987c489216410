"""A learner on a GPU, actors on CPU: rollouts in, policy weights out.

`learner0` holds the policy and its optimizer on `cuda:0`; `actor0..N-1`
run on CPU: each asks the learner for the current weights, plays a toy
bandit-like task with them, and sends its batch back to learn from. Only
the learner is given a GPU (`devices={"learner": "cuda"}`), so the world
maps none between it and the actors: the learner moves what arrives to its
device, and sends CPU tensors back (`.cpu()`), as a CUDA tensor cannot go
to a worker without one.

    python examples/gpu_learner.py [--actors 2] [--rounds 40]

Without CUDA the learner runs on CPU too; the script says so in one line.
It prints the learner's device, the mean reward every 10 rounds, and
whether the reward rose.
"""

from __future__ import annotations

import argparse
import threading
from typing import Any

import torch
from torch import nn

import asyncrpc

OBS, ACTIONS, BATCH = 8, 4, 256


def make_policy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(OBS, 64), nn.Tanh(), nn.Linear(64, ACTIONS))


class Learner:
    """The policy on the learner's device; one policy-gradient step per batch."""

    def __init__(self) -> None:
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.policy = make_policy().to(self.device)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=3e-3)
        self.lock = threading.Lock()  # actors' calls run on several RPC threads at once

    def where(self) -> str:
        return str(next(self.policy.parameters()).device)

    def weights(self) -> dict[str, torch.Tensor]:
        # The actors have no GPU: they get CPU copies.
        with self.lock:
            return {k: v.detach().cpu() for k, v in self.policy.state_dict().items()}

    def learn(self, obs: torch.Tensor, actions: torch.Tensor, rewards: torch.Tensor) -> float:
        obs, actions, rewards = (t.to(self.device) for t in (obs, actions, rewards))
        with self.lock:
            logits = self.policy(obs)
            chosen = torch.distributions.Categorical(logits=logits).log_prob(actions)
            loss = -((rewards - rewards.mean()) * chosen).mean()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
        return float(rewards.mean())


def act(learner: asyncrpc.RemoteObject[Learner], seed: int, rounds: int) -> list[float]:
    """One actor: fetch weights, play a batch on CPU, send it to learn; the mean rewards."""
    policy = make_policy()
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(OBS, ACTIONS, generator=torch.Generator().manual_seed(7))
    means = []
    for _ in range(rounds):
        policy.load_state_dict(learner.call("weights"))
        obs = torch.randn(BATCH, OBS, generator=gen)
        with torch.no_grad():
            actions = torch.distributions.Categorical(logits=policy(obs)).sample()
        best = (obs @ target).argmax(dim=1)
        rewards = (actions == best).float()
        means.append(learner.call("learn", obs, actions, rewards))
    return means


def devices() -> dict[str, str] | None:
    """The learner's GPU where there is one; else None, said in one line."""
    if torch.cuda.is_available():
        return {"learner": "cuda"}
    print("gpu_learner: no CUDA here, so the learner runs on CPU too")
    return None


def main(ctx: asyncrpc.Context, rounds: int) -> dict[str, Any] | None:
    if ctx.name != "learner0":
        return None
    learner = asyncrpc.spawn("learner0", Learner)
    futures = [
        asyncrpc.rpc_async(name, act, args=(learner, seed, rounds))
        for seed, name in enumerate(ctx.workers("actor"))
    ]
    per_actor = [f.wait() for f in futures]
    curve = [sum(r[i] for r in per_actor) / len(per_actor) for i in range(rounds)]
    for i in range(0, rounds, 10):
        print(f"round {i:3d}: mean reward {curve[i]:.3f}")
    first, last = sum(curve[:5]) / 5, sum(curve[-5:]) / 5
    print(f"learner on {learner.call('where')}; reward {first:.3f} -> {last:.3f}: "
          f"{'rose' if last > first else 'did not rise'}")  # fmt: skip
    return {"device": learner.call("where"), "first": first, "last": last}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=40)
    options = parser.parse_args()
    asyncrpc.run(main, roles={"learner": 1, "actor": options.actors}, args=(options.rounds,),
                 devices=devices())  # fmt: skip
