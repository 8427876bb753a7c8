"""The Plexus 3D-parallel GCN (plexus-3d.md sections 1-4).

Layer ``l`` with roles (O, I, P) on rank (o, i, p)::

    F_l   [N/O, D_l/I]     layer 0: all-gather of the flat feature shard over P       (1)
    H_l = A_l F_l          [N/P, D_l/I], partial over O -> all-reduce over O            (2)
    W_l   [D_l/I, D_l+1/O] all-gather of the flat weight shard over P                  (3)
    Q_l = H_l W_l          [N/P, D_l+1/O], partial over I -> all-reduce over I          (4)
    F_l+1 = relu(Q_l)      (no activation after the last layer)

Backward: re-gather W over P (5), reduce-scatter dW over P (6), all-reduce dH over O (7),
dF = A_l^T dH: reduce-scatter over P at layer 0 (only with trainable features), all-reduce
over P for layers >= 1 (8); plexus.ops has the operators with both passes written out. The
adjacency never moves. Parallel equals serial: the same seed gives the same full weights on
every grid (:func:`init_weights`), and each rank keeps its slice.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from common import autograd
from common import collectives as coll
from common.comm_stats import CommStats
from common.grid import AxisGroup
from common.sharded import Slab
from plexus import layout, ops
from plexus.config import MODELS, NORMS
from plexus.data import partition
from plexus.data.memory import root_blocks
from plexus.data.shard import GraphShard
from plexus.layers import ShardedBatchNorm, ShardedLayerNorm, apply_dropout, keep_mask
from plexus.layout import flat_shard

ROOT_SEED_OFFSET = 7919  # GraphSAGE's root weights R_l come from init_weights(seed + this)


def _shape(groups: dict[str, AxisGroup]) -> dict[str, int]:
    return {ax: g.size for ax, g in groups.items()}


def _coords(groups: dict[str, AxisGroup]) -> dict[str, int]:
    return {ax: g.rank for ax, g in groups.items()}


def init_weights(widths: list[int], seed: int) -> list[torch.Tensor]:
    """Full (unsharded, unpadded) weights ``W_l`` [D_l, D_l+1], Glorot-uniform, from ``seed``.

    Every rank (and the serial reference) draws the same matrices, so any grid trains the
    same model.
    """
    gen = torch.Generator().manual_seed(seed)
    out = []
    for d_in, d_out in itertools.pairwise(widths):
        bound = math.sqrt(6.0 / (d_in + d_out))
        out.append((torch.rand(d_in, d_out, generator=gen) * 2 - 1) * bound)
    return out


def _chunk(order: np.ndarray, group: AxisGroup) -> torch.Tensor:
    """This rank's chunk of a node order (a copy: the order may be a read-only memory map)."""
    n = order.size // group.size
    assert n * group.size == order.size, "the padded node count splits evenly over every axis"
    return torch.from_numpy(np.array(order[group.rank * n:(group.rank + 1) * n], dtype=np.int64))


def _slab(shape: tuple[int, ...], rows, cols: tuple[int, AxisGroup],
          flat: tuple[tuple[int, int], AxisGroup] | None) -> Slab:
    """A :class:`Slab` of columns ``cols`` (padded width, split over a group) and, with
    ``flat`` (block shape, group), the block flattened and split as :func:`flat_shard`."""
    width, group = cols
    step = width // group.size
    flat_range = None
    if flat is not None:
        (a, b), p = flat
        size = -(-a * b // p.size)
        flat_range = (p.rank * size, (p.rank + 1) * size)
    return Slab(shape, rows, (group.rank * step, (group.rank + 1) * step), flat_range)


class PlexusGCN(nn.Module):
    """An L-layer GCN or GraphSAGE whose every tensor is sharded over a 3D grid (x, y, z).

    Layer ``l`` (roles O, I, P)::

        F'  = dropout(F_l)                       grid-independent mask (plexus.layers)
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

    Args:
        shard: this rank's :class:`~plexus.data.shard.GraphShard` (``shard.root`` set for
            ``model="sage"``).
        groups: the rank's axis groups ``{"x", "y", "z"}`` from ``ProcessGrid.create_groups``.
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

    Shapes:
        forward() -> logits [N/P, C_pad/O] of the last layer's roles, rows in output order,
        replicated over I.
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
    ) -> None:
        super().__init__()
        if model not in MODELS or norm not in NORMS or not 0 <= dropout < 1:
            raise ValueError(f"need model in {MODELS}, norm in {NORMS} and 0 <= dropout < 1; "
                             f"got {model!r}, {norm!r}, {dropout}")
        if model == "sage" and shard.root is None:
            raise ValueError("model 'sage' needs a shard built with aggregation 'mean'")
        if residual and shard.root is None:
            shard.root = root_blocks(shard.pr, shard.pc, shard.num_nodes, _shape(groups),
                                     _coords(groups), len(shard.widths) - 1)
        self.shard, self.groups, self.kind = shard, groups, model
        self.residual = residual
        self.seed, self.dropout, self.norm_kind = seed, dropout, norm
        self.num_layers = len(shard.widths) - 1
        self.block_shapes = [self._block_shape(layer) for layer in range(self.num_layers)]
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
        self.norms = nn.ModuleList(self._make_norm(layer) for layer in range(self.num_layers - 1)
                                   if norm != "none")
        block = shard.features_block
        if normalize_features:
            block = self._normalized(block)
        feat = flat_shard(block, groups["z"].size, groups["z"].rank)
        if learn_features:
            self.features = nn.Parameter(feat)
        else:
            self.register_buffer("features", feat)
        self.features_shape = tuple(block.shape)
        # With fixed input features and no dropout, H_0 = A_0 F_0 is the same in every pass:
        # compute it (with collectives 1 and 2) once and reuse it, saving one SpMM per pass.
        # With dropout only the evaluation pass could reuse it; there it is not worth holding
        # a second [N/P, D_0/I] block (common.perf.gcn counts the cache the same way).
        self.cache_first_aggregation = not learn_features and dropout == 0
        self._h0: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._ids: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, stats: CommStats | None = None, *, step: int = 0) -> torch.Tensor:
        """Logits (module docstring); ``step`` keys the dropout masks (the epoch)."""
        g = self.groups
        drop = self.training and self.dropout > 0
        f = None
        for layer in range(self.num_layers):
            _o_ax, i_ax, p_ax = layout.roles(layer)
            cached = layer == 0 and self.cache_first_aggregation and not drop
            skip = None
            if cached and self._h0 is not None:
                h, r = self._h0
            else:
                x = self._layer_input(layer, f, stats)
                f = None  # references are dropped as soon as they are spent: peak memory
                if self._has_skip(layer):
                    skip = self._skip(layer, x, stats)
                if drop:
                    x = apply_dropout(x, self._keep_mask(layer, step, x.device), self.dropout)
                h = self._spmm_o(self.shard.adj, layer, x, stats)
                r = self._spmm_o(self.shard.root, layer, x, stats) if self.kind == "sage" else None
                x = None
                if cached:
                    self._h0 = (h.detach(), None if r is None else r.detach())
            q = ops.GatheredMatmul.apply(h, self.weights[layer], g[p_ax],
                                      self.block_shapes[layer], stats)
            h = None
            if r is not None:
                q = q + ops.GatheredMatmul.apply(r, self.root_weights[layer], g[p_ax],
                                              self.block_shapes[layer], stats)
                r = None
            q = autograd.all_reduce_identity(q, g[i_ax], stats, inplace=True)  # q is fresh
            if len(self.biases):  # in place: the logits block is the largest activation
                q = q.add_(autograd.identity_all_reduce(self.biases[layer], g[p_ax], stats))
            if layer < self.num_layers - 1:
                if len(self.norms):
                    q = self.norms[layer](q, stats)
                q = ops.ReLU.apply(q)  # q is a fresh tensor: rectified in place
                if skip is not None:
                    q = q + skip
            f = q
        return f

    def _layer_input(self, layer: int, f: torch.Tensor | None, stats: CommStats | None):
        """F_l [N/O, D_l/I], replicated over P: layer 0 gathers its flat shard over P
        (collective 1; backward 8 reduce-scatters), later layers all-reduce dF over P."""
        p_group = self.groups[layout.roles(layer)[2]]
        if layer == 0:
            x = autograd.all_gather_reduce_scatter(self.features, p_group, stats=stats)
            return x[: math.prod(self.features_shape)].view(self.features_shape)
        return autograd.identity_all_reduce(f, p_group, stats)

    def _spmm_o(self, blocks, layer: int, x: torch.Tensor, stats: CommStats | None):
        """``B_l F_l`` for ``B`` = the adjacency (H_l) or the root blocks (R_l = S_l F_l),
        all-reduced over O (collective 2; backward 7)."""
        o_group = self.groups[layout.roles(layer)[0]]
        blk = blocks[layer % 6]
        h = ops.SpMM.apply(blk.a, blk.a_t, x)
        h = autograd.all_reduce_identity(h, o_group, stats, inplace=True)  # h is fresh
        return autograd.identity_all_reduce(h, o_group, stats)

    def _has_skip(self, layer: int) -> bool:
        return self.residual and 1 <= layer < self.num_layers - 1

    def _skip(self, layer: int, x: torch.Tensor, stats: CommStats | None) -> torch.Tensor:
        """F_l in the layout of layer l's output [N/P, D_l+1/O], replicated over I (the
        residual): rows through ``S_l`` (all-reduce over O), then this rank's I-chunk of
        columns placed at its columns of the O split and summed over I."""
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
        return autograd.all_reduce_identity(placed, g[i_ax], stats)

    def _input_ids(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(node ids [N/O], column ids [D_l/I]) of the rows and columns of F_l on this rank."""
        if layer not in self._ids:
            o_ax, i_ax, _ = layout.roles(layer)
            g, sh = self.groups, self.shard
            order = partition.layer_orders(layer % 2, sh.pr, sh.pc)[1]
            rows = _chunk(order, g[o_ax])
            width = sh.widths_padded[layer] // g[i_ax].size
            cols = torch.arange(width) + g[i_ax].rank * width
            self._ids[layer] = (rows, cols)
        return self._ids[layer]

    def _keep_mask(self, layer: int, step: int, device) -> torch.Tensor:
        rows, cols = self._input_ids(layer)
        return keep_mask(self.dropout, seed=self.seed, step=step, layer=layer, rows=rows,
                            cols=cols).to(device)

    def _output_rows(self, layer: int) -> torch.Tensor:
        """bool [N/P]: the rows of layer ``layer``'s output that are graph nodes."""
        _, _, p_ax = layout.roles(layer)
        g, sh = self.groups, self.shard
        order = partition.layer_orders(layer % 2, sh.pr, sh.pc)[0]
        return _chunk(order, g[p_ax]) < sh.num_nodes

    def _make_norm(self, layer: int) -> nn.Module:
        o_ax, _, p_ax = layout.roles(layer)
        g, width = self.groups, self.block_shapes[layer][1]
        if self.norm_kind == "batch":
            return ShardedBatchNorm(width, self._output_rows(layer), self.shard.num_nodes,
                                    g[p_ax])
        cols = torch.arange(width) + g[o_ax].rank * width
        return ShardedLayerNorm(width, cols < self.shard.widths[layer + 1],
                                self.shard.widths[layer + 1], g[o_ax], g[p_ax])

    @torch.no_grad()
    def _normalized(self, block: torch.Tensor) -> torch.Tensor:
        """PyG's NormalizeFeatures on the features block [N/X, D_0/Y]: x - min over the whole
        graph, then each row over its row sum (all-reduced over y) clamped to >= 1."""
        g, sh = self.groups, self.shard
        rows = _chunk(sh.pc, g["x"]) < sh.num_nodes
        width = block.shape[1]
        cols = torch.arange(width) + g["y"].rank * width < sh.widths[0]
        real = rows[:, None] & cols[None, :]
        vals = torch.where(real, block, torch.inf)
        low = (vals.min() if vals.numel() else torch.tensor(torch.inf)).reshape(1)
        for ax in ("x", "y"):
            low = coll.all_reduce(low, g[ax], op=dist.ReduceOp.MIN)
        shifted = torch.where(real, block - low, 0.0)
        sums = coll.all_reduce(shifted.sum(1), g["y"])
        return shifted / sums.clamp(min=1.0)[:, None]

    def _apply(self, fn, recurse=True):  # .to(device) etc. must not keep a stale cache
        self._h0 = None
        return super()._apply(fn, recurse)

    # ------------------------------------------------------------ full <-> shard maps
    def _block_shape(self, layer: int) -> tuple[int, int]:
        o_ax, i_ax, _ = layout.roles(layer)
        w_pad = self.shard.widths_padded
        return (w_pad[layer] // self.groups[i_ax].size, w_pad[layer + 1] // self.groups[o_ax].size)

    def shard_weight(self, full: torch.Tensor, layer: int) -> torch.Tensor:
        """This rank's flat shard of a full (unpadded) ``W_l`` [D_l, D_l+1] (or of any tensor
        laid out like it: its gradient, Adam moments)."""
        o_ax, i_ax, p_ax = layout.roles(layer)
        g = self.groups
        w_pad = self.shard.widths_padded
        padded = full.new_zeros(w_pad[layer], w_pad[layer + 1])
        padded[: full.shape[0], : full.shape[1]] = full
        blk = padded.chunk(g[i_ax].size, 0)[g[i_ax].rank].chunk(g[o_ax].size, 1)[g[o_ax].rank]
        return flat_shard(blk, g[p_ax].size, g[p_ax].rank)

    @torch.no_grad()
    def gather_weight(self, local: torch.Tensor, layer: int) -> torch.Tensor:
        """Inverse of :meth:`shard_weight`: the full unpadded [D_l, D_l+1] on every rank."""
        o_ax, i_ax, p_ax = layout.roles(layer)
        blk = ops.gather_flat(local, self.groups[p_ax], self.block_shapes[layer], None)
        full = coll.all_gather(coll.all_gather(blk, self.groups[i_ax], dim=0),
                            self.groups[o_ax], dim=1)
        return full[: self.shard.widths[layer], : self.shard.widths[layer + 1]]

    def shard_features(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's flat shard of full input features [N, D_0] in original node order."""
        g, sh = self.groups, self.shard
        padded = full.new_zeros(sh.num_nodes_padded, sh.widths_padded[0])
        padded[: full.shape[0], : full.shape[1]] = full
        rows = _chunk(sh.pc, g["x"])
        blk = padded[rows].chunk(g["y"].size, 1)[g["y"].rank]
        return flat_shard(blk, g["z"].size, g["z"].rank)

    @torch.no_grad()
    def gather_features(self, local: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`shard_features`: full [N, D_0] in original order, every rank."""
        blk = ops.gather_flat(local, self.groups["z"], self.features_shape, None)
        full_perm = coll.all_gather(coll.all_gather(blk, self.groups["y"], dim=1),
                                 self.groups["x"], dim=0)
        out = torch.empty_like(full_perm)
        out[torch.from_numpy(self.shard.pc)] = full_perm
        return out[: self.shard.num_nodes, : self.shard.widths[0]]

    def shard_vector(self, full: torch.Tensor, layer: int) -> torch.Tensor:
        """This rank's chunk [D_l+1_pad/O] of a full per-output-column vector [D_l+1] of layer
        ``layer`` (bias, norm parameters and statistics); padding is zero."""
        o_ax = layout.roles(layer)[0]
        padded = full.new_zeros(self.shard.widths_padded[layer + 1])
        padded[: full.numel()] = full
        return padded.chunk(self.groups[o_ax].size)[self.groups[o_ax].rank].clone()

    @torch.no_grad()
    def gather_vector(self, local: torch.Tensor, layer: int) -> torch.Tensor:
        """Inverse of :meth:`shard_vector`: the full [D_l+1] on every rank."""
        o_ax = layout.roles(layer)[0]
        return coll.all_gather(local, self.groups[o_ax])[: self.shard.widths[layer + 1]]

    def sharded_state(self) -> list[tuple[str, torch.Tensor, str, int | None]]:
        """(name, local tensor, kind, layer) of every parameter and statistic in a fixed
        order; kind ``weight``/``vector``/``features`` says which gather/shard pair maps it
        (:meth:`gather`, :meth:`shard_full`). Used by checkpoints."""
        out: list[tuple[str, torch.Tensor, str, int | None]] = []
        for layer in range(self.num_layers):
            out.append((f"w{layer}", self.weights[layer], "weight", layer))
            if len(self.root_weights):
                out.append((f"root{layer}", self.root_weights[layer], "weight", layer))
            if len(self.biases):
                out.append((f"b{layer}", self.biases[layer], "vector", layer))
            if len(self.norms) and layer < self.num_layers - 1:
                for key, t in [*self.norms[layer].named_parameters(),
                               *self.norms[layer].named_buffers()]:
                    if key in ("weight", "bias", "running_mean", "running_var"):
                        out.append((f"norm{layer}.{key}", t, "vector", layer))
        if isinstance(self.features, nn.Parameter):
            out.append(("features", self.features, "features", None))
        return out

    def gather(self, kind: str, local: torch.Tensor, layer: int | None) -> torch.Tensor:
        """The full tensor of a local one of :meth:`sharded_state` (collective)."""
        if kind == "features":
            return self.gather_features(local)
        assert layer is not None
        return (self.gather_weight if kind == "weight" else self.gather_vector)(local, layer)

    def shard_full(self, kind: str, full: torch.Tensor, layer: int | None) -> torch.Tensor:
        """This rank's shard of a full tensor of :meth:`sharded_state`'s ``kind``."""
        if kind == "features":
            return self.shard_features(full)
        assert layer is not None
        return (self.shard_weight if kind == "weight" else self.shard_vector)(full, layer)

    def slab(self, kind: str, layer: int | None) -> Slab:
        """Where this rank's tensor of :meth:`sharded_state`'s ``kind`` sits in the full one
        (a sharded checkpoint's description of :meth:`shard_full`; pure)."""
        g, sh = self.groups, self.shard
        if kind == "features":
            rows = _chunk(sh.pc, g["x"]).numpy()
            return _slab((sh.num_nodes, sh.widths[0]), rows,
                         (sh.widths_padded[0], g["y"]), (self.features_shape, g["z"]))
        assert layer is not None
        o_ax, i_ax, p_ax = layout.roles(layer)
        w_out = sh.widths_padded[layer + 1]
        if kind == "vector":
            return _slab((sh.widths[layer + 1],), (0, 1), (w_out, g[o_ax]), None)
        d_in = sh.widths_padded[layer] // g[i_ax].size
        rows = (g[i_ax].rank * d_in, (g[i_ax].rank + 1) * d_in)
        return _slab((sh.widths[layer], sh.widths[layer + 1]), rows, (w_out, g[o_ax]),
                     (self.block_shapes[layer], g[p_ax]))

    def full_weights(self, grads: bool = False) -> list[torch.Tensor]:
        """Every full (unpadded) ``W_l`` (or its gradient), on every rank (collective)."""
        return [self.gather_weight(w.grad if grads else w.detach(), layer)
                for layer, w in enumerate(self.weights)]

    def full_features(self, grads: bool = False) -> torch.Tensor:
        """The full input features [N, D_0] (or their gradient), original node order."""
        return self.gather_features(self.features.grad if grads else self.features.detach())
