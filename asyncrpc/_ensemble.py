"""Ensembles: members built on their workers, run with the local fan-out, combined.

    caller                                  each worker holding members
    Ensemble(factory, n, workers=[...])
      └─ spawn(worker, _Shard, ...) ──────> _Shard builds its members there
                                            (factory(*args) under seed + index)
    ens(x) / ens.call_async(x)
      └─ call_async("forward", x) ────────> Fanout over its members, on its own
                                            threads: no RPC thread waits for them
                                            sum / mean: one partial sum back
                                            stack / custom: every output back
      <── gather (member order) ── combine ─┘

Without `workers` the members live in the calling process and only the local
fan-out runs.
"""

from __future__ import annotations

import contextlib
import numbers
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.futures import Future

from ._actor import actor
from ._core import _futures
from ._core._execution import async_execution
from ._core._mailbox import ASYNC_LIMIT
from ._fanout._fanout import Fanout
from ._fanout._tuner import Engine
from ._handles import RemoteObject
from ._spawn import spawn

Combine = str | Callable[[list[Any]], Any]
_MODES = ("sum", "mean", "stack")


# Seeding uses torch's process-wide generator: members built at once by the
# caller and by an RPC thread of the same process must take turns.
_seeding = threading.Lock()


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    if seed is None:
        yield
        return
    with _seeding, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def build_members(
    factory: Callable[..., torch.nn.Module],
    indices: Sequence[int],
    args: tuple[Any, ...],
    seed: int | None,
) -> list[torch.nn.Module]:
    """Build the members with these indices; member i is made under ``seed + i``."""
    members = []
    for index in indices:
        with _seeded(None if seed is None else seed + index):
            members.append(factory(*args))
    return members


def member_names(members: Sequence[torch.nn.Module], indices: Sequence[int]) -> list[str]:
    """How errors and traces name each member: by its index in the whole ensemble."""
    return [
        f"member {i} ({type(m).__name__}) of the ensemble"
        for m, i in zip(members, indices, strict=True)
    ]


def _sum(outputs: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack(outputs).sum(dim=0)


@actor(max_concurrency=ASYNC_LIMIT)  # calls overlap: the fan-out runs each on its own
class _Shard:
    """The members one worker holds, run with the local fan-out (lives on that worker)."""

    def __init__(
        self,
        factory: Callable[..., torch.nn.Module],
        indices: Sequence[int],
        args: tuple[Any, ...],
        seed: int | None,
        engine: Engine,
        threads: int | None,
    ) -> None:
        self.members = build_members(factory, indices, args, seed)
        self.fan = Fanout(
            self.members, engine=engine, threads=threads, names=member_names(self.members, indices)
        )

    @async_execution
    def forward(self, reduce: bool, *args: Any) -> Future[Any]:
        with torch.no_grad():  # the fan-out's threads take the caller's grad mode
            outputs = self.fan.call_async(*args)
        # Summing here sends one tensor back instead of one per member.
        return _futures.chain(outputs, _sum) if reduce else outputs


class Ensemble:
    """`n` members made by `factory(*args)`, run in parallel and combined into one output.

    Members are built where they run, never pickled across: in this process
    (``workers=None``), spread evenly over a list of worker names in
    contiguous blocks, or placed by a ``{worker: count}`` mapping. Inside each
    process the members run with the local fan-out (`engine`, `threads`: see
    `Fanout`). `combine` is ``"sum"``, ``"mean"``, ``"stack"`` or a function
    of the list of member outputs. With `seed`, member i is built under
    ``torch.manual_seed(seed + i)`` wherever it lives, so placements agree.

    Example::

        ens = asyncrpc.Ensemble(BiLSTM, 4, workers=["worker1", "worker2"], seed=0)
        y = ens(x)                 # sum of the 4 members' outputs
        fut = ens.call_async(x)    # a Future of the same
    """

    def __init__(
        self,
        factory: Callable[..., torch.nn.Module],
        n: int,
        *args: Any,
        workers: Sequence[str] | Mapping[str, int] | None = None,
        combine: Combine = "sum",
        seed: int | None = None,
        engine: Engine = "auto",
        threads: int | None = None,
    ) -> None:
        if isinstance(factory, torch.nn.Module) or not callable(factory):
            name = type(factory).__name__
            raise TypeError(
                f"got a {name} instance where a factory that builds one member was expected; "
                f"pass the class itself (members are built where they run): Ensemble({name}, 4)"
            )
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be a positive int (the number of members), got {n!r}")
        if not (combine in _MODES or callable(combine)):
            raise ValueError(f"combine must be one of {_MODES} or a function, got {combine!r}")
        if seed is not None and not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        self.n = n
        self.combine = combine
        self.placement = _place(n, workers)
        self._local: Fanout | None = None
        self._shards: list[tuple[RemoteObject[_Shard], list[int]]] = []
        if workers is None:
            members = build_members(factory, range(n), args, seed)
            names = member_names(members, range(n))
            self._local = Fanout(members, engine=engine, threads=threads, names=names)
            return
        for worker, indices in _blocks(self.placement):
            handle = spawn(worker, _Shard, factory, indices, args, seed, engine, threads)
            self._shards.append((handle, indices))

    def __call__(self, *args: Any) -> Any:
        """Run every member on `args` and return the combined output."""
        return self.call_async(*args).wait()

    def call_async(self, *args: Any) -> Future[Any]:
        """Run every member on `args`; return a Future of the combined output."""
        if self._local is not None:
            return _futures.chain(self._local.call_async(*args), self._combine)
        reduce = self.combine in ("sum", "mean")
        parts = [handle.call_async("forward", reduce, *args) for handle, _ in self._shards]
        return _futures.chain(_futures.gather(parts), self._merge)

    def close(self) -> None:
        """Stop the local fan-out threads; remote members go with the last handle."""
        if self._local is not None:
            self._local.close()

    def __repr__(self) -> str:
        where = "local" if self._local is not None else dict(_blocks_count(self.placement))
        return f"Ensemble({self.n} members, combine={self.combine!r}, placement={where})"

    def _merge(self, parts: list[Any]) -> Any:
        if self.combine in ("sum", "mean"):
            total = torch.stack(parts).sum(dim=0)
            return total / self.n if self.combine == "mean" else total
        outputs: list[Any] = [None] * self.n  # back in member order, whatever the placement
        for (_, indices), part in zip(self._shards, parts, strict=True):
            for index, output in zip(indices, part, strict=True):
                outputs[index] = output
        return self._combine(outputs)

    def _combine(self, outputs: list[Any]) -> Any:
        if self.combine == "sum":
            return torch.stack(outputs).sum(dim=0)
        if self.combine == "mean":
            return torch.stack(outputs).mean(dim=0)
        if self.combine == "stack":
            return torch.stack(outputs)
        assert callable(self.combine)
        return self.combine(outputs)


def _place(n: int, workers: Sequence[str] | Mapping[str, int] | None) -> tuple[str | None, ...]:
    """The worker of each member, in member order (None: this process)."""
    if workers is None:
        return (None,) * n
    if isinstance(workers, Mapping):
        counts = dict(workers)
        bad = {w: c for w, c in counts.items() if not isinstance(c, int) or c < 0}
        if bad or sum(counts.values()) != n:
            raise ValueError(
                f"placement {counts} must give non-negative member counts that add up to "
                f"n={n}; for example {{'worker1': {n - n // 2}, 'worker2': {n // 2}}}"
            )
        return tuple(w for w, c in counts.items() for _ in range(c))
    if isinstance(workers, str) or not workers or not all(isinstance(w, str) for w in workers):
        raise TypeError(
            f"workers must be a non-empty list of worker names or a {{name: count}} mapping, "
            f"got {workers!r}; write workers=['worker1', 'worker2']"
        )
    names = list(workers)
    base, extra = divmod(n, len(names))
    sizes = [base + (1 if i < extra else 0) for i in range(len(names))]
    return tuple(name for name, size in zip(names, sizes, strict=True) for _ in range(size))


def _blocks(placement: tuple[str | None, ...]) -> list[tuple[str, list[int]]]:
    """Group member indices by worker, keeping member order inside each block."""
    groups: dict[str, list[int]] = {}
    for index, worker in enumerate(placement):
        if worker is not None:
            groups.setdefault(worker, []).append(index)
    return list(groups.items())


def _blocks_count(placement: tuple[str | None, ...]) -> list[tuple[str, int]]:
    return [(worker, len(indices)) for worker, indices in _blocks(placement)]
