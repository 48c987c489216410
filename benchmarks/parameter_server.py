"""Batch-updating parameter server vs applying every gradient at once, in one run.

Runs examples/parameter_server.py's server with 1 ps and k trainers, the
two variants alternated round by round, and prints for each model size:
gradient updates per second (all trainers), optimizer steps, and the
wall-clock time and rounds for the mean trainer loss to reach 15% of its
first value.

    python benchmarks/parameter_server.py [--trainers 3] [--rounds 100] [--repeats 3]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

from parameter_server import rounds_to, run_variant

import asyncrpc

SIZES = [(128, "sgd"), (8192, "adam")]  # (hidden units, optimizer)


def main(ctx: asyncrpc.Context, opts: argparse.Namespace) -> None:
    if ctx.name != "trainer0":
        return
    trainers = len(ctx.workers("trainer"))
    print(f"1 ps, {trainers} trainers, {opts.rounds} rounds each, median of {opts.repeats}")
    print(
        f"{'model':<22}{'variant':<11}{'updates/s':>10}{'steps':>7}"
        f"{'to 15% loss':>13}{'final loss':>12}"
    )
    for hidden, optimizer in SIZES:
        run_variant(ctx, "batched", 5, hidden, optimizer)  # warm-up: connections, imports
        runs: dict[str, list[dict[str, object]]] = {"batched": [], "immediate": []}
        for _ in range(opts.repeats):
            for mode, results in runs.items():
                results.append(run_variant(ctx, mode, opts.rounds, hidden, optimizer))
        rates = {}
        for mode, results in runs.items():
            rate = statistics.median(r["updates_per_s"] for r in results)  # type: ignore[misc]
            rates[mode] = rate
            curve = results[-1]["curve"]
            reached = rounds_to(curve, 0.15)  # type: ignore[arg-type]
            per_round = statistics.median(r["seconds"] for r in results) / opts.rounds  # type: ignore[misc]
            to_target = f"{reached * per_round:.2f} s/{reached}r" if reached else "never"
            label = f"{hidden} hidden, {optimizer}"
            print(
                f"{label:<22}{mode:<11}{rate:>10.0f}{results[-1]['steps']:>7}"
                f"{to_target:>13}{curve[-1]:>12.4f}"
            )  # type: ignore[index]
        print(
            f"{'':<22}batched / immediate updates/s: {rates['batched'] / rates['immediate']:.2f}x"
        )


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


if __name__ == "__main__":
    options = _parse()
    asyncrpc.run(main, roles={"ps": 1, "trainer": options.trainers}, args=(options,))
