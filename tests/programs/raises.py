"""worker2 raises from main; the others wait for it."""

import os
import sys

import asyncrpc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from remote_errors import ExampleFailure


def main(ctx: asyncrpc.Context) -> None:
    if ctx.name == "worker2":
        raise ExampleFailure("worker2 could not load its shard")


if __name__ == "__main__":
    asyncrpc.run(main, world_size=3)
