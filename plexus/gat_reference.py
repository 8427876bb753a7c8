"""The serial reference of graph attention (GAT): PyG's ``GATConv`` stack in dense torch, one
process, with the initial weights, dropout masks and recipe options of the Plexus models.

A layer ``l`` with ``K`` heads (Velickovic et al., ICLR 2018; PyG's ``GATConv``): a shared
linear map per head, scores from per-node terms, a softmax over each node's in-neighbours
(self-loops included), dropout on the coefficients, the heads concatenated in hidden layers
and averaged in the last::

    F'      = dropout(F_l)                              [N, D_l]
    G       = F' W_l                                    [N, K, c]   W_l [D_l, K c]
    s_j     = G_j . a_src      t_i = G_i . a_dst        [N, K]      per head
    e_ij    = LeakyReLU_0.2(t_i + s_j)                  edge j -> i, and i -> i
    alpha_ij = exp(e_ij - m_i) / sum_j' exp(e_ij' - m_i) m_i = max_j e_ij
    Q_i     = sum_j dropout(alpha)_ij G_j               [N, K, c]
    Q       = concat_heads(Q) or mean_heads(Q), + b_l   [N, D_l+1]
    F_l+1   = relu(norm(Q)) (+ F_l)                     hidden layers; the last returns Q

Hidden widths ``D_l+1`` are ``K c`` (c = D_l+1 / K); the last layer has ``K`` heads of the
``C`` classes, averaged. Duplicate edges count once (the adjacency is a set); existing
self-loops are replaced by one, as ``GATConv`` does. The attention dropout masks are keyed by
edge and head (:func:`plexus.dropout.edge_keep_mask`), the input's by node and column, so a
sharded model can draw the same ones.

Dense: the scores are ``[N, N, K]``, so small graphs only; it is the statement of the model
that parallel runs are compared with, in float64.

Shapes: F_0 [N, D_0], logits [N, C].
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn

from plexus.config import NORMS
from plexus.data.graph import Graph
from plexus.dropout import edge_keep_mask
from plexus.reference import input_dropout, layer_tail_tensors, layer_tails, normalized_features

__all__ = ["NEGATIVE_SLOPE", "SerialGAT", "attention_mask", "init_gat"]

NEGATIVE_SLOPE = 0.2  # of the LeakyReLU on the scores (GATConv's default)


def attention_mask(graph: Graph) -> torch.Tensor:
    """Dense ``[N, N]`` bool: entry (i, j) for every edge ``j -> i`` and every ``i -> i``."""
    n = graph.num_nodes
    src, dst = graph.edge_index
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[dst, src] = True
    mask.fill_diagonal_(True)
    return mask


def init_gat(widths: list[int], heads: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Per layer ``W`` [D_l, K c_l], ``att_src`` and ``att_dst`` [K, c_l] (c_l = D_l+1 / K in
    hidden layers, C in the last), Glorot-uniform from ``seed``, as ``GATConv`` draws its own
    (its ``lin`` without bias, its ``att_*`` of shape [1, K, c])."""
    gen = torch.Generator().manual_seed(seed)
    last = len(widths) - 2
    out = []
    for layer, (d_in, d_out) in enumerate(itertools.pairwise(widths)):
        c = d_out if layer == last else d_out // heads

        def glorot(rows: int, cols: int, fan_in: int, fan_out: int) -> torch.Tensor:
            bound = math.sqrt(6.0 / (fan_in + fan_out))
            return (torch.rand(rows, cols, generator=gen) * 2 - 1) * bound

        out.append({"w": glorot(d_in, heads * c, d_in, heads * c),
                    "att_src": glorot(heads, c, heads, c),
                    "att_dst": glorot(heads, c, heads, c)})
    return out


class SerialGAT(nn.Module):
    """A dense GAT with the recipe options of :class:`plexus.model.PlexusGCN`.

    Args:
        graph: the whole graph.
        widths: ``[D_0, hidden, ..., C]`` (:func:`plexus.layout.layer_widths`); every hidden
            width a multiple of ``heads``.
        heads: attention heads ``K`` of every layer.
        attention_dropout: rate of dropout on the attention coefficients (training mode).
        seed, dropout, bias, norm, normalize_features, residual: as ``PlexusGCN``.
        dtype: of every tensor (float64: a reference for float32 runs).

    Tensors are named ``w{l}``, ``att_src{l}``, ``att_dst{l}``, ``b{l}``, ``norm{l}.*``
    (:meth:`named_tensors`).

    Shapes:
        forward() -> logits [N, C], rows in node order.
    """

    def __init__(self, graph: Graph, widths: list[int], *, heads: int = 1,
                 attention_dropout: float = 0.0, seed: int = 0, dropout: float = 0.0,
                 bias: bool = True, norm: str = "none", normalize_features: bool = False,
                 residual: bool = False, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        if heads < 1 or any(d % heads for d in widths[1:-1]):
            raise ValueError(f"every hidden width must be a multiple of heads={heads}; "
                             f"got widths {widths}")
        if norm not in NORMS or not 0 <= dropout < 1 or not 0 <= attention_dropout < 1:
            raise ValueError(f"need norm in {NORMS} and 0 <= dropout, attention_dropout < 1; "
                             f"got {norm!r}, {dropout}, {attention_dropout}")
        self.heads, self.seed, self.residual = heads, seed, residual
        self.dropout, self.attention_dropout = dropout, attention_dropout
        self.num_layers = len(widths) - 1
        self.register_buffer("mask", attention_mask(graph))
        params = init_gat(widths, heads, seed)
        self.weights = nn.ParameterList(nn.Parameter(p["w"].to(dtype)) for p in params)
        self.att_src = nn.ParameterList(nn.Parameter(p["att_src"].to(dtype)) for p in params)
        self.att_dst = nn.ParameterList(nn.Parameter(p["att_dst"].to(dtype)) for p in params)
        self.biases, self.norms = layer_tails(widths, bias=bias, norm=norm, dtype=dtype)
        x = graph.x.to(dtype)
        self.register_buffer("features", normalized_features(x) if normalize_features else x)

    def forward(self, *, step: int = 0) -> torch.Tensor:
        """Logits (module docstring); ``step`` keys the dropout masks (training mode only)."""
        f = self.features
        for layer in range(self.num_layers):
            f_in = f
            q = self.attend(layer, input_dropout(self, f, layer, step), step)
            if len(self.biases):
                q = q + self.biases[layer]
            if layer < self.num_layers - 1:
                q = torch.relu(self.norms[layer](q) if len(self.norms) else q)
                if self.residual and layer >= 1:
                    q = q + f_in
            f = q
        return f

    def coefficients(self, layer: int, f: torch.Tensor) -> torch.Tensor:
        """The attention coefficients ``alpha`` [N, N, K] of ``layer`` on its input ``f``
        (before their dropout); zero off the edges."""
        g = self._heads(layer, f)
        s = torch.einsum("jkc,kc->jk", g, self.att_src[layer])
        t = torch.einsum("ikc,kc->ik", g, self.att_dst[layer])
        e = torch.nn.functional.leaky_relu(t[:, None, :] + s[None, :, :], NEGATIVE_SLOPE)
        e = e.masked_fill(~self.mask[:, :, None], -math.inf)
        return torch.softmax(e, dim=1)

    def attend(self, layer: int, f: torch.Tensor, step: int = 0) -> torch.Tensor:
        """One layer's attention aggregation of ``f`` (already dropped out): the heads
        concatenated (hidden layers) or averaged (the last), no bias. Shapes: [N, D_l] ->
        [N, D_l+1]."""
        g = self._heads(layer, f)
        alpha = self.coefficients(layer, f)
        if self.training and self.attention_dropout > 0:
            dst, src = self.mask.nonzero(as_tuple=True)
            keep = edge_keep_mask(self.attention_dropout, seed=self.seed, step=step,
                                  layer=layer, dst=dst, src=src, heads=self.heads)
            scale = torch.zeros_like(alpha)
            scale[dst, src] = keep.to(alpha.dtype) / (1.0 - self.attention_dropout)
            alpha = alpha * scale
        q = torch.einsum("ijk,jkc->ikc", alpha, g)
        if layer == self.num_layers - 1:
            return q.mean(dim=1)
        return q.reshape(q.shape[0], -1)

    def _heads(self, layer: int, f: torch.Tensor) -> torch.Tensor:
        return (f @ self.weights[layer]).view(f.shape[0], self.heads, -1)

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and norm statistic by name (the class docstring)."""
        out: dict[str, torch.Tensor] = {}
        for layer in range(self.num_layers):
            out.update({f"{name}{layer}": ts[layer] for name, ts in (
                ("w", self.weights), ("att_src", self.att_src), ("att_dst", self.att_dst))})
            out.update(layer_tail_tensors(self, layer))
        return out
