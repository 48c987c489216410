"""How a failed call reaches its caller: with its type kept, and the worker named.

A remote function's exception travels as the call's *value*, so torch does
not flatten it into a RuntimeError on the way; it is raised again when the
caller reads the reply. torch's own failures (a timeout, a dead peer, a
reply that cannot be pickled) are named where they are read::

    callee (worker1)                                caller
    run_python(func, args, kwargs)
      func raises KeyError  ─> Failure(exc, where,   reply read: wait(), value(),
                               traceback) returned   to_here(), await
                               as the call's value   └─ check_reply: Failure ─> raise
                                                        KeyError & RemoteError
    torch fails the call (timeout, dead peer, unpicklable result)
                                                     └─ RuntimeError ─> name_failure
                                                        ─> CallTimeoutError, ...

A `RemoteError` is an instance of the type raised remotely *and* of
RuntimeError (what torch raises there), so `except KeyError`,
`except RuntimeError` and `except asyncrpc.RemoteError` all catch it.

A failure nobody reads is lost, unless `log_unwaited_failures` is on: then
it is logged once, when its Future is dropped unread (or fails after that).
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import traceback
from typing import Any, NoReturn

from . import _torch
from ._errors import (
    CallTimeoutError,
    RemoteError,
    SerializationError,
    WorkerUnreachableError,
)

__all__ = [
    "Failure",
    "as_remote_error",
    "capture",
    "capture_for_torch",
    "check_reply",
    "label_of",
    "log_unwaited_failures",
    "name_failure",
    "name_future_failure",
    "name_rref_failure",
    "raise_unsendable",
    "revive_remote",
    "unwaited_logging",
    "watch_unwaited",
]


class Failure:
    """A remote exception sent as a call's value; `error` is the exception to raise.

    Not torch's `RemoteException`: torch's caller would turn that into a
    RuntimeError before asyncrpc sees it.
    """

    __slots__ = ("error", "msg")

    def __init__(self, msg: str, error: BaseException) -> None:
        self.msg = msg
        self.error = error

    def __reduce__(self) -> tuple[Any, ...]:
        cls = type(self.error)
        try:
            payload: bytes | None = pickle.dumps(self.error)
        except Exception:  # an exception holding unpicklable state: send its text
            payload = None
        return (_revive_failure, (self.msg, cls.__module__, cls.__qualname__, payload))


def _revive_failure(msg: str, module: str, qualname: str, payload: bytes | None) -> Failure:
    error: BaseException
    try:
        error = pickle.loads(payload) if payload is not None else RuntimeError(msg)
    except Exception as exc:
        error = SerializationError(
            f"the remote function raised {module}.{qualname}, which this process cannot "
            f"import ({exc}); make that module importable here too. Remote error: {msg}"
        )
    return _failure(error, msg)


def _failure(error: BaseException, msg: str) -> Failure:
    return Failure(msg, error)


class TorchFailure(_torch.RemoteException):
    """A remote exception in torch's own form, for an async_execution function's Future.

    torch sends it to its caller as a `RemoteException` (a plain torch caller
    raises a RuntimeError naming the type); `error` is raised by a local
    `wait()`, and by asyncrpc's callee wrapper, which sends it on as a `Failure`.
    """

    error: BaseException

    def __reduce__(self) -> tuple[Any, ...]:
        cls = type(self.error)
        base = getattr(cls, "_remote_base", cls)
        return (_torch.RemoteException, (self.msg, base))


def capture_for_torch(error: BaseException, where: str, func: object) -> TorchFailure:
    """Like `capture`, in the form torch sends back from an async_execution Future."""
    failure = capture(error, where, func)
    torch_form = TorchFailure(failure.msg, type(failure.error))
    torch_form.error = failure.error
    return torch_form


def capture(error: BaseException, where: str, func: object) -> Failure:
    """`error`, raised by `func` on this worker, as a value to send back."""
    if isinstance(error, RemoteError):
        return _failure(error, str(error))  # relayed: it already names its origin
    text = _user_traceback(error)
    head = f"On {where}, in {label_of(func)}:"
    return _failure(as_remote_error(error, f"{head}\n{text.rstrip()}"), f"{head}\n{text}")


_INTERNAL = (os.path.dirname(__file__), os.path.join("torch", "futures"))


def _user_traceback(error: BaseException) -> str:
    """The formatted traceback, less asyncrpc's and torch's own frames."""
    summary = traceback.TracebackException.from_exception(error)
    frames = [f for f in summary.stack if not f.filename.startswith(_INTERNAL[0])]
    summary.stack = traceback.StackSummary.from_list(
        [f for f in frames if _INTERNAL[1] not in f.filename]
    )
    return "".join(summary.format())


def check_reply(value: object) -> object:
    """The unwrap step of every reply: raise a remote exception, pass anything else."""
    if type(value) is Failure or type(value) is TorchFailure:
        raise value.error
    return value


_subclasses: dict[type[BaseException], type[BaseException] | None] = {}
_subclasses_lock = threading.Lock()


def as_remote_error(error: BaseException, remote_text: str) -> BaseException:
    """`error` as an instance of both its own type and `RemoteError`, with `remote_text`."""
    sub = _remote_subclass(type(error))
    if sub is None:  # a type that cannot be combined: keep it, add the text as a note
        error.add_note(remote_text)
        return error
    try:
        twin = sub.__new__(sub, *error.args)
        twin.args = error.args
        twin.__dict__.update(getattr(error, "__dict__", {}))
    except Exception:
        error.add_note(remote_text)
        return error
    twin.remote_text = remote_text  # type: ignore[attr-defined]
    twin.__cause__, twin.__traceback__ = error.__cause__, None
    return twin


def revive_remote(
    cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any], remote_text: str
) -> BaseException:
    """Unpickle a `RemoteError` twin: rebuild `cls(*args)` and combine it again."""
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return as_remote_error(error, remote_text)


def _remote_str(self: Any) -> str:
    own = self._remote_base.__str__(self)
    text = getattr(self, "remote_text", "")
    return f"{own}\n\n{text}" if own and text else own or text


def _remote_reduce(self: Any) -> tuple[Any, ...]:
    state = {k: v for k, v in self.__dict__.items() if k != "remote_text"}
    return (revive_remote, (self._remote_base, self.args, state, self.remote_text))


def _remote_subclass(cls: type[BaseException]) -> type[BaseException] | None:
    with _subclasses_lock:
        if cls not in _subclasses:
            try:
                namespace = {
                    "__module__": cls.__module__,
                    "__qualname__": cls.__qualname__,
                    "_remote_base": cls,
                    "__str__": _remote_str,
                    "__reduce__": _remote_reduce,
                }
                _subclasses[cls] = type(cls.__name__, (cls, RemoteError), namespace)
            except TypeError:  # a final type, or a layout RuntimeError cannot share
                _subclasses[cls] = None
        return _subclasses[cls]


def name_failure(error: BaseException, worker: str, func: object) -> BaseException:
    """torch's RuntimeError for a failed call, named: which worker, what to do.

    Errors that are not torch's (a remote function's own) come back unchanged.
    """
    kind = _torch.failure_kind(error) if isinstance(error, RuntimeError) else None
    if kind is None or isinstance(error, (RemoteError, CallTimeoutError)):
        return error
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    named: BaseException
    if kind == "timeout":
        named = CallTimeoutError(
            f"the call to {label_of(func)} on worker {worker!r} timed out ({first}); pass a "
            f"larger timeout=..., or check that {worker!r} is not stuck",
            worker,
        )
    elif kind == "unreachable":
        named = WorkerUnreachableError(
            f"worker {worker!r} cannot be reached, so the call to {label_of(func)} failed; "
            f"it has probably died (its own output or the launcher says why). Transport: "
            f"{first}",
            worker,
        )
    elif kind == "unimportable":
        named = SerializationError(
            f"the call to {label_of(func)} on {worker!r} carried an object of a class one side "
            f"cannot import ({first}); make that module importable on both the caller and "
            f"{worker!r}"
        )
    elif "'coroutine'" in first:
        named = SerializationError(
            f"{label_of(func)} on {worker!r} is an `async def` function, so calling it made a "
            f"coroutine that cannot be sent back ({first}); decorate it with "
            f"@asyncrpc.async_execution so the worker runs it"
        )
    else:
        named = SerializationError(
            f"the result of {label_of(func)} on {worker!r}, or something it raised, could not "
            f"be sent back ({first}); return tensors or plain data, and keep other objects "
            f"on the worker with asyncrpc.spawn"
        )
    named.__cause__ = error
    return named


def name_future_failure(error: BaseException, sent: tuple[str, object]) -> BaseException:
    """`name_failure` for a Future's read; `sent` is its tag: (worker, func)."""
    return name_failure(error, *sent)


def name_rref_failure(error: BaseException, owner: str) -> BaseException:
    """`name_failure` for torch's `RRef.to_here()`."""
    return name_failure(error, owner, "RRef.to_here()")


_logger = logging.getLogger("asyncrpc")
_unwaited = [False]


def log_unwaited_failures(enabled: bool = True) -> None:
    """Log a call's failure when its Future is dropped without being read.

    Off by default (it adds a callback per call). `asyncrpc.run(...,
    log_unwaited_failures=True)` turns it on in every worker, and so does the
    environment variable ``ASYNCRPC_LOG_UNWAITED=1``. The record goes to the
    ``"asyncrpc"`` logger at WARNING, once per failed call. Example::

        asyncrpc.log_unwaited_failures()
        asyncrpc.rpc_async("worker1", update, args=(grads,))   # fire and forget
        # WARNING asyncrpc: a call nobody waited for failed: ...
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, got {enabled!r}")
    _unwaited[0] = enabled


def unwaited_logging() -> bool:
    """True when failures nobody waited for are logged (`log_unwaited_failures`)."""
    return _unwaited[0]


def watch_unwaited(fut: object, worker: str, func: object) -> None:
    """Log `fut`'s failure if it is dropped unread (see `log_unwaited_failures`)."""

    def report(error: BaseException) -> None:
        named = name_failure(error, worker, func) if type(error) is RuntimeError else error
        _logger.warning(
            "a call nobody waited for failed: %s on %s raised %s: %s; read its Future "
            "(wait(), value(), await) to handle it",
            label_of(func),
            worker,
            type(named).__name__,
            (str(named).strip().splitlines() or [""])[0],
        )

    _torch.watch_unread(fut, report)


def raise_unsendable(error: BaseException, worker: str, func: object) -> NoReturn:
    """Raise `error` from sending a call; named SerializationError for an unpicklable argument."""
    if not isinstance(error, pickle.PicklingError) and "pickle" not in str(error).lower():
        raise error
    named = SerializationError(
        f"the arguments of {label_of(func)} could not be sent to {worker!r}: {error}; pass "
        f"tensors, numbers, strings and containers of them, or objects of module-level "
        f"classes and functions both sides can import (not lambdas, locks or open files; "
        f"keep such objects on their owner with asyncrpc.spawn)"
    )
    raise named from error


def label_of(func: object) -> str:
    """How a called function is named in messages: `Counter.add()`, `torch.add()`."""
    if isinstance(func, str):
        return func
    target = _torch.async_target(func)
    if target is not None and not isinstance(func, type):
        func = target
    name = getattr(func, "__qualname__", None) or getattr(func, "name", None)
    return f"{name or type(func).__name__}()"
