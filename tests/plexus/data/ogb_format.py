"""Test helper: write tiny datasets in the exact on-disk format of ogb 1.3.6.

The unmodified ``ogb.nodeproppred.NodePropPredDataset`` reads what these writers produce, so
tests exercise the real loading path offline. Layout, per ogb/nodeproppred/master.csv and
ogb/io/read_graph_raw.py (dataset dir = root/<name with '-' -> '_'>):

    ogbn_arxiv/      raw/{edge, node-feat, node-label, num-node-list, num-edge-list,
                          node_year}.csv.gz         split/time/{train,valid,test}.csv.gz
    ogbn_products/   raw/ as arxiv without node_year; each undirected edge stored once
                     (add_inverse_edge: the loader appends the reverse)
                                                     split/sales_ranking/{...}.csv.gz
    ogbn_papers100M/ raw/data.npz (edge_index int64 [2, E], num_nodes_list, num_edges_list,
                     node_feat float32 [N, F], node_year int64 [N, 1]),
                     raw/node-label.npz (node_label float [N, 1], NaN = unlabeled)
                                                     split/time/{...}.csv.gz
    RELEASE_v1.txt   in each (optional here, to test that the loader side writes it)

CSV files have no header; floats are written with a decimal point (pandas would read "1" as
an int column). The graphs come from plexus's planted partition with a strong feature signal,
so labels are learnable from features and structure. Each writer returns the arrays the
loader should produce, for comparison.

Shapes: N nodes, F features, E directed edges as loaded, M stored (undirected) edges.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from plexus.data.generators import planted_partition


@dataclass(frozen=True)
class Written:
    """What a writer put on disk, as the loader should return it.

    Attributes:
        directory: the dataset directory (root/ogbn_...).
        edge_index: int64 [2, E] in the loader's order (products: each edge then its reverse).
        x: float32 [N, F] as written (rounded to 6 decimals in CSV).
        y: int64 [N], -1 = unlabeled.
        train_idx, valid_idx, test_idx: int64 [n] official split.
    """

    directory: Path
    edge_index: np.ndarray
    x: np.ndarray
    y: np.ndarray
    train_idx: np.ndarray
    valid_idx: np.ndarray
    test_idx: np.ndarray


def write_arxiv_like(root: str | Path, num_nodes: int = 300, *, num_classes: int = 4,
                     num_features: int = 16, avg_degree: float = 8.0, seed: int = 0,
                     release_file: bool = True) -> Written:
    """ogbn-arxiv layout: directed edges, CSV, time split by node_year (<=2017/2018/>=2019)."""
    rng = np.random.default_rng(seed)
    undirected, x, y = _planted(num_nodes, num_classes, num_features, avg_degree, seed)
    flip = rng.random(undirected.shape[1]) < 0.5  # a random citing direction per pair
    edges = np.where(flip, undirected[::-1], undirected)
    year = rng.integers(2010, 2021, num_nodes)
    d = _dataset_dir(root, "ogbn-arxiv", release_file)
    _write_csv_raw(d / "raw", edges, x, y, year)
    splits = _time_split(year, np.ones(num_nodes, dtype=bool))
    _write_splits(d / "split" / "time", splits)
    return Written(d, edges, x, y, *splits)


def write_products_like(root: str | Path, num_nodes: int = 300, *, num_classes: int = 4,
                        num_features: int = 16, avg_degree: float = 8.0, seed: int = 0,
                        release_file: bool = True) -> Written:
    """ogbn-products layout: undirected, each edge stored once, CSV, random sales_ranking split."""
    rng = np.random.default_rng(seed)
    undirected, x, y = _planted(num_nodes, num_classes, num_features, avg_degree, seed)
    d = _dataset_dir(root, "ogbn-products", release_file)
    _write_csv_raw(d / "raw", undirected, x, y, year=None)
    perm = rng.permutation(num_nodes)
    a, b = int(0.1 * num_nodes), int(0.15 * num_nodes)  # products: ~8% train, 2% valid
    splits = (np.sort(perm[:a]), np.sort(perm[a:b]), np.sort(perm[b:]))
    _write_splits(d / "split" / "sales_ranking", splits)
    loaded = np.repeat(undirected, 2, axis=1)  # the loader interleaves each edge and reverse
    loaded[:, 1::2] = undirected[::-1]
    return Written(d, loaded, x, y, *splits)


def write_papers100m_like(root: str | Path, num_nodes: int = 400, *, num_classes: int = 4,
                          num_features: int = 16, avg_degree: float = 8.0,
                          labeled_fraction: float = 0.5, seed: int = 0,
                          release_file: bool = True) -> Written:
    """ogbn-papers100M layout: binary npz, directed, NaN labels for unlabeled nodes."""
    rng = np.random.default_rng(seed)
    undirected, x, y = _planted(num_nodes, num_classes, num_features, avg_degree, seed)
    edges = np.where(rng.random(undirected.shape[1]) < 0.5, undirected[::-1], undirected)
    labeled = rng.random(num_nodes) < labeled_fraction
    year = rng.integers(2010, 2021, num_nodes)
    d = _dataset_dir(root, "ogbn-papers100M", release_file)
    raw = d / "raw"
    raw.mkdir(parents=True)
    np.savez_compressed(
        raw / "data.npz", edge_index=edges.astype(np.int64),
        num_nodes_list=np.array([num_nodes], dtype=np.int64),
        num_edges_list=np.array([edges.shape[1]], dtype=np.int64),
        node_feat=x, node_year=year.astype(np.int64).reshape(-1, 1))
    node_label = np.where(labeled, y, np.nan).astype(np.float64).reshape(-1, 1)
    np.savez_compressed(raw / "node-label.npz", node_label=node_label)
    splits = _time_split(year, labeled)
    _write_splits(d / "split" / "time", splits)
    return Written(d, edges, x, np.where(labeled, y, -1), *splits)


def _planted(num_nodes: int, num_classes: int, num_features: int, avg_degree: float,
             seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(edges int64 [2, M] each undirected pair once with s < t, x float32 [N, F], y [N])."""
    g = planted_partition(num_nodes=num_nodes, num_classes=num_classes, avg_degree=avg_degree,
                          p_in=0.8, num_features=num_features, signal=0.6, seed=seed)
    s, t = g.edge_index.numpy()
    x = np.round(g.x.numpy(), 6).astype(np.float32)
    return np.stack([s[s < t], t[s < t]]), x, g.y.numpy()


def _dataset_dir(root: str | Path, name: str, release_file: bool) -> Path:
    d = Path(root) / name.replace("-", "_")
    d.mkdir(parents=True)
    if release_file:
        (d / "RELEASE_v1.txt").write_text("written by tests/plexus/ogb_format.py\n")
    return d


def _write_csv_raw(raw: Path, edges: np.ndarray, x: np.ndarray, y: np.ndarray,
                   year: np.ndarray | None) -> None:
    raw.mkdir(parents=True)
    _savetxt(raw / "edge.csv.gz", edges.T, "%d")
    _savetxt(raw / "node-feat.csv.gz", x, "%.6f")  # decimal point: pandas reads floats
    _savetxt(raw / "node-label.csv.gz", y.reshape(-1, 1), "%d")
    _savetxt(raw / "num-node-list.csv.gz", np.array([[x.shape[0]]]), "%d")
    _savetxt(raw / "num-edge-list.csv.gz", np.array([[edges.shape[1]]]), "%d")
    if year is not None:
        _savetxt(raw / "node_year.csv.gz", year.reshape(-1, 1), "%d")


def _time_split(year: np.ndarray, labeled: np.ndarray) -> tuple[np.ndarray, ...]:
    """OGB's time split: train up to 2017, valid 2018, test from 2019; labeled nodes only."""
    return tuple(np.flatnonzero(labeled & m)
                 for m in (year <= 2017, year == 2018, year >= 2019))


def _write_splits(split_dir: Path, splits: tuple[np.ndarray, ...]) -> None:
    split_dir.mkdir(parents=True)
    for name, idx in zip(("train", "valid", "test"), splits, strict=True):
        _savetxt(split_dir / f"{name}.csv.gz", idx.reshape(-1, 1), "%d")


def _savetxt(path: Path, rows: np.ndarray, fmt: str) -> None:
    with gzip.open(path, "wt") as f:
        np.savetxt(f, rows, fmt=fmt, delimiter=",")
