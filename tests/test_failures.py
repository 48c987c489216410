"""How a failure is captured, carried, sent and raised again; no world needed."""

from __future__ import annotations

import gc
import pickle
import weakref
from typing import Any

import pytest
import torch

import asyncrpc
from asyncrpc._core import _failures

from remote_errors import HoldsALock, Rejected

WHERE = "worker 'worker1' (rank 1)"


class Big:
    """Stands for a large local: a weakref tells whether anything still holds it."""


def load(key: str) -> None:
    raise KeyError(key)


def _captured(error: BaseException) -> _failures.Failure:
    try:
        raise error
    except BaseException as exc:
        return _failures.capture(exc, WHERE, load)


def _raised(value: object) -> BaseException:
    with pytest.raises(BaseException) as raised:
        _failures.check_reply(value)
    return raised.value


def _sent_and_raised(error: BaseException) -> BaseException:
    return _raised(pickle.loads(pickle.dumps(_captured(error))))


def test_a_remote_exception_keeps_its_type_and_names_the_worker() -> None:
    err = _sent_and_raised(KeyError("shard 3"))
    assert isinstance(err, KeyError) and isinstance(err, asyncrpc.RemoteError)
    assert isinstance(err, RuntimeError)  # the type torch raises for remote errors
    assert "On worker 'worker1' (rank 1), in load(). Original exception on remote side was:" in (
        str(err)
    )
    assert "Traceback" in err.remote_text  # type: ignore[attr-defined]


def test_attributes_and_errno_survive() -> None:
    rejected = _sent_and_raised(Rejected("too big", 413))
    assert isinstance(rejected, Rejected) and rejected.code == 413  # type: ignore[attr-defined]
    missing = _sent_and_raised(FileNotFoundError(2, "No such file", "/x"))
    assert isinstance(missing, FileNotFoundError) and missing.errno == 2  # type: ignore[attr-defined]


def test_a_relayed_error_keeps_its_origin() -> None:
    first = _sent_and_raised(ValueError("bad shard"))
    again = _sent_and_raised(first)  # raised again by a worker that awaited it
    assert isinstance(again, ValueError) and again.remote_text == first.remote_text  # type: ignore[attr-defined]


def test_an_exception_that_cannot_be_pickled_is_named_with_its_text() -> None:
    err = _sent_and_raised(HoldsALock())
    assert isinstance(err, asyncrpc.SerializationError) and isinstance(err, RuntimeError)
    assert isinstance(err, asyncrpc.RemoteError)
    assert "HoldsALock" in str(err) and "holds a lock" in str(err) and WHERE in str(err)

    class LocalClass(Exception):
        pass

    local = _sent_and_raised(LocalClass("defined in a function"))
    assert isinstance(local, asyncrpc.SerializationError)
    assert "LocalClass" in str(local) and "defined in a function" in str(local)


def test_a_class_the_caller_cannot_import_is_named() -> None:
    failure = _captured(KeyError("x"))
    reviver, (_, _, message, where, _, why) = failure.__reduce__()
    revived = reviver("no_such_module", "Gone", message, where, b"not a pickle", why)
    with pytest.raises(asyncrpc.SerializationError, match=r"no_such_module\.Gone.*cannot rebuild"):
        _failures.check_reply(revived)


def test_every_read_raises_a_fresh_copy_and_keeps_no_frame() -> None:
    # The stored error never gains a reader's frames: no cycle through a torch Future.
    failure = _captured(KeyError("once"))
    first, second = _raised(failure), _raised(failure)
    assert first is not second and first is not failure.error
    assert type(first) is type(second) is type(failure.error)
    assert str(first) == str(failure.error)
    assert failure.error.__traceback__ is None  # a twin carries its traceback as text


def test_held_errors_release_their_frames_locals() -> None:
    def fails(marker: Big) -> None:
        raise ValueError("held")

    big = Big()
    alive = weakref.ref(big)
    try:
        fails(big)
    except ValueError as exc:
        failure = _failures.hold(exc)
    del big
    gc.collect()
    assert alive() is None  # the frame of `fails` kept no locals
    raised = _raised(failure)
    assert isinstance(raised, ValueError) and raised.__traceback__ is not None


def test_a_kept_failure_never_links_to_the_frame_that_runs_when_gc_does() -> None:
    # Python 3.12 links a kept frame whose generator is closed by running it to the
    # frame running at that moment (gc's, at any allocation): that frame's locals,
    # a Batch's reply callback's say, would then live as long as the failure.
    def fails() -> None:
        raise ValueError("held")

    failures = []
    for _ in range(20):
        try:
            fails()
        except ValueError as exc:
            failures.append(_failures.hold(exc))

    def runs_while_gc_frees(holder: Big) -> None:
        gc.collect()

    big = Big()
    alive = weakref.ref(big)
    runs_while_gc_frees(big)
    del big
    gc.collect()
    assert alive() is None  # no kept frame links to `runs_while_gc_frees`
    tracebacks = [failure.error.__traceback__ for failure in failures]
    assert all(tb is not None and tb.tb_frame.f_back is None for tb in tracebacks)


def test_a_future_failed_with_a_failure_leaks_nothing() -> None:
    # torch's own set_exception keeps the raised object: each read would add the
    # reader's frame, which holds the Future (a cycle gc cannot see).
    refs = []
    for _ in range(50):
        fut = asyncrpc.failed(KeyError("k"))
        big = Big()
        refs.append(weakref.ref(big))

        def read(f: torch.futures.Future[None], holder: Big = big) -> None:
            f.wait()

        with pytest.raises(KeyError):
            read(fut)
        del big, fut, read
    gc.collect()
    assert sum(ref() is not None for ref in refs) == 0


def test_errors_that_stand_for_torch_failures_are_its_types() -> None:
    for cls in (
        asyncrpc.CallTimeoutError,
        asyncrpc.WorkerUnreachableError,
        asyncrpc.UnknownWorkerError,
        asyncrpc.SerializationError,
        asyncrpc.NotInitializedError,
        asyncrpc.RemoteError,
        asyncrpc.NestedCallError,
        asyncrpc.UnsupportedTorchError,
        asyncrpc.BatchNotSentError,
    ):
        assert issubclass(cls, RuntimeError), cls
    assert issubclass(asyncrpc.CallTimeoutError, TimeoutError)
    assert issubclass(asyncrpc.WorkerUnreachableError, ConnectionError)
    assert issubclass(asyncrpc.SerializationError, (TypeError, pickle.PicklingError))


def test_torchs_failures_are_named_and_keep_torchs_text() -> None:
    torch_error = RuntimeError("RPCErr:1:RPC ran for more than set timeout (300 ms)")
    named = _failures.name_failure(torch_error, "worker2", load)
    assert isinstance(named, asyncrpc.CallTimeoutError) and named.name == "worker2"
    assert "RPC ran for more than set timeout" in str(named) and named.__cause__ is torch_error
    own = KeyError("not torch's")
    assert _failures.name_failure(own, "worker2", load) is own


def test_a_torch_caller_gets_torchs_wire_form() -> None:
    failure = _captured(KeyError("for torch"))
    failure.for_torch = True
    wire = pickle.loads(pickle.dumps(failure))
    assert type(wire).__name__ == "RemoteException" and wire.exception_type is KeyError
    assert "for torch" in wire.msg and WHERE in wire.msg


def test_holding_an_error_that_keeps_propagating_keeps_a_copy() -> None:
    # `hold(exc)` then `raise`: the propagating error gains the caller's frames;
    # the kept copy must not, and the caller's traceback must stay whole.
    def fails() -> None:
        raise KeyError("propagates")

    def holder() -> _failures.Failure:
        try:
            fails()
        except KeyError as exc:
            kept = _failures.hold(exc)
            holder.kept = kept  # type: ignore[attr-defined]
            raise
        raise AssertionError("unreachable")

    with pytest.raises(KeyError) as raised:
        holder()
    kept = holder.kept  # type: ignore[attr-defined]
    assert kept.error is not raised.value
    frames = []
    tb = kept.error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert frames == ["fails"]  # neither `holder` (running then) nor the test's frame
    assert [e.name for e in raised.traceback][-2:] == ["holder", "fails"]


def test_a_suspended_generator_survives_holding_its_error() -> None:
    def errors() -> Any:
        try:
            raise ValueError("yielded")
        except ValueError as exc:
            yield exc
        yield "still running"

    gen = errors()
    _failures.hold(next(gen))
    assert next(gen) == "still running"


def test_group_members_are_detached_and_reads_share_no_notes() -> None:
    def fails(marker: Big) -> None:
        raise ValueError("member")

    big = Big()
    alive = weakref.ref(big)
    try:
        try:
            fails(big)
        except ValueError as member:
            raise ExceptionGroup("group", [member]) from None
    except ExceptionGroup as group:
        failure = _failures.hold(group)
    del big
    gc.collect()
    assert alive() is None
    first = _raised(failure)
    assert isinstance(first, ExceptionGroup) and isinstance(first.exceptions[0], ValueError)
    first.add_note("added by one reader")
    assert "added by one reader" not in getattr(_raised(failure), "__notes__", [])


class Slotted(Exception):
    __slots__ = ("code",)

    def __init__(self, code: int) -> None:
        super().__init__(f"code {code}")
        self.code = code


def test_slots_survive_the_copy_of_every_read() -> None:
    raised = _raised(_failures.hold(Slotted(7)))
    assert isinstance(raised, Slotted) and raised.code == 7  # type: ignore[attr-defined]


def test_torchs_own_wire_form_is_raised_as_torch_raises_it() -> None:
    from asyncrpc._core import _torch

    wire = _torch.RemoteException("On WorkerInfo(id=1, name=worker1):\nKeyError('k')", KeyError)
    with pytest.raises(KeyError, match="WorkerInfo"):
        _failures.check_reply(wire)


@pytest.mark.parametrize(
    "error",
    [
        asyncrpc.WorkerUnreachableError("worker 'worker2' cannot be reached", "worker2"),
        asyncrpc.CallTimeoutError("the call timed out", "worker1"),
        asyncrpc.SerializationError("could not be pickled"),
        asyncrpc.WorkerFailedError("worker1", 1, -9),
        FileNotFoundError(2, "No such file", "/x"),
        Rejected("too big", 413),
    ],
    ids=lambda e: type(e).__name__,
)
def test_every_kind_of_error_reads_back_as_itself(error: BaseException) -> None:
    raised = _raised(_failures.hold(error))
    assert type(raised) is type(error) and str(raised) == str(error)
    assert raised.__dict__ == error.__dict__
