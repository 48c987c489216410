"""What a worker knows of its world (`Context`) and the options of a world (`Settings`).

Plain values, built by `_world` when a world starts or is adopted, and by
`_supervisor` before it spawns workers; nothing here touches torch's agent.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import torch

from ._device_options import check as check_devices
from ._errors import WorldSizeMismatchError

__all__ = ["Context", "Settings", "names_for", "resolve_world_size"]


def _default_channels() -> tuple[str, ...] | None:
    return None if torch.cuda.is_available() else ("basic",)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Options shared by `init` and `run`; every field has a safe default.

    Example::

        asyncrpc.run(main, world_size=4, rpc_timeout=120, heartbeat_timeout=10)
        asyncrpc.run(main, world_size=2, devices="cuda")  # CUDA tensors between workers

    `devices` and `device_maps`: see docs/gpus.md.
    """

    num_worker_threads: int = 16
    rpc_timeout: float = 60.0
    init_timeout: float = 120.0
    intra_op_threads: int | None = None
    interface: str | None = None
    # TensorPipe's shared-memory transport busy-polls about a core per idle
    # worker; uv (TCP) idles at ~0, which matters more on small machines.
    # With uv, the basic channel (tensors inline on the connection) has the
    # shortest round trip of the CPU channels; CUDA builds keep torch's set.
    transports: tuple[str, ...] | None = ("uv",)
    channels: tuple[str, ...] | None = dataclasses.field(default_factory=_default_channels)
    # None keeps the process's choice (asyncrpc.log_unwaited_failures, ASYNCRPC_LOG_UNWAITED).
    log_unwaited_failures: bool | None = None
    # Launched worlds: a peer silent this long is taken for dead. A worker that holds
    # the GIL for long (pickling a huge object) beats late: raise it for such programs.
    heartbeat_timeout: float = 3.0
    # Python's full collections walk every object, torch's import-time hundreds of
    # thousands included; frozen when the world starts, they are skipped (gc.freeze).
    freeze_gc: bool = True
    # torch's RPC threads are no Python threads: each time one takes the GIL it is
    # given a new Python thread state, deleted as it lets go (9 per small Python
    # call). Kept, each thread has one for as long as it exists (see _threadstates).
    keep_thread_states: bool = True
    # Embedded worlds (asyncrpc.run without a launcher): "forkserver" forks workers
    # from a warm interpreter that has imported torch, its RPC layer and asyncrpc
    # (not the script: each worker imports that itself); "spawn" starts each from a
    # cold one (every worker imports torch itself).
    start_method: str = "forkserver"
    # A call still pending after this many seconds logs one WARNING on the
    # caller: its function, the worker it waits on, where that worker is (the
    # innermost frame of the user's code) and any cycle of waits. None: off.
    hang_report_after: float | None = None
    # CUDA tensors between workers (see _devices): "cuda" gives each worker one GPU
    # and maps it to every GPU peer's; None keeps the world on CPU (or reads
    # ASYNCRPC_DEVICES, which `asyncrpc-launch --devices` sets).
    devices: Any = None
    device_maps: Mapping[str, Mapping[Any, Any]] | None = None

    def __post_init__(self) -> None:
        check_devices(self.devices, self.device_maps)
        if not isinstance(self.num_worker_threads, int) or self.num_worker_threads < 1:
            raise ValueError(
                f"num_worker_threads must be a positive int, got {self.num_worker_threads!r}"
            )
        for field in ("rpc_timeout", "init_timeout", "heartbeat_timeout"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{field} must be a finite number of seconds > 0, got {value!r}")
        if self.start_method not in ("forkserver", "spawn"):
            raise ValueError(
                f"start_method must be 'forkserver' or 'spawn', got {self.start_method!r}"
            )
        for flag in ("freeze_gc", "keep_thread_states"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        after = self.hang_report_after
        if after is not None and (
            isinstance(after, bool)  # True would read as 1 s
            or not isinstance(after, (int, float))
            or not math.isfinite(after)
            or after <= 0
        ):
            raise ValueError(
                f"hang_report_after must be a finite number of seconds > 0 or None, got {after!r}"
            )
        threads = self.intra_op_threads
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"intra_op_threads must be a positive int, got {threads!r}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Settings:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown option(s) {unknown}; asyncrpc accepts {sorted(known)}")
        return cls(**options)


@dataclasses.dataclass(frozen=True)
class Context:
    """What a worker knows of its world; also a context manager that shuts it down.

    Example::

        def main(ctx: asyncrpc.Context) -> None:
            peer = ctx.names[(ctx.rank + 1) % ctx.world_size]
            print(ctx.name, "->", peer, ctx.workers("trainer"))
            if ctx.attempt:  # the world was restarted after a failure
                state = load_my_checkpoint(ctx.name)

    `attempt` counts restarts: 0 on the first run of `main`, 1 after the first
    restart (`asyncrpc.run(..., max_restarts=N)`, `asyncrpc-launch --max-restarts N`).
    In a world that heals (`restart="worker"`) it is this worker's own count
    of replacements; the survivors' does not change.
    """

    rank: int
    world_size: int
    name: str
    names: tuple[str, ...]
    roles: tuple[tuple[str, int], ...] = ()
    attempt: int = 0
    # How `with ctx:` leaves the world; the world that made this context sets it.
    _leave: Callable[[bool], None] | None = dataclasses.field(
        default=None, repr=False, compare=False
    )

    @property
    def role(self) -> str | None:
        """The role of this worker (`"trainer"` for `trainer3`), or None without roles."""
        for role, _ in self.roles:
            if self.name.startswith(role) and self.name[len(role) :].isdigit():
                return role
        return None

    def workers(self, role: str | None = None) -> tuple[str, ...]:
        """All worker names, or those of one role, in rank order."""
        if role is None:
            return self.names
        if role not in dict(self.roles):
            raise LookupError(
                f"unknown role {role!r}; this world has roles {[r for r, _ in self.roles]}"
            )
        return tuple(n for n in self.names if n[len(role) :].isdigit() and n.startswith(role))

    def __enter__(self) -> Context:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._leave is not None:
            self._leave(exc_type is None)


def names_for(world_size: int, roles: Mapping[str, int] | None) -> tuple[str, ...]:
    """Default worker names: `worker{rank}`, or `{role}{i}` in the order roles are given."""
    if not roles:
        return tuple(f"worker{r}" for r in range(world_size))
    for role, count in roles.items():
        if not role.isidentifier() or not isinstance(count, int) or count < 1:
            raise ValueError(
                f"roles must map a name to a positive count, got {role!r}: {count!r}; "
                f"e.g. roles={{'ps': 1, 'trainer': 4}}"
            )
    total = sum(roles.values())
    if total != world_size:
        raise WorldSizeMismatchError(
            f"roles {dict(roles)} add up to {total} workers but world_size is "
            f"{world_size}; make them agree, or leave world_size out"
        )
    return tuple(f"{role}{i}" for role, count in roles.items() for i in range(count))


def resolve_world_size(world_size: int | None, roles: Mapping[str, int] | None) -> int | None:
    """The world size a caller asked for, from `world_size`, `roles`, or both."""
    if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if roles and world_size is None:
        world_size = sum(roles.values())
    if world_size is not None:
        names_for(world_size, roles)
    return world_size
