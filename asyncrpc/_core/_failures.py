"""How a failure reaches whoever reads it: one capture, one carrier, one raise, one naming.

A failed outcome travels as a *value*, a `Failure`, never as an exception
stored in a torch Future: torch would flatten a remote one into a
RuntimeError, and a stored exception that is raised gains the reader's
frames in its traceback, frames that hold the Future that holds the
exception, a cycle through C++ that Python's gc cannot collect. So every
read raises a fresh copy, and a held exception keeps no frame's locals::

    callee (worker1)                               caller
    func raises KeyError
      capture(error, where, func) -> Failure        reply read: wait(), value(), await,
        (KeyError & RemoteError, "On worker ..."      to_here(), local_value()
         text; frames cleared)                      └─ check_reply(Failure) raises a fresh
      on the wire: the pickled error, or its           copy: KeyError & RemoteError &
      class and text if it cannot be pickled            RuntimeError, "On worker ..."
    torch fails the call (timeout, dead peer, unpicklable result)
                                                    └─ torch's RuntimeError -> name_failure
                                                       -> CallTimeoutError, ...

A `RemoteError` is an instance of the type raised remotely *and* of
RuntimeError (what torch raises there), so `except KeyError`,
`except RuntimeError` and `except asyncrpc.RemoteError` all catch it. Local
Futures asyncrpc fails (gather, with_timeout, Batch, fan-out) carry a
`Failure` too (`hold`). A reply that goes to a plain torch caller (one of
our async_execution functions called with torch's rpc_sync) crosses in
torch's own form, `RemoteException`, which torch raises there.
"""

from __future__ import annotations

import copy
import functools
import os
import pickle
import re
import sys
import threading
import traceback
import types
from collections.abc import Mapping
from typing import Any, NoReturn, Protocol

from . import _runtime, _torch
from ._errors import (
    AsyncRPCError,
    CallTimeoutError,
    DeviceMapError,
    ObjectLostError,
    RemoteError,
    SerializationError,
    WorkerLeftError,
    WorkerUnreachableError,
)

__all__ = [
    "Failure",
    "as_remote_error",
    "capture",
    "check_reply",
    "detach",
    "hold",
    "label_of",
    "name_failure",
    "raise_unsendable",
    "revive_remote",
]


class Failure:
    """A failed outcome carried as a value: a call's reply, or a local Future's result.

    `error` is kept with its frames cleared; each read raises a fresh copy.
    With `for_torch`, it pickles as torch's `RemoteException`, for a torch caller.
    """

    __slots__ = ("error", "for_torch")

    def __init__(self, error: BaseException, for_torch: bool = False) -> None:
        self.error = error
        self.for_torch = for_torch

    def __reduce__(self) -> tuple[Any, ...]:
        error = self.error
        if self.for_torch:
            return _torch.remote_exception(_plain_text(error), _base_type(error))
        cls = _base_type(error)
        try:
            payload: bytes | None = pickle.dumps(error)
            why = ""
        except Exception as exc:  # held a lock, a local class...: send what can be sent
            payload, why = None, f"{type(exc).__name__}: {exc}"
        parts = (cls.__module__, cls.__qualname__, _own_text(error), _remote_text(error))
        return (_revive, (*parts, payload, why))

    def __repr__(self) -> str:
        return f"Failure({self.error!r})"


def _revive(
    module: str, qualname: str, message: str, where: str, payload: bytes | None, why: str
) -> Failure:
    """Unpickle a Failure on the reader's side; what cannot be rebuilt is named."""
    name = f"{module}.{qualname}"
    if payload is None:
        error: BaseException = SerializationError(
            f"{name} was raised, but it could not be pickled to be sent back ({why}); its "
            f"message: {message!r}. Raise exceptions of module-level classes whose "
            f"arguments and attributes can be pickled"
        )
        return Failure(as_remote_error(error, where) if where else error)
    try:
        return Failure(pickle.loads(payload))
    except Exception as exc:
        error = SerializationError(
            f"{name} was raised, but this process cannot rebuild it ({type(exc).__name__}: "
            f"{exc}); its message: {message!r}. Make that module importable here too"
        )
        return Failure(as_remote_error(error, where) if where else error)


def hold(error: BaseException, for_torch: bool = False) -> Failure:
    """`error` as a Failure to set as a Future's result: a detached copy (see `detach`)."""
    return Failure(detach(error), for_torch)


def check_reply(value: object) -> object:
    """The unwrap step of every read: a Failure raises a fresh copy of its error.

    A reply in torch's own form (the runner itself failed on the callee) is
    raised as torch raises it.
    """
    if type(value) is Failure:
        raise _fresh(value.error)
    if type(value) is _torch.RemoteException:
        _torch.raise_remote_exception(value)
    return value


def capture(error: BaseException, where: str, func: object, for_torch: bool = False) -> Failure:
    """`error`, raised by `func` on this worker, as the value to send back.

    The error becomes an instance of its own type and `RemoteError`, and its
    text ends with where it was raised and the traceback.
    """
    if isinstance(error, RemoteError):
        return Failure(detach(error), for_torch)  # relayed: it already names its origin
    text = _user_traceback(error)
    # torch's own phrase, which code written against torch may look for.
    head = f"On {where}, in {label_of(func)}. Original exception on remote side was:"
    return Failure(as_remote_error(detach(error), f"{head}\n{text.rstrip()}"), for_torch)


# ---- keeping exceptions without frames, and copying them ---------------------------


def detach(error: BaseException, memo: dict[int, BaseException] | None = None) -> BaseException:
    """A copy of `error` to keep in a Future, holding no frame of the program.

    `error` itself may still be propagating (its traceback then grows with
    every frame it passes, frames that may hold the very Future), so a copy
    is kept: same type, arguments, attributes and notes; its `__cause__`,
    `__context__` and group members are detached too. Its traceback names
    the same functions, files and lines, but on stand-in frames
    (`_stand_ins`): a real frame, even cleared, holds the frame that called
    it, and that one its caller, locals and all (a callback's frame holding
    the very Future the error is kept in: a cycle through C++ that gc cannot
    see). Frames still running (the one that caught the error, and its
    callers) are left out.
    """
    memo = {} if memo is None else memo
    if id(error) in memo:
        return memo[id(error)]
    if isinstance(error, BaseExceptionGroup):
        twin = _copy(error, [detach(e, memo) for e in error.exceptions])
    else:
        twin = _copy(error)
    memo[id(error)] = twin
    twin.__traceback__ = _stand_ins(error.__traceback__)
    cause, context = error.__cause__, error.__context__
    twin.__cause__ = None if cause is None else detach(cause, memo)
    twin.__context__ = None if context is None else detach(context, memo)
    twin.__suppress_context__ = error.__suppress_context__
    return twin


def _stand_ins(tb: types.TracebackType | None) -> types.TracebackType | None:
    """`tb` again, less the frames running on this thread, each frame a stand-in."""
    running = set()
    frame: types.FrameType | None = sys._getframe()
    while frame is not None:
        running.add(id(frame))
        frame = frame.f_back
    entries = []
    while tb is not None:
        if id(tb.tb_frame) not in running:
            entries.append((tb.tb_frame.f_code, tb.tb_lineno))
        tb = tb.tb_next
    rebuilt = None
    for code, line in reversed(entries):
        rebuilt = types.TracebackType(rebuilt, _stand_in(code), -1, line)
    return rebuilt


def _stand_in(code: types.CodeType) -> types.FrameType:
    """A frame that shows as `code`'s (its name, file and line) and holds nothing.

    The frame of a generator never started: no calling frame and no local.
    Freeing such a generator never runs it, so its frame stays unlinked. A
    generator that was started is closed by running it when it is freed (at
    once, or by gc at any moment), and Python 3.12 then links its kept frame
    to the one running at that moment (`f_back`), and through it to every
    caller's locals: a Batch's reply callback's, holding the very Futures
    the failure is kept in (test_leaks, under 3.12).
    """
    gen = types.FunctionType(_stand_in_code(code), {})()
    frame: types.FrameType = gen.gi_frame
    return frame


@functools.lru_cache(maxsize=4096)
def _stand_in_code(code: types.CodeType) -> types.CodeType:
    return _unstarted.__code__.replace(
        co_name=code.co_name,
        co_qualname=code.co_qualname,
        co_filename=code.co_filename,
        co_firstlineno=code.co_firstlineno,
    )


def _unstarted() -> Any:
    yield  # never reached: a stand-in's generator is never started


def _fresh(error: BaseException) -> BaseException:
    """A copy of a kept error to raise: same type, attributes, chain and traceback."""
    members = list(error.exceptions) if isinstance(error, BaseExceptionGroup) else None
    twin = _copy(error, members)
    twin.__cause__, twin.__context__ = error.__cause__, error.__context__
    twin.__suppress_context__ = error.__suppress_context__
    return twin.with_traceback(error.__traceback__)


def _copy(error: BaseException, members: list[BaseException] | None = None) -> BaseException:
    """A new exception like `error` (no traceback or chain), or a RuntimeError naming it."""
    cls = type(error)
    try:
        if members is not None and isinstance(error, BaseExceptionGroup):
            twin: BaseException = error.derive(members)
        elif cls.__module__ == "builtins" or cls.__reduce__ is not BaseException.__reduce__:
            twin = copy.copy(error)  # as the class rebuilds itself: fields its __init__ sets
        else:  # never a user's __init__: it may take other arguments than `args`
            twin = cls.__new__(cls, *error.args)
            twin.args = error.args
        twin.__dict__.update(getattr(error, "__dict__", {}))
        for name in _slots(cls):
            if hasattr(error, name):
                setattr(twin, name, getattr(error, name))
        notes = getattr(error, "__notes__", None)
        if isinstance(notes, list):
            twin.__notes__ = list(notes)  # a reader's add_note stays on its copy
    except Exception:  # a type that cannot be rebuilt: its name and text survive
        return RuntimeError(f"{cls.__module__}.{cls.__qualname__}: {error}")
    return twin


def _slots(cls: type) -> list[str]:
    names: list[str] = []
    for klass in cls.__mro__:
        slots = vars(klass).get("__slots__", ())
        names += [slots] if isinstance(slots, str) else [s for s in slots if s != "__dict__"]
    return names


# ---- the RemoteError twin of a remote exception ------------------------------------------

_INTERNAL = (os.path.dirname(os.path.dirname(__file__)), os.path.join("torch", "futures"))


def _user_traceback(error: BaseException) -> str:
    """The formatted traceback, less asyncrpc's and torch's own frames."""
    summary = traceback.TracebackException.from_exception(error)
    frames = [f for f in summary.stack if not f.filename.startswith(_INTERNAL[0])]
    summary.stack = traceback.StackSummary.from_list(
        [f for f in frames if _INTERNAL[1] not in f.filename]
    )
    return "".join(summary.format())


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


def _base_type(error: BaseException) -> type[BaseException]:
    base: type[BaseException] = getattr(type(error), "_remote_base", type(error))
    return base


def _own_text(error: BaseException) -> str:
    base = _base_type(error)
    try:
        return base.__str__(error)
    except Exception:
        return repr(error)


def _remote_text(error: BaseException) -> str:
    return str(getattr(error, "remote_text", ""))


def _plain_text(error: BaseException) -> str:
    """The whole message, as torch's `RemoteException` carries it to a torch caller."""
    own, where = _own_text(error), _remote_text(error)
    return f"{own}\n\n{where}" if own and where else own or where


# ---- naming torch's own failures -----------------------------------------------------


def name_failure(error: BaseException, worker: str, func: object) -> BaseException:
    """torch's RuntimeError for a failed call, named: which worker, what to do.

    Errors that are not torch's (a remote function's own) come back unchanged.
    """
    kind = _torch.failure_kind(error) if isinstance(error, RuntimeError) else None
    # Already named (read once by the hook, once by the reply): named once.
    if kind is None or isinstance(error, (AsyncRPCError, RemoteError, CallTimeoutError)):
        return error
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    named: BaseException
    if kind == "lost":
        named = _lost(error, worker, func)
    elif kind == "timeout":
        named = CallTimeoutError(
            f"the call to {label_of(func)} on worker {worker!r} timed out ({first}); pass a "
            f"larger timeout=..., or check that {worker!r} is not stuck",
            worker,
        )
    elif kind == "unreachable":
        named = _unreachable(worker, func, first)
    elif kind == "unmapped":
        named = DeviceMapError(
            f"the call to {label_of(func)} on {worker!r} carried a CUDA tensor between workers "
            f"with no device map for it ({first}); start the world with devices='cuda' on "
            f"every worker with a GPU (or pass device_maps=...), or send tensor.cpu() to a "
            f"worker without one"
        )
    elif kind == "unreadable":
        named = SerializationError(
            f"the arguments of {label_of(func)} could not be unpickled on {worker!r} "
            f"({first}), so it did not run; send tensors, plain data or objects of classes "
            f"{worker!r} can import and rebuild"
        )
    elif kind == "unimportable":
        named = SerializationError(
            f"the call to {label_of(func)} on {worker!r} carried an object of a class one side "
            f"cannot import ({first}); make that module importable on both the caller and "
            f"{worker!r}"
        )
    else:
        named = SerializationError(
            f"the result of {label_of(func)} on {worker!r} could not be sent back ({first}); "
            f"return tensors or plain data, and keep other objects on the worker with "
            f"asyncrpc.spawn"
        )
    named.__cause__ = error
    return named


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class _Left(Protocol):
    @property
    def left(self) -> Mapping[str, str]: ...  # a member that left: why


class _World(Protocol):
    """What naming a failure reads of the running world (`_world.World`, layers above)."""

    @property
    def members(self) -> _Left | None: ...  # `_membership.Members` in a world that heals

    @property
    def stopping(self) -> threading.Event: ...  # this worker is being removed

    @property
    def context(self) -> _Named: ...  # `_context.Context`


def _unreachable(worker: str, func: object, first: str) -> WorkerUnreachableError:
    """A call's worker could not be reached: it died, left, or this worker was removed."""
    world: _World | None = _runtime.running_world()
    members = world.members if world is not None else None
    if world is not None and members is not None and world.stopping.is_set():
        removed = members.left.get(world.context.name, "removed")
        return WorkerUnreachableError(
            f"the call to {label_of(func)} on worker {worker!r} failed: this worker was "
            f"removed from the world ({removed}), which may end without it; return "
            f"from main once asyncrpc.stopping() is True. Transport: {first}",
            worker,
        )
    left = members.left.get(worker) if members is not None else None
    if left is not None:
        return WorkerLeftError(
            f"worker {worker!r} left the world ({left}) before the call to "
            f"{label_of(func)} finished there; call one of asyncrpc.members() instead. "
            f"Transport: {first}",
            worker,
        )
    return WorkerUnreachableError(
        f"worker {worker!r} cannot be reached, so the call to {label_of(func)} failed; "
        f"it has probably died (its own output or the launcher says why). Transport: "
        f"{first}",
        worker,
    )


_LOST_OWNER = re.compile(r"ObjectLostError: (.*?live[sd] on worker '([^']*)'.*?)(?:\n\n|\nAt:|$)",
                         re.DOTALL)  # fmt: skip


def _lost(error: BaseException, worker: str, func: object) -> ObjectLostError:
    """An RRef or handle in the call's arguments whose owner died, as `worker` refused it."""
    found = _LOST_OWNER.search(str(error))
    if found is not None:  # the callee's own ObjectLostError, carried in torch's text
        return ObjectLostError(
            f"the call to {label_of(func)} on worker {worker!r} failed there: "
            f"{found.group(1).strip()}",
            found.group(2),
        )
    return ObjectLostError(
        f"the call to {label_of(func)} on worker {worker!r} carried an RRef or handle whose "
        f"object lived on a process that died before {worker!r} joined the world "
        f"({str(error).strip().splitlines()[0]}); create the object again",
        "",
    )


def raise_unsendable(error: BaseException, worker: str, func: object) -> NoReturn:
    """Raise `error` from sending a call, named as a read names it (a dead peer, say).

    An argument that cannot be pickled is a SerializationError that says what to send.
    """
    if not isinstance(error, pickle.PicklingError) and "pickle" not in str(error).lower():
        named = name_failure(error, worker, func)
        if named is error:
            raise error
        raise named from error
    if "Future" in str(error):  # one inside a list, dict or object: only the top level waits
        advice = (
            "a Future travels only as a top-level argument (it arrives as its value); "
            "pass it as one, wait for it first, or asyncrpc.put its value and pass the ref"
        )
    else:
        advice = (
            "pass tensors, numbers, strings and containers of them, or objects of "
            "module-level classes and functions both sides can import (not lambdas, locks or "
            "open files; keep such objects on their owner with asyncrpc.spawn)"
        )
    named = SerializationError(
        f"the arguments of {label_of(func)} could not be sent to {worker!r}: {error}; {advice}"
    )
    raise named from error


def label_of(func: object) -> str:
    """How a called function is named in messages: `Counter.add()`, `torch.add()`."""
    if isinstance(func, str):
        return func
    if not callable(func) or not hasattr(func, "__qualname__"):
        func = getattr(func, "__wrapped__", func)  # a callable object standing for a function
    target = _torch.async_target(func)
    if target is not None and not isinstance(func, type):
        func = target
    name = getattr(func, "__qualname__", None) or getattr(func, "name", None)
    return f"{name or type(func).__name__}()"
