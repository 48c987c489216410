"""Local fan-out: run several callables or modules in parallel inside one process.

`Fanout` owns the engines and the thread budget; `fanout` is its one-shot form.

    caller thread                      plan (engine="auto" times them: _tuner)
    Fanout(members)(x) ──┬── "vmap":    members of one architecture as one
                         │    batched call over their stacked weights
                         ├── "threads": a pool of `threads` Python threads,
                         │    each with `intra_op_threads`; torch ops
                         │    release the GIL, so eager modules overlap
                         ├── "fork":    one TorchScript driver forks every
                         │    member (torch.jit.fork runs in parallel only
                         │    inside TorchScript) and waits for them all
                         └── "serial":  one after the other
    results, in member order  <──┘

Budget: inter-op width x intra-op threads fits the intra-op threads this
process had when the `Fanout` was made (asyncrpc gives each worker its share
of the cores), so N members never oversubscribe the machine. "auto" runs a
call that draws random numbers serially, so the stream is the serial one
(_randomness); a copy or pickle is a new `Fanout` over copied members (_copies).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
from torch.futures import Future

from .._core import _futures
from . import _exit
from ._calling import call, on_rows, settle, span, succeeded
from ._copies import copied_members, rows_of
from ._decline import Declined, decline
from ._forked import run_forked, script_driver
from ._grads import StackedGrads
from ._options import check_members, check_names, check_threads
from ._pool import Pool
from ._randomness import RandomGuard, Watch
from ._stacked import Stacked
from ._storage import Storage, Unstackable
from ._tuner import Engine, FanoutPlan, Ticket, Tuner, candidate_plans

_ENGINES = ("auto", "vmap", "threads", "fork", "serial")
_Calls = list[tuple[tuple[Any, ...], dict[str, Any]]]
_logger = logging.getLogger("asyncrpc")


class Fanout:
    """Run `members` in parallel in this process; results come back in member order.

    `engine` is ``"vmap"`` (modules of one architecture run as one batched
    call over their stacked weights; members it cannot stack run serially,
    the reason in `declined`), ``"threads"`` (any eager module or function),
    ``"fork"`` (TorchScript `jit.fork`; members are modules taking one Tensor
    and returning one), ``"serial"``, or ``"auto"``: the first calls time each
    candidate `FanoutPlan` (serial on the whole intra-op budget; vmap when
    the members can be stacked; threads at each inter-op width; fork too when
    every member is a ScriptModule), alternating call by call, and every
    later call uses the fastest (`plan`; None until then). Calls that draw
    random numbers run serially under ``"auto"``, so the same seed gives
    the same draws as the members one by one, whichever plan it picked.
    `threads` fixes the inter-op width (and so the plan: nothing is timed);
    each lane gets ``budget // threads`` intra-op threads. `names` label the
    members in errors ("raised by <name>") and in traces (default
    ``"member i (Linear)"``). TorchScript's deprecation warnings stay hidden
    unless ``show_warnings=True``. `copy.deepcopy` and `pickle` give a new
    `Fanout` over copies of the members, with the same options.

    Example::

        heads = asyncrpc.Fanout([torch.nn.Linear(8, 2) for _ in range(4)])
        outputs = heads(torch.rand(16, 8))          # 4 tensors, same input
        outputs = heads.map([(x0,), (x1,), (x2,), (x3,)])  # one input each
        heads.plan      # the plan "auto" settled on, after its timed calls
        heads.declined  # {"fork": "...why not"}: engines these members cannot use
    """

    def __init__(
        self,
        members: Sequence[Callable[..., Any]],
        *,
        engine: Engine = "auto",
        threads: int | None = None,
        names: Sequence[str] | None = None,
        show_warnings: bool = False,
    ) -> None:
        self.members = check_members(members)
        self.names = check_names(names, self.members)
        if engine not in _ENGINES:
            raise ValueError(f"engine must be one of {_ENGINES}, got {engine!r}")
        self.engine: Engine = engine
        self._options = (check_threads(threads), show_warnings)  # for copies
        self.budget = torch.get_num_threads()
        scripted = all(isinstance(m, torch.jit.ScriptModule) for m in self.members)
        self.declined: dict[str, str] = {}
        """Engines these members cannot use, each with the reason (also logged)."""
        if not scripted and engine == "auto":  # engine="fork" scripts them instead
            self.declined["fork"] = "the members are not all TorchScript modules"
        self._stacked: Stacked | None = None
        self._kept: Stacked | None = None  # declined, its stacks still stepped (_grads)
        if engine in ("auto", "vmap"):
            self._stacked = self._stack_members(engine)
        plans = candidate_plans(
            engine,
            len(self.members),
            self._options[0],
            self.budget,
            scripted,
            stackable=self._stacked is not None,
        )
        self._tuner = Tuner(plans)
        self._serial_plan = FanoutPlan("serial", 1, self.budget)
        # "auto" keeps the serial random stream: calls that draw run serially.
        self._guard: RandomGuard | None = None
        if engine == "auto" and any(plan.engine != "serial" for plan in plans):
            self._guard = RandomGuard(self.members, self.names)
        self._pools: dict[FanoutPlan, Pool] = {}
        self._driver: torch.jit.ScriptModule | None = None
        self._lock = threading.Lock()
        if any(plan.engine == "fork" for plan in plans):
            self._driver = script_driver(self.members, show_warnings)
        # Members may fork too (a scripted BiLSTM): settle torch's threads at exit.
        _exit.settle_at_exit()

    def _stack_members(self, engine: Engine) -> Stacked | None:
        reason = decline(self.members)
        if reason is None:
            return Stacked(self.members)  # type: ignore[arg-type]  # decline checked Modules
        self._decline(reason, engine == "vmap")
        return None

    def _decline(self, reason: str, asked: bool) -> None:
        self.declined["vmap"] = reason
        level = logging.WARNING if asked else logging.INFO
        _logger.log(level, "Fanout: engine 'vmap' declined: %s", reason)

    @property
    def plan(self) -> FanoutPlan | None:
        """The plan every call uses; None while ``engine="auto"`` is still timing plans."""
        return self._tuner.chosen

    @property
    def plans(self) -> tuple[FanoutPlan, ...]:
        """The candidate plans: one for a fixed engine, several for ``"auto"``."""
        return self._tuner.plans

    def parameters(self) -> list[torch.Tensor]:
        """The stacks the members' parameters are rows of, for one optimizer over all members.

        Engine ``"vmap"`` only. Gradients then reach each stack in one piece
        (`stack.grad`), and each member's `.grad` is a view of its row of it, on
        calls stacked or member by member; an optimizer over the stacks steps
        every member at once (one foreach or fused kernel per name, not one per
        member). Zero gradients through that optimizer. Valid until `close`.
        Example::

            fan = asyncrpc.Fanout(critics, engine="vmap")
            opt = torch.optim.Adam(fan.parameters(), lr=3e-4)
            loss = torch.stack(fan(x)).sub(y).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()   # every critic stepped
        """
        stacked = self._stacked
        storage = stacked.storage if stacked is not None else None
        if self.engine != "vmap" or storage is None:
            why = self.declined.get("vmap", "it is closed") if self.engine == "vmap" else ""
            raise RuntimeError(
                "Fanout.parameters() needs engine='vmap' over members it stacks, got "
                f"engine={self.engine!r}"
                + (f" (declined: {why})" if why else "")
                + "; step the members' own parameters instead: "
                "[p for m in members for p in m.parameters()]"
            )
        with contextlib.suppress(Unstackable):
            storage.sync()  # members changed since the last call (`.double()`): restack now
        return list(storage.stacked_gradients().stacks.values())

    def timings(self) -> dict[FanoutPlan, tuple[float, ...]]:
        """Seconds of the timed calls of each candidate plan (``"auto"``'s evidence)."""
        return self._tuner.timings()

    def __call__(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Call every member with the same arguments and return their results."""
        return self.call_async(*args, **kwargs).wait()

    def map(self, inputs: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Call member i with ``*inputs[i]``; one argument tuple per member."""
        return self.map_async(inputs).wait()

    def call_async(self, *args: Any, **kwargs: Any) -> Future[list[Any]]:
        """Like calling the `Fanout`, but return a Future of the results at once."""
        return self._run([(args, kwargs)] * len(self.members))

    def map_async(self, inputs: Sequence[tuple[Any, ...]]) -> Future[list[Any]]:
        """Like `map`, but return a Future of the results at once."""
        if not isinstance(inputs, Sequence) or len(inputs) != len(self.members):
            got = len(inputs) if isinstance(inputs, Sequence) else type(inputs).__name__
            raise ValueError(
                f"map needs one argument tuple per member ({len(self.members)}), got {got}; "
                "write fan.map([(x0,), (x1,), ...])"
            )
        calls: _Calls = []
        for item in inputs:
            if not isinstance(item, tuple):
                raise TypeError(
                    f"each input must be a tuple of arguments, got {type(item).__name__}; "
                    "write (x,) for one argument"
                )
            calls.append((item, {}))
        return self._run(calls)

    def close(self) -> None:
        """Stop the engine's threads, and give stacked members memory of their own again.

        Also done when the `Fanout` is collected. While the "vmap" engine
        runs, each member's parameters and buffers are views into one stacked
        tensor per name; after `close` they are plain tensors again.
        """
        self._close_pools(keep=None)
        self._release_stacks()

    def _release_stacks(self) -> None:
        stacked = self._stacked or self._kept
        self._kept = None
        if stacked is not None:
            if stacked.storage is not None and stacked.storage.users <= 1:
                stacked.storage.grads = None  # closed on purpose: nothing to warn of
            stacked.release()

    def __enter__(self) -> Fanout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # At interpreter exit torch's C state is being torn down: calling into it from
        # a collector (no_grad, a tensor's .data) crashed the process (SIGSEGV, seen with
        # CUDA tensors); the memory goes with the process anyway.
        if hasattr(self, "_pools") and not sys.is_finalizing():  # no _pools: __init__ raised
            self.close()

    def __repr__(self) -> str:
        plan = self.plan if self.plan is not None else f"timing {len(self.plans)} plans"
        return f"Fanout({len(self.members)} members, engine={self.engine!r}, plan={plan})"

    def __deepcopy__(self, memo: dict[int, Any]) -> Fanout:
        """A new `Fanout` over deep copies of the members, with the same options (_copies)."""
        members = copied_members(self.members, rows_of(self.members, self._storage()), memo)
        return _rebuild(members, self.engine, *self._options, self.names)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its members and options; unpickled, a new `Fanout` (_copies)."""
        storage = self._storage()
        members = self.members
        if storage is not None:  # a row would pickle its whole stack
            members = tuple(copied_members(members, rows_of(members, storage)))
        return (_rebuild, (list(members), self.engine, *self._options, self.names))

    def _storage(self) -> Storage | None:
        stacked = self._stacked
        return stacked.storage if stacked is not None else None

    def _run(self, calls: _Calls) -> Future[list[Any]]:
        watch = self._watch()
        plan, ticket = self._tuner.begin(self._serial_plan if watch and watch.probe else None)
        try:
            if watch is not None and watch.probe:
                fut = settle(lambda: self._probe(watch, calls))
            else:
                fut = self._run_plan(plan, calls)
        except BaseException:
            if ticket is not None:
                self._tuner.end(ticket, ok=False)
            raise
        if ticket is None and watch is None:
            return fut
        if fut.done():  # ran in this thread: record it now, no second Future
            self._finished(plan, ticket, watch, fut, None)
            return fut
        # The caller sees the results only once the time and the random state are
        # recorded, so its next call never overlaps this one in the tuner's eyes.
        out = _futures.Settle()
        fut.add_done_callback(lambda done: self._finished(plan, ticket, watch, done, out))
        return out.future

    def _watch(self) -> Watch | None:
        """The random-stream guard's watch over the next call (engine="auto" only)."""
        guard = self._guard
        if guard is not None and self.plan is not None and self.plan.engine == "serial":
            guard = self._guard = None  # every call runs serially: nothing to guard
        return guard.start() if guard is not None else None

    def _probe(self, watch: Watch, calls: _Calls) -> list[Any]:
        results = []
        for i, (m, n, (a, k)) in enumerate(self._triples(calls)):
            results.append(call(m, n, a, k))
            watch.after_member(i)
        return results

    def _finished(
        self,
        plan: FanoutPlan,
        ticket: Ticket | None,
        watch: Watch | None,
        done: Future[list[Any]],
        out: _futures.Settle | None,
    ) -> None:
        try:
            ok = succeeded(done)
            guard, drew = self._guard, None
            if watch is not None and guard is not None:
                drew = guard.finish(watch, ok, plan)
                if drew is not None:
                    self._run_serially(*drew)
            if ticket is not None:
                if ok and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
                    # A trial's time is its kernels' too, not only their launch.
                    torch.cuda.synchronize()
                self._tuner.end(ticket, ok=ok)
            if (ticket is not None or drew is not None) and self.plan is not None:
                self._close_pools(keep=self.plan)
                if self.plan.engine != "vmap":  # the members need not stay stacked
                    self._release_stacks()
        finally:
            if out is not None:
                out.copy(done)

    def _run_serially(self, reason: str, warn: bool) -> None:
        """A call drew random numbers: "auto" runs every later call serially."""
        for plan in self._tuner.plans:
            if plan.engine != "serial":
                self.declined[plan.engine] = reason
        self._tuner.settle(self._serial_plan)
        self._guard = None
        _logger.log(logging.WARNING if warn else logging.INFO, "Fanout: %s", reason)

    def _run_plan(self, plan: FanoutPlan, calls: _Calls) -> Future[list[Any]]:
        if plan.engine == "serial":
            return settle(lambda: self._serial(calls))
        if plan.engine == "vmap":
            return settle(lambda: self._vmap(plan, calls))
        if plan.engine == "fork":
            driver = self._driver
            assert driver is not None
            return settle(lambda: run_forked(driver, self._lock, plan, calls))
        pool = self._ensure_pool(plan)
        futs = [pool.submit(partial(call, m, n, a, k)) for m, n, (a, k) in self._triples(calls)]
        return _futures.gather(futs)

    def _stacked_grads(self) -> StackedGrads | None:
        """The stacks `parameters()` handed out, while the members are their rows."""
        stacked = self._stacked or self._kept
        storage = stacked.storage if stacked is not None else None
        return storage.grads if storage is not None else None

    def _serial(self, calls: _Calls) -> list[Any]:
        grads = self._stacked_grads()
        if grads is not None and torch.is_grad_enabled() and self._restacked(grads):
            # Member by member on their rows of the stacks: gradients reach stack.grad whole.
            rows = grads.rows(self.members)
            return [
                call(partial(on_rows, m, rows[i]), n, a, k)
                for i, (m, n, (a, k)) in enumerate(self._triples(calls))
            ]
        return [call(m, n, a, k) for m, n, (a, k) in self._triples(calls)]

    def _restacked(self, grads: StackedGrads) -> bool:
        """True when the members' tensors are rows of the stacks now (restacked if they
        moved: `.double()`); False when they cannot be (members unlike each other)."""
        stacked = self._stacked or self._kept
        if stacked is not None and stacked.storage is not None:
            with contextlib.suppress(Unstackable):
                stacked.storage.sync()
        return grads.current()

    def _vmap(self, plan: FanoutPlan, calls: _Calls) -> list[Any]:
        stacked = self._stacked
        if stacked is None:  # declined by an earlier call
            return self._serial(calls)
        grads = self._stacked_grads()
        if grads is not None and torch.is_grad_enabled():
            grads.point(create=False)
        try:
            with span(f"vmap of {len(self.members)} members"):
                return stacked.run(calls, lambda: self._serial(calls))
        except Declined as declined:
            if grads is None:
                stacked.release()
            else:  # the members stay rows of the stacks an optimizer steps: calls run
                self._kept = stacked  # member by member, their gradients in stack.grad
            self._stacked = None
            self._decline(str(declined), self.engine == "vmap")
            self._tuner.drop(plan, FanoutPlan("serial", 1, self.budget))
            return declined.results if declined.results is not None else self._serial(calls)

    def _triples(self, calls: list[Any]) -> Iterator[tuple[Any, str, Any]]:
        return zip(self.members, self.names, calls, strict=True)

    def _ensure_pool(self, plan: FanoutPlan) -> Pool:
        with self._lock:
            pool = self._pools.get(plan)
            if pool is None:
                pool = self._pools[plan] = Pool(plan.threads, plan.intra_op_threads)
            return pool

    def _close_pools(self, keep: FanoutPlan | None) -> None:
        with self._lock:
            for plan in [p for p in self._pools if p != keep]:
                self._pools.pop(plan).close()


def _rebuild(
    members: Sequence[Callable[..., Any]],
    engine: Engine,
    threads: int | None,
    show_warnings: bool,
    names: Sequence[str],
) -> Fanout:
    """A copied or unpickled `Fanout` (see `Fanout.__reduce__`)."""
    return Fanout(
        members, engine=engine, threads=threads, names=names, show_warnings=show_warnings
    )


def fanout(
    members: Sequence[Callable[..., Any]],
    *args: Any,
    engine: Engine = "auto",
    threads: int | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Call every member with the same arguments in parallel; results in member order.

    A one-shot `Fanout` (its threads stop afterwards). Example::

        a, b = asyncrpc.fanout([model_a, model_b], x)
    """
    with Fanout(members, engine=engine, threads=threads) as fan:
        return fan(*args, **kwargs)
