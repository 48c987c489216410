"""A spare interpreter of `asyncrpc-launch --elastic`: torch imported ahead, then the script.

An added worker under a launcher is a new interpreter, and most of its
start is importing torch. The launcher keeps one interpreter started ahead
(`Spare`); an add hands it the worker's environment on its stdin, and it
runs the script as `python script.py` would::

    launcher: Spare.start()  ──>  python -m asyncrpc._launch._warm [-m] SCRIPT ARGS...
                                    import torch, asyncrpc; block on stdin
    add_workers(1): Spare.use(env) ── one JSON line {RANK, ASYNCRPC_NAME, ...} ──>
                                    os.environ.update(env); run SCRIPT as __main__
    the launcher's end, or the world's: stdin closed ──> exit 0 (never a worker)
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys

from . import _parent

__all__ = ("Spare",)


class Spare:
    """One interpreter started ahead for the next added worker of this launcher."""

    def __init__(self, command: list[str]) -> None:
        self.command = command
        self.proc: subprocess.Popen[bytes] | None = None
        self.stderr: int | None = None  # where its stderr goes (None: the launcher's own)

    def usable(self) -> bool:
        """Whether the command is a Python script or module this can start ahead."""
        command = self.command
        return len(command) >= 3 and command[0] == sys.executable and command[1] == "-u"

    def start(self) -> None:
        """Start the spare (an idle interpreter that imports torch and waits)."""
        if not self.usable() or (self.proc is not None and self.proc.poll() is None):
            return
        _, *flags_and_target = self.command[1:]  # the "-u" the launcher passes
        command = [sys.executable, "-u", "-m", __name__, *flags_and_target]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, start_new_session=True,
                                     stderr=self.stderr)  # fmt: skip

    def use(self, env: dict[str, str]) -> subprocess.Popen[bytes] | None:
        """The spare, now running the script as a worker with `env`; None if none is ready."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None or proc.stdin is None:
            return None
        try:
            proc.stdin.write(json.dumps(env).encode() + b"\n")
            proc.stdin.close()
        except OSError:  # it died meanwhile
            proc.kill()
            return None
        return proc

    def close(self) -> None:
        """End the spare unused: its stdin closes (it exits 0), and one still importing torch
        is stopped (it holds the workers' stderr pipe, whose end the launcher waits for)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.stdin is not None:
            proc.stdin.close()
        if proc is not None and proc.poll() is None:
            proc.terminate()


def _run(argv: list[str]) -> None:
    """In the spare: import what every worker imports, wait for the assignment, run it."""
    _parent.die_with_parent(os.getppid())
    import torch  # noqa: F401  # the slow part of a worker's start, paid ahead

    import asyncrpc  # noqa: F401

    line = sys.stdin.readline()
    if not line:  # closed unused
        os._exit(0)
    os.environ.clear()
    os.environ.update(json.loads(line))
    sys.stdin = open(os.devnull)  # as a launched worker's: nothing to read
    module = argv[0] == "-m"
    target, args = (argv[1], argv[2:]) if module else (argv[0], argv[1:])
    if module:
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    sys.argv = [target, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py` sets it
    runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    _run(sys.argv[1:])
