"""Exceptions the failure tests raise on workers and read back, each defined once.

Tests import them (`from remote_errors import ...`; pytest puts tests/ on the
path) and so do the programs under tests/programs, which put tests/ on their
path first: a process that unpickles one (a worker, the caller reading the
failure back) imports it by the same module name as the process that raised it.
"""

from __future__ import annotations

import threading

__all__ = ("ExampleFailure", "HoldsALock", "Rejected")


class Rejected(Exception):
    """A user exception whose __init__ takes more than the message."""

    def __init__(self, reason: str, code: int) -> None:
        super().__init__(reason)
        self.code = code


class HoldsALock(Exception):
    """A user exception that cannot be pickled: it holds a lock."""

    def __init__(self) -> None:
        super().__init__("holds a lock")
        self.lock = threading.Lock()


class ExampleFailure(Exception):
    """What a worker's `main` raises when it cannot go on (its type names it in reports)."""
