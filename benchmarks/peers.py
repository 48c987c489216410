"""asyncrpc against its peers: raw torch.distributed.rpc and Ray actors, one run.

Every row runs each way in turn, round by round, so drift on a shared
machine hits all of them alike; the figure is the median over rounds, and
the ratios compare asyncrpc with each peer (for Ray: how many times slower
Ray is, or how many times more calls/s asyncrpc makes)::

    this script (worker0 of a 3-worker asyncrpc world; Ray's driver too)
      |-- asyncrpc / torch rpc --> worker1 (echo, Counter) --> worker2 (relay's hop)
      `-- Ray (local, 127.0.0.1) --> actor B (echo, Counter) --> actor C

Rows: a small call's round trip; a 1 MiB argument; 1000 calls in flight (one
by one, and coalesced by `asyncrpc.Batch` into one message); a
chained hop A -> B -> C written with async functions (Ray: an async actor
awaiting another actor); a method call on a remote object (one call at a
time, asyncrpc's default as Ray's); 100 `async def` calls in flight on one
object, interleaving on its worker's event loop (asyncrpc beside Ray: torch
runs no event loop for remote code); and, each in a
fresh process, a 3-worker world from start to its first call and back to
exit (asyncrpc.run, mp.spawn + rpc.init_rpc, ray.init + actors), a second
world in that process (asyncrpc forks it from its warm interpreter), and for
asyncrpc a restart after a worker is killed (max_restarts). Then what
torch RPC has no way to do, asyncrpc beside Ray (benchmarks/beyond_torch.py):
cancelling a call, streaming a generator's items, bounding a stream.

Ray stays on loopback like everything else here (benchmarks/ray_peer.py
starts it), and the report says where Ray's new listening sockets are.

Ray is optional: `pip install 'asyncrpc[bench]'` (or `pip install ray`).
Without it the Ray rows are skipped and the rest run.

    python benchmarks/peers.py [--calls 200] [--rounds 5] [--startups 3] [--no-ray]
        [--beyond-rounds 20] [--stream-items 2000] [--json PATH]

--json PATH also writes every figure printed, with the run's date, machine,
versions and command line (benchmarks/run_record.py), for benchmarks/charts.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import Tensor
from torch.futures import Future

import asyncrpc

import ray_peer  # before anything imports Ray: it keeps Ray on loopback
import run_record

Way = Callable[[], object]
_IN_FLIGHT = 1000
_ASYNC_CALLS = 100  # concurrent async def calls on one object
_NAP_S = 0.01


def echo(x: Any) -> Any:
    return x


def add_one(x: Tensor) -> Tensor:
    return x + 1


@rpc.functions.async_execution
def torch_relay(x: Tensor) -> Future[Tensor]:
    return rpc.rpc_async("worker2", add_one, args=(x,))


@asyncrpc.async_execution
async def relay(x: Tensor) -> Tensor:
    return await asyncrpc.rpc_async("worker2", add_one, args=(x,))


class Counter:
    def __init__(self) -> None:
        self.total = 0

    def add(self, n: int) -> int:
        self.total += n
        return self.total


class Napper:
    """An object whose async method waits on asyncio: its calls interleave."""

    async def nap(self) -> int:
        await asyncio.sleep(_NAP_S)
        return 1


# ---- the ways of each row -----------------------------------------------------------


def _local_ways(small: Tensor, big: Tensor) -> dict[str, dict[str, Way]]:
    counter = asyncrpc.spawn("worker1", Counter)
    torch_counter = rpc.remote("worker1", Counter)
    napper = asyncrpc.spawn("worker1", Napper)

    def burst(call: Callable[..., Future[Any]]) -> Way:
        return lambda: torch.futures.wait_all(
            [call("worker1", echo, args=(small,)) for _ in range(_IN_FLIGHT)]
        )

    def batched() -> object:
        with asyncrpc.Batch() as batch:
            futs = [batch.rpc_async("worker1", echo, args=(small,)) for _ in range(_IN_FLIGHT)]
        return torch.futures.wait_all(futs)

    return {
        "small call round trip": {
            "asyncrpc": lambda: asyncrpc.rpc_sync("worker1", echo, args=(small,)),
            "torch": lambda: rpc.rpc_sync("worker1", echo, args=(small,)),
        },
        "1 MiB argument round trip": {
            "asyncrpc": lambda: asyncrpc.rpc_sync("worker1", echo, args=(big,)),
            "torch": lambda: rpc.rpc_sync("worker1", echo, args=(big,)),
        },
        f"{_IN_FLIGHT} calls in flight": {
            "asyncrpc": burst(asyncrpc.rpc_async),
            "torch": burst(rpc.rpc_async),
        },
        f"{_IN_FLIGHT} calls in flight, in one Batch": {
            "asyncrpc": batched,
            "torch": burst(rpc.rpc_async),
        },
        "chained hop A -> B -> C (async)": {
            "asyncrpc": lambda: asyncrpc.rpc_sync("worker1", relay, args=(small,)),
            "torch": lambda: rpc.rpc_sync("worker1", torch_relay, args=(small,)),
        },
        "method call on a remote object": {
            "asyncrpc": lambda: counter.call("add", 1),
            "torch": lambda: torch_counter.rpc_sync().add(1),
        },
        # torch has no event loop for remote code: asyncrpc beside Ray only.
        f"{_ASYNC_CALLS} async def calls in flight on one object": {
            "asyncrpc": lambda: torch.futures.wait_all(
                [napper.call_async("nap") for _ in range(_ASYNC_CALLS)]
            ),
        },
    }


def _ray_ways(small: Tensor, big: Tensor) -> dict[str, dict[str, Way]]:
    import ray

    @ray.remote
    class Echo:
        def echo(self, x: Any) -> Any:
            return x

        def add_one(self, x: Tensor) -> Tensor:
            return x + 1

    @ray.remote
    class Relay:
        def __init__(self, to: Any) -> None:
            self.to = to

        async def relay(self, x: Tensor) -> Tensor:
            return await self.to.add_one.remote(x)  # type: ignore[no-any-return]

    @ray.remote
    class RayCounter:  # Counter's twin, defined here so that Ray ships it by value
        def __init__(self) -> None:
            self.total = 0

        def add(self, n: int) -> int:
            self.total += n
            return self.total

    @ray.remote
    class RayNapper:  # Napper's twin: an async actor (1000 calls at once by default)
        async def nap(self) -> int:
            await asyncio.sleep(_NAP_S)
            return 1

    napper = RayNapper.remote()  # type: ignore[attr-defined]
    b, c = Echo.remote(), Echo.remote()  # type: ignore[attr-defined]
    relay_b = Relay.remote(c)  # type: ignore[attr-defined]
    counter = RayCounter.remote()  # type: ignore[attr-defined]
    ray.get([b.echo.remote(0), c.echo.remote(0), relay_b.relay.remote(small)])
    return {
        "small call round trip": {"ray": lambda: ray.get(b.echo.remote(small))},
        "1 MiB argument round trip": {"ray": lambda: ray.get(b.echo.remote(big))},
        f"{_IN_FLIGHT} calls in flight": {
            "ray": lambda: ray.get([b.echo.remote(small) for _ in range(_IN_FLIGHT)])
        },
        "chained hop A -> B -> C (async)": {"ray": lambda: ray.get(relay_b.relay.remote(small))},
        "method call on a remote object": {"ray": lambda: ray.get(counter.add.remote(1))},
        f"{_ASYNC_CALLS} async def calls in flight on one object": {
            "ray": lambda: ray.get([napper.nap.remote() for _ in range(_ASYNC_CALLS)])
        },
    }


# ---- measuring ----------------------------------------------------------------------


def _measure(rows: dict[str, dict[str, Way]], calls: int, rounds: int) -> dict[str, Any]:
    """Median seconds per call of every way of every row, ways alternated round by round."""
    out: dict[str, dict[str, float]] = {}
    for row, ways in rows.items():
        n = max(1, calls // 20) if "in flight" in row else calls
        for way in ways.values():
            way()  # warm-up: first-call costs (connections, actor start) stay out
        samples: dict[str, list[float]] = {name: [] for name in ways}
        for r in range(rounds):
            order = list(ways.items())
            for name, way in order[r % len(order) :] + order[: r % len(order)]:
                start = time.perf_counter()
                for _ in range(n):
                    way()
                samples[name].append((time.perf_counter() - start) / n)
        out[row] = {name: statistics.median(s) for name, s in samples.items()}
    return out


def main(ctx: asyncrpc.Context, opts: argparse.Namespace) -> None:
    if ctx.rank != 0:
        return
    import beyond_torch

    small, big = torch.ones(16), torch.ones(256 * 1024)  # 64 B and 1 MiB of float32
    rows = _local_ways(small, big)
    ray = not opts.no_ray and ray_peer.start()
    if ray:
        for row, ways in _ray_ways(small, big).items():
            rows[row].update(ways)
    measured = _measure(rows, opts.calls, opts.rounds)
    beyond = beyond_torch.ray_ways() if ray else None
    beyond_rows = beyond_torch.measure(opts.beyond_rounds, opts.stream_items, beyond)
    with open(opts.results, "w") as f:
        json.dump({"rows": measured, "beyond": beyond_rows, "ray_sockets": ray_peer.sockets}, f)


# ---- start-up and shutdown, each in a fresh process ----------------------------------


def _first_call(ctx: asyncrpc.Context) -> None:
    if ctx.rank == 0:
        asyncrpc.rpc_sync("worker1", echo, args=(1,))
        print(f"FIRST {time.time()}", flush=True)


def _killed_once(ctx: asyncrpc.Context) -> None:
    """Attempt 0: worker1 is killed after the first call; attempt 1 stamps its first call."""
    if ctx.attempt == 0:
        if ctx.rank == 0:
            asyncrpc.rpc_sync("worker1", echo, args=(1,))
            asyncrpc.rpc_sync("worker1", _die)
        time.sleep(60)  # until the supervisor stops this world
    elif ctx.rank == 0:
        asyncrpc.rpc_sync("worker1", echo, args=(1,))
        print(f"RESTART_FIRST {time.time()}", flush=True)


def _die() -> None:
    print(f"KILLED {time.time()}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _probe_asyncrpc() -> None:
    asyncrpc.run(_first_call, 3)
    print(f"END {time.time()}", flush=True)
    print(f"WARM_START {time.time()}", flush=True)
    asyncrpc.run(_first_call, 3)  # a second world: forked from the warm interpreter
    asyncrpc.run(_killed_once, 3, max_restarts=1)


def _torch_worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    options = rpc.TensorPipeRpcBackendOptions(_transports=["uv"], _channels=["basic"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3, rpc_backend_options=options)
    if rank == 0:
        rpc.rpc_sync("worker1", echo, args=(1,))
        print(f"FIRST {time.time()}", flush=True)
    rpc.shutdown()


def _probe_torch() -> None:
    _torch_world()
    print(f"END {time.time()}", flush=True)
    print(f"WARM_START {time.time()}", flush=True)
    _torch_world()  # torch has no warm start: mp.spawn again


def _torch_world() -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_torch_worker, args=(port,), nprocs=3)


def _probe_ray() -> None:
    import ray

    ray_peer.start()
    ways = _ray_ways(torch.ones(16), torch.ones(16))  # starts 4 actors, calls each
    ways["method call on a remote object"]["ray"]()
    print(f"FIRST {time.time()}", flush=True)
    ray.shutdown()
    print(f"END {time.time()}", flush=True)
    print(f"WARM_START {time.time()}", flush=True)
    ray_peer.start()
    ways = _ray_ways(torch.ones(16), torch.ones(16))
    ways["method call on a remote object"]["ray"]()
    print(f"FIRST {time.time()}", flush=True)
    ray.shutdown()


_PROBES = {"asyncrpc": _probe_asyncrpc, "torch": _probe_torch, "ray": _probe_ray}


def _time_startups(ways: list[str], rounds: int) -> dict[str, dict[str, float]]:
    """Seconds from the start call to the first call, and to the end, per way (medians)."""
    first: dict[str, list[float]] = {w: [] for w in ways}
    total: dict[str, list[float]] = {w: [] for w in ways}
    warm: dict[str, list[float]] = {w: [] for w in ways}
    restart: list[float] = []
    for r in range(rounds):
        for way in ways[r % len(ways) :] + ways[: r % len(ways)]:
            done = subprocess.run(
                [sys.executable, __file__, "--probe", way],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            if done.returncode != 0:
                sys.exit(f"the {way} start-up probe failed:\n{done.stderr[-3000:]}")
            stamps = [s for s in map(_stamp, done.stdout.splitlines()) if s is not None]
            at = dict(stamps[:3])  # START, FIRST, END of the first world: a cold start
            later = dict(stamps[3:])  # WARM_START, the second FIRST, KILLED, RESTART_FIRST
            first[way].append(at["FIRST"] - at["START"])
            total[way].append(at["END"] - at["START"])
            warm[way].append(later["FIRST"] - later["WARM_START"])
            if "RESTART_FIRST" in later:
                restart.append(later["RESTART_FIRST"] - later["KILLED"])
    rows = {
        "world start-up to first call": {w: statistics.median(first[w]) for w in ways},
        "start-up, first call and shutdown": {w: statistics.median(total[w]) for w in ways},
        "second world, same process, first call": {w: statistics.median(warm[w]) for w in ways},
    }
    if restart:
        rows["restart after a kill, to first call"] = {"asyncrpc": statistics.median(restart)}
    return rows


_STAMPS = ("START", "FIRST", "END", "WARM_START", "KILLED", "RESTART_FIRST")


def _stamp(line: str) -> tuple[str, float] | None:
    words = line.split()
    if len(words) == 2 and words[0] in _STAMPS:
        return words[0], float(words[1])
    return None


# ---- the report -----------------------------------------------------------------------


def _figures(results: dict[str, dict[str, float]]) -> dict[str, dict[str, Any]]:
    """Row -> seconds per way, calls/s (rows of calls in flight) and the two ratios."""
    rows = {}
    for row, ways in results.items():
        ours = ways["asyncrpc"]
        figures: dict[str, Any] = {"seconds": dict(ways)}
        if "in flight" in row:
            calls = _ASYNC_CALLS if "async def" in row else _IN_FLIGHT
            figures["calls_per_s"] = {way: calls / s for way, s in ways.items()}
        figures["vs_torch"] = ours / ways["torch"] if "torch" in ways else None
        figures["ray_over_ours"] = ways["ray"] / ours if "ray" in ways else None
        rows[row] = figures
    return rows


def _report(rows: dict[str, dict[str, Any]]) -> None:
    print(f"{'row':<40}{'asyncrpc':>12}{'torch':>12}{'Ray':>12}{'vs torch':>10}{'Ray/ours':>10}")
    for row, figures in rows.items():
        cells = []
        for way in ("asyncrpc", "torch", "ray"):
            s = figures["seconds"].get(way)
            rate = figures.get("calls_per_s", {}).get(way)
            cells.append("-" if s is None else f"{rate:.0f}/s" if rate else _seconds(s))
        vs_torch = "-" if figures["vs_torch"] is None else f"{figures['vs_torch']:.2f}x"
        vs_ray = "-" if figures["ray_over_ours"] is None else f"{figures['ray_over_ours']:.1f}x"
        print(f"{row:<40}{cells[0]:>12}{cells[1]:>12}{cells[2]:>12}{vs_torch:>10}{vs_ray:>10}")
    print("vs torch: asyncrpc's time / torch's (<= 1 is as fast); Ray/ours: Ray's time / "
          "asyncrpc's (for calls in flight: asyncrpc's calls/s over Ray's)")  # fmt: skip


def _seconds(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per way per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--startups", type=int, default=3, help="start-up rounds (0: none)")
    parser.add_argument("--no-ray", action="store_true", help="leave Ray out")
    parser.add_argument("--beyond-rounds", type=int, default=20, help="cancel rounds")
    parser.add_argument("--stream-items", type=int, default=2000, help="items per stream sample")
    parser.add_argument("--json", metavar="PATH", help="also write this run's figures here")
    parser.add_argument("--probe", choices=sorted(_PROBES), help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    return parser.parse_args()


def _probe(way: str) -> None:
    print(f"START {time.time()}", flush=True)
    _PROBES[way]()  # prints FIRST, END, then the second world's stamps


def _run(opts: argparse.Namespace) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        opts.results = os.path.join(folder, "results.json")
        asyncrpc.run(main, 3, args=(opts,))
        with open(opts.results) as f:
            measured = json.load(f)
    calls = _figures(measured["rows"])
    startup = {}
    if opts.startups:
        ray = ray_peer.installed() and not opts.no_ray
        ways = ["asyncrpc", "torch"] + (["ray"] if ray else [])
        startup = _figures(_time_startups(ways, opts.startups))
    _report({**calls, **startup})
    print()
    import beyond_torch

    beyond_torch.print_rows(measured["beyond"])
    if opts.json:
        options = {k: v for k, v in vars(opts).items() if k not in ("probe", "results", "json")}
        run_record.write(opts.json, {
            "benchmark": "peers", "options": options, "in_flight": _IN_FLIGHT,
            "calls": calls, "startup": startup, "beyond": measured["beyond"],
            "ray_sockets": measured["ray_sockets"],
        })  # fmt: skip


if __name__ == "__main__":
    options = _parse()
    if options.probe:
        _probe(options.probe)
    else:
        _run(options)
