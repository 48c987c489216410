"""Whether a reply can be sent: checked before torch pickles it, where torch would not say.

torch sends the reply of a call that ran without holding an RPC thread (an
`async def`, a mailbox's call) from a callback; when pickling it fails
there, no reply is sent and the caller waits out its timeout. Such replies
are pickled once here first, to nowhere: tensors and RRefs are passed over
(torch sends them apart; pickling an RRef would fork it), so the check
costs the pickling of the rest, and nothing for a number, string or tensor::

    reply value ─> plain (number, str, tensor)? ─> sent as it is
               └─> pickled to nowhere ─ fails ─> a Failure: SerializationError,
                                                naming the method and this worker
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from . import _torch
from ._errors import SerializationError
from ._failures import Failure, label_of
from ._world import describe_self

__all__ = ("check_sendable",)

_PLAIN = (int, float, str, bytes, bool, type(None), torch.Tensor, Failure)


class _Nowhere(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return len(data)


class _Checker(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, (torch.Tensor, _torch.PyRRef)):
            return 0  # sent apart by torch
        return None


def check_sendable(value: Any, fn: object) -> Any:
    """`value`, or a Failure (SerializationError) when it cannot be pickled to send back."""
    if type(value) in _PLAIN:
        return value
    try:
        _Checker(_Nowhere(), protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except Exception as exc:
        error = SerializationError(
            f"the result of {label_of(fn)} on {describe_self()} could not be sent back: "
            f"{type(exc).__name__}: {exc}; return tensors, numbers, strings and containers "
            f"of them, or objects of module-level classes (keep other objects on their "
            f"owner and return a handle: asyncrpc.spawn)"
        )
        return Failure(error)
    return value
