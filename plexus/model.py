"""The Plexus 3D-parallel GCN (docs/design/plexus-3d.md sections 1-4).

Layer ``l`` with roles (O, I, P) on rank (o, i, p)::

    F_l   [N/O, D_l/I]     layer 0: all-gather of the flat feature shard over P       (1)
    H_l = A_l F_l          [N/P, D_l/I], partial over O -> all-reduce over O            (2)
    W_l   [D_l/I, D_l+1/O] all-gather of the flat weight shard over P                  (3)
    Q_l = H_l W_l          [N/P, D_l+1/O], partial over I -> all-reduce over I          (4)
    F_l+1 = relu(Q_l)      (no activation after the last layer)

Backward: re-gather W over P (5), reduce-scatter dW over P (6), all-reduce dH over O (7),
dF = A_l^T dH: reduce-scatter over P at layer 0 (only with trainable features), all-reduce
over P for layers >= 1 (8); plexus.ops has the operators with both passes written out. The
adjacency never moves. How each layer runs (labelled rows, overlap, weight first, layer 0's
``H_0``) is a :class:`~plexus.layer_plan.LayerPlan`, decided before the model is built.
Parallel equals serial: every rank slices the full weights of the serial model
(plexus.reference) as plexus.shards declares, so every grid trains that model.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from common import autograd, dense, flat
from common.comm_stats import CommStats
from common.grid import AxisGroup
from plexus import layout, ops, shards
from plexus.config import check_recipe
from plexus.data.shard import GraphShard
from plexus.first_layer import FirstLayer
from plexus.gat_model import GATLayers
from plexus.last_layer import LastLayer
from plexus.layer_dropout import LayerDropout
from plexus.layer_plan import AGGREGATION_BLOCKS, LayerPlan, plan_layers
from plexus.norms import make_norm, normalized_features
from plexus.residual import add_root_blocks, has_skip, in_output_columns
from plexus.root_rows import ExchangedRows, RootExchange
from plexus.sharded_state import ShardedState
from plexus.weights import ROOT_SEED_OFFSET, init_weights

__all__ = ["ROOT_SEED_OFFSET", "PlexusGCN", "init_weights"]


class PlexusGCN(ShardedState, FirstLayer, LastLayer, GATLayers, nn.Module):
    """An L-layer GCN, GraphSAGE or GAT whose every tensor is sharded over a 3D grid (x, y, z).

    Layer ``l`` (roles O, I, P)::

        F'  = dropout(F_l)                       grid-independent mask (plexus.layer_dropout)
        GCN:  Q = (Â F') W_l                     collectives 1-4
        SAGE: Q = (A_mean F') W_l + (S F') R_l   A_mean: mean over in-neighbours
        Q  += b_l                                b_l [D_l+1/O], replicated over I and P
        GAT:  Q = attention(F', W_l, a_l)        plexus.gat_model: heads over I, G1-G7
        F_l+1 = relu(norm(Q)) (+ F_l)            hidden layers; the last layer returns Q

    GraphSAGE's root term ``x_i R_l`` needs the input rows of the output nodes, which live on
    other ranks (F_l rows are split over O, Q rows over P). ``S`` is this rank's block of the
    permuted identity (plexus.data.partition.permuted_identity), stationary like the
    adjacency: ``S F'`` is an SpMM all-reduced over O with ``A_mean F'``, never a full-size
    transfer; the residual moves ``F_l`` the same way (plexus.residual). Where each tensor
    lives is declared in :mod:`plexus.shards` (``self.maps``, applied by ShardedState).

    Args:
        shard: this rank's :class:`~plexus.data.shard.GraphShard` (``shard.root`` set for
            ``model="sage"``).
        groups: the rank's axis groups ``{"x", "y", "z"}`` from ``ctx.create_groups(grid)``.
        model, learn_features, seed, dropout, bias, norm, normalize_features, residual,
            precision: the recipe, as :class:`plexus.config.ModelConfig` documents it (these
            defaults are the paper's bare model). bf16 stores F_0, the kept ``H`` and the
            norm's saved inputs in bf16 and sends every message of (1)-(8) as bf16
            (:attr:`wire`); sums, weights and gradients stay float32.
        gemm: the backend of ``H W``, ``dQ W^T`` and ``dW`` (:func:`common.dense.mm`;
            :attr:`products`).
        heads, attention_dropout: GAT's (``model="gat"``; ``shard.widths``' hidden widths are
            then ``heads`` times a head's).
        plan: how each layer runs (:func:`plexus.layer_plan.plan_layers`, as the trainer
            makes it); None: made here from ``options`` (``labelled_rows_only``, ``overlap``,
            ``aggregation_blocks``, ``recompute_first``, ``weight_first``).

    Shapes:
        forward() -> logits [R, C_pad/O] of the last layer's roles (R: :attr:`labelled_rows`,
        or all N/P rows), rows in output order, replicated over I.
    """

    def __init__(self, shard: GraphShard, groups: dict[str, AxisGroup], *, model: str = "gcn",
                 learn_features: bool = False, seed: int = 0, dropout: float = 0.0,
                 bias: bool = False, norm: str = "none", normalize_features: bool = False,
                 residual: bool = False, precision: str = "fp32", gemm: str = "auto",
                 plan: LayerPlan | None = None, heads: int = 1, attention_dropout: float = 0.0,
                 **options: Any) -> None:
        super().__init__()
        check_recipe(model=model, norm=norm, dropout=dropout, precision=precision,
                     learn_features=learn_features)
        if model == "sage" and shard.root is None:
            raise ValueError("model 'sage' needs a shard built with aggregation 'mean'")
        sizes = {ax: g.size for ax, g in groups.items()}
        if plan is None:
            plan = plan_layers(shard, sizes, model=model, learn_features=learn_features,
                               dropout=dropout, **options)
        elif options:
            raise TypeError(f"give a plan or its options, not both: {sorted(options)}")
        plan.check(num_layers=len(shard.widths) - 1, learn_features=learn_features,
                   dropout=dropout)
        asked = [k for k, v in options.items()
                 if v and k != "recompute_first" and not (k == "aggregation_blocks" and v == 1)]
        if model == "gat" and (asked or plan != LayerPlan(weight_first=plan.weight_first)
                               or any(plan.weight_first)):
            raise ValueError(f"model 'gat' runs none of the layer plan's options (asked: "
                             f"{asked or plan}): its layers are attention, not an aggregation "
                             "and a product")
        self.plan, self.precision, self.gemm = plan, precision, dense.check_backend(gemm)
        # the dtype F_0 and the kept activations are stored in (None: float32, as computed)
        self.keep_dtype = torch.bfloat16 if precision == "bf16" else None
        if residual or model == "gat":  # GAT: t reaches the block's rows by owner
            add_root_blocks(shard, groups)
        self.shard, self.groups, self.kind, self.residual = shard, groups, model, residual
        self._exchanges: dict[int, tuple] = {}  # GraphSAGE's root rows by owner, per block
        # the groups of the activation and gradient collectives (1)-(8): in bf16, their
        # float32 messages travel as bf16 and sum in float32 (common.collectives)
        self.wire = ({ax: g.on_wire(torch.bfloat16) for ax, g in groups.items()}
                     if precision == "bf16" else groups)
        self.seed, self.dropout, self.norm_kind = seed, dropout, norm
        self.heads, self.attention_dropout = heads, attention_dropout
        self.num_layers = len(shard.widths) - 1
        self.maps = shards.shard_maps(shard, heads if model == "gat" else None)
        self.block_shapes = [self.maps["weight", layer].block_shape(sizes)
                             for layer in range(self.num_layers)]
        # Q's columns on this rank, D_l+1/O (GAT's weight blocks hold every column)
        self.out_cols = [self.maps["vector", layer].block_shape(sizes)[0]
                         for layer in range(self.num_layers)]
        self.att_src, self.att_dst = nn.ParameterList(), nn.ParameterList()  # GAT's a_l
        if model == "gat":
            self._gat_parameters(seed)  # W_l and a_l (plexus.gat_model)
        else:
            self.weights = self.sharded_weights(init_weights(shard.widths, seed))  # W_l
        self.root_weights = self.sharded_weights(  # R_l: GraphSAGE's root term
            init_weights(shard.widths, seed + ROOT_SEED_OFFSET) if model == "sage" else [])
        self.biases = nn.ParameterList(
            nn.Parameter(self.shard_vector(torch.zeros(shard.widths[layer + 1]), layer))
            for layer in range(self.num_layers) if bias)
        self.norms = nn.ModuleList(
            make_norm(norm, layer, self.out_cols[layer], shard, groups)
            for layer in range(self.num_layers - 1) if norm != "none")
        block = shard.features_block  # [N/X, D_0/Y]
        if normalize_features:
            block = normalized_features(block, shard, groups)
        self.features_shape = self.maps["features", None].block_shape(sizes)
        assert tuple(block.shape) == self.features_shape, "features block and its map differ"
        feat = flat.flat_shard(block, groups["z"].size, groups["z"].rank)  # [N*D_0/(X*Y*Z)]
        if self.keep_dtype is not None:
            feat = feat.to(self.keep_dtype)
        if learn_features:
            self.features = nn.Parameter(feat)
        else:
            self.register_buffer("features", feat)
        self.drop = LayerDropout(dropout, seed, shard, groups)  # F' = drop(layer, F_l, step)
        self.register_buffer("labelled_rows", self._restrict_last_layer(plan.labelled_rows_only),
                             persistent=False)  # (a buffer: it moves with the model)

    weight_first = property(lambda self: self.plan.weight_first, doc="LayerPlan's, per layer")

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
            if layer == 0 and self.plan.recompute_first and not rows_only:
                q = self._first_not_kept(step, stats, w)   # H_0 W_0, nothing kept  (1)-(7)
            elif self.kind == "gat":
                f = self._input(layer, f, stats)           # F_l                      (1)
                skip = self._skip(layer, f, stats)
                f = self.drop(layer, f, step) if self.training else f  # F'
                q = self._attend(layer, f, stats, step)    # attention, G1-G7
                f = None
            elif self.plan.weight_first[layer]:
                f = self._input(layer, f, stats)           # F_l                      (1) or (8)
                skip = self._skip(layer, f, stats)
                f = self.drop(layer, f, step) if self.training else f  # F'
                q = self._weight_first(layer, f, stats, w)  # A (F' W) (+ S (F' R))  (2)-(7)
                f = None
            else:
                cached = self._h0_cached(rows_only) if layer == 0 else None
                if cached is not None:
                    h, r = cached                          # fixed F_0, no dropout: a past H_0
                else:
                    f = self._input(layer, f, stats)       # F_l, replicated over P  (1) or (8)
                    skip = self._skip(layer, f, stats)     # F_l in Q's layout (residual) or None
                    f = self.drop(layer, f, step) if self.training else f  # F'
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

    def _input(self, layer: int, f: torch.Tensor | None, stats: CommStats | None):
        """F_l [N/O, D_l/I], replicated over P: layer 0 gathers its flat shard over P
        (collective 1; backward 8 reduce-scatters), later layers all-reduce dF over P (not
        GAT's: its dF' is whole there, plexus.gat_model)."""
        p_group = self.wire[layout.roles(layer)[2]]
        if layer == 0:
            return flat.all_gather_reduce_scatter(self.features, p_group, self.features_shape,
                                                  stats)
        return f if self.kind == "gat" else autograd.identity_all_reduce(f, p_group, stats)

    def _aggregate(self, layer: int, f: torch.Tensor, stats: CommStats | None,
                   rows_only: bool = False):
        """(H, R): ``A_l F'`` and, for SAGE, ``S_l F'`` ([N/P, D_l/I], or the labelled rows
        [R, D_l/I] with ``rows_only``); at layer 0 kept for the next passes where
        :attr:`LayerPlan.cache_first`."""
        adj = self._labelled_blocks(layer) if rows_only else self.shard.adj
        # GraphSAGE: A^T dH and S^T dR summed in one block (autograd would hold both)
        shared = ops.SharedGradient(2) if self.kind == "sage" and f.requires_grad else None
        # (each feeds one product only: backward may reduce its gradient in place)
        # bf16: H W reads the H that is kept (and cached); a sum whose messages are bf16
        # (common.collectives) comes back in bf16 (ops.BlockedAggregation's narrow)
        o_group = self.wire[layout.roles(layer)[0]]
        narrow = (self.keep_dtype is not None and o_group.size > 1
                  and o_group.wire == self.keep_dtype)
        h = self._spmm_o(adj, layer, f, stats, shared, spend_grad=True, narrow=narrow)
        r = self._root_rows(layer, f, stats, rows_only, shared) if self.kind == "sage" else None
        if self.keep_dtype is not None and not narrow:
            h = ops.Rounded.apply(h, self.keep_dtype)
        if layer == 0 and self.plan.cache_first:
            return self._keep_h0(h, r, rows_only)
        return h, r

    def _spmm_o(self, blocks, layer: int, x: torch.Tensor, stats: CommStats | None,
                shared: ops.SharedGradient | None = None, spend_grad: bool = False,
                narrow: bool = False, stored: bool = True):
        """``B_l F_l`` for ``B`` = the adjacency (H_l) or the root blocks (R_l = S_l F_l),
        all-reduced over O in both passes (collectives 2 and 7): in row blocks, overlapped
        with the SpMM, when :attr:`LayerPlan.aggregation_blocks` > 1. ``shared``: the
        gradient of ``F_l`` summed there with the other term's; ``spend_grad``: the product
        feeds one operator, so its gradient may be reduced in place; ``narrow``: returned in
        the messages' bf16 (ops.BlockedAggregation); ``stored``: on a GPU the SpMM reads
        ``F_l`` in the stored precision (bf16: half the bytes it gathers, the bulk of a GPU
        epoch's traffic; sums in float32), else as it is (the residual's rows, copied, not
        summed; on the CPU a bf16 copy beside a float32 ``F_l`` would add to the step's
        peak memory more than its gathers save in time)."""
        self._check_not_released(blocks, layer)
        blk, group = blocks[layout.layout_of(layer)], self.wire[layout.roles(layer)[0]]
        read_as = self.keep_dtype if stored and x.is_cuda else None
        if (self.plan.aggregation_blocks > 1 or narrow) and group.size > 1:
            # narrowed: in row blocks even where they do not overlap, so that the float32
            # scratch is one block's (the blocks change no bits)
            num = self.plan.aggregation_blocks
            return ops.BlockedAggregation.apply(
                blk.a, blk.a_t, x, group, stats, max(num, AGGREGATION_BLOCKS) if narrow else num,
                self.plan.overlap and num > 1, shared, spend_grad, narrow, read_as)
        h = ops.SpMM.apply(blk.a, blk.a_t, x, shared, read_as)  # fresh: reduced in place
        return autograd.all_reduce_all_reduce(h, group, stats, inplace=True)

    def _root_rows(self, layer: int, f: torch.Tensor, stats: CommStats | None,
                   rows_only: bool, shared: ops.SharedGradient | None) -> torch.Tensor:
        """GraphSAGE's ``R_l = S_l F'`` [N/P, D_l/I] (the labelled rows with ``rows_only``),
        each row sent by the rank of O that holds it (plexus.root_rows: an all-gather over O
        forward, a reduce-scatter backward, where the SpMM with ``S`` would all-reduce both);
        in the stored precision (bf16: the messages' dtype, the values the SpMM's sum of
        bf16 messages gives)."""
        dtype = self.keep_dtype or f.dtype
        return ExchangedRows.apply(f, self.root_exchange(layer, rows_only),
                                   self.wire[layout.roles(layer)[0]], stats, dtype, shared)

    def root_exchange(self, layer: int, rows_only: bool = False) -> RootExchange:
        """Where each row of ``layer``'s ``R`` comes from (plexus.root_rows.RootExchange),
        made once per root block; ``rows_only``: of the last layer's labelled rows."""
        if rows_only:
            blk = self.shard.labelled_root
        else:
            self._check_not_released(self.shard.root, layer)
            blk = self.shard.root[layout.layout_of(layer)]
        key = id(blk)
        if key not in self._exchanges:  # (the block kept with it: the id stays its)
            self._exchanges[key] = (blk, RootExchange(blk, self.groups[layout.roles(layer)[0]]
                                                      .size))
        return self._exchanges[key][1]

    def _prefetch(self, layer: int, stats: CommStats | None) -> tuple:
        """With :attr:`LayerPlan.overlap`, the handles of W_l's (and R_l's) all-gather over P
        (3), issued now so that they travel during the aggregation; else (None, None)."""
        p_group = self.wire[layout.roles(layer)[2]]
        if not self.plan.overlap or p_group.size == 1:
            return None, None
        shape = self.block_shapes[layer]
        return tuple(flat.gather(ws[layer].detach(), p_group, shape, stats=stats, async_op=True)
                     if len(ws) else None for ws in (self.weights, self.root_weights))

    def _matmul(self, layer: int, h: torch.Tensor, weights: nn.ParameterList,
                stats: CommStats | None, gathered=None, into=None,
                kept: torch.Tensor | None = None) -> torch.Tensor:
        """``H W`` [N/P, D_l+1/O], partial over I, with ``W`` gathered over P (3, 5, 6);
        ``gathered``: the handle of that all-gather, issued by :meth:`_prefetch`; ``into``:
        a fresh product it is added into; ``kept``: ``H``'s copy for backward, shared with
        another product of the same ``H`` (:meth:`_kept_copy`)."""
        p_group = self.wire[layout.roles(layer)[2]]
        keep = self.keep_dtype if torch.is_grad_enabled() else None  # no copy for no backward
        return ops.GatheredMatmul.apply(h, weights[layer], p_group, self.block_shapes[layer],
                                        stats, gathered, keep, self.products, into, kept)

    def _kept_copy(self, h: torch.Tensor) -> torch.Tensor | None:
        """The copy of ``h`` that :meth:`_matmul` keeps for backward, made once for every
        product of ``h`` (None where it keeps ``h`` itself or keeps nothing)."""
        if self.keep_dtype is None or not torch.is_grad_enabled():
            return None
        return dense.converted(h.detach(), self.keep_dtype)  # (no graph: as made in forward)

    @property
    def products(self) -> str:
        """The dense products' backend (:mod:`common.dense`): ``gemm``, but for ``auto`` in
        bf16 on a GPU ``tf32``, the tensor cores with float32 sums (the kept bf16 ``H`` is
        exact in TF32; ``W`` is rounded to 10 mantissa bits there, as a grid with P > 1
        rounds it to bf16's 8 in its messages)."""
        if self.gemm == "auto" and self.keep_dtype is not None and self.features.is_cuda:
            return "tf32"
        return self.gemm

    def _weight_first(self, layer: int, f: torch.Tensor, stats: CommStats | None,
                      gathered: tuple) -> torch.Tensor:
        """``A_l (F' W_l)`` (SAGE: ``+ S_l (F' R_l)``) [N/P, D_l+1/O] where O and I have one
        rank: ``F' W`` is a whole [N/O, D_l+1] block, so the SpMM reads the rows it needs
        from it directly; backward ``A^T dQ`` is partial over P, and (6) and (8) sum it
        there. In bf16 ``F'`` is rounded first, so the product reads the ``F'`` kept."""
        if self.keep_dtype is not None:  # in place into a fresh F', else into a copy
            fresh = (self.training and self.dropout > 0) or not torch.is_grad_enabled()
            f = ops.Rounded.apply(f, self.keep_dtype, not fresh)
        kept = self._kept_copy(f) if self.kind == "sage" else None  # one for both terms
        q = self._spmm_o(self.shard.adj, layer,
                         self._matmul(layer, f, self.weights, stats, gathered[0], kept=kept),
                         stats)
        if self.kind == "sage":  # added into the first term's Q (fresh: nothing saved it)
            q = q.add_(self._spmm_o(self.shard.root, layer, self._matmul(
                layer, f, self.root_weights, stats, gathered[1], kept=kept), stats))
        return q

    def _sum_inner(self, layer: int, q: torch.Tensor, stats: CommStats | None):
        """Q summed over I (collective 4, in place: q is fresh), then ``+ b_l`` in place (the
        logits block is the largest activation); the bias's gradient is all-reduced over P."""
        _, i_ax, p_ax = layout.roles(layer)
        if self.kind != "gat":  # GAT's Q is whole already (plexus.gat.heads_to_columns)
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
        # in bf16 the norm's saved inputs are kept in bf16
        with nullcontext() if self.keep_dtype is None else ops.StoredIn(self.keep_dtype):
            return self.norms[layer](q, stats, relu=True, over_grad=over_grad)

    def _skip(self, layer: int, f: torch.Tensor, stats: CommStats | None):
        """F_l in the layout of layer l's output [N/P, D_l+1/O], replicated over I, where the
        layer has a residual (plexus.residual), else None."""
        if not has_skip(self.residual, layer, self.num_layers):
            return None
        if self.kind == "gat":  # S^T dR is partial over P, where GAT's input is not summed
            f = autograd.identity_all_reduce(f, self.wire[layout.roles(layer)[2]], stats)
        rows = self._spmm_o(self.shard.root, layer, f, stats, stored=False)  # S_l F_l
        return in_output_columns(rows, layer, self.out_cols[layer],
                                 self.shard.widths[layer], self.groups, self.wire, stats)
