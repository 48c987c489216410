"""What one launcher of `asyncrpc-launch --restart worker` runs: its `Plan`.

Made once from the checked arguments (`_cli.build_args`); read by the
launcher's node (`_nodes`) and by its side of an elastic world (`_node_changes`).
"""

from __future__ import annotations

import argparse
import sys
from typing import NamedTuple

__all__ = ("Plan", "plan")


class Plan(NamedTuple):
    """What one launcher runs: its node, the world's shape, the store, the command."""

    node: int
    nnodes: int
    nproc: int
    host: str
    port: int
    command: list[str]
    max_restarts: int
    elastic: bool = False  # --elastic: members may add and remove workers (`_node_changes`)
    max_world_size: int | None = None
    join: bool = False  # --join: this node joins a running elastic world


def plan(args: argparse.Namespace, nproc: int) -> Plan:
    """The `Plan` of checked launcher arguments (`_cli.build_args`)."""
    host, _, port = args.rdzv_endpoint.rpartition(":")
    python = [] if args.no_python else [sys.executable, "-u"] + (["-m"] if args.module else [])
    command = [*python, args.training_script, *args.training_script_args]
    nnodes = int(str(args.nnodes).partition(":")[0])
    join = bool(getattr(args, "join", None))
    return Plan(-1 if join else args.node_rank, nnodes, nproc, host.strip("[]"), int(port),
                command, args.max_restarts, bool(getattr(args, "elastic", False)),
                getattr(args, "max_world_size", None), join)  # fmt: skip
