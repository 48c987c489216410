"""Hang reports: a slow call logs one WARNING after hang_report_after, a quick one nothing.

Every verb is tried at once, each on its own slow function on worker1:
rpc_sync, rpc_async, remote, a handle's call and a stream.

python tests/programs/hang_report.py
"""

import logging
import threading
import time
from collections.abc import Iterator

import asyncrpc

SLOW_S = 2.5


def slow_sync() -> str:
    time.sleep(SLOW_S)  # the user's code: the report names this line
    return "sync done"


def slow_async() -> str:
    time.sleep(SLOW_S)
    return "async done"


def slow_remote() -> str:
    time.sleep(SLOW_S)
    return "remote done"


def slow_items() -> Iterator[str]:
    time.sleep(SLOW_S)
    yield "stream done"


class Slow:
    def quick(self) -> str:
        return "quick method done"

    def method(self) -> str:
        time.sleep(SLOW_S)
        return "method done"


def quick() -> str:
    return "quick done"


def main(ctx: asyncrpc.Context) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if ctx.rank != 0:
        return
    handle = asyncrpc.spawn("worker1", Slow)
    quick_ones = [asyncrpc.rpc_sync("worker1", quick), asyncrpc.remote("worker1", quick).to_here()]
    print(*quick_ones, handle.call("quick"))
    ways = {
        "rpc_sync": lambda: asyncrpc.rpc_sync("worker1", slow_sync),
        "rpc_async": lambda: asyncrpc.rpc_async("worker1", slow_async).wait(),
        "remote": lambda: asyncrpc.remote("worker1", slow_remote).to_here(),
        "handle": lambda: handle.call("method"),
        "stream": lambda: next(iter(asyncrpc.stream("worker1", slow_items))),
    }
    results: dict[str, str] = {}
    threads = [
        threading.Thread(target=lambda k=k, f=f: results.__setitem__(k, f()))
        for k, f in ways.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(sorted(results.values()))


if __name__ == "__main__":
    asyncrpc.run(main, world_size=2, hang_report_after=1)
