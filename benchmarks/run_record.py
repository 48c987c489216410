"""What a benchmark's `--json PATH` file holds beside its figures: when, where, with what, how.

Every benchmark that takes `--json` writes one object: its own figures
(every one it prints) and, from here, `date` (when the run started, local
time with its offset), `machine` (`cpus`, `cpu_model` from /proc/cpuinfo,
`memory_gib` from /proc/meminfo), the `torch`, `python` and `ray` versions
(`ray` is null where Ray is not installed) and `command`, the command line
that started the run. benchmarks/charts.py draws them.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from importlib import metadata
from typing import Any

import torch

_STARTED = datetime.datetime.now().astimezone()  # the run starts when its script imports this


def environment() -> dict[str, Any]:
    """The run's date, machine, versions and command line."""
    try:
        ray: str | None = metadata.version("ray")
    except metadata.PackageNotFoundError:
        ray = None
    return {
        "date": _STARTED.isoformat(timespec="seconds"),
        "machine": machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "ray": ray,
        "command": command(),
    }


def machine() -> dict[str, Any]:
    """This machine's CPU count, CPU model and memory (GiB)."""
    kib = _proc_field("/proc/meminfo", "MemTotal")
    return {
        "cpus": os.cpu_count(),
        "cpu_model": _proc_field("/proc/cpuinfo", "model name"),
        "memory_gib": None if kib is None else round(int(kib.split()[0]) / 2**20, 1),
    }


def _proc_field(path: str, name: str) -> str | None:
    """The value of the first `name: value` line of a /proc file (None: no such line)."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return None


def command() -> str:
    """This process's command line as it was started (/proc/self/cmdline), shell-quoted."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        argv = [sys.executable, *sys.argv]
    return shlex.join(argv)


def write(path: str, figures: dict[str, Any]) -> None:
    """Write the run's environment and its `figures` to `path` as JSON; say where."""
    with open(path, "w") as f:
        json.dump({**environment(), **figures}, f, indent=2)
        f.write("\n")
    print(f"results written to {path}", file=sys.stderr)
