"""Fan-out plans, and the tuner that picks one by timing real calls.

A plan is how a `Fanout` spends its thread budget: which engine, how many
members at a time (inter-op width), how many intra-op threads each. Which
plan is fastest depends on the machine and the members, not on a rule:

    serial, 2 intra-op threads    one member at a time, each op on both cores
    vmap, 2 intra-op threads      every member in one batched op (same
                                  architecture: _stacked), on both cores
    threads x2, 1 intra-op        two members at a time, each op on one core

Lanes of one intra-op thread beat serial by at most ``budget / S``, where S is
how much faster one member runs on the whole budget than on one thread (the
members' own intra-op scaling). Where torch's kernels scale well (big GEMMs,
S close to the budget) serial wins; where they scale badly (small batches,
pointwise ops, the Python layer) lanes win. So ``engine="auto"`` measures, in blocks of calls:

    block  ─> 3 calls in a row on the plan whose turn it is (fewest blocks
              timed, so plans alternate block by block); the first call of
              a block is not timed: it bears what the plan before left
              behind (its threads still spinning, caches), and the first
              block of a plan also warms it up (pools, the first vmap call's
              check); the block's sample is the quicker of its other two
              calls (a call that overlapped another is not counted)
    enough ─> every plan has 3 blocks and 0.3 s of samples, or 10 blocks;
              or the trials took 3 s and every plan has 2 blocks; or
              30 calls per plan started (callers that always overlap)
    then   ─> the plan with the lowest median sample, for every later call

So "auto" settles within 30 calls per plan (120 for four plans), and within
about 3 s of trials unless a single block takes longer.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Literal

_logger = logging.getLogger("asyncrpc")

Engine = Literal["auto", "vmap", "threads", "fork", "serial"]
PlanEngine = Literal["vmap", "threads", "fork", "serial"]


@dataclasses.dataclass(frozen=True)
class FanoutPlan:
    """How a `Fanout` runs its members: engine, inter-op width, intra-op threads each.

    Read it from `Fanout.plan` (the plan calls use) or `Fanout.plans` (the
    candidates ``engine="auto"`` times). Example::

        fan = asyncrpc.Fanout(members)      # engine="auto"
        while fan.plan is None:             # its first calls time the plans
            fan(x)
        print(fan.plan)   # FanoutPlan(engine='threads', threads=2, intra_op_threads=1)
    """

    engine: PlanEngine
    threads: int
    intra_op_threads: int

    def __str__(self) -> str:
        if self.engine in ("serial", "vmap"):
            return f"{self.engine} ({self.intra_op_threads} intra-op)"
        return f"{self.engine} x{self.threads} ({self.intra_op_threads} intra-op each)"


class Ticket:
    """One trial call: its plan, start time, and whether it is timed and began alone."""

    __slots__ = ("alone", "number", "plan", "start", "timed")

    def __init__(self, plan: FanoutPlan, number: int, alone: bool, timed: bool) -> None:
        self.plan, self.number, self.alone, self.timed = plan, number, alone, timed
        self.start = time.perf_counter()


class Tuner:
    """Times each candidate plan on real calls, block by block, then keeps the fastest."""

    BLOCK = 3  # calls per block; the first is not timed
    BUDGET = 3.0  # seconds of trials after which 2 blocks a plan are enough

    def __init__(
        self, plans: Sequence[FanoutPlan], rounds: int = 3, seconds: float = 0.3, most: int = 10
    ) -> None:
        self.plans = tuple(plans)
        self.rounds, self.seconds, self.most = rounds, seconds, most
        self.chosen: FanoutPlan | None = self.plans[0] if len(self.plans) == 1 else None
        self._samples: dict[FanoutPlan, list[float]] = {plan: [] for plan in self.plans}
        self._block: tuple[FanoutPlan, int, list[float]] | None = None  # plan, calls left, times
        self._lock = threading.Lock()
        self._started = 0
        self._active = 0
        self._trials = 0.0  # seconds of trial calls so far

    def begin(self, prefer: FanoutPlan | None = None) -> tuple[FanoutPlan, Ticket | None]:
        """The plan for the next call, and a ticket while plans are still being timed.

        `prefer` runs this call on that plan, untimed (a call that must run serially).
        """
        with self._lock:
            if self.chosen is not None or (prefer is not None and prefer not in self.plans):
                plan = prefer or self.chosen
                assert plan is not None
                return plan, None
            self._started += 1
            alone = self._active == 0
            self._active += 1
            if prefer is not None:
                return prefer, Ticket(prefer, self._started, alone, timed=False)
            if self._block is None or self._block[1] == 0:
                short = [p for p in self.plans if not self._enough(self._samples[p])]
                plan = min(short or self.plans, key=self._turns)
                self._block = (plan, self.BLOCK, [])
                timed = False  # the block's first call
            else:
                plan, timed = self._block[0], True
            self._block = (plan, self._block[1] - 1, self._block[2])
            return plan, Ticket(plan, self._started, alone, timed)

    def end(self, ticket: Ticket, ok: bool) -> None:
        """Record a trial call that finished; decide once every plan has its blocks."""
        seconds = time.perf_counter() - ticket.start
        with self._lock:
            self._active -= 1
            self._trials += seconds
            if self.chosen is not None:
                return
            block = self._block
            if block is not None and block[0] == ticket.plan:
                if ok and ticket.timed and ticket.alone and self._started == ticket.number:
                    block[2].append(seconds)
                if block[1] == 0 and self._active == 0:
                    if block[2]:
                        self._samples[ticket.plan].append(min(block[2]))
                    self._block = None
            self._decide()

    def _decide(self) -> None:
        blocks = [len(samples) for samples in self._samples.values()]
        if all(self._enough(samples) for samples in self._samples.values()):
            self._choose()
        elif self._trials >= self.BUDGET and min(blocks) >= 2:
            self._choose()  # slow calls: settle on what the trials so far show
        elif self._started >= self.most * self.BLOCK * len(self.plans):
            self._choose()  # calls keep overlapping: settle on what was timed

    def _choose(self) -> None:
        timed = [plan for plan in self.plans if self._samples[plan]]
        if not timed:  # nothing ran alone: lanes if there are any, else serial
            self.chosen = self.plans[min(1, len(self.plans) - 1)]
        else:
            self.chosen = min(timed, key=lambda p: statistics.median(self._samples[p]))
        _logger.info("Fanout chose %s; medians: %s", self.chosen, self._describe())

    def drop(self, plan: FanoutPlan, instead: FanoutPlan) -> None:
        """Stop offering `plan` (it declined); `instead` when no other plan is left."""
        with self._lock:
            self.plans = tuple(p for p in self.plans if p != plan) or (instead,)
            self._samples.pop(plan, None)
            if self._block is not None and self._block[0] == plan:
                self._block = None
            for left in self.plans:
                self._samples.setdefault(left, [])
            if len(self.plans) == 1:
                self.chosen = self.plans[0]
            elif self.chosen == plan:
                self._choose()

    def settle(self, plan: FanoutPlan) -> None:
        """Run every call on `plan` from now on, the only candidate (timed or not)."""
        with self._lock:
            self.plans, self.chosen = (plan,), plan
            self._samples.setdefault(plan, [])

    def timings(self) -> dict[FanoutPlan, tuple[float, ...]]:
        """Each plan's samples so far: seconds of the quicker timed call of each block."""
        with self._lock:
            return {plan: tuple(samples) for plan, samples in self._samples.items()}

    def _enough(self, samples: list[float]) -> bool:
        # Short calls swing more on a shared machine: time them for longer.
        if len(samples) < self.rounds:
            return False
        return sum(samples) >= self.seconds or len(samples) >= self.most

    def _turns(self, plan: FanoutPlan) -> tuple[int, int]:
        # Fewest blocks first, so plans alternate block by block.
        return len(self._samples[plan]), self.plans.index(plan)

    def _describe(self) -> str:
        return ", ".join(
            f"{plan} {statistics.median(samples) * 1e3:.2f} ms"
            for plan, samples in self._samples.items()
            if samples
        )


def candidate_plans(
    engine: Engine,
    members: int,
    threads: int | None,
    budget: int,
    scripted: bool,
    stackable: bool = False,
) -> list[FanoutPlan]:
    """The plans an engine may run: one for a fixed engine or width, several for ``"auto"``.

    ``threads=`` fixes the inter-op width, so even ``"auto"`` has one plan then:
    lanes at that width (serial for 1), nothing to time. ``"vmap"`` runs
    serially where the members cannot be stacked.
    """
    serial = FanoutPlan("serial", 1, budget)
    stacked = FanoutPlan("vmap", 1, budget)
    if engine == "vmap":
        return [stacked if stackable else serial]
    if engine == "serial" or (members == 1 and engine == "auto"):
        return [serial]
    if engine in ("threads", "fork"):
        width = threads if threads is not None else max(1, min(members, budget))
        return [FanoutPlan(engine, width, max(1, budget // width))]
    if threads is not None:  # "auto" at a fixed width
        return [
            serial if threads == 1 else FanoutPlan("threads", threads, max(1, budget // threads))
        ]
    lanes = [
        FanoutPlan("threads", w, max(1, budget // w)) for w in _widths(members, budget) if w > 1
    ]
    forked = [FanoutPlan("fork", p.threads, p.intra_op_threads) for p in lanes[-1:]]
    return [serial, *([stacked] if stackable else []), *lanes, *(forked if scripted else [])]


def _widths(members: int, budget: int) -> list[int]:
    """Inter-op widths worth timing: powers of two, and every member at once, within budget."""
    top = max(1, min(members, budget))
    widths = {top}
    width = 2
    while width < top:
        widths.add(width)
        width *= 2
    return sorted(widths)
