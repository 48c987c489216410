"""An embedded world started by a script whose stdout is closed (`python script.py >&-`).

Python then has `sys.stdout = None`; the world still runs, and the caller
writes rank 0's result to stderr.
"""

from __future__ import annotations

import sys

import asyncrpc


def main(ctx: asyncrpc.Context) -> int:
    return 40 + ctx.world_size


if __name__ == "__main__":
    assert sys.stdout is None, "run this with its stdout closed"
    sys.stderr.write(f"result={asyncrpc.run(main, world_size=2)}\n")
