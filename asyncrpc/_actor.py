"""Actor options, as Ray users write them: `asyncrpc.actor` and `asyncrpc.method`.

`@asyncrpc.actor(...)` sets how many calls of an object run at once and
how often it is rebuilt; `@asyncrpc.method(...)` puts a method in a
concurrency group and says when its calls are retried. The owner enforces
the limits (`_core._mailbox`), the caller numbers its calls and rebuilds
(`_family`), and retries them (`_retry`)::

    @asyncrpc.actor(max_concurrency=2, concurrency_groups={"io": 4})
    class Server: ...                        (a subclass carrying the options)
    h = asyncrpc.spawn("w1", Server)         the handle carries the options
    h.call_async("get", k)  ── (stream, 0, options) ──> Server's mailbox on w1
    h.call_async("get", k)  ── (stream, 1, options) ──>   starts no earlier than call 0
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar

from ._core._mailbox import METHOD_OPTIONS, Options, method_group

__all__ = (
    "ActorOptions",
    "MethodOptions",
    "actor",
    "actor_options",
    "check_retries",
    "check_retryable",
    "method",
    "method_options",
    "sendable_class",
)

C = TypeVar("C", bound=type)
F = TypeVar("F")
Retryable = bool | tuple[type[BaseException], ...]
_ACTOR_OPTIONS = "__asyncrpc_actor__"
_ACTOR_BASE = "__asyncrpc_actor_base__"


class ActorOptions(NamedTuple):
    """What `asyncrpc.actor` sets on a class."""

    max_concurrency: int | None = None
    concurrency_groups: tuple[tuple[str, int], ...] = ()
    max_restarts: int = 0

    def for_mailbox(self) -> Options:
        return Options(self.max_concurrency, self.concurrency_groups)


class MethodOptions(NamedTuple):
    """What `asyncrpc.method` sets on a method."""

    concurrency_group: str | None = None
    max_retries: int = 0
    retry_exceptions: Retryable = False


def actor(
    max_concurrency: int | None = None,
    concurrency_groups: Mapping[str, int] | None = None,
    max_restarts: int = 0,
) -> Callable[[C], C]:
    """Set how an object of the class runs its calls (a class decorator, as Ray's).

    `max_concurrency`: calls at once (default 1: one call at a time; 1000
    for a class with `async def` methods, which interleave on the worker's
    event loop). `concurrency_groups`: groups with limits of their own,
    which `asyncrpc.method(concurrency_group=...)` puts methods in.
    `max_restarts`: how often an object on a worker that was replaced is
    rebuilt from its constructor's arguments (-1: always).

    Decorating gives a subclass carrying the options; applied where an
    object is made, it leaves the class as it was. On a class that has
    options already, what is left out stays the class's.

    Example::

        @asyncrpc.actor(max_concurrency=4, concurrency_groups={"io": 2})
        class Server:
            def compute(self, x): ...

            @asyncrpc.method(concurrency_group="io")
            async def fetch(self, url): ...

        h = asyncrpc.spawn("worker1", asyncrpc.actor(max_concurrency=8)(Server))
    """
    if isinstance(max_concurrency, type):
        raise TypeError(
            f"asyncrpc.actor takes options, and was given the class {max_concurrency.__name__}: "
            f"write @asyncrpc.actor() (with the parentheses) above `class`"
        )
    given = ActorOptions(
        _limit("max_concurrency", max_concurrency),
        _groups(concurrency_groups),
        _restarts(max_restarts),
    )

    def decorate(cls: C) -> C:
        if not isinstance(cls, type):
            raise TypeError(
                f"asyncrpc.actor decorates a class, got {type(cls).__name__} {cls!r:.60}; "
                f"write @asyncrpc.actor(...) above `class`"
            )
        base = vars(cls).get(_ACTOR_BASE, cls)
        options = _over(actor_options(cls), given, concurrency_groups is None)
        _check_groups(base, options)
        namespace = {
            _ACTOR_OPTIONS: options, _ACTOR_BASE: base, "__module__": base.__module__,
            "__qualname__": base.__qualname__, "__doc__": base.__doc__,
        }  # fmt: skip
        made: C = type(cls)(base.__name__, (cls,), namespace)
        return made

    return decorate


def _over(before: ActorOptions, given: ActorOptions, keep_groups: bool) -> ActorOptions:
    """Options given where a class already has some: what was left out stays the class's."""
    return ActorOptions(
        given.max_concurrency if given.max_concurrency is not None else before.max_concurrency,
        before.concurrency_groups if keep_groups else given.concurrency_groups,
        given.max_restarts or before.max_restarts,
    )


def method(
    concurrency_group: str | None = None, max_retries: int = 0, retry_exceptions: Retryable = False
) -> Callable[[F], F]:
    """Set a method's concurrency group and retries (a method decorator, as Ray's).

    `max_retries`: how often a failed call is sent again (-1: always);
    `retry_exceptions`: which failures of the method itself count (False:
    none, True: any, or a tuple of exception types). In a world that heals,
    a call that met the death of its callee is retried on the replacement
    when `max_retries` allows (at least once, then: only where asked).

    Example::

        class Fetcher:
            @asyncrpc.method(concurrency_group="io", max_retries=3,
                             retry_exceptions=(ConnectionError,))
            async def fetch(self, url): ...
    """
    if callable(concurrency_group):
        raise TypeError(
            f"asyncrpc.method takes options, and was given {concurrency_group!r:.60}: write "
            f"@asyncrpc.method() (with the parentheses) above `def`"
        )
    options = MethodOptions(
        _group_name(concurrency_group), check_retries("max_retries", max_retries),
        check_retryable(retry_exceptions),
    )  # fmt: skip

    def decorate(fn: F) -> F:
        target = getattr(fn, "__func__", fn)  # staticmethod, classmethod
        if not callable(target):
            raise TypeError(
                f"asyncrpc.method decorates a method, got {type(fn).__name__} {fn!r:.60}"
            )
        setattr(target, METHOD_OPTIONS, options)
        return fn

    return decorate


def actor_options(cls: type | None) -> ActorOptions:
    """The options of `cls` (set by `asyncrpc.actor`), or the defaults."""
    found = getattr(cls, _ACTOR_OPTIONS, None)
    return found if isinstance(found, ActorOptions) else ActorOptions()


def method_options(cls: type | None, name: str) -> MethodOptions:
    """The options of method `name` of `cls` (set by `asyncrpc.method`), or the defaults."""
    found = getattr(getattr(cls, name, None), METHOD_OPTIONS, None)
    return found if isinstance(found, MethodOptions) else _DEFAULTS


_DEFAULTS = MethodOptions()


def sendable_class(cls: Any) -> Any:
    """What to send for `cls`: an options subclass that pickle cannot find by name sends
    its base (the handle carries the options)."""
    while isinstance(cls, type) and _ACTOR_BASE in vars(cls) and not _found_by_name(cls):
        cls = cls.__bases__[0]  # the class it was made from, up to one pickle finds
    return cls


def _found_by_name(cls: type) -> bool:
    found: Any = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is cls


# ---- checking the options -----------------------------------------------------------------


def _limit(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number of at least 1, or None; got {value!r}")
    return value


def _restarts(value: object) -> int:
    return check_retries("max_restarts", value)


def check_retries(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(f"{name} must be a whole number >= 0, or -1 for no limit; got {value!r}")
    return value


def _group_name(value: object) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"concurrency_group must be a group's name or None; got {value!r}")
    return value


def _groups(groups: Mapping[str, int] | None) -> tuple[tuple[str, int], ...]:
    if groups is None:
        return ()
    if not isinstance(groups, Mapping):
        raise TypeError(
            f"concurrency_groups maps names to limits, e.g. {{'io': 2}}; got "
            f"{type(groups).__name__} {groups!r:.60}"
        )
    checked = []
    for name, limit in groups.items():
        _group_name(name)
        checked.append((name, _limit(f"concurrency_groups[{name!r}]", limit) or 1))
    return tuple(sorted(checked))


def check_retryable(value: object) -> Retryable:
    """`retry_exceptions` as given, checked: False, True, or a tuple of exception types."""
    if isinstance(value, bool):
        return value
    if isinstance(value, type) and issubclass(value, BaseException):
        return (value,)
    if isinstance(value, (tuple, list)) and all(
        isinstance(t, type) and issubclass(t, BaseException) for t in value
    ):
        return tuple(value)
    raise TypeError(
        f"retry_exceptions must be False, True or a tuple of exception types; got "
        f"{type(value).__name__} {value!r:.60}"
    )


def _check_groups(cls: type, options: ActorOptions) -> None:
    declared = {name for name, _ in options.concurrency_groups}
    for name in dir(cls):
        group = method_group(cls, name)
        if group and group not in declared:
            raise ValueError(
                f"{cls.__qualname__}.{name} is in concurrency group {group!r}, which "
                f"@asyncrpc.actor does not declare (it has {sorted(declared)}); add "
                f"concurrency_groups={{{group!r}: N}}"
            )
