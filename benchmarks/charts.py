"""Charts of the benchmarks' `--json` results, as PNG files (matplotlib, Agg backend).

    peers.png   benchmarks/peers.py --json peers.json: asyncrpc vs raw torch
                RPC vs Ray for every row (calls, start-up, what torch cannot do),
                each bar the way's cost relative to asyncrpc's, on a log scale
    scale.png   benchmarks/scale.py --json scale.json: start-up time, end time and the
                world's memory (PSS; scale.py prints RSS too) against the
                world's size, one line per system
    vmap.png    benchmarks/stacked_mlp.py --json stacked_mlp.json: the vmap
                engine, serial, auto and the floor in the members' layout,
                relative to the stacked-GEMM floor, by batch
    training.png  benchmarks/ensemble_training.py --json ensemble_training.json:
                a REDQ/SAC training step and acting, the loop, the engine,
                auto and the hand-written floor, as speed relative to the loop
    heal.png    benchmarks/heal.py --json heal.json: a killed worker's time from
                the kill to its replacement's first answer, asyncrpc healing it
                in place vs restarting the whole world vs Ray, against the target
    elastic.png benchmarks/elastic.py --json elastic.json: adding 1 and 8 workers
                (to their first answers) and removing one, asyncrpc embedded and
                under asyncrpc-launch --elastic vs Ray's actors

Every chart names its run's date and machine. A missing JSON file skips its
chart, with a line saying so.

    python benchmarks/charts.py [--results docs/benchmarks/results] [--out docs/benchmarks]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter

ROOT = Path(__file__).resolve().parent.parent
COLORS = {"asyncrpc": "#1f77b4", "torch": "#ff7f0e", "ray": "#2ca02c"}
NAMES = {"asyncrpc": "asyncrpc", "torch": "raw torch RPC", "ray": "Ray"}


def run_line(data: dict[str, Any]) -> str:
    """The footnote every chart carries: when, on what, with what."""
    m = data["machine"]
    ray = f", Ray {data['ray']}" if data.get("ray") else ""
    return (
        f"benchmarks/{data['benchmark']}.py, run {data['date'].replace('T', ' ')}; "
        f"{m['cpus']} CPUs ({m['cpu_model']}), "
        f"{m['memory_gib']} GiB; torch {data['torch']}, Python {data['python']}{ray}"
    )


def _finish(fig: Figure, data: dict[str, Any], title: str, path: Path) -> None:
    fig.suptitle(title, fontsize=13, fontweight="bold")
    fig.text(0.5, 0.005, run_line(data), ha="center", va="bottom", fontsize=8, color="0.35")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


# ---- peers.png ----------------------------------------------------------------------------


Bar = tuple[str, float, str]  # system, cost relative to asyncrpc's, the figure as printed
Row = tuple[str, list[Bar]]


def _peer_bars(data: dict[str, Any]) -> list[tuple[str, list[Row]]]:
    """The chart's panels: (panel, its rows), each row (row, its bars)."""
    calls: list[Row] = []
    startup: list[Row] = []
    for section, into in ((data["calls"], calls), (data["startup"], startup)):
        for row, found in section.items():
            rates = found.get("calls_per_s")
            bars = []
            for way, s in found["seconds"].items():
                label = f"{rates[way]:,.0f} calls/s" if rates else _seconds(s)
                bars.append((way, s / found["seconds"]["asyncrpc"], label))
            if "Batch" in row:
                row += "\n(torch: one by one)"
            into.append((row, bars))
    beyond = [(row.strip(), _beyond_bars(found)) for row, found in data["beyond"].items()]
    return [("calls", calls), ("start-up", startup), ("what torch RPC cannot do", beyond)]


def _beyond_bars(found: dict[str, Any]) -> list[Bar]:
    ours, unit = found["asyncrpc"], found["unit"]
    bars = []
    for way in ("asyncrpc", "ray"):
        value = found.get(way)
        if value is None:
            continue
        cost = ours / value if found["higher_is_better"] else value / ours
        label = _seconds(value) if unit == "s" else f"{value:,.0f} {unit or 'items'}"
        bars.append((way, cost, label))
    return bars


def _seconds(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def peers_chart(data: dict[str, Any], path: Path) -> None:
    panels = [(name, rows) for name, rows in _peer_bars(data) if rows]
    heights = [len(rows) for _, rows in panels]
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(11, 1.1 + 0.62 * sum(heights)), sharex=True,
        gridspec_kw={"height_ratios": heights}, squeeze=False,
    )  # fmt: skip
    costs = [c for _, rows in panels for _, bars in rows for _, c, _ in bars]
    low, high = min([*costs, 1.0]) / 1.6, max([*costs, 1.0]) * 4
    for ax, (name, rows) in zip(axes[:, 0], panels, strict=True):
        _peer_panel(ax, name, rows, low)
    axes[-1, 0].set_xscale("log")
    axes[-1, 0].set_xlim(low, high)
    axes[-1, 0].xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}x"))
    axes[-1, 0].set_xlabel("cost relative to asyncrpc (time, or 1 / rate): lower is better")
    handles = [Patch(color=COLORS[w]) for w in COLORS]
    top = 1 - 0.75 / fig.get_figheight()  # room for the title and the legend
    fig.legend(handles, NAMES.values(), loc="upper center", ncol=3, frameon=False,
               bbox_to_anchor=(0.5, top + 0.01))  # fmt: skip
    fig.tight_layout(rect=(0, 0.02, 1, top - 0.01))
    _finish(fig, data, "asyncrpc vs raw torch RPC vs Ray, one run", path)


_LABEL_BOX = {"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 0.6}


def _peer_panel(ax: Axes, name: str, rows: list[Row], low: float) -> None:
    height = 0.8 / 3
    for i, (_, bars) in enumerate(rows):
        for j, (way, cost, label) in enumerate(bars):
            y = i + (j - 1) * height
            ax.barh(y, cost - low, left=low, height=height * 0.92, color=COLORS[way])
            # right of the bar, or of the asyncrpc line where the bar stops short of it
            ax.text(max(cost, 1.0) * 1.06, y, label, va="center", fontsize=7.5, bbox=_LABEL_BOX)
    ax.axvline(1.0, color="0.3", linewidth=0.8, linestyle="--")
    ax.set_yticks(range(len(rows)), [row for row, _ in rows], fontsize=9)
    ax.invert_yaxis()
    ax.set_title(name, loc="left", fontsize=10, fontweight="bold")
    ax.grid(axis="x", which="major", alpha=0.3)


# ---- scale.png ----------------------------------------------------------------------------


def scale_chart(data: dict[str, Any], path: Path) -> None:
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(17, 5))
    for system in data["systems"]:
        found = data["results"].get(system, {})
        sizes = sorted(int(n) for n in found)
        if not sizes:
            continue
        at = [found[str(n)] for n in sizes]
        style = {"color": COLORS[system], "marker": "o", "label": NAMES[system]}
        left.plot(sizes, [f["startup_s"] for f in at], **style)
        _label_last(left, sizes[-1], at[-1]["startup_s"], f"{at[-1]['startup_s']:.1f} s")
        if all("end_s" in f for f in at):  # runs before end_s was measured have none
            middle.plot(sizes, [f["end_s"] for f in at], **style)
            _label_last(middle, sizes[-1], at[-1]["end_s"], f"{at[-1]['end_s']:.1f} s")
        right.plot(sizes, [f["pss_mib"] / 1024 for f in at], **style)
        gib = at[-1]["pss_mib"] / 1024
        _label_last(right, sizes[-1], gib, f"{gib:.1f} GiB")
    left.set_title("start-up: from the start call to every worker's answer")
    left.set_ylabel("seconds (median)")
    middle.set_title("end: from every answer to the world's end")
    middle.set_ylabel("seconds (median)")
    right.set_title("memory: every process of the world, PSS summed")
    right.set_ylabel("GiB at the first answers (median)")
    for ax in (left, middle, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(data["sizes"], [str(n) for n in data["sizes"]])
        ax.set_xlabel("world size (workers; Ray: actors)")
        ax.set_ylim(bottom=0)
        ax.margins(x=0.12)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left")
    notes = [f"{NAMES[s]} at {n}: did not fit ({why})" for s, by in data["failures"].items()
             for n, why in by.items()]  # fmt: skip
    if notes:
        fig.text(0.5, 0.04, "; ".join(notes), ha="center", fontsize=8, color="firebrick")
    fig.tight_layout(rect=(0, 0.07 if notes else 0.03, 1, 0.95))
    rounds = data["options"]["rounds"]
    title = f"A world's cost by its size (a fresh process each; medians of {rounds} "
    _finish(fig, data, title + ("round)" if rounds == 1 else "rounds)"), path)


def _label_last(ax: Axes, x: float, y: float, text: str) -> None:
    ax.annotate(text, (x, y), textcoords="offset points", xytext=(6, 0), va="center", fontsize=8)


# ---- vmap.png -----------------------------------------------------------------------------

VMAP_WAYS = {  # way in stacked_mlp.json: color
    "serial": "#7f7f7f",
    "auto": "#9467bd",
    "vmap engine": "#1f77b4",
    "floor, members' layout": "#8fbbd9",
    "floor (baddbmm chain)": "#2ca02c",
}


def vmap_chart(data: dict[str, Any], path: Path) -> None:
    batches = list(data["batches"])
    fig, ax = plt.subplots(figsize=(10, 5.2))
    width = 0.8 / len(VMAP_WAYS)
    for j, (way, color) in enumerate(VMAP_WAYS.items()):
        for i, batch in enumerate(batches):
            found = data["batches"][batch]["ways"][way]
            x = i + (j - (len(VMAP_WAYS) - 1) / 2) * width
            ax.bar(x, found["vs_floor"], width * 0.92, color=color, label=way if i == 0 else None)
            label = f"{found['vs_floor']:.2f}x\n{_us(found['us'])}"
            ax.text(x, found["vs_floor"], label, ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="0.3", linewidth=0.8, linestyle="--")
    ratios = [data["batches"][b]["ways"][w]["vs_floor"] for b in batches for w in VMAP_WAYS]
    if max(ratios) / min(ratios) > 10:
        ax.set_yscale("log")
    else:
        ax.set_ylim(0, max(ratios) * 1.25)
    ticks = [f"batch {b}\nauto chose {data['batches'][b]['auto_plan']}" for b in batches]
    ax.set_xticks(range(len(batches)), ticks)
    ax.set_ylabel("time per call relative to the floor (lower is better)")
    ax.legend(loc="upper right", fontsize=8, ncol=len(VMAP_WAYS), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    threads = data["intra_op_threads"]
    size = f"{data['members']} members x {data['layers']} Linear({data['width']}, {data['width']})"
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    _finish(fig, data, f"MLP ensemble, {size}, {threads} intra-op threads", path)


def _us(us: float) -> str:
    return f"{us:,.0f} us" if us < 10_000 else f"{us / 1e3:,.1f} ms"


# ---- heal.png -----------------------------------------------------------------------------

HEAL_COLORS = {  # way in heal.json: color
    "asyncrpc, heal one worker": COLORS["asyncrpc"],
    "asyncrpc, restart the whole world": "#8fbbd9",
    "Ray, restart one actor": COLORS["ray"],
}


def heal_chart(data: dict[str, Any], path: Path) -> None:
    ways = list(data["ways"])
    samples = [s for w in ways for s in data["ways"][w]["samples"]]
    low, high = min([*samples, data["target"]["heal_s"]]) / 2, max(samples) * 5
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.7 * len(ways)))
    for i, way in enumerate(ways):
        found = data["ways"][way]
        color = HEAL_COLORS.get(way, "0.5")
        ax.barh(i, found["seconds"] - low, left=low, height=0.6, color=color)
        ax.plot(found["samples"], [i] * len(found["samples"]), "k|", markersize=12, alpha=0.6)
        kept = "survivors' state kept" if found["state_kept"] else "state lost"
        label = f"{_seconds(found['seconds'])}, {found['vs_heal']:.2f}x heal's, {kept}"
        ax.text(max(found["samples"]) * 1.08, i, label, va="center", fontsize=8, bbox=_LABEL_BOX)
    target = data["target"]
    ax.axvline(target["heal_s"], color="firebrick", linewidth=0.9, linestyle="--")
    met = "met" if target["met"] else "not met"
    label = f" target for a heal: {target['heal_s']} s ({met})"
    ax.text(target["heal_s"], len(ways) - 0.45, label, color="firebrick", fontsize=8, va="bottom")
    ax.set_yticks(range(len(ways)), ways, fontsize=9)
    ax.set_ylim(len(ways) - 0.3, -0.6)
    ax.set_xscale("log")
    ax.set_xlim(low, high)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g} s"))
    ax.set_xlabel("seconds from the SIGKILL to the replacement's first answer "
                  "(bar: median; ticks: every kill)")  # fmt: skip
    ax.grid(axis="x", which="major", alpha=0.3)
    fig.tight_layout(rect=(0, 0.04, 1, 0.93))
    _finish(fig, data, f"A killed worker of {data['world_size']} back in service", path)


# ---- elastic.png ------------------------------------------------------------------------


def elastic_chart(data: dict[str, Any], path: Path) -> None:
    rows = list(data["rows"])
    systems = [
        ("asyncrpc (embedded)", COLORS["asyncrpc"]),
        ("asyncrpc (asyncrpc-launch)", "#17becf"),
        ("Ray (actors)", COLORS["ray"]),
    ]
    fig, ax = plt.subplots(figsize=(10, 1.6 + 1.1 * len(rows)))
    samples = [s for r in rows for got in data["rows"][r]["samples"].values() for s in got]
    for i, row in enumerate(rows):
        found = data["rows"][row]
        for j, (system, color) in enumerate(systems):
            if system not in found["seconds"]:
                continue
            y = i + (j - 1) * 0.28
            seconds = found["seconds"][system]
            ax.barh(y, seconds, height=0.25, color=color, label=system if i == 0 else None)
            ax.plot(found["samples"][system], [y] * len(found["samples"][system]), "k|",
                    markersize=8, alpha=0.6)  # fmt: skip
            ratio = found.get("ray_over_ours")
            note = f" ({ratio:.1f}x asyncrpc's)" if system.startswith("Ray") and ratio else ""
            ax.text(max(found["samples"][system]) * 1.1, y, _seconds(seconds) + note,
                    va="center", fontsize=8, bbox=_LABEL_BOX)  # fmt: skip
    ax.set_yticks(range(len(rows)), rows, fontsize=9)
    ax.set_ylim(len(rows) - 0.4, -0.6)
    ax.set_xscale("log")
    ax.set_xlim(min(samples) / 2, max(samples) * 8)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g} s"))
    ax.set_xlabel("seconds (bar: median; ticks: every sample)")
    ax.legend(loc="lower right", fontsize=8, frameon=False)
    ax.grid(axis="x", which="major", alpha=0.3)
    fig.tight_layout(rect=(0, 0.04, 1, 0.93))
    _finish(fig, data, "Adding and removing workers while a world runs", path)


# ---- training.png -------------------------------------------------------------------------

TRAINING_WAYS = {  # way in ensemble_training.json: color
    "loop": "#7f7f7f",
    "auto": "#9467bd",
    "vmap": "#1f77b4",
    "floor": "#2ca02c",
}


def training_chart(data: dict[str, Any], path: Path) -> None:
    groups = [(f"training step, batch {b}", found["ways"]) for b, found in data["steps"].items()]
    groups.append(("acting, batch 1\n(no gradients)", data["acting"]["ways"]))
    fig, ax = plt.subplots(figsize=(10, 5.2))
    width = 0.8 / len(TRAINING_WAYS)
    for j, (way, color) in enumerate(TRAINING_WAYS.items()):
        for i, (_, ways) in enumerate(groups):
            if way not in ways:
                continue
            x = i + (j - (len(TRAINING_WAYS) - 1) / 2) * width
            speed = ways[way]["vs_loop"]
            ax.bar(x, speed, width * 0.92, color=color, label=way if i == 0 else None)
            ax.text(x, speed, f"{speed:.2f}x\n{ways[way]['ms']:.2f} ms", ha="center",
                    va="bottom", fontsize=7)  # fmt: skip
    ax.axhline(1.0, color="0.3", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), [title for title, _ in groups])
    ax.set_ylabel("speed relative to the Python loop (higher is better)")
    top = max(w["vs_loop"] for _, ways in groups for w in ways.values())
    ax.set_ylim(0, top * 1.3)
    ax.legend(loc="upper right", fontsize=8, ncol=len(TRAINING_WAYS), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    title = (f"REDQ/SAC step over {data['critics']} critics (hidden {data['hidden']}), "
             f"{data['intra_op_threads']} intra-op threads")  # fmt: skip
    _finish(fig, data, title, path)


# ---- main -----------------------------------------------------------------------------------

CHARTS: dict[str, tuple[str, Callable[[dict[str, Any], Path], None]]] = {
    "peers.png": ("peers.json", peers_chart),
    "scale.png": ("scale.json", scale_chart),
    "vmap.png": ("stacked_mlp.json", vmap_chart),
    "heal.png": ("heal.json", heal_chart),
    "elastic.png": ("elastic.json", elastic_chart),
    "training.png": ("ensemble_training.json", training_chart),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / "docs" / "benchmarks" / "results")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    for chart, (source, draw) in CHARTS.items():
        path = opts.results / source
        if not path.is_file():
            print(f"{chart} skipped: no {path}")
            continue
        draw(json.loads(path.read_text()), opts.out / chart)


if __name__ == "__main__":
    main()
