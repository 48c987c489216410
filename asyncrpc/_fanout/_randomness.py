"""Which calls draw random numbers: how ``engine="auto"`` keeps the serial random stream.

Run one after another, member i draws from torch's generator right after
member i-1: the stream a loop over the members gives. Thread lanes and
`jit.fork` draw from that one generator in whatever order the lanes reach
it, and the stacked (vmap) call draws one batched tensor for all members:
other numbers. So ``"auto"`` runs a call on another plan only where it has
seen that such a call draws nothing::

    call ── the members' modes (every submodule's `training`) seen quiet?
      no  ── run it serially, comparing torch's generator states after each
             member (a probe):
               drew:  every later call runs serially (`drew` names who)
               quiet: calls in these modes may use any plan from now on
      yes ── run it on the tuner's plan, states compared after it; moved
             after all (a member that draws on some inputs only): that
             call's draws were not in member order; every later call runs
             serially

The generators watched are torch's default CPU generator, and each CUDA
device's once CUDA is initialized. A member's own `torch.Generator` is its
business.
"""

from __future__ import annotations

import itertools
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._core import _torch
from ._tuner import FanoutPlan

__all__ = ("RandomGuard", "Watch")


_training = operator.attrgetter("training")


def _states() -> list[torch.Tensor]:
    states = [torch.default_generator.get_state()]
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        states.extend(g.get_state() for g in torch.cuda.default_generators)
    return states


def _moved(before: list[torch.Tensor]) -> bool:
    after = _states()
    return len(after) != len(before) or not all(map(torch.equal, before, after))


class Watch:
    """One call under the guard: its modes, whether it runs as a probe, the states before it."""

    __slots__ = ("drawer", "key", "probe", "states")

    def __init__(self, key: tuple[bool, ...], probe: bool) -> None:
        self.key, self.probe = key, probe
        self.drawer: int | None = None  # the first member seen to draw (probes only)
        self.states = _states()

    def after_member(self, index: int) -> None:
        """A probe's member `index` returned: note it if it was the first to draw."""
        if self.drawer is None and _moved(self.states):
            self.drawer = index


class RandomGuard:
    """Tells ``"auto"`` which calls must run serially so the random stream stays the serial one."""

    def __init__(self, members: Sequence[Callable[..., Any]], names: Sequence[str]) -> None:
        self._modules = [m for m in members if isinstance(m, torch.nn.Module)]
        self._subs: list[torch.nn.Module] = []
        self._tables: list[dict[str, Any]] = []  # each submodule's child table
        self._shape: list[Any] = [None]  # the children the tables held when last read
        self._names = tuple(names)
        self._quiet: set[tuple[bool, ...]] = set()  # modes whose probe drew nothing
        self._lock = threading.Lock()
        self.drew: str | None = None
        """Why every call runs serially now (a call drew random numbers), or None."""

    def start(self) -> Watch:
        """Before a call: a probe (run it serially) unless calls in these modes drew nothing."""
        key = tuple(map(_training, self._submodules()))
        with self._lock:
            probe = key not in self._quiet
        return Watch(key, probe)

    def _submodules(self) -> list[torch.nn.Module]:
        """Every member's submodules, walked again only when a child table changed
        (walking them is tens of microseconds a call; reading the tables a few)."""
        shape = list(itertools.chain.from_iterable(map(dict.values, self._tables)))
        if shape != self._shape:
            self._subs = [sub for m in self._modules for sub in m.modules()]
            self._tables = [_torch.module_tables(sub) for sub in self._subs]
            self._shape = list(itertools.chain.from_iterable(map(dict.values, self._tables)))
        return self._subs

    def finish(self, watch: Watch, ok: bool, plan: FanoutPlan) -> tuple[str, bool] | None:
        """After a call on `plan`: (why every later call must run serially, warn?) if it drew.

        Warn: the call ran in parallel, so its draws were not in member order.
        """
        drew = watch.drawer is not None or _moved(watch.states)
        with self._lock:
            if self.drew is not None:
                return None  # said once already
            if not drew:
                if ok and watch.probe:
                    self._quiet.add(watch.key)
                return None
            parallel = plan.engine != "serial"
            self.drew = self._reason(watch, plan, parallel)
            return self.drew, parallel

    def _reason(self, watch: Watch, plan: FanoutPlan, parallel: bool) -> str:
        tail = (
            "so that the draws follow member order, auto runs every call serially from "
            "now on (a fixed engine='threads' or 'vmap' runs them in parallel, drawing in "
            "another order: see 'Random numbers' in docs/ensembles.md)"
        )
        if not watch.probe:
            which = "that call's draws were not in member order" if parallel else "it ran serially"
            return (
                f"a call run on {plan} drew random numbers from torch's generator, though "
                "the first call in these modes, run serially, drew none (a member that "
                f"draws on some inputs only?): {which}; {tail}"
            )
        who = "a member" if watch.drawer is None else self._names[watch.drawer]
        return (
            f"{who} drew random numbers from torch's generator (dropout in training, "
            f"torch.rand, ...); {tail}"
        )
