"""Every exception asyncrpc raises, in one place.

Each class is named by what happened. All derive from `AsyncRPCError`, and
each also derives from the built-in exception a caller would catch without
knowing asyncrpc (`LookupError` for an unknown worker, `OSError` for a busy
port). Where an error stands for a failure torch reports itself, it is also
an instance of the type torch raises there (`RuntimeError` for a timeout, a
dead worker or RPC used outside a world) and keeps torch's text in its
message, so code written against torch keeps catching it.
"""

from __future__ import annotations

import concurrent.futures
import pickle
import signal

__all__ = [
    "AsyncRPCError",
    "AwaitedNonFutureError",
    "BatchNotSentError",
    "CallTimeoutError",
    "CancelledError",
    "DeviceMapError",
    "DuplicateNameError",
    "JoinTimeoutError",
    "NestedCallError",
    "NotAFutureError",
    "NotElasticError",
    "NotInitializedError",
    "ObjectLostError",
    "PortInUseError",
    "RemoteError",
    "RendezvousError",
    "SerializationError",
    "StoreTimeoutError",
    "UnknownWorkerError",
    "UnsupportedTorchError",
    "WorkerFailedError",
    "WorkerLeftError",
    "WorkerUnreachableError",
    "WorldFullError",
    "WorldSizeMismatchError",
]


class AsyncRPCError(Exception):
    """Base class of every error raised by asyncrpc itself."""


class RendezvousError(AsyncRPCError, RuntimeError):
    """The workers could not form a world (a peer never came, a rank was taken twice...)."""


class StoreTimeoutError(RendezvousError, TimeoutError):
    """A wait on the world's store outlived its deadline; the message says what was awaited."""


class PortInUseError(RendezvousError, OSError):
    """The rendezvous port is already taken by another process."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(
            f"port {port} on {host} is already in use, so the rendezvous store cannot "
            f"listen there; pass another master_port=..., or master_port=0 to pick a "
            f"free one, or stop the process holding it (ss -ltnp 'sport = :{port}')"
        )
        self.host = host
        self.port = port


class WorldSizeMismatchError(RendezvousError, ValueError):
    """Two sources disagree on how many workers the world has."""


class DuplicateNameError(RendezvousError, ValueError):
    """Two workers asked for the same name."""


class UnknownWorkerError(AsyncRPCError, LookupError, RuntimeError):
    """A call named a worker that is not part of the world (torch: RuntimeError)."""


class NotInitializedError(AsyncRPCError, RuntimeError):
    """No RPC agent runs in this process (before init or after shutdown)."""


class RemoteError(AsyncRPCError, RuntimeError):
    """The remote function raised. The error is also an instance of the type it raised.

    A `KeyError` raised on worker1 reaches the caller as an exception that is a
    `KeyError`, a `RemoteError` and a `RuntimeError` (the type torch raises
    for any remote failure). Its message ends with the worker and the remote
    traceback; `remote_text` holds that part alone.

    Example::

        try:
            asyncrpc.rpc_sync("worker1", {}.__getitem__, args=("missing",))
        except KeyError as exc:
            assert isinstance(exc, asyncrpc.RemoteError)
    """

    remote_text: str


class NotAFutureError(AsyncRPCError, RuntimeError):
    """An `async_execution` function returned something that is not a torch Future.

    A RuntimeError, the type torch's own decorator raises for a wrong return.
    """


class AwaitedNonFutureError(AsyncRPCError, TypeError):
    """An `async_execution` coroutine awaited something that is not a torch Future."""


class WorkerUnreachableError(AsyncRPCError, RuntimeError, ConnectionError):
    """A call could not reach its worker, or the connection broke (the worker has died).

    Attribute `name`: the worker that was called.
    """

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name

    def __reduce__(self) -> tuple[object, ...]:
        # With its state: notes (where a relayed failure was raised) cross too.
        return (type(self), (str(self), self.name), dict(vars(self)))


class ObjectLostError(WorkerUnreachableError):
    """The object a handle or RRef refers to lived on a worker that died.

    In a world that heals (`restart="worker"`) the worker's replacement
    starts without the objects the dead process held: every verb on such a
    handle raises this, also after the heal. Attribute `name`: the owner's
    name. Spawn the object again (`asyncrpc.on_replaced` says when).
    """


class WorkerLeftError(WorkerUnreachableError):
    """A call went to a worker that was removed from the world (`asyncrpc.remove_workers`).

    Calls to it fail at once from the moment its removal began, and calls
    it was running when it was stopped fail with this too. Attribute `name`:
    the worker that left. The message says who removed it.
    """


class DeviceMapError(AsyncRPCError, RuntimeError, ValueError):
    """A CUDA tensor went to a worker with no device mapped for it; or bad `devices`.

    torch moves a CUDA tensor only along a device map (`device_maps`, or the
    maps `devices="cuda"` makes between workers that have GPUs). A worker
    started without a GPU (`devices` left out, or `"cpu"`) has none: send it
    `tensor.cpu()`. Also a RuntimeError, as torch raises, with torch's text
    inside; also a ValueError for `devices`/`device_maps` refused at start.
    """


class WorldFullError(AsyncRPCError, RuntimeError):
    """`add_workers` would take the world past its `max_world_size`; nothing was started."""


class NotElasticError(AsyncRPCError, RuntimeError):
    """A membership change was asked of a world whose members are fixed.

    Start the world with `asyncrpc.run(main, world_size=N, elastic=True)` (or
    `restart="worker"`, which is elastic too).
    """


class JoinTimeoutError(AsyncRPCError, TimeoutError):
    """Workers `add_workers` started did not join within its timeout; they were stopped."""


class CallTimeoutError(AsyncRPCError, RuntimeError, TimeoutError):
    """A call did not complete within its timeout. Attribute `name`: the worker called.

    Also a RuntimeError, as torch raises for a timeout, with torch's text inside.
    """

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name

    def __reduce__(self) -> tuple[object, ...]:
        # With its state: notes (where a relayed failure was raised) cross too.
        return (type(self), (str(self), self.name), dict(vars(self)))


class WorkerFailedError(AsyncRPCError):
    """A worker of an `asyncrpc.run` world raised an exception or died.

    Attributes: `name` and `rank` of the worker, `exitcode` (negative for a
    signal, as in `multiprocessing`), and `remote_traceback`, the worker's
    formatted traceback when it raised (empty when it was killed).

    Example::

        try:
            asyncrpc.run(main, world_size=4)
        except asyncrpc.WorkerFailedError as failure:
            print(failure.summary())   # worker 'worker2' (rank 2) was killed by SIGKILL
    """

    def __init__(
        self, name: str, rank: int, exitcode: int | None, remote_traceback: str = ""
    ) -> None:
        self.name = name
        self.rank = rank
        self.exitcode = exitcode
        self.remote_traceback = remote_traceback
        super().__init__(self._describe())

    def summary(self) -> str:
        """The first line of the message: who failed and how."""
        if self.remote_traceback:
            last = self.remote_traceback.rstrip().splitlines()[-1]
            return f"worker {self.name!r} (rank {self.rank}) raised {last}"
        return self._describe()

    def _describe(self) -> str:
        who = f"worker {self.name!r} (rank {self.rank})"
        if self.remote_traceback:
            return f"{who} raised:\n{self.remote_traceback.rstrip()}"
        how = describe_exit(self.exitcode)
        if self.exitcode is not None and self.exitcode < 0:
            return f"{who} {how}"
        if self.exitcode == LISTENER_CLOSED_EXIT:
            return (
                f"{who} {how}: something connected to its port and closed before torch's "
                f"first message (a replacement killed as it joined, a port scanner, a TCP "
                f"health check); keep scanners and health checks off the workers' ports"
            )
        if self.exitcode == 0:  # no error: it left without returning from main
            return (
                f"{who} {how} while its world still ran (a normal exit, such as os._exit(0), "
                f"not a return from main)"
            )
        return f"{who} {how} before it could report an error; its own output above may say why"

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.name, self.rank, self.exitcode, self.remote_traceback))


# The exit code of a worker of a world that heals that ends because torch closed
# its listener (see `_healing`): the world replaces it.
LISTENER_CLOSED_EXIT = 76
# ... and of a replacement whose join another member refused (that member's listener
# closed: it ends and is replaced too); its supervisor starts it again, uncounted.
JOIN_REFUSED_EXIT = 77


def describe_exit(exitcode: int | None) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it)."""
    if exitcode == LISTENER_CLOSED_EXIT:
        return (
            f"ended (exit code {exitcode}: in a world that heals, asyncrpc's code for a "
            f"worker whose listener torch had closed, so that no process could connect to "
            f"it any more)"
        )
    if exitcode == JOIN_REFUSED_EXIT:
        return (
            f"ended (exit code {exitcode}: in a world that heals, asyncrpc's code for a "
            f"replacement whose join another member refused, its listener closed)"
        )
    if exitcode is None or exitcode >= 0:
        return f"exited with code {exitcode}"
    try:
        return f"was killed by {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"was killed by signal {-exitcode}"


class SerializationError(AsyncRPCError, RuntimeError, TypeError, pickle.PicklingError):
    """An argument, a result or a remote exception could not be pickled or unpickled.

    Also each type torch or pickle raises there: `PicklingError` or `TypeError`
    for an argument, `RuntimeError` for a reply.
    """


class NestedCallError(AsyncRPCError, RuntimeError):
    """A blocking call from inside an RPC would leave the worker no thread to serve replies.

    torch runs incoming calls on a fixed pool of RPC threads; when every one of
    them waits in a nested `rpc_sync`, nothing is left to process the replies,
    and the worker stalls until each call times out. asyncrpc refuses the call
    that would take the last thread instead. Likewise a coroutine's blocking
    call to a coroutine of its own worker: both need the worker's one event
    loop, which the waiting coroutine holds (`await` the call instead).
    """


class UnsupportedTorchError(AsyncRPCError, RuntimeError):
    """The installed torch lacks a private hook asyncrpc relies on.

    The message names the hook and the torch versions asyncrpc is tested with.
    """


class BatchNotSentError(AsyncRPCError, RuntimeError):
    """A Future of a `Batch` was read before the Batch was sent, or the Batch was dropped.

    Its calls leave when the `with asyncrpc.Batch()` block ends or at
    `batch.send()`; a Future read before that could never complete.
    """


class CancelledError(AsyncRPCError, concurrent.futures.CancelledError):
    """A call was cancelled (`fut.cancel()`, `asyncrpc.cancel(fut)`) before it finished.

    Also a `concurrent.futures.CancelledError`. The message names the worker
    and the function. Attribute `name`: the worker that ran (or was to run) it.

    Example::

        fut = asyncrpc.rpc_async("worker1", slow_search, args=(query,))
        fut.cancel()
        try:
            fut.wait()
        except asyncrpc.CancelledError as exc:
            print(exc)   # the call to slow_search() on worker 'worker1' (rank 1) was cancelled
    """

    def __init__(self, message: str, name: str = "") -> None:
        super().__init__(message)
        self.name = name

    def __reduce__(self) -> tuple[object, ...]:
        # With its state: notes (where a relayed failure was raised) cross too.
        return (type(self), (str(self), self.name), dict(vars(self)))
