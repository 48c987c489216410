"""asyncrpc: torch.distributed.rpc made pleasant and safe for multi-worker programs.

Example::

    import asyncrpc, torch

    def main(ctx):
        if ctx.rank == 0:
            print(asyncrpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)))

    if __name__ == "__main__":
        asyncrpc.run(main, world_size=2)
"""

from ._actor import actor, method
from ._actor_pool import ActorPool
from ._batch import Batch
from ._core._calls import remote, rpc_async, rpc_sync
from ._core._cancel import cancel, cancelled
from ._core._elastic import add_workers, members, on_members, remove_workers, stopping
from ._core._errors import (
    AsyncRPCError,
    AwaitedNonFutureError,
    BatchNotSentError,
    CallTimeoutError,
    CancelledError,
    DeviceMapError,
    DuplicateNameError,
    JoinTimeoutError,
    NestedCallError,
    NotAFutureError,
    NotElasticError,
    NotInitializedError,
    ObjectLostError,
    PortInUseError,
    RemoteError,
    RendezvousError,
    SerializationError,
    StoreTimeoutError,
    UnknownWorkerError,
    UnsupportedTorchError,
    WorkerFailedError,
    WorkerLeftError,
    WorkerUnreachableError,
    WorldFullError,
    WorldSizeMismatchError,
)
from ._core._execution import async_execution
from ._core._futures import (
    as_completed,
    chain,
    completed,
    enable_await,
    failed,
    gather,
    wait_first,
    with_timeout,
)
from ._core._init import init
from ._core._membership import Joined, Left
from ._core._objects import ObjectRef, get, put
from ._core._stream import Stream, stream
from ._core._unwaited import log_unwaited_failures
from ._core._world import (
    Context,
    Replaced,
    Settings,
    current_context,
    on_replaced,
    shutdown,
)
from ._ensemble import Ensemble
from ._fanout._fanout import Fanout, fanout
from ._fanout._tuner import FanoutPlan
from ._handles import RemoteModule, RemoteObject
from ._launch._supervisor import run
from ._spawn import call_all, spawn
from ._trace._render import render_trace
from ._trace._trace import Trace, trace
from ._wait import wait

__version__ = "0.1.0"

__all__ = (
    "ActorPool",
    "AsyncRPCError",
    "AwaitedNonFutureError",
    "Batch",
    "BatchNotSentError",
    "CallTimeoutError",
    "CancelledError",
    "Context",
    "DeviceMapError",
    "DuplicateNameError",
    "Ensemble",
    "Fanout",
    "FanoutPlan",
    "JoinTimeoutError",
    "Joined",
    "Left",
    "NestedCallError",
    "NotAFutureError",
    "NotElasticError",
    "NotInitializedError",
    "ObjectLostError",
    "ObjectRef",
    "PortInUseError",
    "RemoteError",
    "RemoteModule",
    "RemoteObject",
    "RendezvousError",
    "Replaced",
    "SerializationError",
    "Settings",
    "StoreTimeoutError",
    "Stream",
    "Trace",
    "UnknownWorkerError",
    "UnsupportedTorchError",
    "WorkerFailedError",
    "WorkerLeftError",
    "WorkerUnreachableError",
    "WorldFullError",
    "WorldSizeMismatchError",
    "actor",
    "add_workers",
    "as_completed",
    "async_execution",
    "call_all",
    "cancel",
    "cancelled",
    "chain",
    "completed",
    "current_context",
    "enable_await",
    "failed",
    "fanout",
    "gather",
    "get",
    "init",
    "log_unwaited_failures",
    "members",
    "method",
    "on_members",
    "on_replaced",
    "put",
    "remote",
    "remove_workers",
    "render_trace",
    "rpc_async",
    "rpc_sync",
    "run",
    "shutdown",
    "spawn",
    "stopping",
    "stream",
    "trace",
    "wait",
    "wait_first",
    "with_timeout",
)


def _public_here() -> None:
    # Every public name is asyncrpc's: tracebacks, reprs, pickles and the reference
    # say `asyncrpc.CallTimeoutError`, not the private module that defines it.
    for name in __all__:
        obj = globals()[name]
        if getattr(obj, "__module__", "").startswith("asyncrpc."):
            obj.__module__ = __name__


_public_here()
