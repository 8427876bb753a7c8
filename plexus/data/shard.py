"""The seam between data and training: what one rank holds (:class:`GraphShard`) and what can
produce it (:class:`ShardSource`).

The trainer only talks to a ``ShardSource``; it never asks which kind it holds. Two kinds:

* :class:`plexus.data.memory.InMemorySource`: a whole :class:`~plexus.data.graph.Graph` that
  every rank holds and cuts its blocks from (small graphs, and the test oracle);
* :class:`plexus.data.mapped.PreparedGraph`: a dataset written by ``python -m plexus.prepare``
  from which every rank memory-maps only its blocks.

Both give the same shard, bit for bit, for the same permutation and padding
(tests/plexus/data/test_mapped.py).

The source's ``aggregation`` (plexus.data.partition.AGGREGATIONS) picks the matrices: ``gcn``
gives ``adj`` = blocks of ``Â`` and ``root = None``; ``mean`` (GraphSAGE) gives ``adj`` =
blocks of the mean adjacency and ``root`` = the same blocks of the permuted identity ``S``,
so a layer computes ``H = A_l F`` and ``R = S_l F`` (each all-reduced over O) and
``F_next = H W2 + R W1``: R's rows are the input features of the output rows (the root term),
at the cost of one more all-reduce of H's size and no full-size communication.

Shapes (N = padded nodes; roles (O, I, P) of layer l, see plexus.layout):
    adj[l % 6].a     [N/P, N/O]  CSR blocks, int32 indices where they fit
    adj[l % 6].a_t   [N/O, N/P]  the transpose, read from a's own blocks (plexus.transpose)
    root[l % 6]      mean aggregation only: S_l's block [N/P, N/O] (0/1, about N/(P O)
                     ones), compact (:class:`RootBlock`): owners int16 [N/P], cols [N/(P O)];
                     its CSR ``.a`` and transpose ``.a_t`` made where an SpMM reads them
    features_block   [N/X, D_0/Y]  rows chunk x of the Pc order, columns chunk y
    labels, masks    [N/P_last]  rows chunk p of the output order (labels -1 on padding;
                                 int16, or int32 for 2^15 classes or more)
    out_rows         [N/P_last]  original node id of each output row (-1 on padding; int32,
                                 or int64 for 2^31 nodes or more)
    labelled_adj.a   [R, N/O_last]  the last layer's adj rows of the R labelled output rows
    labelled_adj.a_t [N/O_last, R]  its transpose (labelled_root: the same of root)
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from plexus.data.partition import Balance, identity_csr
from plexus.data.schema import SPLITS
from plexus.sparse import BlockSparse
from plexus.transpose import TransposedSparse


def release_pages(arr: np.ndarray) -> None:
    """Drop this process's mapping of the pages of the memory-mapped ``arr`` (the file's pages
    stay in the page cache): a block read once (by the integrity check, or to gather some of
    its rows) and never by the step then adds nothing to the resident size, and one the step
    reads maps its pages again on first touch. A no-op for arrays not backed by a map."""
    m = getattr(arr, "_mmap", None)
    if isinstance(m, mmap.mmap) and hasattr(m, "madvise"):
        m.madvise(mmap.MADV_DONTNEED)


def node_dtypes(num_classes: int, num_nodes: int) -> tuple[torch.dtype, type]:
    """(labels' dtype, node ids' dtype) of a shard's per-row vectors: int16 labels below 2^15
    classes (-1 marks none), else int32; int32 node ids below 2^31 nodes, else int64."""
    label = torch.int16 if num_classes < 2**15 else torch.int32
    return label, (np.int32 if num_nodes < 2**31 else np.int64)


@dataclass
class AdjBlock:
    """One stationary sparse block, its transpose (a view that reads the block's own CSR,
    plexus.transpose), and the balance of its layout (nonzeros of this block and max/mean over
    all ranks' blocks of the same layout)."""

    a: BlockSparse
    a_t: TransposedSparse
    nnz: int
    balance: Balance

    def arrays(self):
        """Yield the index and value arrays of the block and of its transpose's copy."""
        for m in (self.a, self.a_t):
            yield from m.arrays()

    def take_rows(self, rows: np.ndarray) -> AdjBlock:
        """The rows ``rows`` (ascending) of the block, gathered once, with their transpose."""
        a = self.a.take_rows(rows)
        return AdjBlock(a, TransposedSparse(a), a.nnz, self.balance)


class RootBlock:
    """A block of the permuted identity ``S`` (GraphSAGE's root term, residual connections)
    kept compact: its rows' ``owners`` (int16 [rows], the coordinate along O of the rank that
    holds each row's input row, -1 for a padding node) and ``cols`` (int32 [nnz], the
    columns of the rows that this rank, coordinate ``me`` along O, owns, in row order).
    That is all plexus.root_rows reads; the CSR ``a`` (float32 ones) and its transpose
    ``a_t`` are made on first use, where an SpMM reads ``S`` (a layer that multiplies first,
    a recomputed layer 0, a residual), and moved where :meth:`to` last put the block.

    Shapes: owners [N/P], cols [about N/(P O)]; a [N/P, N/O], a_t [N/O, N/P]
    """

    def __init__(self, owners: np.ndarray, cols: np.ndarray, me: int, num_cols: int,
                 balance: Balance) -> None:
        if cols.size != int(np.count_nonzero(owners == me)):
            raise ValueError(f"a root block's rank owns {np.count_nonzero(owners == me)} rows "
                             f"but has {cols.size} columns: rebuild the shard "
                             "(plexus.data.memory.root_blocks)")
        self.owners, self.cols, self.me, self.balance = owners, cols, me, balance
        self.shape = (owners.size, num_cols)
        self._csr: tuple[BlockSparse, TransposedSparse] | None = None
        self._place: tuple = (None, {})  # (device, to()'s keywords) of the last :meth:`to`

    nnz = property(lambda self: int(self.cols.size), doc="the ones this block holds")
    made = property(lambda self: self._csr is not None, doc="whether the CSR has been made")

    def _made(self) -> tuple[BlockSparse, TransposedSparse]:
        if self._csr is None:
            a = BlockSparse.single(identity_csr(self.owners, self.cols, self.me, self.shape[1]))
            a_t = TransposedSparse(a)
            device, kw = self._place
            if device is not None:  # the transpose first: a copy is made from host blocks
                a_t.to(device, **kw)
                a.to(device, **kw)
            self._csr = a, a_t
        return self._csr

    a = property(lambda self: self._made()[0], doc="the CSR of ``S``'s block, made once")
    a_t = property(lambda self: self._made()[1], doc="its transpose (a view of ``a``)")

    def to(self, device: torch.device | str, *, kernel: str | None = None,
           uploaded: dict | None = None) -> RootBlock:
        """Where the SpMMs with this block run (:meth:`BlockSparse.to`): the CSR moves now if
        it is made, else when it is."""
        self._place = (device, {"kernel": kernel})
        if self._csr is not None:
            self._csr[1].to(device, kernel=kernel, uploaded=uploaded)
            self._csr[0].to(device, kernel=kernel, uploaded=uploaded)
        return self

    def arrays(self):
        """Yield ``cols`` and, once made, the CSR's arrays (``owners`` are per-row vectors:
        the planner's node vectors, not the adjacency)."""
        yield self.cols
        if self._csr is not None:
            for m in self._csr:
                yield from m.arrays()

    def take_rows(self, rows: np.ndarray) -> RootBlock:
        """The rows ``rows`` (ascending) of the block: their owners and this rank's columns."""
        place = np.cumsum(self.owners == self.me) - 1  # each owned row's place in cols
        owners = self.owners[rows]
        out = RootBlock(owners, self.cols[place[rows][owners == self.me]], self.me,
                        self.shape[1], self.balance)
        out._place = self._place
        return out


@dataclass
class GraphShard:
    """What one rank holds of the graph (module docstring for the shapes)."""

    num_nodes: int
    num_nodes_padded: int
    num_classes: int
    widths: list[int]  # true layer widths [D_0, hidden..., C]
    widths_padded: list[int]
    pr: np.ndarray
    pc: np.ndarray
    adj: dict[int, AdjBlock]  # plexus.layout.layout_of(layer) -> block
    features_block: torch.Tensor
    labels: torch.Tensor  # int16 (int32 for 2^15 classes or more; node_dtypes)
    masks: dict[str, torch.Tensor]  # split -> bool
    split_counts: dict[str, int]  # split -> labelled nodes in the whole graph
    out_rows: np.ndarray  # int32 (int64 for 2^31 nodes or more; node_dtypes)
    info: dict[str, float] = field(default_factory=dict)
    # layer % 6 -> S block of the permuted identity (mean aggregation); None for GCN
    root: dict[int, RootBlock] | None = None
    # the last layer's adj (and root) blocks restricted to the labelled output rows
    # (:meth:`restrict_last_layer`, called by plexus.model.PlexusGCN); None until then
    labelled_adj: AdjBlock | None = None
    labelled_root: RootBlock | None = None

    def __post_init__(self) -> None:
        # a rank keeps these for every output row: in the narrowest integers that hold them
        label, node = node_dtypes(self.num_classes, self.num_nodes_padded)
        self.labels = self.labels.to(label)
        self.out_rows = np.asarray(self.out_rows).astype(node, copy=False)

    def labelled_rows(self) -> torch.Tensor:
        """int64 [R]: positions in the output rows (``labels``, ``masks``) of the nodes in
        a split (train, val or test), ascending."""
        return torch.stack([self.masks[s] for s in SPLITS]).any(0).nonzero()[:, 0]

    def restrict_last_layer(self, *, root: bool = False) -> None:
        """Set :attr:`labelled_adj` (and, with ``root``, :attr:`labelled_root`): the last
        layer's block with only the rows of :meth:`labelled_rows`, gathered once, and its
        transpose (a view of it). Memory: those rows' nonzeros once and ``R + 1`` indptr
        entries. The full blocks stay (``forward(all_rows=True)``); a memory-mapped full
        ``adj`` block that no other layer reads gives its pages back once the rows are
        gathered (:func:`release_pages`): a training step never reads it, and an all-rows
        pass maps them again."""
        rows = self.labelled_rows().numpy()
        last = (len(self.widths) - 2) % 6

        if self.labelled_adj is None:
            self.labelled_adj = self.adj[last].take_rows(rows)
            if last == len(self.widths) - 2:  # no layer past the sixth reads this layout
                shared = {id(a) for k, b in self.adj.items() if k != last for a in b.a.arrays()}
                for arr in self.adj[last].a.arrays():  # gathering the rows touched its pages
                    if id(arr) not in shared:  # (layouts cut alike share their arrays)
                        release_pages(arr)
        if root and self.labelled_root is None:
            assert self.root is not None, "root blocks are needed to restrict them"
            self.labelled_root = self.root[last].take_rows(rows)

    def adjacency_bytes(self) -> int:
        """Bytes of the distinct index/value arrays of all blocks, root blocks and the
        labelled-row blocks included (mapped or in memory); a block that several layers share
        counts once."""
        seen: dict[object, int] = {}
        extra = [b for b in (self.labelled_adj, self.labelled_root) if b is not None]
        for b in [*self.adj.values(), *(self.root or {}).values(), *extra]:
            for arr in b.arrays():
                seen[getattr(arr, "filename", None) or id(arr)] = arr.nbytes
        return sum(seen.values())


@runtime_checkable
class ShardSource(Protocol):
    """A graph that can hand each rank its shard.

    Attributes:
        name: dataset name (logs, checkpoints).
        num_nodes, num_edges, num_features, num_classes: sizes of the graph.
        nnz: nonzeros of the aggregation matrix (the performance model's): ``Â`` with its
            self-loops for ``gcn``, ``A_mean`` for ``mean`` (whose root blocks add
            ``num_nodes`` more).
        aggregation: ``gcn`` or ``mean`` (plexus.data.partition.AGGREGATIONS; module
            docstring).
        permutation: the load-balancing permutation the shards use.
        split_counts: labelled nodes per split in the whole graph.
        storage: ``"in memory"`` or ``"memory-mapped"`` (logs, and whether a checkpoint's
            edge count compares: the two count duplicates and self-loops differently).
        settings: optional; the settings that made the graph from its files, which a
            checkpoint must match to be resumed on it (plexus.checkpoint): ``seed`` where it
            generated or randomly split the graph (None where it did not), ``symmetrize``.
            :func:`plexus.data.open_source` sets it; absent or {}: nothing to compare.
    """

    name: str
    num_nodes: int
    num_edges: int
    nnz: int
    aggregation: str
    num_features: int
    num_classes: int
    permutation: str
    split_counts: dict[str, int]
    storage: str

    def grid_problems(self, shape: Mapping[str, int]) -> list[str]:
        """Why the source cannot be split over a grid of this shape ([] if it can); each
        problem shows its arithmetic. Use with ``ProcessGrid.check`` and as a planner
        constraint."""
        ...

    def shard(self, shape: Mapping[str, int], coords: Mapping[str, int],
              widths: Sequence[int]) -> GraphShard:
        """This rank's shard for a grid of ``shape`` at ``coords`` and a model whose true
        layer widths are ``widths`` = [D_0, hidden..., C].

        Raises:
            DatasetCorruptError: the rank's files are damaged (may hit some ranks only).
        """
        ...
