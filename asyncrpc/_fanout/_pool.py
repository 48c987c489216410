"""The fan-out thread pool: daemon threads with their own intra-op thread count.

    Fanout ── submit(job) ──> one queue ──> fanout-0 .. fanout-(n-1)
                                            (each: torch.set_num_threads(intra))
    Future <── set_result (a Failure for an error) ──┘

Threads are joined at interpreter exit (`_exit`), so none is still inside
torch while Python finalizes.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.futures import Future

from .._core._failures import hold
from .._core._futures import new_future
from . import _exit


class Pool:
    """Daemon threads, each with its own intra-op thread count, fed from one queue."""

    def __init__(self, size: int, intra: int) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None]
        self._jobs = queue.SimpleQueue()
        ready = threading.Barrier(size + 1)
        before = torch.get_num_threads()
        self._threads = [
            threading.Thread(
                target=self._serve, args=(intra, ready), name=f"fanout-{i}", daemon=True
            )
            for i in range(size)
        ]
        for thread in self._threads:
            thread.start()
        _exit.settle_at_exit(self._threads)
        ready.wait()
        # torch.set_num_threads also sets the default for threads started later;
        # put it back from a throwaway thread so this one and the pool keep theirs.
        restore = threading.Thread(target=torch.set_num_threads, args=(before,))
        restore.start()
        restore.join()

    def _serve(self, intra: int, ready: threading.Barrier) -> None:
        # torch sets up a thread's intra-op count lazily from the process
        # default on first use; do that first so it cannot undo ours later.
        torch.get_num_threads()
        torch.set_num_threads(intra)
        ready.wait()
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            try:
                value = fn()
            except BaseException as error:  # delivered to the caller
                fut.set_result(hold(error))
            else:
                fut.set_result(value)

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn()` on a pool thread, in the caller's grad and inference mode."""
        fut = new_future()
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

        def job() -> Any:
            # Grad and inference mode are thread-local: carry the caller's over.
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                return fn()

        self._jobs.put((job, fut))
        return fut

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
