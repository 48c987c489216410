"""The heal model's traffic beyond plain calls: remote, streams, Batch, relays, lent handles.

tests/programs/heal_model_machine.py holds the model (workers, calls, objects,
kills); this adds rules that draw every other kind of call a learner mixes,
held to the same model: a value from the process the model expects, or a
named failure (`WorkerUnreachableError`, `ObjectLostError` for objects) only
where a death allows one, and no call that ran twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
from heal_model_machine import (
    CALL_S,
    MAYBE,
    NEVER,
    NOT_SENT,
    WORKERS,
    BaseModel,
    Obj,
    Shared,
    Worker,
    _step,
    _waited,
)
from hypothesis.stateful import rule

import asyncrpc


def _named(call: Callable[[], Any]) -> tuple[str, Any]:
    """("value", v) or ("unreachable", error) for any named failure; others propagate."""
    try:
        return "value", call()
    except asyncrpc.WorkerUnreachableError as exc:  # ObjectLostError, and relayed ones too
        return "unreachable", exc


class HealModel(BaseModel):
    """The base model, and the traffic a learner mixes in."""

    def _failed(self, call_id: int, error: BaseException, what: str, ran_on: int = 0) -> None:
        """A named failure: nothing ran when nothing was sent; else it may have run."""
        assert isinstance(error, asyncrpc.WorkerUnreachableError), (what, error)
        if ran_on:
            self.ids[call_id] = ran_on
        else:
            self.ids[call_id] = NEVER if NOT_SENT in str(error) else MAYBE
        Shared.stats[f"{what}: {type(error).__name__}"] += 1

    def _answered(self, worker: Worker, call_id: int, kind: str, got: Any, what: str) -> None:
        """The outcome of one call to `worker`, made now: a value, or a death allowed it."""
        self.note(f"  -> {kind}: {got!r}"[:200])
        if kind == "value":
            self._returned(worker, worker.attempt, call_id, got)
            return
        assert not worker.joined or NOT_SENT in str(got), (
            f"{what} (id {call_id}) to {worker.name}, joined and alive, failed: {got!r}"
        )
        self._failed(call_id, got, what)

    @rule(index=st.integers(0, 2))
    @_step
    def remote_call(self, index: int) -> None:
        worker = self.workers[WORKERS[index]]
        call_id = Shared.new_id()

        def remote() -> Any:
            rref = asyncrpc.remote(worker.name, Shared.record, args=(call_id,), timeout=CALL_S)
            return rref.to_here(CALL_S)

        kind, got = _named(remote)
        self._answered(worker, call_id, kind, got, "remote")

    @rule(index=st.integers(0, 2), window=st.sampled_from([1, 2, 32]), n=st.integers(1, 4))
    @_step
    def stream_call(self, index: int, window: int, n: int) -> None:
        worker = self.workers[WORKERS[index]]
        call_id = Shared.new_id()
        items: list[Any] = []

        def consume() -> list[Any]:
            for item in asyncrpc.stream(worker.name, Shared.record_stream, args=(call_id, n),
                                        window=window, timeout=CALL_S):  # fmt: skip
                items.append(item)
            return items

        kind, got = _named(consume)
        assert [item[3] for item in items] == list(range(len(items))), items  # a prefix
        if kind == "value":
            assert len(items) == n, items
            self._answered(worker, call_id, kind, items[0][:3], "stream")
            return
        self.note(f"  -> {len(items)} items, then {got!r}"[:200])
        assert not worker.joined or NOT_SENT in str(got), f"stream from {worker}: {got!r}"
        if items:  # it ran, once, on the process that made them
            self._returned(worker, worker.attempt, call_id, items[0][:3])
        self._failed(call_id, got, "stream", ran_on=items[0][0] if items else 0)

    @rule(indexes=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    @_step
    def batch_call(self, indexes: list[int]) -> None:
        batch = asyncrpc.Batch(timeout=CALL_S)
        sent = []
        for index in indexes:
            worker = self.workers[WORKERS[index]]
            call_id = Shared.new_id()
            kind, got = _named(lambda w=worker, c=call_id: batch.rpc_async(
                w.name, Shared.record, args=(c,)))  # fmt: skip
            if kind == "value":
                sent.append((worker, worker.attempt, call_id, got))
            else:  # refused as it was added: its worker is being replaced
                self._answered(worker, call_id, kind, got, "Batch call")
        batch.send()  # a worker that cannot be reached fails only its own calls
        for worker, attempt, call_id, fut in sent:
            kind, got = _waited(fut)
            if kind == "value":
                self._returned(worker, attempt, call_id, got)
            else:
                assert not worker.joined or attempt != worker.attempt or NOT_SENT in str(got), (
                    f"Batch call {call_id} to {worker} failed: {got!r}"
                )
                self._failed(call_id, got, "Batch call")

    @rule(dest=st.integers(0, 2), via=st.integers(0, 2))
    @_step
    def relay_call(self, dest: int, via: int) -> None:
        if dest == via:
            return
        to, through = self.workers[WORKERS[dest]], self.workers[WORKERS[via]]
        call_id = Shared.new_id()
        kind, got = _named(lambda: asyncrpc.rpc_sync(
            through.name, Shared.relay, args=(to.name, call_id), timeout=CALL_S))  # fmt: skip
        self.note(f"  -> {kind}: {got!r}"[:200])
        if kind == "value":
            self._returned(to, to.attempt, call_id, got)
            return
        # `through` may learn of `to`'s replacement a moment after worker0 did: then the
        # nested call is refused as "being replaced", and nothing ran.
        assert not (to.joined and through.joined) or NOT_SENT in str(got), (
            f"relay {call_id} through {through} to {to} failed: {got!r}"
        )
        self._failed(call_id, got, "relay")

    @rule(index=st.integers(0, 20), to=st.integers(0, 2), k=st.integers(0, 5))
    @_step
    def lend_call(self, index: int, to: int, k: int) -> None:
        if not self.objects:
            return
        obj = self.objects[index % len(self.objects)]
        holder, owner = self.workers[WORKERS[to]], self.workers[obj.worker]
        call_id = Shared.new_id()
        args = (obj.handle, call_id, k)
        kind, got = _named(
            lambda: asyncrpc.rpc_sync(holder.name, Shared.lend_use, args=args, timeout=CALL_S)
        )
        self.note(f"  -> {kind}: {got!r}"[:200])
        if kind == "value":
            obj.unsure = False
            self._returned(owner, obj.attempt, call_id, got)
            self.ids[obj.created] = got[0]
            assert got[3] == obj.n + k, f"Counter on {obj.worker} says {got[3]}, not {obj.n + k}"
            obj.n = got[3]
            return
        self._lent_failed(obj, holder, owner, call_id, got)

    def _lent_failed(
        self, obj: Obj, holder: Worker, owner: Worker, call_id: int, error: BaseException
    ) -> None:
        if obj.unsure:  # spawned while its worker was replaced: maybe onto the dead process
            obj.lost, obj.unsure, obj.void = True, False, True
        elif not obj.lost:
            assert not (holder.joined and owner.joined) or NOT_SENT in str(error), (
                f"a lent handle to a live Counter on {obj.worker} failed: {error!r}"
            )
        elif owner.joined and not obj.void and getattr(error, "name", None) != holder.name:
            # (a holder being replaced refuses the call first, naming itself)
            assert isinstance(error, asyncrpc.ObjectLostError), (
                f"a lent handle to the lost object of {obj.worker} raised {error!r}"
            )
        self._failed(call_id, error, "lent handle")
