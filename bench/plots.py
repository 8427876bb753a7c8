"""The figures of docs/benchmarks.md, drawn from the benches' JSON results.

    python bench/plots.py                        # bench/results/*.json -> docs/img/*.png
    python bench/plots.py --results DIR --out DIR

One results file per figure (:data:`FIGURES`), each ``{"runs": [...]}`` as bench/provenance.py
describes; a bench given ``--json bench/results/<file>`` appends its run there:

* ``epoch_time.json`` (bench/gcn_epoch.py, bench/products_scale.py): a one-rank GCN epoch,
  ours and PyG, against the graph's nodes; a panel per device.
* ``scaling.json`` (bench/scaling.py): predicted against measured epoch time of every grid;
  per grid the predicted and measured split into compute and communication, where the run
  has the model's split.
* ``memory_per_rank.json`` (bench/memory.py): peak resident memory per rank against ranks.

Axes are logarithmic where the values span a decade or more; each title names the machines of the
runs drawn, and each legend entry its commit.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import read_runs  # noqa: E402

Run = dict[str, Any]
VARIANT_LABELS = {"fixed": "fixed features", "learn": "trainable features"}
DEVICE_LABELS = {"cpu": "CPU", "cuda": "GPU"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _machines(runs: list[Run]) -> str:
    """The runs' machines, each once, in order."""
    seen = dict.fromkeys(r["provenance"]["machine"] for r in runs)
    return "; ".join(seen)


def _wrap(text: str, width: int = 70) -> str:
    return "\n".join(textwrap.wrap(text, width))


def _plain(ax: Any, axis: str = "xy", counts: str = "") -> None:
    """Log axes labelled as plain numbers (``300``, ``0.05``; ``2M`` on the axes of
    ``counts``) at 1, 2 and 5 of every decade."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    def plain(v: float, _pos: object = None) -> str:
        return f"{v:g}" if v < 1e5 else f"{v:.0f}"

    def count(v: float, _pos: object = None) -> str:
        for unit, scale in (("M", 1e6), ("K", 1e3)):
            if v >= scale:
                return f"{v / scale:g}{unit}"
        return f"{v:g}"

    for name in axis:
        which = ax.xaxis if name == "x" else ax.yaxis
        fmt = FuncFormatter(count if name in counts else plain)
        which.set_major_formatter(fmt)
        which.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        which.set_minor_formatter(fmt)


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})  # no version: stable bytes


def _variant(row: dict[str, Any]) -> str:
    """A row's workload in words: its variant, dropout and norm where they are not the
    defaults."""
    out = VARIANT_LABELS.get(row["variant"], row["variant"])
    if row.get("dropout"):
        out += f", dropout {row['dropout']}"
    if row.get("norm", "none") != "none":
        out += f", {row['norm']} norm"
    return out


def epoch_time(runs: list[Run], path: Path) -> None:
    """Seconds per epoch against nodes, ours solid and PyG dashed, one colour per workload;
    points of one workload, bench, machine and commit are joined across graph sizes."""
    plt = _pyplot()
    devices = [d for d in DEVICE_LABELS if any(r.get("device", "cpu") == d for r in runs)]
    fig, axes = plt.subplots(1, len(devices), figsize=(6.2 * len(devices), 4.8), squeeze=False)
    for ax, device in zip(axes[0], devices):
        mine = [r for r in runs if r.get("device", "cpu") == device]
        series: dict[tuple, list[tuple[float, float, float]]] = {}
        for run in mine:
            for row in run["rows"]:
                key = (_variant(row), run["bench"], run["provenance"]["commit"],
                       run["provenance"]["machine"])
                series.setdefault(key, []).append((row["nodes"], row["ours_s"], row["pyg_s"]))
        colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, ((variant, bench, commit, _), points) in enumerate(sorted(series.items())):
            points.sort()
            nodes = [p[0] for p in points]
            where = "" if bench == "gcn_epoch" else f" (bench/{bench}.py)"
            colour = colours[i % len(colours)]
            ax.plot(nodes, [p[1] for p in points], "o-", color=colour,
                    label=f"ours, {variant}{where}, {commit}")
            ax.plot(nodes, [p[2] for p in points], "s--", color=colour, mfc="none",
                    label=f"PyG, {variant}{where}, {commit}")
        ax.set(xscale="log", yscale="log", xlabel="graph nodes",
               ylabel="seconds per epoch (median)",
               title=_wrap(f"{DEVICE_LABELS[device]}: {_machines(mine)}", 60))
        _plain(ax, counts="x")
        ax.grid(True, which="both", lw=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("A 3-layer GCN epoch on one rank: ours (solid) against PyG (dashed)")
    _save(fig, path)


def scaling(runs: list[Run], path: Path) -> None:
    """Measured against predicted epoch time of every grid, a marker per rank count, the
    diagonal where they agree; beside it, where the runs have the model's compute and
    communication split, each grid's predicted and measured split."""
    plt = _pyplot()
    runs = [r for r in runs if r["rows"]]
    split = [r for r in runs if all("pred_compute_ms" in row for row in r["rows"])]
    fig, axes = plt.subplots(1, 2 if split else 1, figsize=(14 if split else 6.5, 5.2),
                             squeeze=False,
                             gridspec_kw={"width_ratios": [1, 2]} if split else None)
    ax = axes[0][0]
    markers = "os^vD"
    values = []
    for run in runs:
        title = f"{run.get('model', 'gcn').upper()} on {run.get('dataset', '?')}"
        for i, ranks in enumerate(sorted({row["ranks"] for row in run["rows"]})):
            sel = [row for row in run["rows"] if row["ranks"] == ranks]
            xs, ys = [row["predicted_ms"] for row in sel], [row["measured_ms"] for row in sel]
            values += xs + ys
            ax.scatter(xs, ys, marker=markers[i % len(markers)],
                       label=f"{title}, G = {ranks}, {run['provenance']['commit']}")
            for row in sel:
                ax.annotate(row["grid"], (row["predicted_ms"], row["measured_ms"]),
                            fontsize=7, xytext=(3, 2), textcoords="offset points")
    if values:
        lo, hi = min(values) * 0.9, max(values) * 1.1
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="measured = predicted")
        ax.set(xlim=(lo, hi), ylim=(lo, hi))
        if hi / lo >= 10:
            ax.set(xscale="log", yscale="log")
            _plain(ax)
    ax.set(xlabel="predicted epoch (ms)",
           ylabel="measured epoch, fastest round's median (ms)",
           title=_wrap(f"Every grid, predicted against measured: {_machines(runs)}", 55))
    ax.grid(True, which="both", lw=0.3)
    ax.legend(fontsize=7)
    if split:
        _split_bars(axes[0][1], [row for r in split for row in r["rows"]])
    _save(fig, path)


def _split_bars(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Per grid, the predicted (left) and measured (right) epoch split into compute and
    communication (measured communication includes waiting)."""
    x = range(len(rows))
    comp = [r["pred_compute_ms"] for r in rows]
    ax.bar([i - 0.2 for i in x], comp, 0.4, label="predicted compute")
    ax.bar([i - 0.2 for i in x], [r["pred_comm_ms"] for r in rows], 0.4, bottom=comp,
           label="predicted communication")
    mcomp = [r["measured_ms"] - r["measured_comm_ms"] for r in rows]
    ax.bar([i + 0.2 for i in x], mcomp, 0.4, label="measured compute (epoch - comm)")
    ax.bar([i + 0.2 for i in x], [r["measured_comm_ms"] for r in rows], 0.4, bottom=mcomp,
           label="measured communication (incl. waiting)")
    ax.set_xticks(list(x), [f"{r['grid']}\nG={r['ranks']}" for r in rows], fontsize=7)
    ax.set(ylabel="ms per epoch", title="per grid: predicted (left) and measured (right)")
    ax.legend(fontsize=8)


# bench/memory.py's cases: (column, its label) of each line drawn against ranks, and which
# rows count (llm: the build step, the one both rank counts run; ogb: not the run that also
# prepares the cache)
MEMORY_LINES: dict[str, tuple[list[tuple[str, str]], Callable[[dict], bool]]] = {
    "plexus": ([("peak_epoch_mib", "plexus: epoch peak"), ("planner_mib", "plexus: planner"),
                ("features_and_optimizer_mib", "plexus: features + Adam state")],
               lambda row: True),
    "llm": ([("peak_mib", "llm: build peak"), ("param_per_rank_mib", "llm: parameters")],
            lambda row: row.get("step") == "build"),
    "ogb": ([("peak_mib", "papers100M format: peak"), ("planner_mib", "papers100M format: "
                                                                     "planner")],
            lambda row: "prepares" not in row.get("run", "")),
}


def memory_per_rank(runs: list[Run], path: Path) -> None:
    """MiB per rank against ranks for each case's lines (:data:`MEMORY_LINES`), with
    ``1/G`` of the first line's one-rank value dotted for reference."""
    plt = _pyplot()
    from matplotlib.ticker import NullLocator

    fig, ax = plt.subplots(figsize=(7, 4.8))
    all_ranks: set[int] = set()
    for run in runs:
        lines, keep = MEMORY_LINES[run["case"]]
        rows = sorted((r for r in run["rows"] if keep(r)), key=lambda r: r["ranks"])
        commit = run["provenance"]["commit"]
        for i, (column, label) in enumerate(lines):
            pts = [(r["ranks"], r[column]) for r in rows if r.get(column) is not None]
            if not pts:
                continue
            all_ranks.update(p[0] for p in pts)
            (line,) = ax.plot(*zip(*pts), "o-" if i == 0 else "s--",
                              label=f"{label}, {commit}")
            if i == 0 and pts[0][0] == 1 and len(pts) > 1:
                ax.plot([p[0] for p in pts], [pts[0][1] / p[0] for p in pts], ":",
                        color=line.get_color(), label=f"{label.split(':')[0]}: 1/G of 1 rank")
    ranks = sorted(all_ranks)
    ax.set(xscale="log", yscale="log", xlabel="ranks G", ylabel="MiB per rank (max over ranks)",
           title=_wrap(f"Peak resident memory per rank: {_machines(runs)}", 60))
    _plain(ax)
    ax.set_xticks(ranks, [str(r) for r in ranks])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.grid(True, which="both", lw=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)


# results file -> (what draws it, the image's name)
FIGURES: dict[str, tuple[Callable[[list[Run], Path], None], str]] = {
    "epoch_time.json": (epoch_time, "epoch_time.png"),
    "scaling.json": (scaling, "scaling.png"),
    "memory_per_rank.json": (memory_per_rank, "memory_per_rank.png"),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results",
                   help="folder of the results files (default: bench/results)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img",
                   help="folder for the images (default: docs/img)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    unknown = sorted(f.name for f in args.results.glob("*.json") if f.name not in FIGURES)
    if unknown:
        p.error(f"results files no figure draws: {unknown}; known: {sorted(FIGURES)}")
    for name, (draw, image) in FIGURES.items():
        source = args.results / name
        if not source.is_file():
            print(f"{source}: absent, {image} not drawn", file=sys.stderr)
            continue
        draw(read_runs(source), args.out / image)
        print(f"{source} -> {args.out / image}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
