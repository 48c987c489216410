"""The process trees the tests start: who is below whom, that a tree ended, its stacks.

Read from /proc, so a test sees what the kernel sees: a zombie has ended, and
a process a test lost track of is still found below its parent.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import IO, Any


def _parents() -> dict[int, int]:
    """pid -> parent pid of every live (not zombie) process."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":  # a zombie has ended; only its reaping is left
            found[int(entry)] = int(fields[1])
    return found


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`."""
    parents, found, frontier = _parents(), set(), {pid}
    while frontier:
        children = {p for p, parent in parents.items() if parent in frontier}
        frontier = children - found
        found |= children
    return found


def alive(pids: set[int]) -> set[int]:
    return pids & set(_parents())


def assert_gone(tree: set[int], within: float) -> None:
    """Every process of `tree` ends within `within` seconds."""
    deadline = time.monotonic() + within
    while alive(tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(tree), {p: open(f"/proc/{p}/cmdline").read()[:80] for p in alive(tree)}


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it (a test's clean-up)."""
    _send({pid} | descendants(pid), signal.SIGKILL)


def _send(pids: set[int], sig: int) -> None:
    """`sig` to each of `pids`; one that has already ended is passed over."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def stacks(parent: subprocess.Popen[Any], err: IO[str] | None = None) -> str:
    """What every process of `parent`'s tree was doing, then the tree ended: SIGUSR1 to
    each (the programs print every thread's stack on it; one that does not, ends),
    `parent`'s stderr read from `err`, the file it writes to, or else from its pipe, and
    SIGKILL to every process of the tree as it was before the signal (a parent that
    the signal ended leaves its children to init, out of reach of `kill_tree`).
    For a test whose program did not end when it should have."""
    tree = {parent.pid} | descendants(parent.pid)
    _send(tree, signal.SIGUSR1)
    time.sleep(2)
    if err is not None:
        err.seek(0)
        said = err.read()
    _send(tree | descendants(parent.pid), signal.SIGKILL)
    if err is None:
        _, said = parent.communicate(timeout=30)
    return _quiet(said if isinstance(said, str) else said.decode(errors="replace"))


def _quiet(stderr: str, keep: int = 20000) -> str:
    """The end of `stderr` without TensorPipe's lines about peers that went away."""
    lines = [line for line in stderr.splitlines() if "tensorpipe" not in line]
    return "\n".join(lines)[-keep:]
