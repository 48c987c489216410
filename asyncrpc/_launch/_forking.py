"""What a warm interpreter does at each fork: freeze its heap first, and the child dies with it.

A warm interpreter (the forkserver, or a fork of the calling process, see
`_forkserver`) holds torch's import: hundreds of thousands of objects. A
child forked from it shares their pages until something writes to them,
and Python's collector writes to every object it walks: one full
collection in a fresh worker copied about 11,000 pages (90 ms of CPU
each, here), so a world of 128 spent seconds on it. Frozen just before
each fork (`gc.freeze`: moved out of the collector's reach, no copy), they
stay shared::

    warm interpreter ── fork ──> before: gc.freeze() (its heap, now)
                                 child:  PR_SET_PDEATHSIG (dies with it); the frozen
                                         objects count as its start's (`_runtime`): a
                                         world still freezes its own (`_world`)
"""

from __future__ import annotations

import gc
import os

from . import _parent

__all__ = ("install",)


def install(parent: int) -> None:
    """In a warm interpreter, once: it dies with `parent` (its own parent, the
    supervisor); it freezes its heap before each fork; each child dies with it."""
    _parent.die_with_parent(parent)
    os.register_at_fork(before=gc.freeze, after_in_child=_forked)


def _forked() -> None:
    _parent.die_with_parent(os.getppid())
    from .._core import _runtime  # the child's own record of its process state

    _runtime.SLOT.frozen_at_import = None  # the start's own: a world freezes (and thaws) freely


if os.environ.get(_parent.PARENT_VARIABLE) == str(os.getppid()):  # multiprocessing's forkserver
    os.environ.pop(_parent.PARENT_VARIABLE)
    install(os.getppid())
