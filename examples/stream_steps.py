"""A model's outputs streamed step by step from the worker that holds it.

worker1 holds a small recurrent model and generates a sequence one step at a
time; worker0 reads each step as soon as it is made, stops when it has seen
enough, and the generator on worker1 is closed (its `finally` says so):

    python examples/stream_steps.py
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

import asyncrpc


class Generator:
    """A GRU that feeds its own output back in: one step per item of the stream."""

    def __init__(self, width: int) -> None:
        torch.manual_seed(0)
        self.cell = torch.nn.GRUCell(width, width)
        self.width = width

    @torch.no_grad()
    def steps(self, count: int) -> Iterator[torch.Tensor]:
        state = torch.zeros(1, self.width)
        x = torch.ones(1, self.width)
        try:
            for _ in range(count):
                state = self.cell(x, state)
                x = state
                yield state.squeeze(0)
        finally:
            print(f"{asyncrpc.current_context().name}: generator closed", flush=True)


def main(ctx: asyncrpc.Context) -> None:
    if ctx.rank != 0:
        return
    model = asyncrpc.spawn("worker1", Generator, 8)
    for step, state in enumerate(model.stream("steps", 1000)):
        print(f"step {step}: norm {state.norm():.4f}")
        if step == 4:
            break  # the rest is never made: the stream closes the generator
    whole = list(model.options(window=4).stream("steps", 6))  # read to the end
    print(f"6 steps read to the end, the last: norm {whole[-1].norm():.4f}")


if __name__ == "__main__":
    asyncrpc.run(main, world_size=2)
