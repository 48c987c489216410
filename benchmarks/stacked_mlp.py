"""An MLP ensemble: serial vs the "vmap" engine vs auto vs the floor, at batch 1, 8 and 64.

16 members, 3 Linear layers of 512 with ReLU between. The floor is the
members' own weights, stacked once, run as one chain of `torch.baddbmm`
(nothing else: no checks, no splitting), with each weight stored transposed
(in, out), the layout torch's batched GEMM reads fastest. The engine's
stacks hold each weight as a `Linear` holds it (out, in), since the members'
own tensors are their rows; "floor, members' layout" is the same chain over
such stacks, so the engine's cost splits into the layout's (floor vs floor,
members' layout) and the engine's own (the rest). Stock `torch.func.vmap`
over `stack_module_state` is timed beside them. All ways alternate round
by round in one run; medians.

    python benchmarks/stacked_mlp.py [--rounds 5] [--batches 1 8 64]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import timing
import torch

import asyncrpc

MEMBERS, WIDTH, LAYERS = 16, 512, 3


def make_members(n: int = MEMBERS, width: int = WIDTH) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    members = []
    for _ in range(n):
        layers: list[torch.nn.Module] = []
        for i in range(LAYERS):
            layers += [torch.nn.Linear(width, width)] + (
                [torch.nn.ReLU()] if i < LAYERS - 1 else []
            )
        members.append(torch.nn.Sequential(*layers).eval())
    return members


def floor(members: list[torch.nn.Module]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The members' weights stacked once, as one baddbmm chain: what batching can reach."""
    linears = [[m for m in member if isinstance(m, torch.nn.Linear)] for member in members]
    with torch.no_grad():
        weights = [
            torch.stack([ls[i].weight.T for ls in linears]).contiguous() for i in range(LAYERS)
        ]
        biases = [torch.stack([ls[i].bias for ls in linears]).unsqueeze(1) for i in range(LAYERS)]

    def run(x: torch.Tensor) -> torch.Tensor:
        h = x.expand(len(members), *x.shape)
        for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
            h = torch.baddbmm(b, h, w)
            if i < LAYERS - 1:
                h = torch.relu(h)
        return h

    return run


def floor_members_layout(members: list[torch.nn.Module]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The floor's chain over stacks in the members' own layout (out, in), read transposed."""
    linears = [[m for m in member if isinstance(m, torch.nn.Linear)] for member in members]
    with torch.no_grad():
        weights = [torch.stack([ls[i].weight for ls in linears]) for i in range(LAYERS)]
        biases = [torch.stack([ls[i].bias for ls in linears]).unsqueeze(1) for i in range(LAYERS)]

    def run(x: torch.Tensor) -> torch.Tensor:
        h = x.expand(len(members), *x.shape)
        for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
            h = torch.baddbmm(b, h, w.mT)
            if i < LAYERS - 1:
                h = torch.relu(h)
        return h

    return run


def stock_vmap(members: list[torch.nn.Module]) -> Callable[[torch.Tensor], torch.Tensor]:
    """torch.func's own recipe: stack_module_state + functional_call under vmap."""
    params, buffers = torch.func.stack_module_state(members)  # type: ignore[arg-type]
    base = make_members(1)[0].to("meta")

    def one(
        p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        return torch.func.functional_call(base, (p, b), (x,))  # type: ignore[no-any-return]

    batched = torch.func.vmap(one, in_dims=(0, 0, None))
    return lambda x: batched(params, buffers, x)


def measure(batch: int, rounds: int, sample: float) -> tuple[dict[str, float], str]:
    """Median seconds per call of each way at this batch; auto's choice."""
    members = make_members()
    x = torch.rand(batch, WIDTH)
    auto = asyncrpc.Fanout(members)
    ways: dict[str, Callable[[], object]] = {  # the engine and the floor timed side by side
        "serial": lambda: [m(x) for m in members],
        "vmap engine": _call(asyncrpc.Fanout(members, engine="vmap"), x),
        "floor (baddbmm chain)": (lambda f: lambda: f(x))(floor(members)),
        "floor, members' layout": (lambda f: lambda: f(x))(floor_members_layout(members)),
        "auto": _call(auto, x),
        "stock torch.func.vmap": (lambda f: lambda: f(x))(stock_vmap(members)),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    with torch.no_grad():
        reference = torch.stack([m(x) for m in members])
        trial = 0
        while auto.plan is None:
            ways["auto"]()
            trial += 1
        for name, way in ways.items():
            out = way()
            got = out if isinstance(out, torch.Tensor) else torch.stack(list(out))  # type: ignore[call-overload]
            assert torch.allclose(got, reference, atol=1e-4), name
        repeat = timing.repeats(ways["serial"], sample)
        for _ in range(rounds):
            for name, way in ways.items():
                times[name].append(timing.mean_seconds(way, repeat))
    # Each round's engine/floor pair ran back to back: the median of those ratios
    # is steadier than the ratio of medians when the machine's speed drifts.
    pairs = statistics.median(
        e / f for e, f in zip(times["vmap engine"], times["floor (baddbmm chain)"], strict=True)
    )
    own = statistics.median(
        e / f for e, f in zip(times["vmap engine"], times["floor, members' layout"], strict=True)
    )
    note = (
        f"auto chose {auto.plan} after {trial} timed calls; engine/floor by round {pairs:.2f}x, "
        f"engine/floor in the members' layout {own:.2f}x"
    )
    return {n: statistics.median(t) for n, t in times.items()}, note


def _call(fan: asyncrpc.Fanout, x: torch.Tensor) -> Callable[[], object]:
    return lambda: fan(x)


def print_rows(results: dict[int, dict[str, float]], notes: dict[int, str]) -> None:
    print(
        f"\nMLP ensemble: {MEMBERS} members x {LAYERS} Linear({WIDTH}, {WIDTH}) + ReLU, "
        f"{torch.get_num_threads()} intra-op threads"
    )
    print("| batch | way | us per call | vs serial | vs floor |\n| --- | --- | --- | --- | --- |")
    for batch, ways in results.items():
        bottom = ways["floor (baddbmm chain)"]
        for way, seconds in ways.items():
            print(
                f"| {batch} | {way} | {seconds * 1e6:.0f} | {ways['serial'] / seconds:.2f}x "
                f"| {seconds / bottom:.2f}x |"
            )
    for batch, note in notes.items():
        ways = results[batch]
        best = min((s, w) for w, s in ways.items() if not w.startswith("floor"))
        engine = ways["vmap engine"] / ways["floor (baddbmm chain)"]
        print(
            f"batch {batch}: {note}; auto {ways['auto'] / best[0]:.2f}x the best way "
            f"({best[1]}); vmap engine {engine:.2f}x the floor (ratio of medians)"
        )


def run(batches: list[int], rounds: int, sample: float) -> None:
    results, notes = {}, {}
    for batch in batches:
        results[batch], notes[batch] = measure(batch, rounds, sample)
    print_rows(results, notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--sample-seconds", type=float, default=0.3)
    opts = parser.parse_args()
    run(opts.batches, opts.rounds, opts.sample_seconds)


if __name__ == "__main__":
    main()
