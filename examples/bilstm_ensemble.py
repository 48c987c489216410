"""The bidirectional-LSTM ensemble in four steps, each checked against the first.

    python examples/bilstm_ensemble.py                   # small: T=50, B=8, C=256
    python examples/bilstm_ensemble.py --size reference  # T=50, B=50, C=1024
    asyncrpc-launch --nnodes 2 ... --nproc-per-node 2 examples/bilstm_ensemble.py --workers 4

worker0 drives; the other workers serve. Steps 1-3 run on worker0 alone, so it
takes every core for them (the others are idle until step 4).

1. serial: the members one after the other;
2. directions forked: each member forks its forward LSTM in TorchScript while
   it runs the backward one (the reference tutorial's first step);
3. members side by side in this process: `Fanout`'s "auto" engine times its
   plans (serial on both cores, or one member per core) and keeps the faster;
4. members spread over the other workers (2 by default), each running its
   members with the local fan-out.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterable

import torch

import asyncrpc

SIZES = {"small": (50, 8, 256), "reference": (50, 50, 1024)}
MEMBERS = 4


class BiLSTM(torch.nn.Module):
    """Two LSTMs over the same sequence, the second one reversed in time."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.cell_f = torch.nn.LSTM(channels, channels)
        self.cell_b = torch.nn.LSTM(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output_f, _ = self.cell_f(x)
        output_b, _ = self.cell_b(torch.flip(x, dims=[0]))
        return torch.cat((output_f, torch.flip(output_b, dims=[0])), dim=2)


class ForkedBiLSTM(BiLSTM):
    """The same member, its forward direction forked (parallel once scripted)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        future_f = torch.jit.fork(self.cell_f, x)
        output_b, _ = self.cell_b(torch.flip(x, dims=[0]))
        output_f, _ = torch.jit.wait(future_f)
        return torch.cat((output_f, torch.flip(output_b, dims=[0])), dim=2)


def scripted_forked(channels: int) -> torch.jit.ScriptModule:
    return torch.jit.script(ForkedBiLSTM(channels))


def seeded_members(
    channels: int, indices: Iterable[int] = range(MEMBERS)
) -> list[torch.nn.Module]:
    """The members as `Ensemble(..., seed=0)` builds them: member i under seed i."""
    members = []
    for i in indices:
        torch.manual_seed(i)
        members.append(BiLSTM(channels))
    return members


def timed(
    ensemble: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    reference: torch.Tensor | None,
) -> str:
    with torch.no_grad():
        ensemble(x)  # warm-up
        start = time.perf_counter()
        y = ensemble(x)
        ms = (time.perf_counter() - start) * 1e3
    if reference is None:
        return f"{ms:8.1f} ms"
    return f"{ms:8.1f} ms, equal to serial: {torch.allclose(y, reference, atol=1e-5)}"


def tour(ctx: asyncrpc.Context, size: str) -> None:
    if ctx.rank != 0:
        return  # serve step 4's members until worker0 is done
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    t, b, c = SIZES[size]
    x = torch.rand(t, b, c, generator=torch.Generator().manual_seed(0))
    serial = asyncrpc.Ensemble(BiLSTM, MEMBERS, c, seed=0, engine="serial")
    with torch.no_grad():
        reference = serial(x)
    print(f"ensemble of {MEMBERS} BiLSTMs, T={t} B={b} C={c}")
    print(f"1. serial                        {timed(serial, x, None)}")
    forked = asyncrpc.Ensemble(scripted_forked, MEMBERS, c, seed=0, engine="serial")
    print(f"2. directions forked             {timed(forked, x, reference)}")
    fan = asyncrpc.Fanout(seeded_members(c))  # engine="auto": times its plans first
    with torch.no_grad():
        while fan.plan is None:
            fan(x)

    def summed(x: torch.Tensor) -> torch.Tensor:  # what Ensemble's combine="sum" does
        return torch.stack(fan(x)).sum(dim=0)

    print(f"3. members side by side          {timed(summed, x, reference)}")
    print(f"   auto settled on: {fan.plan}")
    others = list(ctx.names[1:])
    spread = asyncrpc.Ensemble(BiLSTM, MEMBERS, c, workers=others, seed=0)
    print(f"4. members spread over {len(others)} workers {timed(spread, x, reference)}")
    print(f"   placement: {spread!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="small")
    parser.add_argument(
        "--workers", type=int, default=3, help="world size: worker0 drives (default: 3)"
    )
    args = parser.parse_args()
    asyncrpc.run(tour, world_size=args.workers, args=(args.size,))


if __name__ == "__main__":
    main()
