"""A batch-updating parameter server: one `ps0`, k trainers, one optimizer step per k gradients.

Each trainer computes gradients on its own data, sends them to the server
and waits for the new model. The server adds them up under a lock; the last
of the k arrivals steps the optimizer and answers every waiting trainer at
once through one shared Future, so no server thread waits in between
(`async_execution`). `--mode immediate` is the non-batched variant: every
gradient is applied as it arrives.

    python examples/parameter_server.py [--trainers 3] [--rounds 60] [--mode batched]

The task: fit a small MLP to a fixed random "teacher" network; the script
prints the mean trainer loss every 10 rounds and the rounds it took to
reach 15% of the first loss.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import torch
from torch import nn
from torch.futures import Future

import asyncrpc

IN = 32


def make_model(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def make_data(seed: int, rounds: int, batch: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    teacher = torch.Generator().manual_seed(1234)
    w = torch.randn(IN, 1, generator=teacher)
    gen = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(rounds):
        x = torch.randn(batch, IN, generator=gen)
        data.append((x, torch.tanh(x @ w / 4)))
    return data


class ParameterServer:
    """Holds the model; `update_batched` waits for k gradients, `update_now` applies each."""

    def __init__(self, trainers: int, hidden: int = 128, optimizer: str = "sgd") -> None:
        self.model = make_model(hidden)
        self.trainers = trainers
        self.lock = threading.Lock()
        self.arrived = 0
        self.pending: Future[nn.Module] = Future()
        params = self.model.parameters()
        self.optimizer: torch.optim.Optimizer = (
            torch.optim.Adam(params, lr=1e-3)
            if optimizer == "adam"
            else torch.optim.SGD(params, lr=0.05, momentum=0.5)
        )
        self.steps = 0
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self) -> nn.Module:
        return self.model

    def optimizer_steps(self) -> int:
        return self.steps

    @asyncrpc.async_execution
    def update_batched(self, grads: list[torch.Tensor]) -> Future[nn.Module]:
        with self.lock:
            for p, g in zip(self.model.parameters(), grads, strict=True):
                p.grad += g
            self.arrived += 1
            answer = self.pending
            if self.arrived == self.trainers:
                for p in self.model.parameters():
                    p.grad /= self.trainers
                self._step()
                self.arrived = 0
                self.pending = Future()
                answer.set_result(self.model)  # every waiting trainer gets this model
        return answer

    def update_now(self, grads: list[torch.Tensor]) -> nn.Module:
        with self.lock:
            for p, g in zip(self.model.parameters(), grads, strict=True):
                p.grad.copy_(g)
            self._step()
            return self.model

    def _step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        self.steps += 1


def train(
    ps: asyncrpc.RemoteObject[ParameterServer], method: str, seed: int, rounds: int
) -> dict[str, Any]:
    """One trainer: `rounds` iterations of forward, backward, send gradients, get the model."""
    model = ps.call("get_model")
    losses = []
    started = time.perf_counter()
    for x, y in make_data(seed, rounds):
        model.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        model = ps.call(method, [p.grad for p in model.parameters()])
    return {"losses": losses, "seconds": time.perf_counter() - started}


def run_variant(
    ctx: asyncrpc.Context, mode: str, rounds: int, hidden: int = 128, optimizer: str = "sgd"
) -> dict[str, Any]:
    """Start a fresh server on ps0, run every trainer, return rates and the loss curve."""
    trainers = ctx.workers("trainer")
    ps = asyncrpc.spawn("ps0", ParameterServer, len(trainers), hidden, optimizer)
    method = "update_batched" if mode == "batched" else "update_now"
    started = time.perf_counter()
    runs = [
        asyncrpc.rpc_async(name, train, args=(ps, method, seed, rounds))
        for seed, name in enumerate(trainers)
    ]
    results = asyncrpc.gather(runs).wait()
    elapsed = time.perf_counter() - started
    curve = [sum(r["losses"][i] for r in results) / len(results) for i in range(rounds)]
    return {
        "updates_per_s": len(trainers) * rounds / elapsed,
        "steps": ps.call("optimizer_steps"),
        "curve": curve,
        "seconds": elapsed,
    }


def rounds_to(curve: list[float], fraction: float) -> int | None:
    target = curve[0] * fraction
    return next((i + 1 for i, loss in enumerate(curve) if loss <= target), None)


def main(ctx: asyncrpc.Context, opts: argparse.Namespace) -> None:
    if ctx.name != "trainer0":
        return  # ps0 and the other trainers serve calls
    result = run_variant(ctx, opts.mode, opts.rounds)
    curve = result["curve"]
    for i in range(0, len(curve), 10):
        print(f"round {i + 1:>3}: mean trainer loss {curve[i]:.4f}")
    reached = rounds_to(curve, 0.15)
    print(
        f"{opts.mode}: {result['updates_per_s']:.0f} gradient updates/s, "
        f"{result['steps']} optimizer steps, loss {curve[0]:.4f} -> {curve[-1]:.4f}, "
        f"15% of the first loss after {reached} rounds"
    )


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--mode", choices=["batched", "immediate"], default="batched")
    return parser.parse_args()


if __name__ == "__main__":
    options = parse()
    asyncrpc.run(main, roles={"ps": 1, "trainer": options.trainers}, args=(options,))
