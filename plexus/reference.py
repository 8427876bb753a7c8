"""The serial reference of the Plexus GCN: the model of plexus.model in dense torch, one process.

:class:`SerialGCN` is what :class:`plexus.model.PlexusGCN` computes on any grid, written with
nothing sharded: the same initial weights (:func:`plexus.weights.init_weights`), the same
dropout masks (:func:`plexus.dropout.dropout_mask`, keyed by node and column), the same norms,
residual and bias. The parallel == serial tests (tests/plexus/test_model.py, test_recipe.py)
compare every grid with it, and it is the shortest statement of the model. Layer ``l``::

    F'    = dropout(F_l)
    GCN:  Q = Â F' W_l                        Â = D^-1/2 (A + I) D^-1/2
    SAGE: Q = A_mean F' W_l + F' R_l           A_mean: mean over in-neighbours
    Q    += b_l
    F_l+1 = relu(norm(Q)) (+ F_l)              hidden layers; the last layer returns Q

Shapes: adjacency [N, N] (dense: small graphs only), F_l [N, D_l], W_l and R_l [D_l, D_l+1],
b_l [D_l+1], logits [N, C].
"""

from __future__ import annotations

import torch
from torch import nn

from plexus.config import check_recipe
from plexus.data.graph import Graph
from plexus.data.partition import mean_adjacency
from plexus.dropout import dropout_mask
from plexus.weights import ROOT_SEED_OFFSET, init_weights

__all__ = ["ROOT_SEED_OFFSET", "SerialGCN", "gcn_adjacency", "init_weights",
           "normalized_features"]


def gcn_adjacency(graph: Graph, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Dense ``Â = D^-1/2 (A + I) D^-1/2`` with rows = targets, from the edges directly (an
    oracle independent of plexus.data.partition; existing self-loops replaced by one).

    Shapes: -> [N, N]
    """
    n = graph.num_nodes
    a = torch.zeros(n, n, dtype=dtype)
    src, dst = graph.edge_index
    keep = src != dst
    a.index_put_((dst[keep], src[keep]), torch.ones(int(keep.sum()), dtype=dtype),
                 accumulate=True)
    a += torch.eye(n, dtype=dtype)
    dinv = a.sum(1).rsqrt()
    return dinv[:, None] * a * dinv[None, :]


def normalized_features(x: torch.Tensor) -> torch.Tensor:
    """PyG's ``NormalizeFeatures``: subtract the global minimum, divide each row by its sum
    clamped to >= 1."""
    x = x - x.min()
    return x / x.sum(1, keepdim=True).clamp(min=1.0)


class SerialGCN(nn.Module):
    """A dense GCN or GraphSAGE with the recipe of :class:`plexus.model.PlexusGCN`.

    Args:
        graph: the whole graph.
        widths: layer widths ``[D_0, hidden, ..., C]`` (:func:`plexus.layout.layer_widths`).
        model, learn_features, seed, dropout, bias, norm, normalize_features, residual: as
            :class:`~plexus.model.PlexusGCN`.
        dtype: of every tensor (float64: a reference to compare float32 runs with).

    Tensors are named as in ``PlexusGCN.sharded_state()`` (:meth:`named_tensors`), so
    gradients and states compare name by name.

    Shapes:
        forward() -> logits [N, C], rows in node order.
    """

    def __init__(self, graph: Graph, widths: list[int], *, model: str = "gcn",
                 learn_features: bool = False, seed: int = 0, dropout: float = 0.0,
                 bias: bool = False, norm: str = "none", normalize_features: bool = False,
                 residual: bool = False, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        check_recipe(model=model, norm=norm, dropout=dropout)
        self.kind, self.seed, self.dropout, self.residual = model, seed, dropout, residual
        self.num_layers = len(widths) - 1
        if model == "sage":
            adj = mean_adjacency(graph.edge_index.numpy(), graph.num_nodes).toarray()
            self.register_buffer("adj", torch.from_numpy(adj).to(dtype))
        else:
            self.register_buffer("adj", gcn_adjacency(graph, dtype))
        self.weights = nn.ParameterList(nn.Parameter(w.to(dtype))
                                        for w in init_weights(widths, seed))
        self.root_weights = nn.ParameterList(
            nn.Parameter(w.to(dtype)) for w in init_weights(widths, seed + ROOT_SEED_OFFSET)
            if model == "sage")
        self.biases, self.norms = layer_tails(widths, bias=bias, norm=norm, dtype=dtype)
        x = graph.x.to(dtype)
        x = normalized_features(x) if normalize_features else x
        if learn_features:
            self.features = nn.Parameter(x)
        else:
            self.register_buffer("features", x)

    def forward(self, *, step: int = 0) -> torch.Tensor:
        """Logits (module docstring); ``step`` keys the dropout masks (training mode only)."""
        f = self.features
        for layer in range(self.num_layers):
            f_in = f
            f = input_dropout(self, f, layer, step)                       # F'
            q = self.adj @ f @ self.weights[layer]                        # Â F' W_l
            if self.kind == "sage":
                q = q + f @ self.root_weights[layer]                      # + F' R_l
            if len(self.biases):
                q = q + self.biases[layer]                                # + b_l
            if layer < self.num_layers - 1:
                q = torch.relu(self.norms[layer](q) if len(self.norms) else q)
                if self.residual and layer >= 1:
                    q = q + f_in                                          # + F_l
            f = q
        return f

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and norm statistic by its name in ``PlexusGCN.sharded_state()``."""
        out: dict[str, torch.Tensor] = {}
        for layer in range(self.num_layers):
            out[f"w{layer}"] = self.weights[layer]
            if len(self.root_weights):
                out[f"root{layer}"] = self.root_weights[layer]
            out.update(layer_tail_tensors(self, layer))
        if isinstance(self.features, nn.Parameter):
            out["features"] = self.features
        return out


def layer_tails(widths: list[int], *, bias: bool, norm: str, dtype: torch.dtype
                ) -> tuple[nn.ParameterList, nn.ModuleList]:
    """A serial model's biases ``b_l`` [D_l+1] (zero; none without ``bias``) and the norms of
    its hidden layers (torch's ``BatchNorm1d`` or ``LayerNorm``, eps 1e-5)."""
    biases = nn.ParameterList(nn.Parameter(torch.zeros(d, dtype=dtype))
                              for d in widths[1:] if bias)
    kinds = {"batch": nn.BatchNorm1d, "layer": nn.LayerNorm}
    return biases, nn.ModuleList(kinds[norm](d, eps=1e-5, dtype=dtype)
                                 for d in widths[1:-1] if norm != "none")


def input_dropout(model: nn.Module, f: torch.Tensor, layer: int, step: int) -> torch.Tensor:
    """``F' = dropout(F_l)`` of a serial model (its ``training``, ``dropout``, ``seed``), the
    masks keyed by node and column (:func:`plexus.dropout.dropout_mask`)."""
    if not model.training or model.dropout == 0:
        return f
    rows, cols = torch.arange(f.shape[0]), torch.arange(f.shape[1])
    return f * dropout_mask(model.dropout, seed=model.seed, step=step, layer=layer,
                            rows=rows, cols=cols).to(f.dtype)


def layer_tail_tensors(model: nn.Module, layer: int) -> dict[str, torch.Tensor]:
    """A serial model's bias ``b{l}`` and norm tensors ``norm{l}.*`` of ``layer`` by name (its
    ``biases``, ``norms``, ``num_layers``)."""
    out: dict[str, torch.Tensor] = {}
    if len(model.biases):
        out[f"b{layer}"] = model.biases[layer]
    if len(model.norms) and layer < model.num_layers - 1:
        for key, t in [*model.norms[layer].named_parameters(),
                       *model.norms[layer].named_buffers()]:
            if key in ("weight", "bias", "running_mean", "running_var"):
                out[f"norm{layer}.{key}"] = t
    return out
