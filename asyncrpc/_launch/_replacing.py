"""What a worker's end means in a world that heals, and its replacement: one algorithm.

Both supervisors of a world that heals hand each end of a worker's process
to `Replacer.ended`: an embedded world's (`_local`, over multiprocessing's
processes) and each launcher of `asyncrpc-launch --restart worker`
(`_nodes`, over subprocesses). Each gives it what only it knows, through
`Supervised`; the decision is this one::

    a worker's process ended (Ended: rank, name, exit code, how)
      a change of members (removed and left, or an added
        worker that failed to join: `Supervised.left`)      -> LEFT
      exit 0 and the world ends (every main done)          -> DONE
      the world has not formed (no main ran): nothing to
        heal, the others wait for it in the world's start   -> UNFORMED
      a world that grows and does not heal (max_restarts=0), any worker but
        rank 0, while the world runs: it leaves the world unasked
        (`Supervised.lost`: every member hears `Left`; the replacements
        still joining are stopped first, and start again)   -> LEFT
      else replace it in place:
        stop this supervisor's replacements still joining (torch's join may
          wait for the dead process for good; they start again, uncounted)
        Healer.replace: every member forgets the dead process (`_healer`)
          max_restarts spent, or the world ending           -> FAILED (`reason`)
        a replacement whose join a member refused (exit code 77: that
          member's listener closed, it ends and is replaced too)
          -> started again in 0.25 s, uncounted             -> HEALED
        else the replacement starts now                     -> HEALED
    every turn: start_due() starts the replacements held back

What each supervisor does with UNFORMED and FAILED is its own: embedded,
the world starts again or `run` raises; a launcher ends, naming the worker.
Rank 0's death is never a departure: it runs the program's driver (the
`main` whose result `asyncrpc.run` returns), so it fails a world that does
not heal.
"""

from __future__ import annotations

import enum
import sys
import time
from collections.abc import Callable
from typing import NamedTuple, Protocol

from .._core._errors import JOIN_REFUSED_EXIT
from .._core._membership import Joining
from ._healer import Healer

__all__ = ("Ended", "Exit", "Replacer", "Supervised", "Verdict", "spent")

# A replacement whose join a member refused starts again after this: time for that
# member to see its listener closed and end (`_core/_torch/_listener`), up to
# _REFUSED_MAX times in a row uncounted (then counted: a member refusing for good).
_REFUSED_S = 0.25
_REFUSED_MAX = 40


class Exit(enum.Enum):
    """What a worker's end means (`Replacer.ended`)."""

    DONE = "done"  # it returned from main as the world ends
    LEFT = "left"  # a change of members: it left, or an added worker failed to join
    HEALED = "healed"  # replaced in place (now, or in a moment: `Replacer.start_due`)
    UNFORMED = "unformed"  # it died before the world formed: nothing ran, nothing to heal
    FAILED = "failed"  # the world fails (`Verdict.reason` says why it may not heal)


class Verdict(NamedTuple):
    exit: Exit
    reason: str = ""  # FAILED: "spent" (max_restarts replacements made), or "ending"


class Ended(NamedTuple):
    """One worker's process that ended, as its supervisor saw it."""

    rank: int
    name: str
    code: int  # its exit code; negative: killed by that signal
    summary: str  # who and how, one line: "worker 'worker2' (rank 2) was killed by SIGKILL"
    how: str  # how, for the survivors' errors: "was killed by SIGKILL"
    traceback: str = ""  # its traceback, where the supervisor has it (embedded) to print


class Supervised(Protocol):
    """What one supervisor knows and does, over worker processes of its own type."""

    def world_ended(self) -> bool:
        """Whether the world ends (every main done): a worker that exits 0 is done."""
        ...

    def left(self, end: Ended) -> bool:
        """Whether the end was a change of members (it left, or failed to join); told."""
        ...

    def formed_healer(self) -> Healer | None:
        """The world's healer once it formed (every member knew the others), else None."""
        ...

    def grows(self) -> bool:
        """Whether members may come and go (an elastic world): a death may be a departure."""
        ...

    def lost(self, end: Ended) -> None:
        """`end`'s worker died unasked and leaves the world: every member hears `Left`.

        Said on stderr in one line, with the supervisor's own hint.
        """
        ...

    def start(self, rank: int, joining: Joining, attempt: int) -> None:
        """Start worker `rank`'s replacement, joining as `joining` says, and watch it."""
        ...

    def retire(self, rank: int) -> None:
        """Let go of worker `rank`'s ended process (its descriptors); it was replaced."""
        ...

    def stop_joining(self, names: set[str], stopping: Callable[[str], None]) -> list[str]:
        """Kill this supervisor's processes among `names` (still joining); those killed.

        `stopping(name)` first, for each: the healer marks it stopped (to start
        again), so that no supervisor waits for it as it dies.
        """
        ...


def spent(max_restarts: int, started_again: int, flag: str) -> str:
    """Why a world that heals failed: `max_restarts` spent (`flag`: how it was given)."""
    if not started_again:
        return f"the world replaced workers {max_restarts} times ({flag})"
    return (
        f"the world was started again {started_again} times as it started and replaced "
        f"workers {max_restarts - started_again} times ({flag})"
    )


class Replacer:
    """The one heal algorithm of a supervisor: what each end means, and the replacement."""

    def __init__(self, supervised: Supervised) -> None:
        self.supervised = supervised
        self.later: dict[int, tuple[float, Joining]] = {}  # rank -> (when, how it joins)
        self.refusals: dict[int, int] = {}  # rank -> its replacement's joins refused in a row

    def ended(self, end: Ended) -> Verdict:
        """What worker `end.rank`'s end means; a replacement is started (or held back)."""
        supervised = self.supervised
        if supervised.left(end):
            if end.traceback and end.code != 0:  # it failed to join: say why
                print(end.traceback.rstrip(), file=sys.stderr, flush=True)
            supervised.retire(end.rank)
            return Verdict(Exit.LEFT)
        if end.code == 0 and supervised.world_ended():
            return Verdict(Exit.DONE)
        healer = supervised.formed_healer()
        if healer is None:
            return Verdict(Exit.UNFORMED)
        if self._departs(healer, end):
            return Verdict(Exit.LEFT)
        return self._replace(healer, end)

    def _departs(self, healer: Healer, end: Ended) -> bool:
        """In a world that grows and does not heal, a dead worker (not rank 0) leaves it.

        Not one this supervisor stopped as it joined, nor one still joining
        (they start again, or fail their add), nor once the world ends.
        """
        supervised = self.supervised
        if healer.max_restarts or end.rank == 0 or not supervised.grows():
            return False
        joining = healer.joining()
        if end.name in healer.retry or end.name in joining or supervised.world_ended():
            return False
        # torch's join of one still joining may wait for the dead process for good,
        # and it holds the group's token that forgetting the dead one takes.
        self._stop_joining(healer, joining)
        if end.traceback:
            print(end.traceback.rstrip(), file=sys.stderr, flush=True)
        supervised.lost(end)
        supervised.retire(end.rank)
        return True

    def _replace(self, healer: Healer, end: Ended) -> Verdict:
        retry = end.name in healer.retry  # before `_refused` marks it
        refused = self._refused(healer, end)
        unjoined = healer.joining() - {end.name}  # they have nothing to forget
        if not retry:  # one stopped as it joined held torch's join token: no joiner saw it
            self._stop_joining(healer, unjoined)
        alive = {name for name in healer.names if healer.running(name)} - unjoined
        joining = healer.replace(end.rank, end.how, alive)
        if joining is None:
            self.later.clear()  # the world fails: nothing more starts
            spent_all = healer.count > healer.max_restarts
            return Verdict(Exit.FAILED, "spent" if spent_all else "ending")
        try:
            if end.traceback and not refused:
                print(end.traceback.rstrip(), file=sys.stderr, flush=True)
            print(f"asyncrpc: {_heal_line(healer, end, retry, refused)}",
                  file=sys.stderr, flush=True)  # fmt: skip
            self.supervised.retire(end.rank)
            if refused:
                self.later[end.rank] = (time.monotonic() + _REFUSED_S, joining)
            else:
                self.supervised.start(end.rank, joining, healer.attempts[end.name])
        finally:
            healer.started()
        return Verdict(Exit.HEALED)

    def _refused(self, healer: Healer, end: Ended) -> bool:
        """A replacement whose join a member refused: started again later, not counted.

        That member's listener is closed, and it ends soon to be replaced
        (`_core/_torch/_listener`); a join before then is refused again.
        """
        joined = end.name not in healer.joining()
        if joined or end.code != JOIN_REFUSED_EXIT:
            self.refusals.pop(end.rank, None)
            return False
        self.refusals[end.rank] = self.refusals.get(end.rank, 0) + 1
        if self.refusals[end.rank] > _REFUSED_MAX:
            return False
        healer.retry.add(end.name)  # neither counted nor an attempt of its own
        return True

    def _stop_joining(self, healer: Healer, joining: set[str]) -> None:
        """Kill the replacements still `joining` (they may wait for the dead one); forget them.

        All killed first: one still joining may hold torch's group token, which
        the forgetting of another would wait for. Their deaths come back as
        ends of their own; they start again (`Healer.retry`: not counted).
        """
        for name in self.supervised.stop_joining(joining, healer.stop):
            healer.forget_stopped(name)

    def start_due(self) -> None:
        """Start the replacements held back (`_REFUSED_S`) whose time has come."""
        now = time.monotonic()
        healer = self.supervised.formed_healer()
        for rank, (when, joining) in sorted(self.later.items()):
            if when <= now and healer is not None:
                del self.later[rank]
                self.supervised.start(rank, joining, healer.attempts[healer.names[rank]])

    def next_start(self) -> float | None:
        """When the next replacement held back is due (`time.monotonic()`), if any."""
        return min((when for when, _ in self.later.values()), default=None)


def _heal_line(healer: Healer, end: Ended, retry: bool, refused: bool) -> str:
    name, rank = end.name, end.rank
    if refused:
        return (
            f"the replacement of worker {name!r} (rank {rank}) could not join: another "
            f"member refused its connection (its listener closed; it ends and is replaced "
            f"too); starting it again in {_REFUSED_S:g} s"
        )
    if retry:
        return (
            f"the replacement of worker {name!r} (rank {rank}) was stopped before it "
            f"joined, as another worker died meanwhile; starting it again"
        )
    restart = f"restart {healer.count} of {healer.max_restarts}"
    return f"{end.summary}; replacing it in place ({restart})"
