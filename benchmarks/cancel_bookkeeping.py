"""Cancel bookkeeping stays bounded: 20,000 cancels racing their calls' completion.

The caller sends a small call and cancels it at once or a moment later, in
blocks of 5,000; some cancels win, some lose to the reply. After each block the callee
reports the CPU time it spent in that block, its resident memory (after
glibc's malloc_trim) and the cancel records it holds (running calls,
tombstones, recently ended calls). Flat CPU per block and flat memory mean
nothing grows per cancel.

    python benchmarks/cancel_bookkeeping.py [--blocks 4] [--per-block 5000]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import resource
import time

import asyncrpc
from asyncrpc._core import _cancel


def echo(i: int) -> int:
    return i


def callee_state() -> tuple[float, float, dict[str, int]]:
    """(CPU seconds so far, resident MiB, cancel records) of this worker."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return usage.ru_utime + usage.ru_stime, rss / 1024, _cancel.bookkeeping()


def block(n: int) -> tuple[int, int]:
    """`n` calls each cancelled at once; (cancels that won, cancels that lost)."""
    won = lost = 0
    for i in range(n):
        fut = asyncrpc.rpc_async("worker1", echo, args=(i,))
        if i % 3:  # at once, or after a moment: some cancels win, some lose to the reply
            time.sleep(0.0003 * (i % 4))
        if fut.cancel():
            won += 1
        else:
            lost += 1
        try:
            fut.wait()
        except asyncrpc.CancelledError:
            pass
    return won, lost


def main(ctx: asyncrpc.Context, opts: argparse.Namespace) -> None:
    if ctx.rank != 0:
        return
    block(200)  # warm-up: connections, allocator pools
    time.sleep(0.5)
    cpu, rss, held = asyncrpc.rpc_sync("worker1", callee_state)
    print(f"before: callee RSS {rss:.1f} MiB, records {held}")
    print("| block | cancels won / lost | callee CPU s | callee RSS MiB | tombstones | ended |")
    print("| --- | --- | --- | --- | --- | --- |")
    first = None
    for number in range(1, opts.blocks + 1):
        won, lost = block(opts.per_block)
        time.sleep(0.2)  # the last cancels reach the callee
        now, rss, held = asyncrpc.rpc_sync("worker1", callee_state)
        spent, cpu = now - cpu, now
        first = first or spent
        print(
            f"| {number} | {won} / {lost} | {spent:.2f} | {rss:.1f} | {held['tombstones']} "
            f"| {held['ended']} |"
        )
    print(f"CPU per block, last / first: {spent / first:.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--per-block", type=int, default=5000)
    asyncrpc.run(main, world_size=2, args=(parser.parse_args(),))
