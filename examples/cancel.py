"""Cancelling remote work: the first answer wins, the others stop; a deadline cancels.

Three searchers (worker1..worker3) look for a key, each at its own pace; the
first to answer wins and the others are cancelled: each sees CancelledError
at its `await`, and the call it was awaiting stops too. Then a call that
cannot finish in time is cancelled by its deadline (`with_timeout(...,
cancel=True)`), and a sync loop stops early by polling `asyncrpc.cancelled()`.

    python examples/cancel.py
"""

from __future__ import annotations

import asyncio
import time

import asyncrpc


def probe(seconds: float) -> float:
    """One slow step of a search (sync: it runs to its end)."""
    time.sleep(seconds)
    return seconds


async def search(key: str, step_s: float, steps: int) -> str:
    me = asyncrpc.current_context().name
    try:
        for _ in range(steps):
            await asyncrpc.rpc_async(me, probe, args=(step_s,))
        return f"{me} found {key!r}"
    except asyncio.CancelledError:
        print(f"{me}: cancelled, stopping", flush=True)
        raise


def scan(seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if asyncrpc.cancelled():
            print(f"{asyncrpc.current_context().name}: scan saw it was cancelled", flush=True)
            return "stopped"
        time.sleep(0.01)
    return "finished"


def main(ctx: asyncrpc.Context) -> None:
    if ctx.rank != 0:
        return
    paces = {"worker1": 0.05, "worker2": 0.2, "worker3": 0.3}
    futs = [asyncrpc.rpc_async(w, search, args=("k", pace, 5)) for w, pace in paces.items()]
    first = asyncrpc.wait_first(futs).wait()
    print(f"first: {first.wait()}")
    cancelled = [fut for fut in futs if fut.cancel()]  # the ones still running
    for fut in cancelled:
        try:
            fut.wait()
        except asyncrpc.CancelledError as exc:
            print(f"cancelled: {exc}")
    late = asyncrpc.with_timeout(asyncrpc.rpc_async("worker2", search, args=("k", 1, 5)), 0.3,
                                 cancel=True)  # fmt: skip
    try:
        late.wait()
    except TimeoutError as exc:
        print(f"deadline: {exc}")
    polling = asyncrpc.rpc_async("worker3", scan, args=(30.0,))
    time.sleep(0.2)
    polling.cancel()
    try:
        polling.wait()
    except asyncrpc.CancelledError:
        print("scan: cancelled")
    time.sleep(0.3)  # let the searchers print their last words before the world ends


if __name__ == "__main__":
    asyncrpc.run(main, world_size=4)
