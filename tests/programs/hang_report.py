"""Hang reports: a slow call logs one WARNING after hang_report_after, a quick one nothing.

python tests/programs/hang_report.py
"""

import logging
import time

import asyncrpc


def slow() -> str:
    time.sleep(2.5)  # the user's code: the report names this line
    return "slow done"


def quick() -> str:
    return "quick done"


def main(ctx: asyncrpc.Context) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if ctx.rank == 0:
        print(asyncrpc.rpc_sync("worker1", quick), asyncrpc.rpc_async("worker1", slow).wait())


if __name__ == "__main__":
    asyncrpc.run(main, world_size=2, hang_report_after=1)
