"""A world started by torch's own `rpc.init_rpc`, used through every asyncrpc verb.

    python tests/programs/torch_world.py spawn OUT_DIR                 # mp.spawn, 3 workers
    torchrun --nproc-per-node 3 tests/programs/torch_world.py torchrun OUT_DIR

asyncrpc never starts this world: it adopts it on first use, and every worker
leaves it with asyncrpc.shutdown() in place of torch's rpc.shutdown(). Worker 0
prints one `ok: ...` line per check; any failure raises and exits non-zero.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import sys
import time

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

import asyncrpc

WORLD_SIZE = 3


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def add(self, n: int) -> int:
        self.value += n
        return self.value

    async def add_later(self, to: str, n: int) -> int:
        return self.add(await asyncrpc.rpc_async(to, int, args=(n,)))


class Tally:
    """Records how many of its calls overlap, and the order they ran in."""

    def __init__(self) -> None:
        self.active = self.most = 0
        self.order: list[int] = []

    def add(self, tag: int) -> int:
        self.active += 1
        self.most = max(self.most, self.active)
        time.sleep(0.002)
        self.order.append(tag)
        self.active -= 1
        return tag

    def state(self) -> tuple[int, list[int]]:
        return self.most, self.order

    async def nap(self, seconds: float) -> float:
        await asyncio.sleep(seconds)
        return seconds


@asyncrpc.async_execution
async def add_chained(to: str, x: torch.Tensor, y: int) -> torch.Tensor:
    return await asyncrpc.rpc_async(to, torch.add, args=(x, y)) + 1


def where() -> str:
    return asyncrpc.current_context().name


def lookup(key: str) -> int:
    return {"a": 1}[key]


def check(name: str, ok: bool, detail: object = "") -> None:
    if not ok:
        raise AssertionError(f"{name}: {detail}")
    print(f"ok: {name}", flush=True)


def use_every_verb(out: pathlib.Path) -> None:
    ctx = asyncrpc.current_context()
    check("context", ctx.names == ("worker0", "worker1", "worker2") and ctx.rank == 0, ctx)
    ones = torch.ones(2)
    got = asyncrpc.rpc_sync(to="worker1", func=torch.add, args=(ones, 1), kwargs=None)
    check("rpc_sync by keyword", torch.equal(got, ones + 1), got)
    check("rpc_sync python", asyncrpc.rpc_sync(2, where) == "worker2")
    fut = asyncrpc.rpc_async("worker1", add_chained, args=("worker2", ones, 1))
    check("rpc_async async def", torch.equal(fut.wait(), ones + 2))
    rref = asyncrpc.remote("worker2", Counter, args=(5,))
    check("remote is torch's", isinstance(rref, rpc.PyRRef) and rref.to_here().value == 5)
    counter = asyncrpc.spawn("worker1", Counter, 10)
    check("spawn call", counter.call("add", 1) == 11)
    check("spawn call_async", counter.options(timeout=20).call_async("add", 1).wait() == 12)
    check("spawn call_remote", counter.call_remote("add", 1).to_here() == 13)
    check("spawn async def method", counter.call("add_later", "worker2", 1) == 14)
    proxied = counter.rpc_sync().add_later("worker2", 1)
    check("proxy of an async def method", proxied == 15, proxied)
    wrapped = asyncrpc.RemoteObject(rpc.remote("worker2", Counter, args=(1,)))
    check("wrap torch's rref", wrapped.call("add", 1) == 2)
    both = asyncrpc.call_all([counter, wrapped], "add", 1).wait()
    check("call_all", both == [16, 3], both)
    use_actors()
    errors = []
    for read in (
        lambda: asyncrpc.rpc_sync("worker1", lookup, args=("b",)),
        lambda: asyncrpc.remote("worker1", lookup, args=("b",)).to_here(),
    ):
        try:
            read()
        except KeyError as exc:
            errors.append(exc)
    same = [type(e).__mro__[:4] for e in errors]
    remote_errors = all(isinstance(e, (RuntimeError, asyncrpc.RemoteError)) for e in errors)
    check("remote KeyError keeps its type", len(errors) == 2 and remote_errors, errors)
    check("the same error through rpc_sync and remote", same[0] == same[1], same)
    spread = asyncrpc.Ensemble(torch.nn.Linear, 4, 3, 2, workers=["worker1", "worker2"], seed=0)
    local = asyncrpc.Ensemble(torch.nn.Linear, 4, 3, 2, seed=0)
    x = torch.randn(5, 3)
    check("ensemble", torch.allclose(spread(x), local(x), atol=1e-6))
    with asyncrpc.trace(out / "trace.json"):
        asyncrpc.rpc_sync("worker1", add_chained, args=("worker2", ones, 1))
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    named = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    check("trace", named == {"worker0", "worker1", "worker2"}, named)


def use_actors() -> None:
    tally = asyncrpc.spawn("worker2", Tally)
    torch.futures.wait_all([tally.call_async("add", i) for i in range(16)])
    state = tally.call("state")
    check("actor: one call at a time, in order", state == (1, list(range(16))), state)
    start = time.monotonic()
    naps = tally.call_async("nap", 0.3), *(tally.call_async("nap", 0.2) for _ in range(15))
    torch.futures.wait_all(list(naps))
    took = time.monotonic() - start
    check("actor: asyncio in an async method, interleaved", took < 3.0, took)
    done, pending = asyncrpc.wait([tally.call_async("nap", 5.0), naps[0]], timeout=30)
    check("wait", done == [naps[0]] and len(pending) == 1, (done, pending))
    pending[0].cancel()  # the nap stops at its await
    pool = asyncrpc.ActorPool([tally, asyncrpc.spawn("worker1", Tally)])
    got = list(pool.map(lambda h, tag: h.call_async("add", tag), range(6)))
    check("ActorPool", got == list(range(6)), got)


def worker(rank: int, out: str) -> None:
    # uv: TensorPipe's default shared-memory transport busy-polls a core per worker.
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=8, rpc_timeout=60, _transports=["uv"]
    )
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=WORLD_SIZE, rpc_backend_options=options)
    if rank == 0:
        use_every_verb(pathlib.Path(out))
    asyncrpc.shutdown()  # in place of torch's rpc.shutdown(), on every worker
    if rank == 0:
        try:
            asyncrpc.rpc_sync("worker1", where)
        except asyncrpc.NotInitializedError as exc:
            check("after asyncrpc.shutdown", "no RPC agent runs" in str(exc), exc)


if __name__ == "__main__":
    mode, out_dir = sys.argv[1], sys.argv[2]
    if mode == "spawn":
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        mp.spawn(worker, args=(out_dir,), nprocs=WORLD_SIZE)
    else:
        worker(int(os.environ["RANK"]), out_dir)
