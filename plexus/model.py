"""The Plexus 3D-parallel GCN (docs/design/plexus-3d.md sections 1-4).

Layer ``l`` with roles (O, I, P) on rank (o, i, p)::

    F_l   [N/O, D_l/I]     layer 0: all-gather of the flat feature shard over P       (1)
    H_l = A_l F_l          [N/P, D_l/I], partial over O -> all-reduce over O            (2)
    W_l   [D_l/I, D_l+1/O] all-gather of the flat weight shard over P                  (3)
    Q_l = H_l W_l          [N/P, D_l+1/O], partial over I -> all-reduce over I          (4)
    F_l+1 = relu(Q_l)      (no activation after the last layer)

The last layer can compute only the R output rows of labelled nodes (``labelled_rows_only``):
its H and Q are [R, D_l/I] and [R, C/O], from the rows of A_l (and S_l) gathered once.

Backward: re-gather W over P (5), reduce-scatter dW over P (6), all-reduce dH over O (7),
dF = A_l^T dH: reduce-scatter over P at layer 0 (only with trainable features), all-reduce
over P for layers >= 1 (8); plexus.ops has the operators with both passes written out. The
adjacency never moves. ``precision="bf16"`` stores F_0 and keeps H (and the norm's inputs) in
bf16 and sends every message of (1)-(8) as bf16, all sums float32 (docs/design/plexus-3d.md
section 11). Parallel equals serial: every rank slices the full weights of the serial model
(plexus.reference) as plexus.shards declares, so every grid trains that model.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from common import autograd, dense, flat
from common import collectives as coll
from common.comm_stats import CommStats
from common.grid import AxisGroup
from common.perf.gcn_memory import RECOMPUTE_BLOCKS
from common.perf.gcn_workload import (
    AGGREGATION_BLOCKS,
    labelled_rows_pay,
    overlap_pays,
    weight_first_pays,
)
from plexus import layout, ops, shards
from plexus.config import MODELS, NORMS, PRECISIONS
from plexus.data import partition
from plexus.data.memory import root_blocks
from plexus.data.shard import GraphShard
from plexus.dropout import apply_dropout, dropped, keep_mask
from plexus.norms import make_norm, normalized_features
from plexus.reference import ROOT_SEED_OFFSET, init_weights
from plexus.sharded_state import ShardedState
from plexus.shards import node_chunk

__all__ = ["ROOT_SEED_OFFSET", "PlexusGCN", "init_weights"]


class PlexusGCN(ShardedState, nn.Module):
    """An L-layer GCN or GraphSAGE whose every tensor is sharded over a 3D grid (x, y, z).

    Layer ``l`` (roles O, I, P)::

        F'  = dropout(F_l)                       grid-independent mask (plexus.dropout)
        GCN:  Q = (Â F') W_l                     collectives 1-4
        SAGE: Q = (A_mean F') W_l + (S F') R_l   A_mean: mean over in-neighbours
        Q  += b_l                                b_l [D_l+1/O], replicated over I and P
        F_l+1 = relu(norm(Q))                    hidden layers; the last layer returns Q

    GraphSAGE's root term ``x_i R_l`` needs the input rows of the output nodes, which live on
    other ranks (F_l rows are split over O, Q rows over P). ``S`` is this rank's block of the
    permuted identity (plexus.data.partition.permuted_identity), stationary like the
    adjacency: ``S F'`` is an SpMM with about N/(P*O) nonzeros, all-reduced over O together
    with ``A_mean F'``. So the root term adds one all-reduce of H's size over O (and the
    gather of ``R_l``), never a full-size transfer.

    Where each tensor lives is declared in :mod:`plexus.shards` (``self.maps``); the
    full <-> local methods (:class:`plexus.sharded_state.ShardedState`) apply those maps.

    Args:
        shard: this rank's :class:`~plexus.data.shard.GraphShard` (``shard.root`` set for
            ``model="sage"``).
        groups: the rank's axis groups ``{"x", "y", "z"}`` from ``ctx.create_groups(grid)``.
        model: ``gcn`` or ``sage``.
        learn_features: make the input features a trainable parameter (initialised from the
            dataset's features), as in the paper.
        seed: weight and dropout seed.
        dropout: dropout rate on the input of every layer (training mode only).
        bias: add a bias (initialised to zero) in every layer. The defaults are the paper's
            bare model; :class:`plexus.config.ModelConfig` holds the recipe's defaults.
        norm: ``none``, ``batch`` or ``layer`` normalisation after every hidden layer.
        normalize_features: row-normalise the input features as PyG's ``NormalizeFeatures``
            (subtract the global minimum, divide each row by its sum clamped to >= 1).
        residual: ``F_l+1 = relu(norm(Q_l)) + F_l`` in the hidden layers whose input and output
            widths agree (layers 1 .. L-2). ``F_l``'s rows reach the output rows through the
            same ``S`` block as GraphSAGE's root term (built from the permutations if the
            shard has none); its columns, split over I, are placed at their place in the
            output's O split and summed over I: one all-reduce of Q's size, nothing full-size.
        labelled_rows_only: the last layer computes only the output rows of nodes in a split
            (train, val or test; :attr:`labelled_rows`), which are all that the loss and the
            accuracies read: its SpMM runs over those rows of ``A`` (and ``S``), gathered once
            (:meth:`GraphShard.restrict_last_layer`), and its H, Q, logits and collectives (2),
            (4), (7) shrink to them. None (default): when at most half the nodes are labelled
            (:func:`common.perf.gcn_workload.labelled_rows_pay`; on a fully labelled graph the
            gathered rows would copy the whole block for nothing). ``forward(all_rows=True)``
            computes every row (:func:`plexus.trainer.predictions`).
        overlap: aggregate in ``aggregation_blocks`` row blocks whose all-reduces over O
            (2, 7) travel while the next block computes (:class:`plexus.ops.BlockedAggregation`)
            and start each weight's all-gather over P (3) before the aggregation, waiting for
            it after. None (default): where some axis has more than one rank
            (:func:`common.perf.gcn_workload.overlap_pays`).
        aggregation_blocks: row blocks (None:
            :data:`common.perf.gcn_workload.AGGREGATION_BLOCKS` with overlap, else 1). Blocks
            > 1 without overlap run the same collectives synchronously: the same bits as
            with overlap.
        precision: ``fp32``, or ``bf16``: the input feature shard, its all-gather (1), the
            cached ``H_0``, the ``H_l`` (and ``R_l``) kept for ``dW`` and the norm's saved
            inputs are bf16 (``H`` is rounded to bf16 before ``H W``, so the product reads what
            is kept); every message of (1)-(8) travels as bf16 (:attr:`wire`); the SpMMs,
            ``H W`` and every sum add in float32, and the weights, gradients and optimizer
            state are float32 (docs/design/plexus-3d.md section 11).
            Not with ``learn_features`` (ValueError): their gradient would be reduce-scattered
            (8) as bf16.
        recompute_first: with fixed input features and dropout (``H_0`` differs every pass, so
            it is not cached), layer 0 does not keep ``H_0`` (``R_0``) ``[N/P, D_0/I]`` for
            ``dW_0``: backward aggregates ``dropout(F_0)`` again with the same mask, in
            :data:`common.perf.gcn_memory.RECOMPUTE_BLOCKS` row blocks on the CPU
            (:class:`plexus.ops.RecomputedMatmul`): one more layer-0 SpMM and collectives (1)
            and (2) again, for the largest block a step keeps. ``dW_0`` is then summed over the
            row blocks: equal to float rounding. False keeps ``H_0``.
        weight_first: multiply by the weight before aggregating, ``Q = A (F' W)``, in the
            layers where :func:`common.perf.gcn_workload.weight_first_pays` (:attr:`weight_first`):
            the SpMMs of both passes run ``D_l+1`` wide instead of ``D_l``, as PyG's
            ``GCNConv`` does where a layer narrows. Only where the layer's O and I have one
            rank (then ``F'`` holds whole rows and columns); not in a last layer on labelled
            rows only, nor in layer 0 with fixed features but where True asks for it and
            ``H_0`` would be recomputed (:meth:`_first_remade`: ``dropout(F_0)`` remade in
            backward). None (default): where the layer also has one rank on P and narrows;
            True: every layer where O and I are 1; False: never. ``dW = F'^T (A^T dQ)`` keeps
            ``F'`` (in the stored precision) instead of ``H``. The sums run in another order:
            equal to float rounding.
        gemm: the backend of the dense products ``H W`` and ``dQ W^T`` (:func:`common.dense.mm`):
            ``auto`` (oneDNN for float32 CPU products, where torch's MKL leaves AVX-512
            unused on AMD CPUs), ``onednn`` or ``torch``. Equal to float rounding.

    Each logit row is the same sum in the same order either way, so the logits, the loss and
    the accuracies agree bit for bit where the all-reduces over O and I add two operands
    (groups of 1 or 2); the last layer's ``dW = H^T dQ`` runs over fewer rows (the others are
    zero), so it agrees to float rounding (tests/plexus/test_model.py). That holds for one
    layer order: a last layer that would multiply first over every row aggregates first over
    the labelled ones (``weight_first=False`` compares the two bit for bit).

    Shapes:
        forward() -> logits [R, C_pad/O] of the last layer's roles (R: :attr:`labelled_rows`,
        or all N/P rows), rows in output order, replicated over I.
    """

    def __init__(
        self,
        shard: GraphShard,
        groups: dict[str, AxisGroup],
        *,
        model: str = "gcn",
        learn_features: bool = False,
        seed: int = 0,
        dropout: float = 0.0,
        bias: bool = False,
        norm: str = "none",
        normalize_features: bool = False,
        residual: bool = False,
        labelled_rows_only: bool | None = None,
        overlap: bool | None = None,
        aggregation_blocks: int | None = None,
        precision: str = "fp32",
        recompute_first: bool = True,
        weight_first: bool | None = None,
        gemm: str = "auto",
    ) -> None:
        super().__init__()
        if model not in MODELS or norm not in NORMS or not 0 <= dropout < 1:
            raise ValueError(f"need model in {MODELS}, norm in {NORMS} and 0 <= dropout < 1; "
                             f"got {model!r}, {norm!r}, {dropout}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if precision == "bf16" and learn_features:
            raise ValueError("precision 'bf16' keeps the input features in bf16 and cannot "
                             "train them: use precision 'fp32' with learn_features")
        self.precision = precision
        self.gemm = dense.check_backend(gemm)  # the dense products' backend (common.dense)
        # the dtype F_0 and the kept activations are stored in (None: float32, as computed)
        self.keep_dtype = torch.bfloat16 if precision == "bf16" else None
        if model == "sage" and shard.root is None:
            raise ValueError("model 'sage' needs a shard built with aggregation 'mean'")
        sizes = {ax: g.size for ax, g in groups.items()}
        if residual and shard.root is None:
            shard.root = root_blocks(shard.pr, shard.pc, shard.num_nodes, sizes,
                                     {ax: g.rank for ax, g in groups.items()},
                                     len(shard.widths) - 1)
        self.shard, self.groups, self.kind = shard, groups, model
        # the groups of the activation and gradient collectives (1)-(8): in bf16, their
        # float32 messages travel as bf16 and sum in float32 (common.collectives)
        self.wire = ({ax: g.on_wire(torch.bfloat16) for ax, g in groups.items()}
                     if precision == "bf16" else groups)
        self.residual = residual
        self.seed, self.dropout, self.norm_kind = seed, dropout, norm
        self.num_layers = len(shard.widths) - 1
        self.maps = shards.shard_maps(shard)
        self.block_shapes = [self.maps["weight", layer].block_shape(sizes)
                             for layer in range(self.num_layers)]
        self.weights = nn.ParameterList(
            nn.Parameter(self.shard_weight(w, layer))
            for layer, w in enumerate(init_weights(shard.widths, seed)))
        self.root_weights = nn.ParameterList(
            nn.Parameter(self.shard_weight(w, layer))
            for layer, w in enumerate(init_weights(shard.widths, seed + ROOT_SEED_OFFSET))
            if model == "sage")
        self.biases = nn.ParameterList(
            nn.Parameter(self.shard_vector(torch.zeros(shard.widths[layer + 1]), layer))
            for layer in range(self.num_layers) if bias)
        self.norms = nn.ModuleList(
            make_norm(norm, layer, self.block_shapes[layer][1], shard, groups)
            for layer in range(self.num_layers - 1) if norm != "none")
        block = shard.features_block  # [N/X, D_0/Y]
        if normalize_features:
            block = normalized_features(block, shard, groups)
        self.features_shape = self.maps["features", None].block_shape(sizes)
        assert tuple(block.shape) == self.features_shape, "features block and its map differ"
        feat = flat.flat_shard(block, groups["z"].size, groups["z"].rank)
        if self.keep_dtype is not None:
            feat = feat.to(self.keep_dtype)
        if learn_features:
            self.features = nn.Parameter(feat)
        else:
            self.register_buffer("features", feat)
        # With fixed input features and no dropout, H_0 = A_0 F_0 is the same in every pass:
        # compute it (with collectives 1 and 2) once and reuse it, saving one SpMM per pass.
        # With dropout only the evaluation pass could reuse it; there it is not worth holding
        # a second [N/P, D_0/I] block (common.perf.gcn counts the cache the same way).
        self.cache_first_aggregation = not learn_features and dropout == 0
        # with dropout H_0 is new every pass: recomputed in backward instead of kept
        self.recompute_first = recompute_first and not learn_features and dropout > 0
        self._h0: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._h0_rows_only = False  # a one-layer model caches the rows its pass computed
        # the caller's promise that H_0 is never needed afresh (no .to(), no other rows): once
        # it is cached, layer 0's blocks are dropped where no other layer reads them (the
        # trainer sets it; a third of a 3-layer model's adjacency on grids that cut each
        # layer's blocks differently)
        self.release_first_blocks = False
        self._ids: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        labelled = sum(shard.split_counts.values()) / max(shard.num_nodes, 1)
        self.labelled_rows: torch.Tensor | None  # int64 [R]: output rows the logits hold
        rows = None
        if labelled_rows_pay(labelled, labelled_rows_only):
            shard.restrict_last_layer(root=model == "sage")
            rows = shard.labelled_rows()
        self.register_buffer("labelled_rows", rows, persistent=False)
        self.overlap = overlap_pays(sizes, overlap)
        # per layer: Q = A (F' W) instead of (A F') W
        self.weight_first = [weight_first_pays(
            tuple(sizes[ax] for ax in layout.roles(layer)), shard.widths_padded[layer],
            shard.widths_padded[layer + 1], option=weight_first,
            fixed_first=layer == 0 and not learn_features, remade=self.recompute_first,
            rows_only=layer == self.num_layers - 1 and rows is not None,
            terms=2 if model == "sage" else 1)
            for layer in range(self.num_layers)]
        self.aggregation_blocks = (aggregation_blocks if aggregation_blocks is not None
                                   else AGGREGATION_BLOCKS if self.overlap else 1)

    # ------------------------------------------------------------------ the layer
    def forward(self, stats: CommStats | None = None, *, step: int = 0,
                all_rows: bool = False) -> torch.Tensor:
        """Logits (class docstring); ``step`` keys the dropout masks (the epoch); ``all_rows``
        computes every output row even with :attr:`labelled_rows` (predictions of every node).

        One line per equation. Each name is rebound or cleared as soon as its tensor is spent,
        so a layer's input is freed once aggregated and H once multiplied (peak memory).
        """
        f = None
        for layer in range(self.num_layers):
            rows_only = self._rows_only(layer, all_rows)   # last layer: labelled rows only
            w = self._prefetch(layer, stats)               # W_l's all-gather in flight (3)
            skip = None
            if layer == 0 and self.weight_first[0] and self.recompute_first:
                q = self._first_remade(step, stats, w)     # A_0 (F' W_0), F' remade  (1)-(7)
            elif layer == 0 and self._recomputes(rows_only):
                q = self._first_recomputed(step, stats, w)  # H_0 W_0, H_0 not kept (1)-(3)
            elif self.weight_first[layer]:
                f = self._input(layer, f, stats)           # F_l                      (1) or (8)
                skip = self._skip(layer, f, stats)
                f = self._dropout(layer, f, step)          # F'
                q = self._weight_first(layer, f, stats, w)  # A (F' W) (+ S (F' R))  (2)-(7)
                f = None
            else:
                if layer == 0 and self._h0 is not None and self._h0_rows_only == rows_only:
                    h, r = self._h0                        # fixed F_0, no dropout: a past H_0
                else:
                    f = self._input(layer, f, stats)       # F_l, replicated over P  (1) or (8)
                    skip = self._skip(layer, f, stats)     # F_l in Q's layout (residual) or None
                    f = self._dropout(layer, f, step)      # F' = dropout(F_l)
                    h, r = self._aggregate(layer, f, stats, rows_only)  # A F', S F' (2), (7)
                    f = None
                q = self._matmul(layer, h, self.weights, stats, w[0])      # H W_l (3), (5), (6)
                h = None
                if r is not None:  # + R R_l, added into H W (fresh: nothing saved it)
                    q = self._matmul(layer, r, self.root_weights, stats, w[1], into=q)
                    r = None
            q = self._sum_inner(layer, q, stats)           # Q summed over I (4), + b_l
            if layer < self.num_layers - 1:
                q = self._norm_relu(layer, q, stats, skip is None)  # relu(norm(Q)), in place
                q = q if skip is None else q + skip        # + F_l
            f, q = q, None  # F_l+1: held by f alone, so the next layer frees it once spent
        return f

    def _weight_first(self, layer: int, f: torch.Tensor, stats: CommStats | None,
                      gathered: tuple) -> torch.Tensor:
        """``A_l (F' W_l)`` (SAGE: ``+ S_l (F' R_l)``) [N/P, D_l+1/O] for a layer of
        :attr:`weight_first` (O and I of one rank): ``F' W`` is a whole [N/O, D_l+1] block, so
        the SpMM reads the rows it needs from it directly; backward ``A^T dQ`` is partial over
        P, and (6) and (8) sum it there as they sum the aggregate-first path's partials. In
        bf16 ``F'`` is rounded first, so the product reads the ``F'`` that is kept."""
        if self.keep_dtype is not None:  # Rounded writes in place: only into a fresh F'
            fresh = (self.training and self.dropout > 0) or not torch.is_grad_enabled()
            f = ops.Rounded.apply(f if fresh else f.clone(), self.keep_dtype)
        q = self._spmm_o(self.shard.adj, layer,
                         self._matmul(layer, f, self.weights, stats, gathered[0]), stats)
        if self.kind == "sage":  # added into the first term's Q (fresh: nothing saved it)
            q = q.add_(self._spmm_o(self.shard.root, layer, self._matmul(
                layer, f, self.root_weights, stats, gathered[1]), stats))
        return q

    def _input(self, layer: int, f: torch.Tensor | None, stats: CommStats | None):
        """F_l [N/O, D_l/I], replicated over P: layer 0 gathers its flat shard over P
        (collective 1; backward 8 reduce-scatters), later layers all-reduce dF over P."""
        p_group = self.wire[layout.roles(layer)[2]]
        if layer == 0:
            return flat.all_gather_reduce_scatter(self.features, p_group, self.features_shape,
                                                  stats)
        return autograd.identity_all_reduce(f, p_group, stats)

    def _dropout(self, layer: int, f: torch.Tensor, step: int,
                 kept: ops.BitMask | None = None) -> torch.Tensor:
        """F' = dropout(F_l) with the mask of ``step``; ``kept``: the mask drawn already, as
        bits (then no graph is built: F' of fixed features, recomputed or remade)."""
        if not self.training or self.dropout == 0:
            return f
        if f.dtype != torch.float32:  # bf16 F_0 (no gradient): scaled in float32, rounded once
            scaled = f.mul(1.0 / (1.0 - self.dropout))
            if kept is not None:
                return kept.clear_(scaled)
            return scaled.masked_fill_(~self._keep_mask(layer, step, f.device), 0.0)
        if kept is not None:
            return dropped(f, kept, self.dropout)
        # F_l is read by nothing after this, F' feeds the aggregation or H W alone: in place
        return apply_dropout(f, self._keep_mask(layer, step, f.device), self.dropout, spent=True)

    def _recomputes(self, rows_only: bool) -> bool:
        """Whether this pass's layer 0 runs in row blocks and leaves ``H_0`` to backward
        (:attr:`recompute_first`): every pass over every row, evaluation included (it then
        holds one row block of ``H_0`` instead of all of it)."""
        return self.recompute_first and not rows_only

    def _first_recomputed(self, step: int, stats: CommStats | None, gathered) -> torch.Tensor:
        """``H_0 W_0`` (+ ``R_0 W_r0``) [N/P, D_1/O], partial over I, multiplied row block by
        row block as :meth:`_first_blocks` aggregates them, none kept: backward aggregates
        them again from this pass's dropout mask, kept as bits (no mask in evaluation)."""
        p_group = self.wire[layout.roles(0)[2]]
        bits = (ops.BitMask(self._keep_mask(0, step, self.features.device)) if self.training
                else None)
        sage = self.kind == "sage"
        return ops.RecomputedMatmul.apply(
            lambda: self._first_blocks(bits, stats), self.shard.adj[0].a.shape[0], p_group,
            self.block_shapes[0], stats, gathered, self.weights[0],
            self.root_weights[0] if sage else None, self.gemm)

    def _first_remade(self, step: int, stats: CommStats | None, gathered) -> torch.Tensor:
        """``A_0 (F' W_0)`` (GraphSAGE: ``+ S_0 (F' R_0)``) [N/P, D_1/O] for fixed features
        with dropout in a layer that multiplies first (O and I of one rank): ``F' =
        dropout(F_0)`` is made for the products and made again for ``dW`` in backward from
        this pass's mask, kept as bits (:class:`plexus.ops.RemadeInputMatmul`); nothing of
        ``F'`` or ``H_0`` is kept, and the SpMMs of both passes run ``D_1`` wide."""
        bits = (ops.BitMask(self._keep_mask(0, step, self.features.device)) if self.training
                else None)

        def make() -> torch.Tensor:  # F' [N/O, D_0/I]: F_0 gathered over P (1), dropped out
            with torch.no_grad():
                f = self._input(0, None, stats)
                return f if bits is None else self._dropout(0, f, 0, kept=bits)

        sage = self.kind == "sage"
        g = ops.RemadeInputMatmul.apply(make, self.wire[layout.roles(0)[2]],
                                        self.block_shapes[0], stats, gathered, self.weights[0],
                                        self.root_weights[0] if sage else None, self.gemm)
        q = self._spmm_o(self.shard.adj, 0, g[0], stats)
        if sage:
            q = q + self._spmm_o(self.shard.root, 0, g[1], stats)
        return q

    def _first_blocks(self, bits: ops.BitMask | None, stats: CommStats | None):
        """Yield ``(term, lo, hi, rows lo..hi of H_0 (term 0) or R_0 (term 1))``: F_0
        gathered over P (1), ``dropout(F_0)`` with the mask ``bits`` (the values
        :meth:`_dropout` gives; None: F_0 as it is), aggregated in row blocks (whole on a
        GPU, where a row block's matrix would be a copy), each all-reduced over O (2) and,
        in bf16, rounded as :meth:`_aggregate` rounds H."""
        o_group = self.wire[layout.roles(0)[0]]
        with torch.no_grad():
            f = self._input(0, None, stats)                              # (1)
            if bits is not None:
                f = self._dropout(0, f, 0, kept=bits)
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
                        x.copy_(x.to(self.keep_dtype))
                    yield term, lo, hi, x
                    x = None

    def _rows_only(self, layer: int, all_rows: bool) -> bool:
        return self.labelled_rows is not None and not all_rows and layer == self.num_layers - 1

    def _aggregate(self, layer: int, f: torch.Tensor, stats: CommStats | None,
                   rows_only: bool = False):
        """(H, R): ``A_l F'`` and, for SAGE, ``S_l F'`` ([N/P, D_l/I], or the labelled rows
        [R, D_l/I] with ``rows_only``); kept for the next passes at layer 0 when
        :attr:`cache_first_aggregation`."""
        adj, root = self.shard.adj, self.shard.root
        if rows_only:
            adj, root = self._labelled_blocks(layer)
        # GraphSAGE: A^T dH and S^T dR summed in one block (autograd would hold both)
        shared = ops.SharedGradient(2) if self.kind == "sage" and f.requires_grad else None
        # (each feeds one product only: backward may reduce its gradient in place)
        h = self._spmm_o(adj, layer, f, stats, shared, spend_grad=True)
        r = (self._spmm_o(root, layer, f, stats, shared, spend_grad=True)
             if self.kind == "sage" else None)
        o_group = self.wire[layout.roles(layer)[0]]
        if self.keep_dtype is not None and not (o_group.size > 1
                                                and o_group.wire == self.keep_dtype):
            # bf16: H W reads the H that is kept (and cached); a sum whose messages were bf16
            # (common.collectives) is bf16 values already
            h = ops.Rounded.apply(h, self.keep_dtype)
            r = None if r is None else ops.Rounded.apply(r, self.keep_dtype)
        if layer == 0 and self.cache_first_aggregation:
            self._h0 = (self._kept(h), None if r is None else self._kept(r))
            self._h0_rows_only = rows_only
            if self.release_first_blocks and 1 < self.num_layers <= 6:  # (layer 6 reads 0's)
                self._release_first_blocks()
            if self.keep_dtype is not None:  # H W reads and keeps the bf16 copy, as later
                return self._h0              # passes do (no gradient flows here): one copy
        return h, r

    def _release_first_blocks(self) -> None:
        """Drop layer 0's adjacency (and root) block from the shard where no other layer
        reads the same block (:attr:`release_first_blocks`)."""
        for blocks in (self.shard.adj, self.shard.root):
            first = (blocks or {}).get(0)
            if first is not None and all(b is not first for k, b in blocks.items() if k):
                del blocks[0]

    def _kept(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` detached, in :attr:`keep_dtype` (bf16) or as it is."""
        t = t.detach()
        return t if self.keep_dtype is None else t.to(self.keep_dtype)

    def _labelled_blocks(self, layer: int):
        """({layout_of(layer): the labelled rows of A_l}, the same of S_l or None), on the
        device and with the kernel of the full blocks (moved on first use: ``BlockSparse.to``
        after the trainer uploads the full ones)."""
        sh, key = self.shard, layout.layout_of(layer)
        out = []
        for sub, full in ((sh.labelled_adj, sh.adj), (sh.labelled_root, sh.root)):
            if sub is None or full is None:
                out.append(None)
                continue
            ref = full[key].a
            for m in (sub.a_t, sub.a):  # the transpose first: a copy is made from host blocks
                if m.device != ref.device or m.kernel != ref.kernel:
                    m.to(ref.device, kernel=ref.kernel)
            out.append({key: sub})
        return out[0], out[1]

    def _spmm_o(self, blocks, layer: int, x: torch.Tensor, stats: CommStats | None,
                shared: ops.SharedGradient | None = None, spend_grad: bool = False):
        """``B_l F_l`` for ``B`` = the adjacency (H_l) or the root blocks (R_l = S_l F_l),
        all-reduced over O in both passes (collectives 2 and 7): in row blocks, overlapped
        with the SpMM, when :attr:`aggregation_blocks` > 1. ``shared``: the gradient of
        ``F_l`` summed there with the other term's; ``spend_grad``: the product feeds one
        operator, so its gradient may be reduced in place."""
        if layout.layout_of(layer) not in blocks:
            raise RuntimeError(
                f"layer {layer}'s adjacency block was released once H_0 was cached "
                "(PlexusGCN.release_first_blocks, set by the trainer): build the model again "
                "to compute H_0 afresh")
        blk, group = blocks[layout.layout_of(layer)], self.wire[layout.roles(layer)[0]]
        if self.aggregation_blocks > 1 and group.size > 1:
            return ops.BlockedAggregation.apply(blk.a, blk.a_t, x, group, stats,
                                                self.aggregation_blocks, self.overlap, shared,
                                                spend_grad)
        h = ops.SpMM.apply(blk.a, blk.a_t, x, shared)  # a fresh tensor: reduced in place
        return autograd.all_reduce_all_reduce(h, group, stats, inplace=True)

    def _prefetch(self, layer: int, stats: CommStats | None) -> tuple:
        """With :attr:`overlap`, the handles of W_l's (and R_l's) all-gather over P (3),
        issued now so that they travel during the aggregation; else (None, None)."""
        p_group = self.wire[layout.roles(layer)[2]]
        if not self.overlap or p_group.size == 1:
            return None, None
        shape = self.block_shapes[layer]
        return tuple(flat.gather(ws[layer].detach(), p_group, shape, stats=stats, async_op=True)
                     if len(ws) else None for ws in (self.weights, self.root_weights))

    def _matmul(self, layer: int, h: torch.Tensor, weights: nn.ParameterList,
                stats: CommStats | None, gathered=None, into=None) -> torch.Tensor:
        """``H W`` [N/P, D_l+1/O], partial over I, with ``W`` gathered over P (3, 5, 6);
        ``gathered``: the handle of that all-gather, issued by :meth:`_prefetch`; ``into``:
        a fresh product it is added into."""
        p_group = self.wire[layout.roles(layer)[2]]
        keep = self.keep_dtype if torch.is_grad_enabled() else None  # no copy for no backward
        return ops.GatheredMatmul.apply(h, weights[layer], p_group, self.block_shapes[layer],
                                        stats, gathered, keep, self.gemm, into)

    def _sum_inner(self, layer: int, q: torch.Tensor, stats: CommStats | None):
        """Q summed over I (collective 4, in place: q is fresh), then ``+ b_l`` in place (the
        logits block is the largest activation); the bias's gradient is all-reduced over P."""
        _, i_ax, p_ax = layout.roles(layer)
        q = autograd.all_reduce_identity(q, self.wire[i_ax], stats, inplace=True)
        if len(self.biases):
            q = q.add_(autograd.identity_all_reduce(self.biases[layer], self.groups[p_ax], stats))
        return q

    def _norm_relu(self, layer: int, q: torch.Tensor, stats: CommStats | None,
                   over_grad: bool) -> torch.Tensor:
        """``relu(norm(Q))`` (plexus.norms); ``over_grad``: the gradient reaching it is read by
        nothing else (no residual shares it), so backward writes over it."""
        if not len(self.norms):
            return ops.ReLU.apply(q, over_grad)
        norm = self.norms[layer]
        if self.keep_dtype is None:
            return norm(q, stats, relu=True, over_grad=over_grad)
        with ops.StoredIn(self.keep_dtype):  # the norm's saved inputs in bf16
            return norm(q, stats, relu=True, over_grad=over_grad)

    def _skip(self, layer: int, x: torch.Tensor, stats: CommStats | None):
        """F_l in the layout of layer l's output [N/P, D_l+1/O], replicated over I (the
        residual), or None where the layer has none: rows through ``S_l`` (all-reduce over O),
        then this rank's I-chunk of columns placed at its columns of the O split and summed
        over I."""
        if not (self.residual and 1 <= layer < self.num_layers - 1):
            return None
        o_ax, i_ax, _ = layout.roles(layer)
        g = self.groups
        r = self._spmm_o(self.shard.root, layer, x, stats)  # [N/P, D_l/I]
        w_in, w_out = r.shape[1], self.block_shapes[layer][1]
        lo_in, lo_out = g[i_ax].rank * w_in, g[o_ax].rank * w_out
        lo = max(lo_in, lo_out)
        hi = min(lo_in + w_in, lo_out + w_out, self.shard.widths[layer])
        # an empty slice when the chunks do not overlap keeps r in the graph, so every rank
        # runs r's backward collectives
        part, left = (r[:, lo - lo_in: hi - lo_in], lo - lo_out) if hi > lo else (r[:, :0], 0)
        placed = torch.nn.functional.pad(part, (left, w_out - left - part.shape[1]))
        return autograd.all_reduce_identity(placed, self.wire[i_ax], stats)

    def output_rows(self, t: torch.Tensor, *, all_rows: bool = False) -> torch.Tensor:
        """The rows of a per-output-row tensor ``t`` [N/P, ...] (labels, split masks) that the
        logits of ``forward(all_rows=all_rows)`` hold: ``t`` itself, or its labelled rows.

        Shapes: [N/P, ...] -> [R, ...]
        """
        if all_rows or self.labelled_rows is None:
            return t
        return t.index_select(0, self.labelled_rows.to(t.device))

    # ------------------------------------------------------------------ set-up helpers
    def _input_ids(self, layer: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(node ids [N/O], column ids [D_l/I]) of the rows and columns of F_l on this rank,
        on ``device``: made once (a copy from host memory every epoch would make the host
        wait for a GPU)."""
        if (layer, device) not in self._ids:
            o_ax, i_ax, _ = layout.roles(layer)
            g, sh = self.groups, self.shard
            order = partition.layer_orders(layer % 2, sh.pr, sh.pc)[1]
            rows = node_chunk(order, g[o_ax])
            width = sh.widths_padded[layer] // g[i_ax].size
            cols = torch.arange(width) + g[i_ax].rank * width
            self._ids[layer, device] = (rows.to(device), cols.to(device))
        return self._ids[layer, device]

    def _keep_mask(self, layer: int, step: int, device) -> torch.Tensor:
        """Layer ``layer``'s dropout mask at ``step`` [N/O, D_l/I], drawn on ``device``."""
        device = torch.device(device)
        rows, cols = self._input_ids(layer, device)
        return keep_mask(self.dropout, seed=self.seed, step=step, layer=layer, rows=rows,
                         cols=cols, device=device)

    def _apply(self, fn, recurse=True):  # .to(device) etc. must not keep a stale cache
        self._h0 = None
        return super()._apply(fn, recurse)
