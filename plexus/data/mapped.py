"""A dataset written by ``python -m plexus.prepare``: each rank maps only the blocks it needs.

    from plexus.data.mapped import PreparedGraph
    g = PreparedGraph("data/rmat-24-k8")          # reads manifest.json only
    shard = g.shard(shape, coords, widths=[16, 16, 16, 32])

Layer ``l`` with roles (O, I, P) on rank (o, i, p) needs rows chunk ``p`` of P and columns
chunk ``o`` of O of its matrix (``A'`` for even layers, ``A''`` for odd ones): the file blocks
``R`` in ``[p k/P, (p+1) k/P)`` x ``C`` in ``[o k/O, (o+1) k/O)``, so every grid axis must
divide k. They are memory-mapped, not read: the kernel pages in what it touches, and the page
cache shares blocks between ranks of one node. For symmetric graphs ``A''`` block (R, C) is
the transpose of ``A'`` block (C, R), whose CSR the files hold already.

The rank reads (copies) only its features block (rows chunk x of Pc order, columns chunk y)
and the labels and split codes of its output rows. The file layout: plexus.data.schema.

Only ``gcn`` aggregation: the files hold ``Â``'s values ``m_ts / sqrt(d_t d_s)`` with
self-loop edges dropped at preparation and no degree file. The mean adjacency needs
``deg_t`` for every row and column node, i.e. the self-loop values spread over all ``k^2``
blocks, and the dropped self-loop messages cannot come back, so GraphSAGE (``mean``) needs an
in-memory graph for now.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from plexus import layout
from plexus.data import partition as part
from plexus.data.errors import DatasetCorruptError
from plexus.data.schema import SPLIT_CODES, SPLITS, read_manifest
from plexus.data.shard import AdjBlock, GraphShard
from plexus.sparse import BlockSparse, CSRBlock


class PreparedGraph:
    """A prepared dataset: sizes from its manifest, shards on demand.

    Args:
        path: the directory written by ``python -m plexus.prepare``.
        aggregation: must be ``gcn`` (module docstring).

    Raises:
        FileNotFoundError: no manifest.json at ``path``.
        DatasetCorruptError: the manifest is unreadable or of another format version.
        ValueError: an aggregation other than ``gcn``.
    """

    storage = "memory-mapped"

    def __init__(self, path: str | os.PathLike, *, aggregation: str = "gcn") -> None:
        if aggregation not in part.AGGREGATIONS:
            raise ValueError(f"unknown aggregation {aggregation!r}; choose from "
                             f"{part.AGGREGATIONS}")
        if aggregation != "gcn":
            raise ValueError(
                f"aggregation {aggregation!r} (GraphSAGE) needs an in-memory graph for now: "
                f"the prepared dataset {path} stores only the GCN's normalised adjacency "
                "(no degrees, self-loops dropped), from which the mean adjacency cannot be "
                "recovered; train GraphSAGE on the dataset by name (e.g. --dataset "
                "ogbn-products), not on a prepared directory")
        self.aggregation = aggregation
        self.path = Path(path)
        m = read_manifest(self.path)
        self.manifest = m
        self.name = m["name"]
        self.num_nodes = int(m["num_nodes"])
        self.num_nodes_padded = int(m["num_nodes_padded"])
        self.num_edges = int(m["num_edges"])
        self.nnz = int(m["nnz"])
        self.num_features = int(m["num_features"])
        self.num_classes = int(m["num_classes"])
        self.blocks = int(m["blocks"])
        self.block_size = int(m["block_size"])
        self.symmetric = bool(m["symmetric"])
        self.permutation = m["permutation"]
        self.seed = int(m["seed"])
        self.split_counts = {s: int(m["split_counts"][s]) for s in SPLITS}

    def __repr__(self) -> str:
        return (f"PreparedGraph({str(self.path)!r}: {self.num_nodes:,} nodes, "
                f"{self.num_edges:,} edges, k={self.blocks})")

    def grid_problems(self, shape: Mapping[str, int]) -> list[str]:
        """Every axis size must divide k (each axis is a row and a column split somewhere)."""
        k = self.blocks
        bad = [f"{a}={s}" for a, s in shape.items() if k % s]
        if not bad:
            return []
        ok = [d for d in range(1, k + 1) if k % d == 0]
        return [f"axes {', '.join(bad)} do not divide the {k}x{k} blocks of {self.path} "
                f"(axis sizes must be in {ok}); prepare again with --blocks K for a K that "
                "every axis divides"]

    # ------------------------------------------------------------------ loading
    def _load(self, rel: str, **kw) -> np.ndarray:
        p = self.path / rel
        try:
            arr = np.load(p, mmap_mode="r", **kw)
        except (OSError, ValueError) as e:
            raise DatasetCorruptError(
                f"cannot read {p} ({e}); the prepared dataset is incomplete or damaged: "
                f"check it with python -m plexus.prepare --verify {self.path}") from e
        want = self.manifest["files"].get(rel, {}).get("bytes")
        if want is not None and p.stat().st_size != want:
            raise DatasetCorruptError(
                f"{p} has {p.stat().st_size} bytes, the manifest says {want}; the prepared "
                f"dataset is damaged: run python -m plexus.prepare --verify {self.path}")
        return arr

    def _csr(self, mat: str, r: int, c: int, transposed: bool,
             mapped: dict[tuple, CSRBlock] | None = None) -> CSRBlock:
        """Block (r, c) of ``mat`` (its transpose's files with ``transposed``), mapped once per
        ``mapped`` dict: layers that read the same files share the block object (and so its
        device copy, ``BlockSparse.to``)."""
        if mapped is not None:
            if (mat, r, c, transposed) not in mapped:
                mapped[mat, r, c, transposed] = self._csr(mat, r, c, transposed)
            return mapped[mat, r, c, transposed]
        pre = f"{mat}/{r}_{c}/" + ("t_" if transposed else "")
        indptr = self._load(pre + "indptr.npy")
        indices = self._load(pre + "indices.npy")
        values = self._load(pre + "values.npy")
        bs = self.block_size
        nnz = self.manifest["block_nnz"][mat][r][c]
        if indptr.shape != (bs + 1,) or indices.shape != (nnz,) or values.shape != (nnz,):
            raise DatasetCorruptError(f"block {pre} has inconsistent array sizes; prepare the "
                                      "dataset again")
        block = CSRBlock(indptr, indices, values, (bs, bs))
        # read once here (the SpMM reads it all anyway): a damaged file that kept its size
        # must stop with its name, not crash the kernel
        problem = block.problem()
        if problem is not None:
            raise DatasetCorruptError(
                f"{self.path}/{pre}{{indptr,indices,values}}.npy: {problem}; the prepared "
                f"dataset is damaged: run python -m plexus.prepare --verify {self.path}, then "
                "prepare it again")
        return block

    def _matrix(self, layer: int, rows: range, cols: range,
                mapped: dict[tuple, CSRBlock] | None = None
                ) -> tuple[BlockSparse, BlockSparse]:
        """(A_l block, its transpose) over file row blocks ``rows`` and column blocks
        ``cols`` of layer ``l``'s matrix (blocks shared through ``mapped``, :meth:`_csr`)."""
        odd = layer % 2 == 1
        if odd and self.symmetric:  # A'' (R, C) = A' (C, R)^T
            def get(r, c, t):
                return self._csr("even", c, r, not t, mapped)
        else:
            mat = "odd" if odd else "even"

            def get(r, c, t):
                return self._csr(mat, r, c, t, mapped)
        bs = self.block_size
        a = BlockSparse([[get(r, c, False) for c in cols] for r in rows],
                        [bs] * len(rows), [bs] * len(cols))
        a_t = BlockSparse([[get(r, c, True) for r in rows] for c in cols],
                          [bs] * len(cols), [bs] * len(rows))
        return a, a_t

    def _balance(self, layer: int, num_p: int, num_o: int) -> part.Balance:
        mat = "even" if layer % 2 == 0 or self.symmetric else "odd"
        nnz = np.asarray(self.manifest["block_nnz"][mat], dtype=np.int64)
        if layer % 2 == 1 and self.symmetric:
            nnz = nnz.T
        k = self.blocks
        per_rank = nnz.reshape(num_p, k // num_p, num_o, k // num_o).sum(axis=(1, 3))
        return part.Balance(int(per_rank.max()), float(per_rank.mean()))

    def shard(self, shape: Mapping[str, int], coords: Mapping[str, int],
              widths: Sequence[int]) -> GraphShard:
        """This rank's :class:`~plexus.data.shard.GraphShard`, mapped from the block files.

        The caller has checked :meth:`grid_problems` (``ProcessGrid.check``).
        """
        widths = list(widths)
        num_layers = len(widths) - 1
        if num_layers < 1:
            raise ValueError(f"need at least one layer, got widths {widths}")
        assert not self.grid_problems(shape), self.grid_problems(shape)
        k, bs, n, n_pad = self.blocks, self.block_size, self.num_nodes, self.num_nodes_padded
        widths_pad = layout.padded_widths(widths, shape)

        def chunk(axis: str) -> range:
            per = k // shape[axis]
            return range(coords[axis] * per, (coords[axis] + 1) * per)

        adj = {}
        mapped: dict[tuple, CSRBlock] = {}  # each block file once, whichever layers read it
        for layer in range(min(6, num_layers)):
            o_ax, _, p_ax = layout.roles(layer)
            a, a_t = self._matrix(layer, chunk(p_ax), chunk(o_ax), mapped)
            adj[layer] = AdjBlock(a, a_t, a.nnz, self._balance(layer, shape[p_ax], shape[o_ax]))

        # features: rows chunk x (Pc order), columns chunk y of the padded width
        o0, i0, _ = layout.roles(0)
        width = widths_pad[0] // shape[i0]
        lo = coords[i0] * width
        hi = min(lo + width, self.num_features)
        feats = torch.zeros(len(chunk(o0)) * bs, width)
        for n_, c in enumerate(chunk(o0)):
            x = self._load(f"features/{c}.npy")
            if x.shape != (bs, self.num_features):
                raise DatasetCorruptError(f"features/{c}.npy has shape {x.shape}; expected "
                                          f"{(bs, self.num_features)}")
            if hi > lo:
                feats[n_ * bs:(n_ + 1) * bs, : hi - lo] = torch.from_numpy(np.array(x[:, lo:hi]))

        # labels, split masks and node ids of the output rows (rows chunk p of the last layer)
        _, _, p_last = layout.roles(num_layers - 1)
        pr, pc = self._load("perm/pr.npy"), self._load("perm/pc.npy")
        name = "pr" if num_layers % 2 == 1 else "pc"  # part.output_order
        order = pr if name == "pr" else pc
        rows = chunk(p_last)
        labels = np.concatenate([self._load(f"labels/{name}_{c}.npy") for c in rows])
        split = np.concatenate([self._load(f"split/{name}_{c}.npy") for c in rows])
        out_rows = np.array(order[rows.start * bs:rows.stop * bs], dtype=np.int64)
        out_rows[out_rows >= n] = -1
        if labels.size and ((labels < -1) | (labels >= self.num_classes)).any():
            raise DatasetCorruptError(f"labels in {self.path} fall outside [0, "
                                      f"{self.num_classes}); prepare the dataset again")
        masks = {s: torch.from_numpy(split == SPLIT_CODES[s]) for s in SPLITS}
        return GraphShard(
            num_nodes=n, num_nodes_padded=n_pad, num_classes=self.num_classes,
            widths=widths, widths_padded=widths_pad,
            pr=pr, pc=pc, adj=adj,
            features_block=feats, labels=torch.from_numpy(labels.astype(np.int64)),
            masks=masks, split_counts=dict(self.split_counts), out_rows=out_rows,
        )
