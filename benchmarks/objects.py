"""Objects that travel once, beside Ray and beside sending a copy with every call.

One run, the ways alternated round by round (the first way rotates), medians.
Each round puts the tensor again (a put copies it, in asyncrpc as in Ray),
and each reader sums every element (it reads all the memory):

    broadcast M MiB to k workers   put once, each worker's call takes the ref
                                   | the tensor in each call (today's way)
                                   | Ray: ray.put once, each actor gets the ObjectRef
    put + get on another worker    put here, a call there reads it (get on a ref in a list)
                                   | Ray: ray.put in the driver, an actor's ray.get
    parameter server, per step     Ray's synchronous parameter server (examples/from_ray/):
                                   gradients' Futures passed straight to apply_gradients
                                   | today's way: gather the gradients, then pass them
                                   | Ray: as its docs write it, ObjectRefs as arguments

Ray is optional (`pip install 'asyncrpc[bench]'`); without it, or with
--no-ray, its column says so.

    python benchmarks/objects.py [--rounds 5] [--mib 128] [--workers 4 8] [--no-ray]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import asyncrpc

import ray_peer  # before Ray runs anywhere: its children stay on loopback

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "from_ray"))
import parameter_server as ps_example

Way = Callable[[], Any]
STEPS = 10  # parameter-server steps per call of a way


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
        rows[row] = {"asyncrpc": by_ref, "today's way": by_copy}
    for label, value in sizes.items():
        rows[f"put + get on another worker, {label}"] = {
            "asyncrpc": lambda v=value: asyncrpc.rpc_sync(  # type: ignore[misc]
                names[0], get_inside, args=([asyncrpc.put(v)],)
            )
        }
    return rows


def _ps_ways(names: list[str]) -> dict[str, Way]:
    """A step of the parameter server, the Futures passed on and the gradients gathered."""
    ps = asyncrpc.spawn(names[0], ps_example.ParameterServer, 1e-2)
    workers = [asyncrpc.spawn(n, ps_example.DataWorker, seed) for seed, n in enumerate(names[1:3])]

    def passed() -> Any:  # Ray's loop, `call_async` for `.remote`
        weights = ps.call_async("get_weights")
        for _ in range(STEPS):
            gradients = [w.call_async("compute_gradients", weights) for w in workers]
            weights = ps.call_async("apply_gradients", *gradients)
        return weights.wait()

    def gathered() -> Any:  # every gradient back to the driver, then sent on
        weights = ps.call("get_weights")
        for _ in range(STEPS):
            gradients = asyncrpc.gather(
                [w.call_async("compute_gradients", weights) for w in workers]
            ).wait()
            weights = ps.call("apply_gradients", *gradients)
        return weights

    return {"asyncrpc": passed, "today's way": gathered}


def _ray_ps() -> Way:
    import ray
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(ps_example)  # Ray's workers cannot import it
    server = ray.remote(ps_example.ParameterServer)
    data = ray.remote(ps_example.DataWorker)
    ps = server.remote(1e-2)
    workers = [data.remote(seed) for seed in range(2)]

    def as_ray_writes_it() -> Any:
        weights = ps.get_weights.remote()
        for _ in range(STEPS):
            gradients = [w.compute_gradients.remote(weights) for w in workers]
            weights = ps.apply_gradients.remote(*gradients)
        return ray.get(weights)

    return as_ray_writes_it


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
    rows[PS_ROW] = {"ray": _ray_ps()}
    return rows


PS_ROW = f"parameter server, {STEPS} steps"


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
    columns = ("asyncrpc", "today's way", "ray")
    print(f"{'row':<42}{'asyncrpc':>12}{'today':>12}{'Ray':>12}{'today/ours':>11}{'Ray/ours':>10}")
    for row, ways in results.items():
        cells = [f"{ways[c] * 1e3:.2f} ms" if c in ways else "-" for c in columns]
        ours = ways["asyncrpc"]
        today = f"{ways[columns[1]] / ours:.2f}x" if columns[1] in ways else "-"
        ray = f"{ways['ray'] / ours:.2f}x" if "ray" in ways else "-"
        print(f"{row:<42}{cells[0]:>12}{cells[1]:>12}{cells[2]:>12}{today:>11}{ray:>10}")
    print(
        "today: a copy in each call (broadcast), every gradient through the driver (parameter "
        "server); today/ours, Ray/ours: that way's time over asyncrpc's (> 1: asyncrpc is faster)"
    )


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
    ways[PS_ROW] = _ps_ways(names)
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
