"""`asyncrpc-launch`: torchrun with asyncrpc's safe defaults.

The launcher is torchrun itself (`torch.distributed.run`), run in-process
with one change: its default static rendezvous is replaced by the
`asyncrpc` backend, whose store listens only on the master address
(127.0.0.1 on one machine) instead of every interface::

    asyncrpc-launch --nproc-per-node 3 script.py
      `-> torchrun --rdzv-backend asyncrpc --rdzv-endpoint 127.0.0.1:0 ... script.py
            agent: store bound to 127.0.0.1:<free port> (node rank 0 only)
            `-- workers (RANK, WORLD_SIZE, MASTER_ADDR/PORT) -> asyncrpc.run joins

The same backend is registered for plain torchrun through the
`torchrun.handlers` entry point: `torchrun --rdzv-backend asyncrpc ...`.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .._core import _net, _rendezvous

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

__all__ = ["BACKEND", "build_args", "main", "rendezvous_handler"]

BACKEND = "asyncrpc"
_DEFAULT_TIMEOUT_S = 600

_EPILOG = """\
Every torchrun option works as in torchrun. What differs:
  * on one machine (--nnodes 1, the default) the rendezvous store and the
    workers' RPC listen on 127.0.0.1 only, on a free port;
  * across machines (--nnodes N) node 0 hosts the store on --master-addr
    (an address of that host, on the private network), and every node
    binds RPC to --interface, or to the interface that reaches the master;
  * OMP/intra-op threads default to cores // nproc-per-node.

examples:
  asyncrpc-launch --nproc-per-node 3 examples/ring.py
  asyncrpc-launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 \\
      --master-port 29500 --nproc-per-node 4 --interface eth1 train.py
"""


@functools.cache
def _handler_class() -> type[Any]:
    # torch's rendezvous package loads the `torchrun.handlers` entry points while
    # it initializes, and that entry point is this module: import it lazily.
    from .._core import _torch

    return _torch.bound_static_rendezvous(
        BACKEND, _rendezvous.host_store, _rendezvous.client_store
    )


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    if "rank" not in params.config:
        raise ValueError(
            f"the {BACKEND!r} rendezvous needs the node rank: add --rdzv-conf rank=R "
            f"(asyncrpc-launch adds it from --node-rank)"
        )
    addr, port = parse_rendezvous_endpoint(params.endpoint.strip(), -1)
    if port < 0:
        raise ValueError(
            f"the {BACKEND!r} rendezvous needs a port in --rdzv-endpoint HOST:PORT, "
            f"got {params.endpoint!r}"
        )
    from .._core import _liveness, _torch

    rank = int(params.config["rank"])
    timeout = int(params.config.get("timeout", _DEFAULT_TIMEOUT_S))
    handler = _handler_class()(addr, port, rank, params.max_nodes, params.run_id, timeout)
    # This process is the agent: let it name the workers it sees die, while the
    # rendezvous lasts (torch's launcher shuts it down when the agent ends).
    handler.on_shutdown = _torch.watch_agent_failures(_liveness.report_exits)
    return handler  # type: ignore[no-any-return]


def rendezvous_handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """Entry point for torchrun's `torchrun.handlers` group."""
    return _create_handler


def _parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "asyncrpc-launch"
    parser.description = (
        "Launch an asyncrpc (or any torch.distributed) script with torchrun, "
        "listening on loopback only unless several machines are asked for."
    )
    parser.epilog = _EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--interface",
        default=None,
        help="network interface the workers' RPC binds to (default: lo on one machine, "
        "else the interface that reaches --master-addr)",
    )
    return parser


def build_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse launcher arguments into torchrun's namespace, with asyncrpc's defaults applied."""
    args = _parser().parse_args(list(argv))
    if args.rdzv_backend == "static" or args.standalone:
        _, max_nodes = _node_range(args.nnodes)
        single = max_nodes == 1
        host = args.master_addr if not single or args.master_addr != "127.0.0.1" else "127.0.0.1"
        if single and not _net.is_loopback(host):
            host = "127.0.0.1"
        port = args.master_port if args.master_port is not None else (0 if single else 29500)
        args.standalone = False
        args.rdzv_backend = BACKEND
        args.rdzv_endpoint = args.rdzv_endpoint or f"{host}:{port}"
        conf = f"rank={args.node_rank}"
        args.rdzv_conf = f"{args.rdzv_conf},{conf}" if args.rdzv_conf else conf
        args.node_rank = 0  # now carried by rdzv_conf; torchrun warns it is ignored otherwise
    if args.rdzv_backend == BACKEND:
        _warn_if_unreachable(args.rdzv_endpoint, args.nnodes)
    return args


def _warn_if_unreachable(endpoint: str, nnodes: str) -> None:
    host = endpoint.rpartition(":")[0].strip("[]")
    if _node_range(nnodes)[1] > 1 and _net.is_loopback(host):
        print(
            f"asyncrpc-launch: warning: --nnodes {nnodes} but the rendezvous host {host!r} "
            f"is a loopback address here, so only launchers on this machine can join; "
            f"on several machines pass node 0's private address (--rdzv-endpoint "
            f"10.0.0.1:29500 or --master-addr 10.0.0.1)",
            file=sys.stderr,
        )


def _node_range(nnodes: str) -> tuple[int, int]:
    low, _, high = nnodes.partition(":")
    return int(low), int(high or low)


def _set_child_env(args: argparse.Namespace) -> None:
    if args.interface:
        os.environ["ASYNCRPC_INTERFACE"] = args.interface
    if "OMP_NUM_THREADS" not in os.environ and str(args.nproc_per_node).isdigit():
        cores = len(os.sched_getaffinity(0))
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // int(args.nproc_per_node)))


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point of `asyncrpc-launch`."""
    from torch.distributed.run import run

    from .._core import _torch

    args = build_args(sys.argv[1:] if argv is None else argv)
    unregister = _torch.register_rendezvous(BACKEND, _create_handler)
    _set_child_env(args)
    try:
        run(args)  # type: ignore[no-untyped-call]
    finally:
        unregister()


if __name__ == "__main__":
    main()
