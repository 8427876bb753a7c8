"""The full <-> local methods of :class:`plexus.model.PlexusGCN`: every parameter and statistic
it holds, by name, and the maps of :mod:`plexus.shards` applied to them (gather a full tensor,
cut a rank's shard of one, say where a shard sits). Checkpoints (plexus.checkpoint), the
optimizer and the parallel-equals-serial tests go through them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from common.grid import AxisGroup
from common.slab import Slab
from plexus import shards


class ShardedState:
    """Mixed into :class:`plexus.model.PlexusGCN`, which sets what it reads: ``maps``
    (:func:`plexus.shards.shard_maps`), ``groups`` (the rank's axis groups), ``num_layers``,
    and the ``weights``, ``root_weights``, ``att_src``, ``att_dst``, ``biases``, ``norms`` and
    ``features`` it holds."""

    maps: dict[tuple[str, int | None], shards.ShardMap]
    groups: Mapping[str, AxisGroup]
    num_layers: int
    weights: Any
    root_weights: Any
    att_src: Any
    att_dst: Any
    biases: Any
    norms: Any
    features: torch.Tensor

    def sharded_state(self) -> list[tuple[str, torch.Tensor, str, int | None]]:
        """(name, local tensor, kind, layer) of every parameter and statistic in a fixed
        order; (kind, layer) keys its map in :attr:`maps` (:meth:`gather`, :meth:`shard_full`,
        :meth:`slab`). Used by checkpoints and the optimizer."""
        out: list[tuple[str, torch.Tensor, str, int | None]] = []
        for layer in range(self.num_layers):
            out.append((f"w{layer}", self.weights[layer], "weight", layer))
            if len(self.att_src):  # GAT's attention vectors
                out += [(f"att_src{layer}", self.att_src[layer], "att", layer),
                        (f"att_dst{layer}", self.att_dst[layer], "att", layer)]
            if len(self.root_weights):
                out.append((f"root{layer}", self.root_weights[layer], "weight", layer))
            if len(self.biases):
                out.append((f"b{layer}", self.biases[layer], "vector", layer))
            if len(self.norms) and layer < self.num_layers - 1:
                for key, t in [*self.norms[layer].named_parameters(),
                               *self.norms[layer].named_buffers()]:
                    if key in ("weight", "bias", "running_mean", "running_var"):
                        out.append((f"norm{layer}.{key}", t, "vector", layer))
        if isinstance(self.features, torch.nn.Parameter):
            out.append(("features", self.features, "features", None))
        return out

    def gather(self, kind: str, local: torch.Tensor, layer: int | None) -> torch.Tensor:
        """The full tensor of a local one laid out as ``kind`` (collective)."""
        return shards.gather(local, self.maps[kind, layer], self.groups)

    def shard_full(self, kind: str, full: torch.Tensor, layer: int | None) -> torch.Tensor:
        """This rank's local tensor of a full one laid out as ``kind`` (pure)."""
        return shards.shard(full, self.maps[kind, layer], self.groups)

    def slab(self, kind: str, layer: int | None) -> Slab:
        """Where this rank's tensor of ``kind`` sits in the full one (pure)."""
        return shards.slab(self.maps[kind, layer], self.groups)

    def sharded_weights(self, full: list[torch.Tensor]) -> torch.nn.ParameterList:
        """A parameter of every layer's flat shard of the full weights ``full`` (one a layer,
        from layer 0; none: an empty list)."""
        return torch.nn.ParameterList(torch.nn.Parameter(self.shard_weight(w, layer))
                                      for layer, w in enumerate(full))

    def shard_weight(self, full: torch.Tensor, layer: int) -> torch.Tensor:
        """The flat shard of a full ``W_l`` [D_l, D_l+1] (or its gradient, Adam moments)."""
        return self.shard_full("weight", full, layer)

    def gather_weight(self, local: torch.Tensor, layer: int) -> torch.Tensor:
        return self.gather("weight", local, layer)

    def shard_vector(self, full: torch.Tensor, layer: int) -> torch.Tensor:
        """The chunk [D_l+1/O] of a full per-output-column vector [D_l+1] of layer ``layer``
        (bias, norm parameters and statistics); padding is zero."""
        return self.shard_full("vector", full, layer)

    def gather_vector(self, local: torch.Tensor, layer: int) -> torch.Tensor:
        return self.gather("vector", local, layer)

    def shard_features(self, full: torch.Tensor) -> torch.Tensor:
        """The flat shard of full input features [N, D_0] in original node order."""
        return self.shard_full("features", full, None)

    def gather_features(self, local: torch.Tensor) -> torch.Tensor:
        return self.gather("features", local, None)

    def full_weights(self, grads: bool = False) -> list[torch.Tensor]:
        """Every full (unpadded) ``W_l`` (or its gradient), on every rank (collective)."""
        return [self.gather_weight(w.grad if grads else w.detach(), layer)
                for layer, w in enumerate(self.weights)]

    def full_features(self, grads: bool = False) -> torch.Tensor:
        """The full input features [N, D_0] (or their gradient), original node order."""
        return self.gather_features(self.features.grad if grads else self.features.detach())
