"""Which torch versions asyncrpc is tested with, and the check that a private name exists.

Whatever private name of torch the boundary patches or relies on is named in a
`require` call first, so an untested torch is refused by name, with the
versions to install, instead of failing later somewhere inside a call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from .._errors import UnsupportedTorchError

__all__ = ("TESTED_TORCH", "require")

TESTED_TORCH = ("2.13.0", "2.15.0")  # CI runs both ends of the declared range


def require(hooks: Mapping[str, Callable[[], object]]) -> None:
    """Raise UnsupportedTorchError naming the first private hook this torch lacks."""
    for name, find in hooks.items():
        try:
            found = find()
        except (AttributeError, ImportError):
            found = None
        if found is None:
            raise UnsupportedTorchError(
                f"asyncrpc needs torch's private {name}, which torch {torch.__version__} "
                f"does not have; asyncrpc is tested with torch {' and '.join(TESTED_TORCH)}: "
                f"install one of those (pip install torch=={TESTED_TORCH[-1]})"
            )
