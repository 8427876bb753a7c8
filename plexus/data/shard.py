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
    adj[l % 6].a_t   [N/O, N/P]  CSR blocks of the transpose
    root[l % 6].a    [N/P, N/O]  mean aggregation only: S_l block (0/1, about N/(P O) ones)
    root[l % 6].a_t  [N/O, N/P]  its transpose (the root term's backward: dF += S_l^T dR)
    features_block   [N/X, D_0/Y]  rows chunk x of the Pc order, columns chunk y
    labels, masks    [N/P_last]  rows chunk p of the output order (labels -1 on padding)
    out_rows         [N/P_last]  original node id of each output row (-1 on padding)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from plexus.data.partition import Balance
from plexus.sparse import BlockSparse


@dataclass
class AdjBlock:
    """One stationary sparse block, its transpose, and the balance of its layout (nonzeros
    of this block and max/mean over all ranks' blocks of the same layout)."""

    a: BlockSparse
    a_t: BlockSparse
    nnz: int
    balance: Balance


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
    adj: dict[int, AdjBlock]  # layer % 6 -> block (layers of one parity share a matrix)
    features_block: torch.Tensor
    labels: torch.Tensor  # int64
    masks: dict[str, torch.Tensor]  # split -> bool
    split_counts: dict[str, int]  # split -> labelled nodes in the whole graph
    out_rows: np.ndarray
    info: dict[str, float] = field(default_factory=dict)
    # layer % 6 -> S block of the permuted identity (mean aggregation); None for GCN
    root: dict[int, AdjBlock] | None = None

    def adjacency_bytes(self) -> int:
        """Bytes of the distinct index/value arrays of all blocks, root blocks included
        (mapped or in memory); a block that several layers share counts once."""
        seen: dict[object, int] = {}
        for b in [*self.adj.values(), *(self.root or {}).values()]:
            for m in (b.a, b.a_t):
                for arr in m.arrays():
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
        storage: ``"in memory"`` or ``"memory-mapped"`` (logs only).
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
