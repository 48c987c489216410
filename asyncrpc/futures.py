"""Future composition for torch Futures (also re-exported as `asyncrpc.<name>`).

Example::

    from asyncrpc import futures

    values = futures.gather([asyncrpc.rpc_async(n, f) for n in ctx.names]).wait()
"""

from ._core._futures import (
    as_completed,
    chain,
    completed,
    failed,
    gather,
    wait_first,
    with_timeout,
)

__all__ = (
    "as_completed",
    "chain",
    "completed",
    "failed",
    "gather",
    "wait_first",
    "with_timeout",
)
