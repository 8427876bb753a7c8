"""One node-classification graph, held whole on CPU and validated at construction.

Shapes legend (used in every docstring and comment of this module):
    N: number of nodes          E: number of directed edges (an undirected edge counts twice)
    F: feature width            C: number of classes
    edge_index: int64 [2, E]    row 0 = source s, row 1 = target t
    x:          float32 [N, F]  node features
    y:          int64 [N]       class in [0, C), or -1 for an unlabeled node
    *_idx:      int64 [n]       node ids of a split (train / val / test)

Direction convention: message passing aggregates along incoming edges, so node t receives from
s for every column (s, t) of edge_index. An undirected graph stores both (s, t) and (t, s).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from plexus.data.schema import SPLITS

_FINITE_CHECK_ROWS = 1 << 20  # rows of x checked at once, so the bool temp stays small


@dataclass(kw_only=True, eq=False, repr=False)
class Graph:
    """A node-classification graph with its train/val/test split.

    Attributes:
        edge_index: int64 [2, E]; node t aggregates from s for each column (s, t).
        x: float32 [N, F] node features, all finite.
        y: int64 [N] labels in [0, num_classes), -1 = unlabeled.
        num_classes: C, the width of the classifier output.
        train_idx, val_idx, test_idx: int64 [n] node ids; every split node is labeled and no
            node is in two splits (or twice in one).
        name: dataset name for logs.
    """

    edge_index: torch.Tensor
    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    train_idx: torch.Tensor
    val_idx: torch.Tensor
    test_idx: torch.Tensor
    name: str = "graph"

    def __post_init__(self) -> None:
        for field in ("edge_index", "x", "y", *(f"{s}_idx" for s in SPLITS)):
            value = getattr(self, field)
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"Graph.{field} must be a torch.Tensor, got {type(value).__name__}"
                                 "; use Graph.from_edge_index to convert arrays")
            if value.device.type != "cpu":
                raise ValueError(f"Graph.{field} is on {value.device}; Graph holds the whole "
                                 "graph on CPU, move shards to the device after partitioning")
        _check_x(self.x)
        n = self.x.shape[0]
        _check_edge_index(self.edge_index, n)
        if not isinstance(self.num_classes, int) or self.num_classes < 1:
            raise ValueError(f"num_classes must be a positive int, got {self.num_classes!r}")
        check_labels(self.y, n, self.num_classes)
        check_splits({s: self.split_idx(s) for s in SPLITS}, self.y, n)

    @property
    def num_nodes(self) -> int:
        """N, the number of nodes (rows of x)."""
        return int(self.x.shape[0])

    @property
    def num_edges(self) -> int:
        """E, the number of directed edges (columns of edge_index)."""
        return int(self.edge_index.shape[1])

    @property
    def num_features(self) -> int:
        """F, the feature width."""
        return int(self.x.shape[1])

    def split_idx(self, split: str) -> torch.Tensor:
        """int64 [n] node ids of ``split`` ("train", "val" or "test")."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        return getattr(self, f"{split}_idx")

    def mask(self, split: str) -> torch.Tensor:
        """bool [N], True on the nodes of ``split``."""
        m = torch.zeros(self.num_nodes, dtype=torch.bool)
        m[self.split_idx(split)] = True
        return m

    def in_degree(self) -> torch.Tensor:
        """int64 [N] number of incoming edges per node (without self-loops added)."""
        return torch.bincount(self.edge_index[1], minlength=self.num_nodes)

    def edge_homophily(self) -> float:
        """Fraction of edges between two labeled nodes whose labels agree (nan if none)."""
        ys, yt = self.y[self.edge_index[0]], self.y[self.edge_index[1]]
        both = (ys >= 0) & (yt >= 0)
        if not bool(both.any()):
            return float("nan")
        return float((ys[both] == yt[both]).double().mean())

    def is_undirected(self) -> bool:
        """True if every edge (s, t) is matched by (t, s) with the same multiplicity."""
        n = self.num_nodes
        s, t = self.edge_index
        return torch.equal(torch.sort(s * n + t).values, torch.sort(t * n + s).values)

    def to_undirected(self) -> Graph:
        """A copy with both directions of every edge, duplicates and self-loops removed."""
        ei = to_undirected_edges(self.edge_index, self.num_nodes)
        return dataclasses.replace(self, edge_index=ei)

    def summary(self) -> str:
        """One line for logs: sizes, split sizes and label coverage."""
        labeled = int((self.y >= 0).sum())
        return (f"{self.name}: N={self.num_nodes:,} E={self.num_edges:,} F={self.num_features} "
                f"C={self.num_classes} labeled={labeled:,} train/val/test="
                f"{self.train_idx.numel():,}/{self.val_idx.numel():,}/{self.test_idx.numel():,}")

    __repr__ = summary

    @classmethod
    def from_edge_index(
        cls,
        edge_index: Any,
        x: Any,
        y: Any,
        *,
        num_classes: int | None = None,
        train_idx: Any = None,
        val_idx: Any = None,
        test_idx: Any = None,
        split_fractions: Sequence[float] = (0.3, 0.2, 0.5),
        seed: int = 0,
        undirected: bool = False,
        name: str = "graph",
    ) -> Graph:
        """Build a Graph from arrays, converting dtypes and drawing a split if none is given.

        Args:
            edge_index: [2, E] integer array-like (numpy, tensor or nested lists).
            x: [N, F] float array-like.
            y: [N] or [N, 1] labels; -1 or NaN = unlabeled.
            num_classes: C; defaults to max(y) + 1.
            train_idx, val_idx, test_idx: give all three or none; with none, a random split of
                the labeled nodes in ``split_fractions`` proportions is drawn with ``seed``.
            split_fractions: (train, val, test) fractions of the labeled nodes.
            seed: seed of the random split.
            undirected: add the reverse of every edge and drop duplicates and self-loops.
            name: dataset name for logs.

        Returns:
            A validated Graph.
        """
        ei = torch.as_tensor(edge_index).to(torch.int64)
        xt = torch.as_tensor(x).to(torch.float32)
        yt = labels_to_int64(y)
        if num_classes is None:
            if not bool((yt >= 0).any()):
                raise ValueError("no labeled node (all labels are -1/NaN); pass num_classes")
            num_classes = int(yt.max()) + 1
        given = [i is not None for i in (train_idx, val_idx, test_idx)]
        if any(given) and not all(given):
            raise ValueError("give all of train_idx, val_idx and test_idx, or none of them "
                             "(then a random split is drawn)")
        if all(given):
            splits = [torch.as_tensor(i).to(torch.int64).reshape(-1)
                      for i in (train_idx, val_idx, test_idx)]
        else:
            splits = random_split(yt.numel(), split_fractions, seed=seed, labeled=yt >= 0)
        g = cls(edge_index=ei, x=xt, y=yt, num_classes=int(num_classes), train_idx=splits[0],
                val_idx=splits[1], test_idx=splits[2], name=name)
        return g.to_undirected() if undirected else g

    @classmethod
    def from_pyg(cls, data: Any, *, name: str = "pyg", **kwargs: Any) -> Graph:
        """Build a Graph from a torch_geometric ``Data`` with x, y and edge_index.

        The split comes from ``train_idx``/``val_idx``/``test_idx`` in kwargs, else from the
        data's boolean ``train_mask``/``val_mask``/``test_mask`` [N], else a random split (see
        :meth:`from_edge_index`, which receives the remaining kwargs). PyG stores edges as
        (source, target) with aggregation at the target, the same convention as Graph.
        """
        for attr in ("x", "y", "edge_index"):
            if getattr(data, attr, None) is None:
                raise ValueError(f"PyG data has no {attr}; Graph needs x, y and edge_index")
        if "train_idx" not in kwargs and getattr(data, "train_mask", None) is not None:
            for split, attr in zip(SPLITS, ("train_mask", "val_mask", "test_mask"), strict=True):
                m = getattr(data, attr, None)
                if m is None or m.dim() != 1:
                    raise ValueError(f"data.{attr} must be a bool [N] mask, got "
                                     f"{None if m is None else tuple(m.shape)}; pick one split "
                                     "column and pass train_idx/val_idx/test_idx instead")
                kwargs[f"{split}_idx"] = m.nonzero().view(-1)
        return cls.from_edge_index(data.edge_index, data.x, data.y, name=name, **kwargs)


def labels_to_int64(y: Any) -> torch.Tensor:
    """Labels as int64 [N]: accepts [N] or [N, 1], ints or floats; NaN and negatives -> -1."""
    yt = torch.as_tensor(y)
    if yt.dim() == 2 and yt.shape[1] == 1:
        yt = yt.reshape(-1)
    if yt.is_floating_point():
        yt = torch.where(torch.isnan(yt), torch.full_like(yt, -1.0), yt)
    yt = yt.to(torch.int64)
    return torch.where(yt < 0, torch.full_like(yt, -1), yt)


def to_undirected_edges(edge_index: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Both directions of every edge, sorted by (source, target), deduplicated, no self-loops.

    Shapes: edge_index int64 [2, E] -> int64 [2, E'] with E' <= 2E.
    """
    if edge_index.numel() and int(edge_index.max()) >= num_nodes:
        raise ValueError(f"edge_index holds node id {int(edge_index.max())} >= N={num_nodes}")
    s, t = edge_index
    keep = s != t
    s, t = s[keep], t[keep]
    keys = torch.unique(torch.cat([s * num_nodes + t, t * num_nodes + s]))  # sorted
    return torch.stack([keys // num_nodes, keys % num_nodes])


def random_split(
    num_nodes: int,
    fractions: Sequence[float] = (0.3, 0.2, 0.5),
    *,
    seed: int,
    labeled: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random disjoint (train, val, test) node ids, each sorted, int64 [n].

    Args:
        num_nodes: N.
        fractions: (train, val, test) fractions of the candidate nodes, summing to <= 1. If they
            sum to 1, test takes the remainder so that every candidate is used.
        seed: the split is a pure function of (num_nodes, fractions, seed, labeled).
        labeled: optional bool [N]; only these nodes are candidates.
    """
    if len(fractions) != 3 or min(fractions) < 0 or sum(fractions) > 1 + 1e-9:
        raise ValueError(f"split fractions must be 3 non-negative numbers summing to <= 1, "
                         f"got {tuple(fractions)}")
    cand = torch.arange(num_nodes) if labeled is None else labeled.nonzero().view(-1)
    gen = torch.Generator().manual_seed(seed)
    cand = cand[torch.randperm(cand.numel(), generator=gen)]
    n_train, n_val = (int(f * cand.numel()) for f in fractions[:2])
    n_test = (cand.numel() - n_train - n_val if abs(sum(fractions) - 1) < 1e-9
              else int(fractions[2] * cand.numel()))
    bounds = np.cumsum([0, n_train, n_val, n_test]).tolist()
    return tuple(torch.sort(cand[a:b]).values for a, b in itertools.pairwise(bounds))


def _check_x(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"x must be float32 [N, F], got {x.dtype} {tuple(x.shape)}; "
                         "convert with x.float() or x.reshape(N, -1)")
    for start in range(0, x.shape[0], _FINITE_CHECK_ROWS):
        block = x[start:start + _FINITE_CHECK_ROWS]
        if not bool(torch.isfinite(block).all()):
            bad = int(start + (~torch.isfinite(block)).any(1).nonzero()[0, 0])
            raise ValueError(f"features contain NaN or inf (first at node {bad}); clean or "
                             "impute them (e.g. torch.nan_to_num) before building the Graph")


def _check_edge_index(ei: torch.Tensor, n: int) -> None:
    if ei.dim() != 2 or ei.shape[0] != 2 or ei.dtype != torch.int64:
        raise ValueError(f"edge_index must be int64 [2, E] (row 0 source, row 1 target), got "
                         f"{ei.dtype} {tuple(ei.shape)}; transpose an [E, 2] array, use .long()")
    if ei.numel() and (int(ei.min()) < 0 or int(ei.max()) >= n):
        raise ValueError(f"edge_index holds node ids in [{int(ei.min())}, {int(ei.max())}] but "
                         f"x has N={n} rows: ids must lie in [0, {n}); check x matches the edges")


def check_labels(y: torch.Tensor, n: int, c: int) -> None:
    """Labels int64 [N] in [0, C) or -1 (unlabeled); the prepared path (plexus.data.sources)
    applies the same rule with the same words."""
    if y.dtype != torch.int64 or tuple(y.shape) != (n,):
        raise ValueError(f"y must be int64 [N={n}], got {y.dtype} {tuple(y.shape)}; use "
                         "labels_to_int64(y) for [N, 1] or float labels")
    if n and (int(y.min()) < -1 or int(y.max()) >= c):
        raise ValueError(f"labels outside [0, C={c}): found min {int(y.min())}, max "
                         f"{int(y.max())}; use -1 for unlabeled nodes or raise num_classes")


def check_splits(splits: dict[str, torch.Tensor], y: torch.Tensor, n: int) -> None:
    """Split ids int64 [n] in [0, N), of labeled nodes only (a node with y = -1 would count as
    class 0 in the loss), no node in two splits or twice in one; the prepared path
    (plexus.data.sources) applies the same rules with the same words."""
    for split in SPLITS:
        idx = splits[split]
        if idx.dim() != 1 or idx.dtype != torch.int64:
            raise ValueError(f"{split}_idx must be int64 [n], got {idx.dtype} {tuple(idx.shape)}")
        if idx.numel() == 0:
            continue
        if int(idx.min()) < 0 or int(idx.max()) >= n:
            raise ValueError(f"{split}_idx holds ids in [{int(idx.min())}, {int(idx.max())}], "
                             f"outside [0, N={n})")
        unlabeled = int((y[idx] < 0).sum())
        if unlabeled:
            raise ValueError(f"{unlabeled} of {idx.numel()} {split} nodes are unlabeled (y = -1); "
                             "a split may only hold labeled nodes")
    all_idx = torch.cat([splits[s] for s in SPLITS])
    if torch.unique(all_idx).numel() != all_idx.numel():
        raise ValueError("train/val/test indices overlap or repeat a node; splits must be "
                         "disjoint sets of nodes")
