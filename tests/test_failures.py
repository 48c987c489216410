"""How a remote exception is captured, sent and raised again; no world needed."""

from __future__ import annotations

import pickle
import threading

import pytest

import asyncrpc
from asyncrpc._core import _failures

WHERE = "worker 'worker1' (rank 1)"


class Rejected(Exception):
    def __init__(self, reason: str, code: int) -> None:
        super().__init__(reason)
        self.code = code


class HoldsALock(Exception):
    def __init__(self) -> None:
        super().__init__("with a lock")
        self.lock = threading.Lock()


def load(key: str) -> None:
    raise KeyError(key)


def _sent_and_raised(error: BaseException) -> BaseException:
    try:
        raise error
    except BaseException as exc:
        failure = _failures.capture(exc, WHERE, load)
    revived = pickle.loads(pickle.dumps(failure))
    with pytest.raises(BaseException) as raised:
        _failures.check_reply(revived)
    return raised.value


def test_a_remote_exception_keeps_its_type_and_names_the_worker() -> None:
    err = _sent_and_raised(KeyError("shard 3"))
    assert isinstance(err, KeyError) and isinstance(err, asyncrpc.RemoteError)
    assert isinstance(err, RuntimeError)  # the type torch raises for remote errors
    assert "On worker 'worker1' (rank 1), in load():" in str(err)
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


def test_an_exception_that_cannot_be_pickled_arrives_as_its_text() -> None:
    err = _sent_and_raised(HoldsALock())
    assert isinstance(err, RuntimeError) and "HoldsALock" in str(err)


def test_a_class_the_caller_cannot_import_is_named() -> None:
    bogus = _failures.Failure("On worker 'w':\nboom", KeyError("x"))
    state = bogus.__reduce__()[1]
    revived = _failures._revive_failure(state[0], "no_such_module", "Gone", b"not a pickle")
    with pytest.raises(asyncrpc.SerializationError, match=r"no_such_module\.Gone.*cannot import"):
        _failures.check_reply(revived)


def test_errors_that_stand_for_torch_failures_are_its_types() -> None:
    for cls in (
        asyncrpc.CallTimeoutError,
        asyncrpc.WorkerUnreachableError,
        asyncrpc.UnknownWorkerError,
        asyncrpc.SerializationError,
        asyncrpc.NotInitializedError,
        asyncrpc.RemoteError,
        asyncrpc.NestedCallError,
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
