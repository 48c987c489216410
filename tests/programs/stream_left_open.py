"""Streams their consumer never closed are closed on the producer when its world ends.

    python tests/programs/stream_left_open.py MARKER_FILE

worker1 opens a `def` and an `async def` stream from worker0, reads one item
of each and keeps both open (as a consumer that died would leave them). When
the world ends, worker0 closes both generators: each `finally` appends a
line to MARKER_FILE, naming the worker it runs on (its world is still
visible there). Prints what worker0 held open before the end.
"""

import sys
from collections.abc import AsyncIterator, Iterator

import asyncrpc
from asyncrpc._core import _stream

kept: list[object] = []


def counting(marker: str) -> Iterator[int]:
    try:
        yield from range(1_000_000)
    finally:
        with open(marker, "a") as file:
            file.write(f"def generator closed on {asyncrpc.current_context().name}\n")


async def counting_async(marker: str) -> AsyncIterator[int]:
    try:
        for i in range(1_000_000):
            yield i
    finally:
        with open(marker, "a") as file:
            file.write(f"async generator closed on {asyncrpc.current_context().name}\n")


def main(ctx: asyncrpc.Context, marker: str) -> None:
    if ctx.rank == 1:
        for func in (counting, counting_async):
            stream = asyncrpc.stream("worker0", func, args=(marker,), window=4)
            assert next(stream) == 0  # next() reads one item; the stream stays open
            kept.append(stream)  # never closed, never dropped
        held = asyncrpc.rpc_sync("worker0", _stream.open_producers)
        print(f"worker0 holds {held} open streams", flush=True)


if __name__ == "__main__":
    asyncrpc.run(main, world_size=2, args=(sys.argv[1],))
