"""A dataset written by ``python -m plexus.prepare``: each rank maps only the blocks it needs.

    from plexus.data.mapped import PreparedGraph
    g = PreparedGraph("data/rmat-24-k8")          # reads manifest.json only
    shard = g.shard(shape, coords, widths=[16, 16, 16, 32])

Layer ``l`` with roles (O, I, P) on rank (o, i, p) needs rows chunk ``p`` of P and columns
chunk ``o`` of O of its matrix (``A'`` for even layers, ``A''`` for odd ones): the file blocks
``R`` in ``[p k/P, (p+1) k/P)`` x ``C`` in ``[o k/O, (o+1) k/O)``, so every grid axis must
divide k. They are memory-mapped, not read: the kernel pages in what it touches, and the page
cache shares blocks between ranks of one node. For symmetric graphs only ``A'`` is stored:
``A''`` block (R, C) is the transpose of ``A'`` block (C, R), made in memory from it when the
shard is built (:meth:`CSRBlock.transpose`, a counting sort, O(nnz)), as is every transpose a
GPU's backward multiplies; on the CPU the backward reads each block as its own transpose
(plexus.transpose).

The rank reads (copies) only its features block (rows chunk x of Pc order, columns chunk y)
and the labels and split codes of its output rows. The file layout: plexus.data.schema.

Both aggregations (plexus.data.partition.AGGREGATIONS), one per object: ``gcn`` maps the
blocks of ``Â`` (``even/``, ``odd/``); ``mean`` (GraphSAGE) maps those of the mean adjacency
(``mean/even/``, ``mean/odd/``; for symmetric graphs ``A_mean''`` block (R, C) is the structure
of ``A_mean'`` block (C, R) transposed with values of its own, ``A_mean`` not being symmetric,
stored in the order of that block's nonzeros)
and builds the root blocks of the permuted identity ``S`` from the permutations (O(N),
plexus.data.memory.root_blocks), so ``--model sage``, ``--residual`` and ``--norm`` train on a
prepared dataset as on the in-memory graph, bit for bit. :meth:`PreparedGraph.with_aggregation`
gives the other aggregation of the same files. Every block is checked when it is mapped
(``CSRBlock.problem``).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plexus import layout
from plexus.data import partition as part
from plexus.data.errors import DatasetCorruptError
from plexus.data.memory import root_blocks
from plexus.data.schema import MEAN_DIR, SPLIT_CODES, SPLITS, read_manifest
from plexus.data.shard import AdjBlock, GraphShard, release_pages
from plexus.sparse import BlockSparse, CSRBlock
from plexus.transpose import TransposedSparse


class PreparedGraph:
    """A prepared dataset: sizes from its manifest, shards on demand.

    Args:
        path: the directory written by ``python -m plexus.prepare``.
        aggregation: ``gcn`` (the blocks of ``Â``) or ``mean`` (GraphSAGE: the blocks of the
            mean adjacency, and the root blocks; module docstring).
        manifest: the dataset's manifest when already read and checked (for
            :meth:`with_aggregation`); None: read from ``path``.
        settings: the settings that made the dataset, which a checkpoint must match
            (:attr:`plexus.data.shard.ShardSource.settings`); None: {}.

    Raises:
        FileNotFoundError: no manifest.json at ``path``.
        DatasetCorruptError: the manifest is unreadable, or of another format version
            (``StaleFormatError``, naming the command that prepares it again).
        ValueError: an unknown aggregation.
    """

    storage = "memory-mapped"

    def __init__(self, path: str | os.PathLike, *, aggregation: str = "gcn",
                 manifest: Mapping | None = None,
                 settings: Mapping[str, Any] | None = None) -> None:
        if aggregation not in part.AGGREGATIONS:
            raise ValueError(f"unknown aggregation {aggregation!r}; choose from "
                             f"{part.AGGREGATIONS}")
        self.aggregation = aggregation
        self.settings = dict(settings or {})
        self.path = Path(path)
        m = read_manifest(self.path) if manifest is None else manifest
        self.manifest = m
        self.name = m["name"]
        self.num_nodes = int(m["num_nodes"])
        self.num_nodes_padded = int(m["num_nodes_padded"])
        self.num_edges = int(m["num_edges"])
        # nonzeros of the aggregation's matrix (A_mean: without the root blocks' N)
        self.nnz = int(m["nnz"] if aggregation == "gcn" else m["mean"]["nnz"])
        self.num_features = int(m["num_features"])
        self.num_classes = int(m["num_classes"])
        self.blocks = int(m["blocks"])
        self.block_size = int(m["block_size"])
        self.symmetric = bool(m["symmetric"])
        self.permutation = m["permutation"]
        self.seed = int(m["seed"])
        self.split_counts = {s: int(m["split_counts"][s]) for s in SPLITS}
        # nonzeros of every block of A' ("even") and A'' ("odd") of the aggregation, [k, k]
        table = m["block_nnz"] if aggregation == "gcn" else m["mean"]["block_nnz"]
        even = np.asarray(table["even"], dtype=np.int64)
        self.block_nnz = {"even": even, "odd": even.T if self.symmetric
                          else np.asarray(table["odd"], dtype=np.int64)}
        self.files_read: set[str] = set()  # every file this object mapped, relative to path

    def __repr__(self) -> str:
        return (f"PreparedGraph({str(self.path)!r}: {self.num_nodes:,} nodes, "
                f"{self.num_edges:,} edges, k={self.blocks}, aggregation={self.aggregation})")

    def with_aggregation(self, aggregation: str) -> PreparedGraph:
        """The same dataset serving ``aggregation`` (this object if it does already): every
        prepared dataset holds the blocks of both, so a trainer can ask for the one its model
        needs (plexus.config.aggregation_of)."""
        if aggregation == self.aggregation:
            return self
        return PreparedGraph(self.path, aggregation=aggregation, manifest=self.manifest,
                             settings=self.settings)

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
        self.files_read.add(rel)
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

    def _files(self, mat: str, r: int, c: int, transposed: bool
               ) -> tuple[str, str, int, bool]:
        """Where block (r, c) of ``mat`` (``even``: ``A'``, ``odd``: ``A''`` of this
        aggregation), or its transpose with ``transposed``, comes from: (the folder of the
        indptr and indices files, the values file, nonzeros, whether those files hold the
        transpose of what is asked for). A symmetric graph stores ``A'`` only: ``A''`` block
        (r, c) is the transpose of ``A'`` block (c, r) (of its structure, with values of its
        own for the mean adjacency, stored in the order of ``A'``'s nonzeros)."""
        base = f"{MEAN_DIR}/" if self.aggregation == "mean" else ""
        nnz = int(self.block_nnz[mat][r, c])
        if mat == "odd" and self.symmetric:
            pre = f"{base}even/{c}_{r}/"
            values = (f"{base}odd/{r}_{c}/values.npy" if self.aggregation == "mean"
                      else pre + "values.npy")  # Â'' = Â'^T
            return pre, values, nnz, not transposed
        pre = f"{base}{mat}/{r}_{c}/"
        return pre, pre + "values.npy", nnz, transposed

    def _csr(self, mat: str, r: int, c: int, transposed: bool,
             mapped: MutableMapping[tuple, CSRBlock] | None = None) -> CSRBlock:
        """Block (r, c) of ``mat`` (its transpose with ``transposed``), mapped (or, where the
        files hold its transpose, made from them in memory) once per ``mapped`` dict: layers
        that read the same block share the block object (and so its device copy,
        ``BlockSparse.to``)."""
        pre, values_file, nnz, flip = self._files(mat, r, c, transposed)
        key = (pre, values_file, flip)
        if mapped is not None and key in mapped:
            return mapped[key]
        indptr = self._load(pre + "indptr.npy")
        indices = self._load(pre + "indices.npy")
        values = self._load(values_file)
        bs = self.block_size
        names = (f"{pre}{{indptr,indices,values}}.npy" if values_file == pre + "values.npy"
                 else f"{pre}{{indptr,indices}}.npy with {values_file}")
        if indptr.shape != (bs + 1,) or indices.shape != (nnz,) or values.shape != (nnz,):
            raise DatasetCorruptError(f"block {names} has inconsistent array sizes; prepare "
                                      "the dataset again")
        block = CSRBlock(indptr, indices, values, (bs, bs))
        # read once here (the SpMM reads it all anyway): a damaged file that kept its size
        # must stop with its name, not crash the kernel
        problem = block.problem()
        if problem is not None:
            raise DatasetCorruptError(
                f"{self.path}/{names}: {problem}; the prepared dataset is damaged: run python "
                f"-m plexus.prepare --verify {self.path}, then prepare it again")
        if flip:
            block = block.transpose()
        for arr in (indptr, indices, values):  # the reads stay in the page cache
            release_pages(arr)
        if mapped is not None:
            mapped[key] = block
        return block

    def _matrix(self, layer: int, rows: range, cols: range,
                mapped: MutableMapping[tuple, CSRBlock] | None = None
                ) -> tuple[BlockSparse, TransposedSparse]:
        """(A_l block, its transpose read from the same blocks) over file row blocks ``rows``
        and column blocks ``cols`` of layer ``l``'s matrix (blocks shared through ``mapped``,
        :meth:`_csr`)."""
        mat = "odd" if layer % 2 == 1 else "even"
        bs = self.block_size
        a = BlockSparse([[self._csr(mat, r, c, False, mapped) for c in cols] for r in rows],
                        [bs] * len(rows), [bs] * len(cols))
        def stored() -> BlockSparse:  # the transposes, where torch multiplies them
            return BlockSparse([[self._csr(mat, r, c, True, mapped) for r in rows]
                                for c in cols],
                               [bs] * len(cols), [bs] * len(rows))

        return a, TransposedSparse(a, stored)

    def _balance(self, layer: int, num_p: int, num_o: int) -> part.Balance:
        nnz = self.block_nnz["odd" if layer % 2 == 1 else "even"]
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
        # each block once, whichever layers read it (and the transposes a device multiplies,
        # made at upload): weak, so that the host blocks go once they are uploaded
        mapped: MutableMapping[tuple, CSRBlock] = weakref.WeakValueDictionary()
        for layer in range(min(layout.LAYOUTS, num_layers)):
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
        # GraphSAGE's root term: the permuted identity, from the permutations alone (O(N))
        root = root_blocks(pr, pc, n, shape, coords, num_layers) if (
            self.aggregation == "mean") else None
        if labels.size and ((labels < -1) | (labels >= self.num_classes)).any():
            raise DatasetCorruptError(f"labels in {self.path} fall outside [0, "
                                      f"{self.num_classes}); prepare the dataset again")
        masks = {s: torch.from_numpy(split == SPLIT_CODES[s]) for s in SPLITS}
        return GraphShard(
            num_nodes=n, num_nodes_padded=n_pad, num_classes=self.num_classes,
            widths=widths, widths_padded=widths_pad,
            pr=pr, pc=pc, adj=adj,
            features_block=feats, labels=torch.from_numpy(labels.astype(np.int64)),
            masks=masks, split_counts=dict(self.split_counts), out_rows=out_rows, root=root,
        )
