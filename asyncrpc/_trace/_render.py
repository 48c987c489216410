"""Drawing a merged trace as a PNG timeline (matplotlib, the `plot` extra).

A row per thread that did something, grouped by worker; each row shows its
outermost spans; an arrow per call goes from the caller's span to the run
on the callee::

    trace.json --load--> rows (worker, thread) --> bars + arrows --> trace.png
"""

from __future__ import annotations

import argparse
import json
import os
import types
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from ._timeline import CATEGORY

__all__ = ("main", "render_trace")

_PALETTE = (
    "#4c9f70", "#e1a95f", "#8172b3", "#c44e52", "#64b5cd",
    "#937860", "#da8bc3", "#8c8c8c", "#ccb974", "#55a868",
)  # fmt: skip
_OURS = types.MappingProxyType({"call": "#2f5d8c", "run": "#d9822b"})
_ROW_INCHES = 0.32
_LEGEND_ENTRIES = 8

Row = tuple[int, int]  # (pid, tid)


def render_trace(
    trace_path: str | os.PathLike[str],
    png_path: str | os.PathLike[str],
    *,
    title: str | None = None,
    width: float = 14.0,
) -> None:
    """Draw a trace written by `asyncrpc.trace` as a PNG timeline.

    Rows are the threads of each worker that recorded something (calls out
    and calls in on rows of their own); bars are outermost spans, arrows
    join each call to its run on the callee. Needs matplotlib
    (``pip install 'asyncrpc[plot]'``). Example::

        asyncrpc.render_trace("ensemble.json", "ensemble.png", title="4 BiLSTMs")
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "render_trace draws with matplotlib, which is not installed; "
            "pip install 'asyncrpc[plot]' (or matplotlib)"
        ) from exc
    with open(trace_path) as file:
        document = json.load(file)
    events = document.get("traceEvents") if isinstance(document, dict) else None
    if not isinstance(events, list):
        raise ValueError(f"{os.fspath(trace_path)!r} is not a Chrome trace (no traceEvents list)")
    rows, labels, spans = _rows(events)
    if not rows:
        raise ValueError(f"{os.fspath(trace_path)!r} holds no spans to draw")
    figure = Figure(figsize=(width, 1.4 + _ROW_INCHES * len(rows)), dpi=110)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    colors = _colors(spans)
    _draw_bars(axes, rows, spans, colors)
    _draw_arrows(axes, rows, events)
    _decorate(axes, rows, labels, colors, title)
    figure.tight_layout()
    figure.savefig(os.fspath(png_path))


def _rows(
    events: Sequence[dict[str, Any]],
) -> tuple[list[Row], dict[Row, str], dict[Row, list[dict[str, Any]]]]:
    process: dict[int, str] = {}
    process_order: dict[int, int] = {}
    thread: dict[Row, str] = {}
    thread_order: dict[Row, int] = {}
    spans: dict[Row, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        row = (e.get("pid"), e.get("tid"))
        if e.get("ph") == "X" and "dur" in e:
            spans[row].append(e)  # type: ignore[index]
        elif e.get("ph") == "M":
            args = e.get("args", {})
            if e["name"] == "process_name":
                process[e["pid"]] = args.get("name", str(e["pid"]))
            elif e["name"] == "process_sort_index":
                process_order[e["pid"]] = args.get("sort_index", 0)
            elif e["name"] == "thread_name":
                thread[row] = args.get("name", str(e["tid"]))  # type: ignore[index]
            elif e["name"] == "thread_sort_index":
                thread_order[row] = args.get("sort_index", 0)  # type: ignore[index]
    ordered = sorted(
        spans, key=lambda r: (process_order.get(r[0], r[0]), thread_order.get(r, 0), r[1])
    )
    labels = {r: f"{process.get(r[0], r[0])} · {thread.get(r, r[1])}" for r in ordered}
    return ordered, labels, {r: _outermost(spans[r]) for r in ordered}


def _outermost(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    kept, end = [], float("-inf")
    for span in sorted(spans, key=lambda s: (s["ts"], -s["dur"])):
        if span["ts"] >= end:
            kept.append(span)
            end = span["ts"] + span["dur"]
    return kept


def _family(span: dict[str, Any]) -> str:
    if span.get("cat") == CATEGORY:
        return "call (caller)" if span.get("args", {}).get("kind") == "call" else "run (callee)"
    return str(span["name"]).split(" (")[0].rstrip("0123456789 ") or str(span["name"])


def _colors(spans: dict[Row, list[dict[str, Any]]]) -> dict[str, tuple[float, str]]:
    """Total time and color of each kind of span; the longest kinds get distinct colors."""
    totals: dict[str, float] = defaultdict(float)
    for span in (s for row_spans in spans.values() for s in row_spans):
        totals[_family(span)] += span["dur"]
    ours = {"call (caller)": _OURS["call"], "run (callee)": _OURS["run"]}
    others = sorted((f for f in totals if f not in ours), key=lambda f: -totals[f])
    colors = {f: _PALETTE[i % len(_PALETTE)] for i, f in enumerate(others)}
    return {f: (totals[f], ours.get(f) or colors[f]) for f in totals}


def _draw_bars(
    axes: Any, rows: list[Row], spans: dict[Row, list[dict[str, Any]]], colors: dict[str, Any]
) -> None:
    for y, row in enumerate(rows):
        by_color: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for span in spans[row]:
            color = colors[_family(span)][1]
            by_color[color].append((span["ts"] / 1e3, max(span["dur"] / 1e3, 0.02)))
        for color, bars in by_color.items():
            axes.broken_barh(bars, (y - 0.38, 0.76), facecolors=color, edgecolors="none")


def _draw_arrows(axes: Any, rows: list[Row], events: Sequence[dict[str, Any]]) -> None:
    where = {row: y for y, row in enumerate(rows)}
    ends: dict[Any, dict[str, dict[str, Any]]] = defaultdict(dict)
    for e in events:
        if e.get("ph") in ("s", "f") and e.get("cat") == CATEGORY:
            ends[e["id"]][e["ph"]] = e
    for pair in ends.values():
        start, finish = pair.get("s"), pair.get("f")
        if start is None or finish is None:
            continue
        a, b = where.get((start["pid"], start["tid"])), where.get((finish["pid"], finish["tid"]))
        if a is None or b is None:
            continue
        axes.annotate(
            "",
            xy=(finish["ts"] / 1e3, b),
            xytext=(start["ts"] / 1e3, a),
            arrowprops={"arrowstyle": "->", "color": "0.25", "lw": 0.7},
        )


def _decorate(
    axes: Any,
    rows: list[Row],
    labels: dict[Row, str],
    colors: dict[str, tuple[float, str]],
    title: str | None,
) -> None:
    from matplotlib.patches import Patch

    axes.set_yticks(range(len(rows)), [labels[r] for r in rows], fontsize=8)
    axes.set_ylim(len(rows) - 0.4, -0.6)
    axes.set_xlabel("time (ms)")
    for y in range(1, len(rows)):
        if rows[y][0] != rows[y - 1][0]:
            axes.axhline(y - 0.5, color="0.6", lw=0.8)
    axes.grid(axis="x", color="0.9")
    axes.set_axisbelow(True)
    top = sorted(colors.items(), key=lambda kv: -kv[1][0])[:_LEGEND_ENTRIES]
    handles = [Patch(color=color, label=name) for name, (_, color) in top]
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    if title:
        axes.set_title(title)


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point: `asyncrpc-render-trace trace.json trace.png`."""
    parser = argparse.ArgumentParser(
        prog="asyncrpc-render-trace",
        description="Draw a trace written by asyncrpc.trace as a PNG timeline.",
    )
    parser.add_argument("trace", help="the merged trace (JSON)")
    parser.add_argument("png", help="where to write the picture")
    parser.add_argument("--title", default=None)
    parser.add_argument("--width", type=float, default=14.0, help="inches (default 14)")
    args = parser.parse_args(argv)
    render_trace(args.trace, args.png, title=args.title, width=args.width)
