"""Objects that travel once, beside Ray and beside sending a copy with every call.

One run, the ways alternated round by round (the first way rotates), medians.
Each round puts the tensor again (a put copies it, in asyncrpc as in Ray),
and each reader sums every element (it reads all the memory):

    broadcast M MiB to k workers   put once, each worker's call takes the ref
                                   | the tensor in each call (today's way)
                                   | Ray: ray.put once, each actor gets the ObjectRef
    put + get on another worker    put here, a call there reads it (get on a ref in a list)
                                   | Ray: ray.put in the driver, an actor's ray.get

Ray is optional (`pip install 'asyncrpc[bench]'`); without it, or with
--no-ray, its column says so.

    python benchmarks/objects.py [--rounds 5] [--mib 128] [--workers 4 8] [--no-ray]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import asyncrpc

import ray_peer  # before Ray runs anywhere: its children stay on loopback

Way = Callable[[], Any]


def first(x: torch.Tensor) -> float:
    """What a worker does with the weights: reads all of them."""
    return float(x.sum())


def get_inside(refs: list[asyncrpc.ObjectRef[torch.Tensor]]) -> float:
    return first(asyncrpc.get(refs[0]))


def _asyncrpc_ways(names: list[str], weights: torch.Tensor, sizes: dict[str, torch.Tensor],
                   counts: list[int]) -> dict[str, dict[str, Way]]:  # fmt: skip
    rows: dict[str, dict[str, Way]] = {}
    for k in counts:
        to = names[:k]

        def by_ref(to: list[str] = to) -> Any:
            ref = asyncrpc.put(weights)  # put copies it, as ray.put does
            return asyncrpc.gather([asyncrpc.rpc_async(n, first, args=(ref,)) for n in to]).wait()

        def by_copy(to: list[str] = to) -> Any:
            calls = [asyncrpc.rpc_async(n, first, args=(weights,)) for n in to]
            return asyncrpc.gather(calls).wait()

        row = f"broadcast {weights.numel() * 4 >> 20} MiB to {k} workers"
        rows[row] = {"asyncrpc": by_ref, "a copy per call": by_copy}
    for label, value in sizes.items():
        rows[f"put + get on another worker, {label}"] = {
            "asyncrpc": lambda v=value: asyncrpc.rpc_sync(  # type: ignore[misc]
                names[0], get_inside, args=([asyncrpc.put(v)],)
            )
        }
    return rows


def _ray_ways(weights: torch.Tensor, sizes: dict[str, torch.Tensor],
              counts: list[int]) -> dict[str, dict[str, Way]]:  # fmt: skip
    import ray

    @ray.remote
    class Reader:
        def first(self, x: torch.Tensor) -> float:
            return float(x.sum())

        def get_inside(self, refs: list[Any]) -> float:
            return float(ray.get(refs[0]).sum())

    actors = [Reader.remote() for _ in range(max(counts))]  # type: ignore[attr-defined]
    ray.get([a.first.remote(torch.ones(1)) for a in actors])
    rows: dict[str, dict[str, Way]] = {}
    for k in counts:
        row = f"broadcast {weights.numel() * 4 >> 20} MiB to {k} workers"

        def broadcast(k: int = k) -> Any:
            ref = ray.put(weights)
            return ray.get([a.first.remote(ref) for a in actors[:k]])

        rows[row] = {"ray": broadcast}
    for label, value in sizes.items():
        rows[f"put + get on another worker, {label}"] = {
            "ray": lambda v=value: ray.get(actors[0].get_inside.remote([ray.put(v)]))
        }
    return rows


def measure(
    ways: dict[str, dict[str, Way]], rounds: int, repeat: int
) -> dict[str, dict[str, float]]:
    """Seconds per call of each way of each row: medians over rounds, ways alternated."""
    for row in ways.values():
        for way in row.values():
            way()  # warm-up
    samples: dict[str, dict[str, list[float]]] = {r: {w: [] for w in ways[r]} for r in ways}
    for r in range(rounds):
        for row, row_ways in ways.items():
            names = list(row_ways)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                start = time.perf_counter()
                for _ in range(repeat):
                    row_ways[name]()
                samples[row][name].append((time.perf_counter() - start) / repeat)
    return {row: {w: statistics.median(s) for w, s in by.items()} for row, by in samples.items()}


def report(results: dict[str, dict[str, float]]) -> None:
    columns = ("asyncrpc", "a copy per call", "ray")
    print(
        f"{'row':<42}{'asyncrpc':>12}{'copy/call':>12}{'Ray':>12}{'copy/ours':>11}{'Ray/ours':>10}"
    )
    for row, ways in results.items():
        cells = [f"{ways[c] * 1e3:.2f} ms" if c in ways else "-" for c in columns]
        ours = ways["asyncrpc"]
        copy = f"{ways['a copy per call'] / ours:.2f}x" if "a copy per call" in ways else "-"
        ray = f"{ways['ray'] / ours:.2f}x" if "ray" in ways else "-"
        print(f"{row:<42}{cells[0]:>12}{cells[1]:>12}{cells[2]:>12}{copy:>11}{ray:>10}")
    print("copy/ours, Ray/ours: that way's time over asyncrpc's (> 1: asyncrpc is faster)")


def main(ctx: asyncrpc.Context, options: argparse.Namespace) -> None:
    if ctx.rank != 0:
        return
    weights = torch.randn(options.mib << 18)  # float32: MiB * 2**20 / 4 elements
    sizes = {
        "1 KiB": torch.randn(256),
        f"{options.get_mib} MiB": torch.randn(options.get_mib << 18),
    }
    names = [n for n in ctx.names if n != ctx.name]
    ways = _asyncrpc_ways(names, weights, sizes, options.workers)
    with_ray = not options.no_ray and ray_peer.installed()
    if with_ray:
        ray_peer.start()
        for row, more in _ray_ways(weights, sizes, options.workers).items():
            ways[row].update(more)
    report(measure(ways, options.rounds, options.repeat))
    if not with_ray:
        print("Ray: not run (--no-ray, or not installed: pip install 'asyncrpc[bench]')")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3, help="calls per way per round")
    parser.add_argument("--mib", type=int, default=128, help="the broadcast's size")
    parser.add_argument("--get-mib", type=int, default=64, help="the larger put + get")
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--no-ray", action="store_true")
    return parser.parse_args()


if __name__ == "__main__":
    options = _parse()
    asyncrpc.run(main, world_size=max(options.workers) + 1, args=(options,))
