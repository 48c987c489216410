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

    python benchmarks/stacked_mlp.py [--rounds 5] [--batches 1 8 64] [--json PATH]

--json PATH also writes every figure printed, with the run's date, machine,
versions and command line (benchmarks/run_record.py), for benchmarks/charts.py.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch

import asyncrpc

import run_record
import timing

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


def measure(batch: int, rounds: int, sample: float) -> tuple[dict[str, float], dict[str, Any]]:
    """Median seconds per call of each way at this batch; what auto chose, by-round ratios."""
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
    info = {
        "auto_plan": str(auto.plan),
        "auto_trials": trial,
        "engine_over_floor_by_round": _by_round(times, "floor (baddbmm chain)"),
        "engine_over_floor_members_layout_by_round": _by_round(times, "floor, members' layout"),
    }
    return {n: statistics.median(t) for n, t in times.items()}, info


def _by_round(times: dict[str, list[float]], floor_way: str) -> float:
    """The median over rounds of the vmap engine's time over `floor_way`'s."""
    pairs = zip(times["vmap engine"], times[floor_way], strict=True)
    return statistics.median(e / f for e, f in pairs)


def _call(fan: asyncrpc.Fanout, x: torch.Tensor) -> Callable[[], object]:
    return lambda: fan(x)


def figures(ways: dict[str, float], info: dict[str, Any]) -> dict[str, Any]:
    """One batch's printed figures: us, vs serial and vs floor per way; auto's and the engine's."""
    bottom = ways["floor (baddbmm chain)"]
    best = min((s, w) for w, s in ways.items() if not w.startswith("floor"))
    return {
        "ways": {
            way: {"us": s * 1e6, "vs_serial": ways["serial"] / s, "vs_floor": s / bottom}
            for way, s in ways.items()
        },
        **info,
        "best_way": best[1],
        "auto_over_best": ways["auto"] / best[0],
        "engine_over_floor": ways["vmap engine"] / bottom,
    }


def print_rows(results: dict[int, dict[str, Any]]) -> None:
    print(
        f"\nMLP ensemble: {MEMBERS} members x {LAYERS} Linear({WIDTH}, {WIDTH}) + ReLU, "
        f"{torch.get_num_threads()} intra-op threads"
    )
    print("| batch | way | us per call | vs serial | vs floor |\n| --- | --- | --- | --- | --- |")
    for batch, found in results.items():
        for way, f in found["ways"].items():
            cells = f"{f['us']:.0f} | {f['vs_serial']:.2f}x | {f['vs_floor']:.2f}x"
            print(f"| {batch} | {way} | {cells} |")
    for batch, f in results.items():
        print(
            f"batch {batch}: auto chose {f['auto_plan']} after {f['auto_trials']} timed calls; "
            f"engine/floor by round {f['engine_over_floor_by_round']:.2f}x, engine/floor in the "
            f"members' layout {f['engine_over_floor_members_layout_by_round']:.2f}x; "
            f"auto {f['auto_over_best']:.2f}x the best way ({f['best_way']}); "
            f"vmap engine {f['engine_over_floor']:.2f}x the floor (ratio of medians)"
        )


def run(batches: list[int], rounds: int, sample: float) -> dict[int, dict[str, Any]]:
    """Measure every batch, print the table; the figures per batch."""
    results = {batch: figures(*measure(batch, rounds, sample)) for batch in batches}
    print_rows(results)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--sample-seconds", type=float, default=0.3)
    parser.add_argument("--json", metavar="PATH", help="also write this run's figures here")
    opts = parser.parse_args()
    results = run(opts.batches, opts.rounds, opts.sample_seconds)
    if opts.json:
        run_record.write(opts.json, {
            "benchmark": "stacked_mlp",
            "options": {k: v for k, v in vars(opts).items() if k != "json"},
            "members": MEMBERS, "width": WIDTH, "layers": LAYERS,
            "intra_op_threads": torch.get_num_threads(),
            "batches": {str(b): f for b, f in results.items()},
        })  # fmt: skip


if __name__ == "__main__":
    main()
