"""Accuracy parity: plexus's GCN, GraphSAGE and GAT against PyG's on the same graphs, in one run.

    python bench/accuracy.py                      # 2 graphs x 3 models x 5 seeds, 200 epochs
    python bench/accuracy.py --models gcn --seeds 10 --first-layer-decay
    python bench/accuracy.py --quick              # 1,000 nodes, 2 seeds, 30 epochs (the test)
    python bench/accuracy.py --precision bf16     # plexus in bf16 too, against its float32

Graphs, generated here (nothing to download), 10,000 nodes each:

* ``planted``: plexus.data.generators.planted_partition (8 classes, edge homophily 0.45) with
  noisy binary bag-of-words features, row-normalised as PyG's gcn.py does on Planetoid;
* ``arxiv-like``: a directed citation graph (5 classes, real-valued features) written in
  ogbn-arxiv's exact on-disk format (CSV raw files, time split; the format of
  tests/plexus/data/ogb_format.py) into a temporary folder, read back through
  ``plexus.data.load_dataset("ogbn-arxiv", root)`` (the unmodified ogb loader), directed,
  and symmetrised by each side as OGB's arxiv example does with ``adj_t.to_symmetric()``:
  ``plexus.fit(..., symmetrize=True)`` and PyG's ``utils.to_undirected``.

Both are sized so that a 2-layer GCN reaches 73-80%: far above chance, far from 100%.

Models, each side as its users write it, with the same hyper-parameters: 2 layers, ``--hidden``
units, ReLU, dropout 0.5 on the input and the hidden layer, Adam (lr 0.01, L2 weight decay 5e-4
on every parameter, or on the first layer only with ``--first-layer-decay`` as PyG's
examples/gcn.py does), full-batch cross-entropy on the training nodes, ``--epochs`` epochs.

* plexus: ``plexus.fit(graph, grid="1x1x1", model=..., num_layers=2, dropout=0.5, norm="none",
  optimizer="adam", normalize_features=..., ...)``; with ``--grid`` on that grid's ranks
  under mpiexec (both precisions; PyG stays on one process);
* PyG: ``GCNConv(cached=True, normalize=True)`` or ``SAGEConv(aggr="mean")`` twice in the
  model and loop of examples/gcn.py, ``NormalizeFeatures()`` where features are normalised.

GAT runs PyG's GAT recipe (examples/gat.py, the paper's): 8 heads of 8 hidden units
concatenated, dropout 0.6 on every layer's input and on the attention coefficients, Adam lr
0.005 with L2 weight decay 5e-4, ``--epochs``; its last layer's 8 heads averaged (the GAT
paper's PubMed model) and ReLU between the layers on both sides (plexus's hidden activation):
``GATConv(F, 8, heads=8, dropout=0.6)`` and ``GATConv(64, C, heads=8, concat=False,
dropout=0.6)`` against ``plexus.fit(model="gat", hidden=8, heads=8, attention_dropout=0.6)``.
With ``--normalize-features auto`` GAT reads the raw features on every graph: on the planted
graph's row-normalised ones neither side learns within 200 epochs (both stay at chance, which
would compare nothing).

Model selection is OGB's: after every update both sides evaluate with dropout off; a seed's
score is the test accuracy at the first epoch of best validation accuracy (plexus:
``result.info["best"]``, checked against its history). Printed per graph and model: mean +- std
over seeds of that score and of the last epoch's test accuracy on each side, the difference
plexus - PyG in points, the median time per epoch after the first of the training step and,
apart, of the evaluation, and PASS when the mean difference is within ``--tolerance`` points
(default 1.0). Exit 1 if any row fails. Both sides run with the same number of torch threads
(``--threads``, default ``$OMP_NUM_THREADS``, else all cores; plexus's numba kernel follows
torch's count), one after the other, alternating which goes first from seed to seed.

``--precision bf16`` adds a third side, plexus with ``precision="bf16"`` (the same seeds, run
beside the other two), and a second table: plexus bf16 against plexus float32, the difference
of the mean test accuracy at the best validation epoch in points, the train and eval times of
both, and PASS when that difference is within ``--bf16-tolerance`` points (default 0.5). On
a grid of more than one rank (``--grid 2x2x1``) every plexus collective of the bf16 side moves
bf16, so the table is also bf16 messages against float32 ones, in accuracy and epoch time:

    python bench/accuracy.py --precision bf16 --grid 2x2x1   # the issue's check (tens of minutes)

Short runs (``--quick``) do not meet the target: the sides start from different random weights
(and SAGEConv from PyG's default Linear init, uniform +-1/sqrt(fan_in) with a random bias,
where plexus draws Glorot weights and a zero bias), which matters before training converges.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from torch.nn import functional

from plexus.data import Graph, load_dataset
from plexus.data.generators import planted_partition

MODELS = ("gcn", "sage", "gat")
DATASETS = ("planted", "arxiv-like")
DROPOUT = 0.5
LR = 0.01
WEIGHT_DECAY = 5e-4
# PyG's GAT recipe (the module docstring): heads, each head's width, dropout (inputs and
# coefficients), learning rate
GAT_HEADS, GAT_HIDDEN, GAT_DROPOUT, GAT_LR = 8, 8, 0.6, 0.005


def normalizes(ds: Dataset, kind: str, args: argparse.Namespace) -> bool:
    """Whether ``kind`` reads ``ds``'s features row-normalised: the dataset's choice, but GAT's
    raw features under ``--normalize-features auto`` (the module docstring)."""
    return ds.normalize_features and not (kind == "gat" and args.normalize_features == "auto")


def recipe(kind: str, args: argparse.Namespace) -> dict:
    """The hidden width (a head's, for GAT), dropout and learning rate of ``kind``."""
    if kind == "gat":
        return {"hidden": GAT_HIDDEN, "dropout": GAT_DROPOUT, "lr": GAT_LR}
    return {"hidden": args.hidden, "dropout": DROPOUT, "lr": LR}


@dataclass(frozen=True)
class Sizes:
    """Graph sizes of a run (full or --quick)."""

    num_nodes: int
    num_features: int
    avg_degree: float


FULL, QUICK = Sizes(10_000, 128, 8.0), Sizes(1000, 128, 8.0)
NORMALIZE_AUTO = {"planted": True, "arxiv-like": False}  # as PyG's gcn.py / OGB's arxiv example


# ---------------------------------------------------------------- graphs


def planted_graph(sizes: Sizes) -> Graph:
    """Planted partition with noisy bag-of-words features: a word is present (1) where the
    generator's Gaussian feature exceeds 1, so about 16% of the entries are ones, a little
    more often for the words of a node's class (as Cora's binary word features)."""
    g = planted_partition(num_nodes=sizes.num_nodes, num_classes=8, avg_degree=sizes.avg_degree,
                          p_in=0.45, num_features=sizes.num_features, signal=0.25, seed=0)
    return dataclasses.replace(g, x=(g.x > 1.0).to(torch.float32))


def write_arxiv_like(root: Path, sizes: Sizes, seed: int = 1) -> Path:
    """Write a directed citation graph in ogbn-arxiv's raw format under root/ogbn_arxiv.

    The graph is a planted partition (5 classes; noisy real-valued features, like arxiv's
    averaged word embeddings). Each undirected pair (s, t) becomes one citation from the newer
    paper to the older (ties: a coin flip), so edges are directed as in arxiv. Years are drawn
    so that OGB's time split (train <= 2017, valid 2018, test >= 2019) gives about 50/25/25 of
    the nodes: large evaluation splits keep the seed-to-seed spread small. The loader reads
    the 5 planted classes into a 40-class output layer, as ogbn-arxiv has.
    """
    g = planted_partition(num_nodes=sizes.num_nodes, num_classes=5, avg_degree=sizes.avg_degree,
                          p_in=0.5, num_features=sizes.num_features, signal=0.105, seed=seed)
    rng = np.random.default_rng(seed)
    years = rng.choice([2015, 2016, 2017, 2018, 2019, 2020], size=g.num_nodes,
                       p=[0.2, 0.15, 0.15, 0.25, 0.125, 0.125])
    s, t = g.edge_index.numpy()
    s, t = s[s < t], t[s < t]  # each undirected pair once
    newer_s = (years[s] > years[t]) | ((years[s] == years[t]) & (rng.random(s.size) < 0.5))
    edges = np.where(newer_s, np.stack([s, t]), np.stack([t, s]))  # [2, M] citing -> cited
    d = root / "ogbn_arxiv"
    raw, split = d / "raw", d / "split" / "time"
    raw.mkdir(parents=True)
    split.mkdir(parents=True)
    x = np.round(g.x.numpy(), 6)
    _savetxt(raw / "edge.csv.gz", edges.T, "%d")
    _savetxt(raw / "node-feat.csv.gz", x, "%.6f")  # decimal point: pandas reads floats
    _savetxt(raw / "node-label.csv.gz", g.y.numpy().reshape(-1, 1), "%d")
    _savetxt(raw / "num-node-list.csv.gz", np.array([[g.num_nodes]]), "%d")
    _savetxt(raw / "num-edge-list.csv.gz", np.array([[edges.shape[1]]]), "%d")
    _savetxt(raw / "node_year.csv.gz", years.reshape(-1, 1), "%d")
    for name, m in (("train", years <= 2017), ("valid", years == 2018), ("test", years >= 2019)):
        _savetxt(split / f"{name}.csv.gz", np.flatnonzero(m).reshape(-1, 1), "%d")
    return d


def _savetxt(path: Path, rows: np.ndarray, fmt: str) -> None:
    with gzip.open(path, "wt") as f:
        np.savetxt(f, rows, fmt=fmt, delimiter=",")


def arxiv_like_graph(sizes: Sizes, tmp: Path) -> Graph:
    """The arxiv-like graph through the real OGB loader, directed as stored."""
    write_arxiv_like(tmp, sizes)
    g = load_dataset("ogbn-arxiv", tmp)
    if g.is_undirected():
        raise AssertionError("the arxiv-like graph should load directed")
    g.name = "arxiv-like"
    return g


@dataclass
class Dataset:
    """A graph and how both sides prepare it: symmetrise the edges, row-normalise features."""

    graph: Graph
    symmetrize: bool
    normalize_features: bool


def make_datasets(names: list[str], sizes: Sizes, tmp: Path, normalize: str = "auto"
                  ) -> dict[str, Dataset]:
    """The graphs of ``names``; ``normalize``: ``auto`` (:data:`NORMALIZE_AUTO`), on or off."""
    build = {"planted": lambda: planted_graph(sizes),
             "arxiv-like": lambda: arxiv_like_graph(sizes, tmp)}
    return {n: Dataset(build[n](), symmetrize=n == "arxiv-like",
                       normalize_features=NORMALIZE_AUTO[n] if normalize == "auto"
                       else normalize == "on")
            for n in names}


# ---------------------------------------------------------------- one training run


@dataclass
class Run:
    """One seed of one side: test acc at best val (OGB selection), last test acc, timings."""

    best_test: float
    best_val: float
    best_epoch: int
    last_test: float
    train_ms: float  # training step (forward, backward, update): median over epochs after 1st
    eval_ms: float  # the eval-mode forward and accuracies after the update, likewise


def select(history: list[dict]) -> dict:
    """The row of the first epoch of best validation accuracy."""
    return max(history, key=lambda r: r["val_acc"])  # max returns the first maximum


def summarize(history: list[dict]) -> Run:
    best = select(history)
    timed = history[1:] or history
    return Run(best_test=best["test_acc"], best_val=best["val_acc"], best_epoch=best["epoch"],
               last_test=history[-1]["test_acc"],
               train_ms=1000 * statistics.median(r["epoch_s"] for r in timed),
               eval_ms=1000 * statistics.median(r["eval_s"] for r in timed))


def pyg_model(kind: str, num_features: int, hidden: int, num_classes: int,
              dropout: float = DROPOUT) -> torch.nn.Module:
    """PyG's examples/gcn.py model (``SAGEConv(aggr="mean")`` in place of GCNConv for sage;
    for gat, examples/gat.py's two ``GATConv`` with the module docstring's recipe)."""
    from torch_geometric.nn import GATConv, GCNConv, SAGEConv

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if kind == "gcn":
                self.conv1 = GCNConv(num_features, hidden, cached=True, normalize=True)
                self.conv2 = GCNConv(hidden, num_classes, cached=True, normalize=True)
            elif kind == "gat":
                self.conv1 = GATConv(num_features, hidden, heads=GAT_HEADS, dropout=dropout)
                self.conv2 = GATConv(hidden * GAT_HEADS, num_classes, heads=GAT_HEADS,
                                     concat=False, dropout=dropout)
            else:
                self.conv1 = SAGEConv(num_features, hidden, aggr="mean")
                self.conv2 = SAGEConv(hidden, num_classes, aggr="mean")

        def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
            x = functional.dropout(x, p=dropout, training=self.training)
            x = self.conv1(x, edge_index).relu()
            x = functional.dropout(x, p=dropout, training=self.training)
            return self.conv2(x, edge_index)

    return Net()


def run_pyg(ds: Dataset, kind: str, args: argparse.Namespace, seed: int) -> Run:
    """Train PyG's model as examples/gcn.py does; evaluate (model.eval()) after every update."""
    from torch_geometric.data import Data
    from torch_geometric.transforms import NormalizeFeatures
    from torch_geometric.utils import to_undirected

    g = ds.graph
    edge_index = to_undirected(g.edge_index, num_nodes=g.num_nodes) if ds.symmetrize else (
        g.edge_index)
    data = Data(x=g.x.clone(), edge_index=edge_index, y=g.y)
    if normalizes(ds, kind, args):
        data = NormalizeFeatures()(data)
    masks = {s: g.mask(s) for s in ("train", "val", "test")}
    torch.manual_seed(seed)
    rec = recipe(kind, args)
    model = pyg_model(kind, g.num_features, rec["hidden"], g.num_classes, rec["dropout"])
    if args.first_layer_decay:
        groups = [dict(params=model.conv1.parameters(), weight_decay=WEIGHT_DECAY),
                  dict(params=model.conv2.parameters(), weight_decay=0.0)]
    else:
        groups = [dict(params=model.parameters(), weight_decay=WEIGHT_DECAY)]
    opt = torch.optim.Adam(groups, lr=rec["lr"])
    history = []
    for epoch in range(1, args.epochs + 1):
        start = time.perf_counter()
        model.train()
        opt.zero_grad()
        out = model(data.x, data.edge_index)
        loss = functional.cross_entropy(out[masks["train"]], data.y[masks["train"]])
        loss.backward()
        opt.step()
        row = {"epoch": epoch, "loss": loss.item(), "epoch_s": time.perf_counter() - start}
        start = time.perf_counter()
        model.eval()
        with torch.no_grad():
            pred = model(data.x, data.edge_index).argmax(dim=-1)
        for s, m in masks.items():
            row[f"{s}_acc"] = float((pred[m] == data.y[m]).float().mean())
        row["eval_s"] = time.perf_counter() - start
        history.append(row)
    return summarize(history)


def plexus_config(ds: Dataset, kind: str, args: argparse.Namespace, seed: int,
                  precision: str = "fp32") -> dict:
    """The keyword arguments of ``plexus.fit`` for this graph, model and seed."""
    gat = {"heads": GAT_HEADS, "attention_dropout": GAT_DROPOUT} if kind == "gat" else {}
    return dict(model=kind, num_layers=2, norm="none", optimizer="adam", **recipe(kind, args),
                **gat,
                weight_decay=[WEIGHT_DECAY, 0.0] if args.first_layer_decay else WEIGHT_DECAY,
                normalize_features=normalizes(ds, kind, args), epochs=args.epochs, seed=seed,
                precision=precision)


def run_plexus(ds: Dataset, kind: str, args: argparse.Namespace, seed: int,
               precision: str = "fp32") -> Run:
    """Train plexus on ``args.grid`` (one rank here, else its ranks under mpiexec:
    bench/accuracy_worker.py); its history evaluates after every update and ``info["best"]``
    is its OGB-style model selection."""
    config = dict(symmetrize=ds.symmetrize, **plexus_config(ds, kind, args, seed, precision))
    if args.grid == "1x1x1":
        import plexus

        result = plexus.fit(ds.graph, grid="1x1x1", **config)
        history, best = result.history, result.info["best"]
    else:
        from common.grid import ProcessGrid
        from common.spawn import run_worker

        got = run_worker(Path(__file__).with_name("accuracy_worker.py"),
                         ProcessGrid.parse(args.grid).num_ranks,
                         ["--graph", str(saved_graph(ds, args)), "--grid", args.grid,
                          "--config", json.dumps(config)], cwd=Path(__file__).parents[1])
        history, best = got["history"], got["best"]
    run = summarize(history)
    if (best["epoch"], best["test_acc"]) != (run.best_epoch, run.best_test):
        raise AssertionError(f"plexus info['best'] {best} is not the history's first best-val "
                             f"epoch {run.best_epoch} (test acc {run.best_test})")
    return run


def saved_graph(ds: Dataset, args: argparse.Namespace) -> Path:
    """``ds.graph`` saved (once) under ``args.graph_dir`` for the grid's ranks to load."""
    path = Path(args.graph_dir) / f"graph-{id(ds.graph)}.pt"
    if not path.exists():
        torch.save(ds.graph, path)
    return path


def run_plexus_bf16(ds: Dataset, kind: str, args: argparse.Namespace, seed: int) -> Run:
    """:func:`run_plexus` with ``precision="bf16"``."""
    return run_plexus(ds, kind, args, seed, precision="bf16")


SIDES = {"plexus": run_plexus, "pyg": run_pyg}
BF16_SIDE = "plexus bf16"


# ---------------------------------------------------------------- table


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def row_of(dataset: str, kind: str, runs: dict[str, list[Run]], tolerance: float) -> dict:
    """One table row: per side mean/std of the accuracies (points), median times, the seeds."""
    out: dict = {"dataset": dataset, "model": kind}
    for side, rs in runs.items():
        out[side] = {
            "best_test": mean_std([100 * r.best_test for r in rs]),
            "last_test": mean_std([100 * r.last_test for r in rs]),
            "train_ms": statistics.median(r.train_ms for r in rs),
            "eval_ms": statistics.median(r.eval_ms for r in rs),
            "seeds": [asdict(r) for r in rs],
        }
    out["diff"] = out["plexus"]["best_test"][0] - out["pyg"]["best_test"][0]
    out["diff_last"] = out["plexus"]["last_test"][0] - out["pyg"]["last_test"][0]
    finite = all(math.isfinite(v) for side in ("plexus", "pyg") for v in out[side]["best_test"])
    out["pass"] = finite and abs(out["diff"]) <= tolerance
    return out


def bf16_row(r: dict, tolerance: float) -> dict:
    """plexus bf16 against plexus float32 in a :func:`row_of` row: the difference of the mean
    best test accuracy in points, and whether it is within ``tolerance``."""
    low, full = r[BF16_SIDE], r["plexus"]
    diff = low["best_test"][0] - full["best_test"][0]
    finite = all(math.isfinite(v) for v in (*low["best_test"], *full["best_test"]))
    return {"diff": diff, "diff_last": low["last_test"][0] - full["last_test"][0],
            "pass": finite and abs(diff) <= tolerance}


HEADER = (f"{'dataset':<11}{'model':<6}{'plexus best':>14}{'plexus last':>14}{'PyG best':>14}"
          f"{'PyG last':>14}{'diff':>7}{'train ms plexus/PyG':>21}{'eval ms plexus/PyG':>20}"
          "  result")


def fmt_row(r: dict) -> str:
    def acc(v: tuple[float, float]) -> str:
        return f"{v[0]:6.2f}+-{v[1]:4.2f}"

    p, q = r["plexus"], r["pyg"]
    train = f"{p['train_ms']:.2f} / {q['train_ms']:.2f}"
    evals = f"{p['eval_ms']:.2f} / {q['eval_ms']:.2f}"
    return (f"{r['dataset']:<11}{r['model']:<6}{acc(p['best_test']):>14}"
            f"{acc(p['last_test']):>14}{acc(q['best_test']):>14}{acc(q['last_test']):>14}"
            f"{r['diff']:>+7.2f}{train:>21}{evals:>20}  {'PASS' if r['pass'] else 'FAIL'}")


BF16_HEADER = (f"{'dataset':<11}{'model':<6}{'fp32 best':>14}{'bf16 best':>14}{'bf16 last':>14}"
               f"{'diff':>7}{'train ms fp32/bf16':>21}{'eval ms fp32/bf16':>20}  result")


def fmt_bf16_row(r: dict) -> str:
    def acc(v: tuple[float, float]) -> str:
        return f"{v[0]:6.2f}+-{v[1]:4.2f}"

    p, b, c = r["plexus"], r[BF16_SIDE], r["bf16"]
    train = f"{p['train_ms']:.2f} / {b['train_ms']:.2f}"
    evals = f"{p['eval_ms']:.2f} / {b['eval_ms']:.2f}"
    return (f"{r['dataset']:<11}{r['model']:<6}{acc(p['best_test']):>14}"
            f"{acc(b['best_test']):>14}{acc(b['last_test']):>14}{c['diff']:>+7.2f}{train:>21}"
            f"{evals:>20}  {'PASS' if c['pass'] else 'FAIL'}")


# ---------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=None, help="default 200 (--quick: 30)")
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..n-1; default 5 (quick: 2)")
    p.add_argument("--hidden", type=int, default=None,
                   help="gcn and sage (gat: its recipe's); default 64 (--quick: 16)")
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma list from {', '.join(MODELS)}")
    p.add_argument("--datasets", default=",".join(DATASETS),
                   help=f"comma list from {', '.join(DATASETS)}")
    p.add_argument("--quick", action="store_true", help="small graphs and short runs (the test)")
    p.add_argument("--normalize-features", choices=("auto", "on", "off"), default="auto",
                   help="row-normalise features (PyG's NormalizeFeatures) on both sides; auto: "
                   "planted yes (as gcn.py on Planetoid), arxiv-like no (as OGB's example)")
    p.add_argument("--first-layer-decay", action="store_true",
                   help="weight decay on the first layer only, as PyG's examples/gcn.py")
    p.add_argument("--tolerance", type=float, default=1.0,
                   help="PASS if |mean difference| <= this many points")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: also train plexus with --precision bf16 and compare it with "
                   "plexus float32")
    p.add_argument("--bf16-tolerance", type=float, default=0.5,
                   help="with --precision bf16: PASS if |bf16 - fp32| <= this many points")
    p.add_argument("--grid", default="1x1x1",
                   help="plexus's grid, both precisions (more than one rank: launched under "
                        "mpiexec, the bf16 side's collectives in bf16; default %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of both sides; default $OMP_NUM_THREADS, else all cores")
    p.add_argument("--json", metavar="PATH", help="also write the rows (per seed too) as JSON")
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    for name, known in (("models", MODELS), ("datasets", DATASETS)):
        given = getattr(args, name)
        if not given or any(v not in known for v in given):
            p.error(f"--{name} {','.join(given)!r}: choose from {', '.join(known)}")
    defaults = (30, 2, 16) if args.quick else (200, 5, 64)
    for name, default in zip(("epochs", "seeds", "hidden"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if min(args.epochs, args.seeds, args.hidden) < 1:
        p.error("need --epochs, --seeds and --hidden >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    print("command: " + shlex.join(["python", "bench/accuracy.py", *argv]), flush=True)
    warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
    from common.dist import init_distributed
    from common.mpi import cores_available

    # one rank, threads set here (not split by init_distributed) and shared by both sides
    ctx = init_distributed(device="cpu", launcher="single", set_threads=False)
    omp = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(args.threads or (int(omp) if omp.isdigit() else cores_available()))
    sizes = QUICK if args.quick else FULL
    print(f"{args.epochs} epochs, {args.seeds} seeds, hidden {args.hidden}, dropout {DROPOUT}, "
          f"Adam lr {LR} weight decay {WEIGHT_DECAY}"
          f"{' (first layer only)' if args.first_layer_decay else ''}; gat: {GAT_HEADS} heads "
          f"of {GAT_HIDDEN}, dropout {GAT_DROPOUT} (inputs and coefficients), lr {GAT_LR}, "
          f"{torch.get_num_threads()} torch threads", flush=True)
    rows = []
    sides = {**SIDES, BF16_SIDE: run_plexus_bf16} if args.precision == "bf16" else SIDES
    with tempfile.TemporaryDirectory(prefix="accuracy_bench_") as tmp:
        datasets = make_datasets(args.datasets, sizes, Path(tmp), args.normalize_features)
    graphs = tempfile.TemporaryDirectory(prefix="accuracy_bench_graphs_")
    args.graph_dir = graphs.name  # the graphs the grid's ranks load (--grid)
    for name, ds in datasets.items():
        g = ds.graph
        print(f"{g.summary()}, edge homophily {g.edge_homophily():.2f}, "
              f"{'directed (both sides symmetrise it), ' if ds.symmetrize else ''}"
              f"normalize_features={ds.normalize_features}", flush=True)
        for kind in args.models:
            runs: dict[str, list[Run]] = {side: [] for side in sides}
            for seed in range(args.seeds):
                order = list(sides) if seed % 2 == 0 else list(sides)[::-1]  # share any drift
                for side in order:
                    runs[side].append(sides[side](ds, kind, args, seed))
                print(f"  {kind} seed {seed}: " + "  ".join(
                    f"{side} {100 * runs[side][-1].best_test:.2f} (epoch "
                    f"{runs[side][-1].best_epoch}), last {100 * runs[side][-1].last_test:.2f}"
                    for side in sides), flush=True)
            rows.append(row_of(name, kind, runs, args.tolerance))
            if BF16_SIDE in sides:
                rows[-1]["bf16"] = bf16_row(rows[-1], args.bf16_tolerance)
    print(f"\ntest accuracy (%) at the best validation epoch ('best') and at the last epoch, "
          f"mean+-std over {args.seeds} seeds; diff = plexus - PyG (best), PASS if |diff| <= "
          f"{args.tolerance}; ms: median per epoch after the first (train: forward, backward, "
          "update; eval: the forward in eval mode and accuracies after it)")
    print(HEADER)
    for r in rows:
        print(fmt_row(r))
    if args.precision == "bf16":
        print(f"\nplexus --precision bf16 against plexus float32: test accuracy (%) at the best "
              f"validation epoch, mean+-std over the same {args.seeds} seeds; diff = bf16 - "
              f"fp32 (best), PASS if |diff| <= {args.bf16_tolerance}")
        print(BF16_HEADER)
        for r in rows:
            print(fmt_bf16_row(r))
    if args.json:
        Path(args.json).write_text(json.dumps({"command": argv, "args": vars(args),
                                               "rows": rows}, indent=1))
    failed = [r for r in rows if not r["pass"]]
    for r in failed:
        print(f"FAIL: {r['dataset']} {r['model']}: plexus - PyG = {r['diff']:+.2f} points, "
              f"tolerance {args.tolerance}", file=sys.stderr)
    failed_bf16 = [r for r in rows if "bf16" in r and not r["bf16"]["pass"]]
    for r in failed_bf16:
        print(f"FAIL: {r['dataset']} {r['model']}: plexus bf16 - fp32 = {r['bf16']['diff']:+.2f} "
              f"points, tolerance {args.bf16_tolerance}", file=sys.stderr)
    graphs.cleanup()
    ctx.close()
    return 1 if failed or failed_bf16 else 0


if __name__ == "__main__":
    sys.exit(main())
