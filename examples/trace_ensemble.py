"""The BiLSTM ensemble spread over 2 workers, traced as one timeline.

    python examples/trace_ensemble.py              # writes examples/trace_ensemble.{json,png}
    python examples/trace_ensemble.py --out /tmp   # somewhere else

worker0 drives; worker1 and worker2 hold two members each and run them side
by side on two threads. Open the JSON in https://ui.perfetto.dev or
chrome://tracing; the PNG is the same timeline drawn by
`asyncrpc.render_trace`.
"""

from __future__ import annotations

import argparse
import pathlib

import torch
from bilstm_ensemble import BiLSTM

import asyncrpc

T, B, C = 50, 8, 256


def traced(ctx: asyncrpc.Context, out: pathlib.Path) -> None:
    if ctx.rank != 0:
        return  # worker1 and worker2 serve the members
    ensemble = asyncrpc.Ensemble(
        BiLSTM, 4, C, workers=["worker1", "worker2"], engine="threads", threads=2, seed=0
    )
    x = torch.rand(T, B, C, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ensemble(x)  # warm-up, not traced
        with asyncrpc.trace(out / "trace_ensemble.json") as trace:
            ensemble(x)
            ensemble.call_async(x).wait()
    asyncrpc.render_trace(
        trace.path,
        out / "trace_ensemble.png",
        title="4 BiLSTMs over worker1 and worker2, 2 threads each: two ensemble calls",
    )
    print(f"{trace.path}: {len(trace.events)} events from {', '.join(trace.workers)}")
    print(f"{out / 'trace_ensemble.png'}: the timeline")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = pathlib.Path(__file__).resolve().parent
    parser.add_argument("--out", type=pathlib.Path, default=here, help="output folder")
    args = parser.parse_args()
    # Two intra-op threads per worker, so that two members can run at once.
    asyncrpc.run(traced, world_size=3, args=(args.out,), intra_op_threads=2)


if __name__ == "__main__":
    main()
