"""Every verb with CUDA tensors, in worlds asyncrpc starts with `devices`; needs CUDA.

    python tests/gpu/gpu_world.py OUT.json

Two worlds, one after the other:
- "gpus": worker0 and worker1 with devices="cuda" (on one GPU both use
  cuda:0), worker2 on CPU: arguments and results, handles, RRefs, Batch,
  streams, cancel, a CUDA tensor sent to the CPU worker, an ensemble on the
  GPU, the trace;
- "explicit": device_maps given by hand (torch's own form).

Each check is recorded as {"ok": bool, ...details}; a check that raised
records the error. The JSON file holds them all; the exit status is 0 when
the script itself ran to its end.
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

import asyncrpc

CHECKS: dict[str, dict[str, Any]] = {}


def check(name: str, run: Callable[[], dict[str, Any]]) -> None:
    try:
        CHECKS[name] = run()
    except Exception as exc:
        CHECKS[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000],
                        "traceback": traceback.format_exc()[-3000:]}  # fmt: skip


# ---- what the callee runs ------------------------------------------------------------


def double(t: torch.Tensor) -> tuple[torch.Tensor, str]:
    return t * 2, str(t.device)


def device_here() -> str:
    """The worker's GPU, where it was given one (the world set it), else "cpu"."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def slow_sum(t: torch.Tensor, seconds: float) -> torch.Tensor:
    time.sleep(seconds)
    return t.sum()


def frames(n: int) -> Iterator[torch.Tensor]:
    """Yields one CUDA buffer, changed in place after each yield: items must not change."""
    buffer = torch.zeros(1024, device="cuda")
    for i in range(n):
        buffer.fill_(float(i))
        torch.cuda._sleep(1_000_000)  # CUDA work queued after the fill, before the yield
        yield buffer
        buffer.fill_(-1.0)  # after the yield: the item sent must not see this


class Holder:
    def __init__(self) -> None:
        self.weights = torch.arange(4.0, device="cuda")

    def get(self) -> torch.Tensor:
        return self.weights

    def add(self, t: torch.Tensor) -> str:
        self.weights += t
        return str(t.device)


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


# ---- the checks, run by worker0 -------------------------------------------------------


def args_and_results() -> dict[str, Any]:
    t = torch.arange(6.0, device="cuda")
    out, seen = asyncrpc.rpc_sync("worker1", double, args=(t,))
    fut_out, _ = asyncrpc.rpc_async("worker1", double, args=(t,)).wait()
    ok = out.is_cuda and seen.startswith("cuda") and torch.equal(out, t * 2)
    ok = ok and torch.equal(fut_out, t * 2)
    return {"ok": ok, "arrived_on": seen, "back_on": str(out.device)}


def handles() -> dict[str, Any]:
    holder = asyncrpc.spawn("worker1", Holder)
    got = holder.call("get")
    seen = holder.call("add", torch.ones(4, device="cuda"))
    mine = asyncrpc.spawn("worker0", Holder)  # on this worker: torch's map to itself
    own = mine.call("add", torch.ones(4, device="cuda"))
    ok = got.is_cuda and seen.startswith("cuda") and own.startswith("cuda")
    return {"ok": ok, "result_on": str(got.device), "arg_on": seen, "own_arg_on": own}


def rrefs() -> dict[str, Any]:
    """The values must be right; where they land is recorded (torch #54560: the map
    may not apply to RRefs)."""
    holder = asyncrpc.spawn("worker1", Holder)
    rref = asyncrpc.remote("worker1", double, args=(torch.ones(3, device="cuda"),))
    value, _ = rref.to_here()
    remote_value = holder.call_remote("get").to_here()
    ok = torch.equal(value.cpu(), torch.full((3,), 2.0))
    ok = ok and torch.equal(remote_value.cpu(), torch.arange(4.0))
    return {"ok": ok, "rref_value_on": str(value.device),
            "call_remote_on": str(remote_value.device)}  # fmt: skip


def batch() -> dict[str, Any]:
    t = torch.ones(5, device="cuda")
    with asyncrpc.Batch() as b:
        futs = [b.rpc_async("worker1", double, args=(t * i,)) for i in range(4)]
    outs = [f.wait()[0] for f in futs]
    return {"ok": all(o.is_cuda and torch.equal(o, t * i * 2) for i, o in enumerate(outs))}


def streams() -> dict[str, Any]:
    items = list(asyncrpc.stream("worker1", frames, args=(5,)))
    firsts = [float(item[0]) for item in items]
    whole = all(bool((item == float(i)).all()) for i, item in enumerate(items))
    return {"ok": firsts == [0.0, 1.0, 2.0, 3.0, 4.0] and whole and items[0].is_cuda,
            "firsts": firsts, "on": str(items[0].device)}  # fmt: skip


def cancel() -> dict[str, Any]:
    fut = asyncrpc.rpc_async("worker1", slow_sum, args=(torch.ones(3, device="cuda"), 5.0))
    time.sleep(0.3)
    cancelled = asyncrpc.cancel(fut)
    try:
        fut.wait()
        outcome = "completed"
    except asyncrpc.CancelledError:
        outcome = "cancelled"
    after, _ = asyncrpc.rpc_sync("worker1", double, args=(torch.ones(2, device="cuda"),))
    return {"ok": cancelled and outcome == "cancelled" and after.is_cuda, "outcome": outcome}


def to_the_cpu_worker() -> dict[str, Any]:
    try:
        asyncrpc.rpc_sync("worker2", double, args=(torch.ones(2, device="cuda"),))
    except asyncrpc.DeviceMapError as exc:
        return {"ok": "devices='cuda'" in str(exc), "message": str(exc)[:500]}
    return {"ok": False, "message": "no error"}


def cpu_tensor_to_the_cpu_worker() -> dict[str, Any]:
    out, seen = asyncrpc.rpc_sync("worker2", double, args=(torch.ones(2),))
    return {"ok": seen == "cpu" and not out.is_cuda}


def ensemble() -> dict[str, Any]:
    torch.manual_seed(0)
    members = [mlp().cuda() for _ in range(16)]
    x = torch.randn(64, 16, device="cuda")
    with torch.no_grad():
        stacked = asyncrpc.Fanout(members, engine="vmap")
        outs = stacked(x)
        serial = [m(x) for m in members]
    close = all(torch.allclose(a, b, atol=1e-5) for a, b in zip(outs, serial, strict=True))
    mixed = asyncrpc.Fanout([mlp().cuda(), mlp()], engine="vmap")
    reason = mixed.declined.get("vmap", "")
    ok = close and "vmap" not in stacked.declined and outs[0].is_cuda
    ok = ok and "a stacked call runs on one device" in reason
    return {"ok": ok, "plan": str(stacked.plan), "mixed_declined": reason}


def fanout_over_workers() -> dict[str, Any]:
    x = torch.randn(8, 16, device="cuda")
    holders = [asyncrpc.spawn(name, Holder) for name in ("worker0", "worker1")]
    outs = asyncrpc.gather([h.call_async("add", x[0, :4]) for h in holders]).wait()
    return {"ok": all(o.startswith("cuda") for o in outs), "seen": outs}


def traced() -> dict[str, Any]:
    folder = pathlib.Path(tempfile.mkdtemp(prefix="asyncrpc-gpu-trace-"))
    path = folder / "trace.json"
    with asyncrpc.trace(str(path)):
        asyncrpc.rpc_sync("worker1", double, args=(torch.ones(1 << 16, device="cuda"),))
    events = json.loads(path.read_text())
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    names = [e["args"].get("name", "") for e in events if e.get("name") == "thread_name"]
    lanes = sorted({name for name in names if "stream" in name})
    kernels = sum(1 for e in events if e.get("cat") == "kernel")
    return {"ok": bool(lanes) and kernels > 0, "cuda_lanes": lanes, "kernels": kernels}


def gpus(ctx: asyncrpc.Context) -> None:
    if ctx.rank != 0:
        return
    found = {n: asyncrpc.rpc_sync(n, device_here) for n in ctx.names}
    ok = found["worker0"].startswith("cuda") and found["worker1"].startswith("cuda")
    CHECKS["devices"] = {"ok": ok, **found}  # worker2's is recorded: it has no map
    for name, run in [("args_and_results", args_and_results), ("handles", handles),
                      ("rrefs", rrefs), ("batch", batch),
                      ("streams", streams), ("cancel", cancel),
                      ("to_the_cpu_worker", to_the_cpu_worker),
                      ("cpu_tensor_to_the_cpu_worker", cpu_tensor_to_the_cpu_worker),
                      ("ensemble", ensemble), ("fanout_over_workers", fanout_over_workers),
                      ("trace", traced)]:  # fmt: skip
        check(name, run)
    pathlib.Path(sys.argv[1] + ".gpus").write_text(json.dumps(CHECKS))


def explicit(ctx: asyncrpc.Context) -> None:
    if ctx.rank != 0:
        return
    check("explicit_maps", args_and_results)
    pathlib.Path(sys.argv[1] + ".explicit").write_text(json.dumps(CHECKS))


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1])
    results: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        results["card"] = torch.cuda.get_device_name(0)
        for label, body, options in [
            ("gpus", gpus, {"devices": {"worker0": "cuda", "worker1": "cuda", "worker2": "cpu"}}),
            # Every worker gets the same device_maps: the entry naming itself is its own.
            ("explicit", explicit, {"devices": ["cuda:0"], "device_maps": {
                "worker0": {"cuda:0": "cuda:0"}, "worker1": {"cuda:0": "cuda:0"}}}),
        ]:  # fmt: skip
            size = 3 if label == "gpus" else 2
            try:
                asyncrpc.run(body, world_size=size, **options)
                part = pathlib.Path(str(out) + "." + label)
                results.update(json.loads(part.read_text()))
            except Exception as exc:
                results[label] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:3000]}
    out.write_text(json.dumps(results, indent=1))
