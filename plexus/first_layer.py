"""Layer 0 with fixed input features: ``H_0`` cached, recomputed, or never made (``F'`` remade).

With fixed features ``H_0 = A_0 dropout(F_0)`` [N/P, D_0/I] takes no gradient, and keeping it
for ``dW_0 = H_0^T dQ_0`` costs the widest block a step holds. :class:`plexus.layer_plan.
LayerPlan` picks one of three ways out, once (docs/design/plexus-3d.md sections 7 and 12)::

    cached      no dropout: H_0 is the same every pass: computed with (1), (2) once and reused
                (LayerPlan.cache_first)
    recomputed  dropout: Q_0 = H_0 W_0 row block by row block, no block kept; backward
                aggregates them again from the pass's mask, kept as bits (recompute_first)
    remade      dropout, weight first: Q_0 = A_0 (F' W_0), F' = dropout(F_0) kept by neither
                pass; backward makes it again from the mask's bits (recompute_first and
                weight_first[0])

Otherwise (trainable features, or ``recompute_first=False``) layer 0 is an ordinary layer and
autograd keeps what its backward reads.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from common import collectives as coll
from common import dense
from common.comm_stats import CommStats
from common.perf.gcn_memory import RECOMPUTE_BLOCKS
from plexus import layout, ops
from plexus.bf16 import round_
from plexus.layer_dropout import HashedMask, LayerDropout
from plexus.layer_plan import LayerPlan


class FirstLayer:
    """Mixed into :class:`plexus.model.PlexusGCN`, whose layer maths it calls (``_input``,
    ``drop``, ``_spmm_o``) and whose attributes it reads: the model's weights, shard, groups
    on the wire, ``plan`` and ``keep_dtype``."""

    plan: LayerPlan
    shard: Any
    kind: str
    _exchanges: dict  # plexus.model.PlexusGCN.root_exchange's maps, by their root blocks
    training: bool
    num_layers: int
    wire: dict
    features: torch.Tensor
    weights: Any
    root_weights: Any
    block_shapes: list
    products: str  # the dense products' backend (plexus.model.PlexusGCN.products)
    keep_dtype: torch.dtype | None
    drop: LayerDropout
    _input: Any
    _spmm_o: Any

    # the cached (H_0, R_0), and whether it holds the labelled rows only (a one-layer model
    # caches the rows its pass computed)
    _h0: tuple[torch.Tensor, torch.Tensor | None] | None = None
    _h0_rows_only = False
    # the caller's promise that H_0 is never needed afresh (no .to(), no other rows): once it
    # is cached, layer 0's blocks are dropped where no other layer reads them (the trainer
    # sets it; a third of a 3-layer model's adjacency on grids that cut each layer's blocks
    # differently)
    release_first_blocks = False

    def _first_not_kept(self, step: int, stats: CommStats | None, gathered) -> torch.Tensor:
        """Q_0 [N/P, D_1/O], partial over I, of a layer 0 that keeps neither ``H_0`` nor
        ``F'`` (:attr:`LayerPlan.recompute_first`): remade where it multiplies first, else
        recomputed. ``gathered``: the handles of W_0's (and R_0's) all-gathers, or Nones."""
        if self.plan.weight_first[0]:
            return self._q0_remade(step, stats, gathered)
        return self._q0_recomputed(step, stats, gathered)

    def _q0_recomputed(self, step: int, stats: CommStats | None, gathered) -> torch.Tensor:
        """``H_0 W_0`` (+ ``R_0 W_r0``), multiplied row block by row block as
        :meth:`_h0_blocks` aggregates them, none kept: backward aggregates them again from
        this pass's dropout mask, kept as bits (no mask in evaluation)
        (:class:`plexus.ops.RecomputedMatmul`)."""
        bits = self._first_mask(step)
        return ops.RecomputedMatmul.apply(
            lambda: self._h0_blocks(bits, stats), self.shard.adj[0].a.shape[0],
            self.wire[layout.roles(0)[2]], self.block_shapes[0], stats, gathered,
            self.weights[0], self.root_weights[0] if self.kind == "sage" else None,
            self.products)

    def _q0_remade(self, step: int, stats: CommStats | None, gathered) -> torch.Tensor:
        """``A_0 (F' W_0)`` (GraphSAGE: ``+ S_0 (F' R_0)``), O and I of one rank: ``F' =
        dropout(F_0)`` is made for the products and made again for ``dW`` in backward from
        this pass's mask, kept as bits (:class:`plexus.ops.RemadeInputMatmul`); the SpMMs of
        both passes run ``D_1`` wide."""
        bits = self._first_mask(step)

        def make() -> torch.Tensor:  # F' [N/O, D_0/I]: F_0 gathered over P (1), dropped out
            with torch.no_grad():
                f = self._input(0, None, stats)
                return f if bits is None else self.drop(0, f, 0, kept=bits)

        sage = self.kind == "sage"
        g = ops.RemadeInputMatmul.apply(make, self.wire[layout.roles(0)[2]],
                                        self.block_shapes[0], stats, gathered, self.weights[0],
                                        self.root_weights[0] if sage else None,
                                        self.products)
        q = self._spmm_o(self.shard.adj, 0, g[0], stats)
        return q + self._spmm_o(self.shard.root, 0, g[1], stats) if sage else q

    def _first_mask(self, step: int) -> ops.BitMask | HashedMask | None:
        """Layer 0's dropout mask at ``step``, kept for backward (None: evaluation): as bits,
        or as its key where the Triton kernels hash it (:meth:`LayerDropout.kept`)."""
        if not self.training:
            return None
        return self.drop.kept(0, step, self.features.device)

    def _h0_blocks(self, bits: ops.BitMask | HashedMask | None, stats: CommStats | None):
        """Yield ``(term, lo, hi, rows lo..hi of H_0 (term 0) or R_0 (term 1))``: F_0
        gathered over P (1), ``dropout(F_0)`` with the mask ``bits`` (None: F_0 as it is),
        aggregated in row blocks (whole on a GPU, where a row block's matrix would be a
        copy), each all-reduced over O (2) and, in bf16, rounded as the model rounds H."""
        o_group = self.wire[layout.roles(0)[0]]
        with torch.no_grad():
            f = self._input(0, None, stats)                              # (1)
            if bits is not None:
                f = self.drop(0, f, 0, kept=bits)
            terms = [self.shard.adj] + ([self.shard.root] if self.kind == "sage" else [])
            for term, blocks in enumerate(terms):
                a = blocks[0].a
                if a.device.type == "cpu" and RECOMPUTE_BLOCKS > 1:
                    bounds, parts = a.row_blocks(RECOMPUTE_BLOCKS)
                else:
                    bounds, parts = [0, a.shape[0]], [a]
                for (lo, hi), part in zip(itertools.pairwise(bounds), parts):
                    x = part.matmul(f)
                    x = coll.all_reduce(x, o_group, stats=stats, inplace=True)  # (2)
                    if self.keep_dtype is not None:
                        round_(x, self.keep_dtype)
                    yield term, lo, hi, x
                    x = None

    def _h0_cached(self, rows_only: bool) -> tuple | None:
        """The cached ``(H_0, R_0)`` of a pass over these rows, or None."""
        return self._h0 if self._h0 is not None and self._h0_rows_only == rows_only else None

    def _keep_h0(self, h: torch.Tensor, r: torch.Tensor | None, rows_only: bool) -> tuple:
        """Cache ``(H_0, R_0)`` (detached, in the stored precision), and drop layer 0's
        blocks where :attr:`release_first_blocks`; returns the ``(H, R)`` this pass
        multiplies: in bf16 the cached copy (no gradient flows here: one copy), else its
        own."""
        self._h0 = (self._kept(h), None if r is None else self._kept(r))
        self._h0_rows_only = rows_only
        # (layer LAYOUTS reads layer 0's blocks again)
        if self.release_first_blocks and 1 < self.num_layers <= layout.LAYOUTS:
            self._release_first_blocks()
        return self._h0 if self.keep_dtype is not None else (h, r)

    def _check_not_released(self, blocks: dict, layer: int) -> None:
        """Raise where ``layer``'s block of ``blocks`` was released once H_0 was cached."""
        if layout.layout_of(layer) not in blocks:
            raise RuntimeError(
                f"layer {layer}'s adjacency block was released once H_0 was cached "
                "(PlexusGCN.release_first_blocks, set by the trainer): build the model again "
                "to compute H_0 afresh")

    def _release_first_blocks(self) -> None:
        """Drop layer 0's adjacency (and root) block from the shard where no other layer
        reads the same block (:attr:`release_first_blocks`)."""
        for blocks in (self.shard.adj, self.shard.root):
            first = (blocks or {}).get(0)
            if first is not None and all(b is not first for k, b in blocks.items() if k):
                del blocks[0]
                self._exchanges.pop(id(first), None)  # a root block's maps (plexus.root_rows)

    def _kept(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` detached, in :attr:`keep_dtype` (bf16) or as it is."""
        t = t.detach()
        return t if self.keep_dtype is None else dense.converted(t, self.keep_dtype)

    def cached_inputs(self) -> tuple:
        """The cache of ``(H_0, R_0)`` and the rows it is of: what a captured training step
        may read (plexus.cuda_graph holds it while the graph lives, whatever replaces it
        here), and what :meth:`restore_cached_inputs` puts back."""
        return self._h0, self._h0_rows_only

    def restore_cached_inputs(self, cached: tuple) -> None:
        """Put back a cache of :meth:`cached_inputs` (after a CUDA graph's capture that failed:
        what it left there was recorded, not computed, and layer 0's blocks may be gone)."""
        self._h0, self._h0_rows_only = cached

    def _apply(self, fn, recurse=True):  # .to(device) etc. must not keep a stale cache
        self._h0 = None
        return super()._apply(fn, recurse)  # type: ignore[misc]
