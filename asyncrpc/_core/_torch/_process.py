"""What torch runs in this process beside its agent: RPC threads, the inter-op pool, the profiler.

Also TorchScript's deprecation warnings, which asyncrpc's use of torch's
builtins would otherwise print.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.autograd.profiler as _autograd_profiler

__all__ = (
    "interop_pool_started",
    "is_rpc_thread",
    "profiler_config",
    "profiling",
    "quiet_torchscript",
)


def is_rpc_thread() -> bool:
    """True on one of torch's RPC threads (C++ threads: Python sees them as dummies).

    Asking makes Python register a `_DummyThread` ("Dummy-N") for each torch
    thread that calls into Python, once: as many as torch has threads, kept
    until the process ends (never one per call).
    """
    return isinstance(threading.current_thread(), threading._DummyThread)


def profiler_config() -> Any:
    """A profiler configuration that records every thread, torch's RPC threads included."""
    from torch._C._profiler import _ExperimentalConfig

    return _ExperimentalConfig(profile_all_threads=True)


def profiling() -> bool:
    """True while torch's profiler records: in this process, or on this thread only.

    torch keeps a process-wide flag for fast checks (set by `torch.profiler`
    and `autograd.profiler.profile`); a profiler on for one thread (an RPC
    callee's, while a profiled caller calls it) shows in its thread state.
    """
    return bool(_autograd_profiler._is_profiler_enabled) or bool(
        torch._C._autograd._profiler_enabled()
    )


@contextlib.contextmanager
def quiet_torchscript(show: bool = False) -> Iterator[None]:
    """Hide torch's TorchScript deprecation warnings inside the block, unless `show`.

    torch 2.13 raises them as DeprecationWarning, 2.14 and later as FutureWarning.
    """
    if show:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.jit")
        warnings.filterwarnings("ignore", message=r".*torch\.jit.*deprecated", category=Warning)
        yield


def interop_pool_started() -> bool:
    """True once torch has started its inter-op thread pool (threads named PTThreadPool)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return True  # cannot tell on this platform: drain anyway, it is cheap
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                if comm.read().strip() == "PTThreadPool":
                    return True
        except OSError:
            continue
    return False
