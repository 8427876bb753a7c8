"""How the GPT lies on the 4D grid ``data x depth x row x col``
(docs/design/llm-4d-goldfish.md), as data: the layout of every parameter (:class:`ShardSpec`,
:func:`param_specs`) and of the batch (:func:`batch_shard`). Pure: no communication.

Layout of each parameter (dims zero-padded to a multiple of the axis size):

=====================  =================  ==========================  ====================
parameter              full shape         split (dim 0, dim 1)        then
=====================  =================  ==========================  ====================
q, k, v, gate, up      [out, in]          row, col  (normal)          flat, 1/Z over depth
o_proj, down_proj      [out, in]          col, row  (transposed)      flat, 1/Z over depth
lm_head                [V, D]             row, col  (normal)          flat, 1/Z over depth
tok_emb                [V, D]             -, col                      flat, 1/Z over depth
RMSNorm weights        [D]                col                         replicated on depth
=====================  =================  ==========================  ====================

Each Linear's sizes and whether it is transposed come from the model's shape
(:meth:`common.perf.gpt.GPTShape.linears`, which the performance model counts too); this module
names them. Embeddings are untied on a tensor-parallel grid (a tie would couple two
differently sharded tensors). On a grid with depth = row = col = 1 every parameter keeps its
full, natural shape (the fast path). The batch is split over data, then depth.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from common import flat
from common.grid import AxisGroup, ceil_div
from llm.config import GPTConfig

# A block's sub-modules in forward order, each after its RMSNorm, with their Linears in the
# order they are registered (forward order), which is the order the model's shape lists their
# sizes in (GPTShape.linears: q, k, v, o, gate, up, down, then the LM head)
BLOCK = (("attn_norm", "attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
         ("mlp_norm", "mlp", ("gate_proj", "up_proj", "down_proj")))
BLOCK_LINEARS = tuple(f"{module}.{proj}" for _, module, projs in BLOCK for proj in projs)


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter of the serial GPT is laid out on the grid.

    Attributes:
        shape: full (serial) shape.
        axes: for each tensor dim, the grid axis splitting it, or None.
        flat: the block is flattened and split 1/Z over depth (zero-padded to Z chunks;
            :func:`common.flat.flat_shard`).
        replicated: axes other than data over which every member holds the same shard.
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    flat: bool = False
    replicated: tuple[str, ...] = ()

    def block_shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        """Shape of this rank's block before flattening (padded dims divided by the axis)."""
        return tuple(ceil_div(n, sizes[a]) if a else n for n, a in zip(self.shape, self.axes))

    def shard_numel(self, sizes: Mapping[str, int]) -> int:
        return flat.shard_size(math.prod(self.block_shape(sizes)), sizes["depth"])

    def shard_shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        """Shape of this rank's shard: ``(shard_numel,)`` when flat, else the block's."""
        return (self.shard_numel(sizes),) if self.flat else self.block_shape(sizes)

    @property
    def transposed(self) -> bool:
        """A Linear's weight split (col, row): its input is split over row (o_proj,
        down_proj)."""
        return self.axes == ("col", "row")


def is_tensor_parallel(sizes: Mapping[str, int]) -> bool:
    return any(sizes[a] > 1 for a in ("depth", "row", "col"))


def param_specs(config: GPTConfig, sizes: Mapping[str, int]) -> dict[str, ShardSpec]:
    """Layout of every GPT parameter (the module's table), keyed by its state_dict name."""
    d, v = config.d_model, config.vocab_size
    tp = is_tensor_parallel(sizes)  # if not: the fast path, full tensors in natural shapes
    specs: dict[str, ShardSpec] = {}

    def add(name: str, shape: tuple[int, ...], axes: tuple[str | None, ...], flat: bool,
            replicated: tuple[str, ...]) -> None:
        specs[name] = ShardSpec(shape, axes if tp else (None,) * len(shape), flat and tp,
                                replicated if tp else ())

    def linear(name: str, in_features: int, out_features: int, transposed: bool) -> None:
        add(name, (out_features, in_features), ("col", "row") if transposed else ("row", "col"),
            True, ())

    def norm(name: str) -> None:
        add(name, (d,), ("col",), False, ("row", "depth"))

    *block, head = config.linears()
    sizes_of = {name: (n_in, n_out, t) for name, (n_in, n_out, t, _) in zip(BLOCK_LINEARS, block)}
    add("tok_emb.weight", (v, d), (None, "col"), True, ("row",))
    for i in range(config.num_layers):
        for norm_name, module, projections in BLOCK:
            norm(f"blocks.{i}.{norm_name}.weight")
            for proj in projections:
                linear(f"blocks.{i}.{module}.{proj}.weight", *sizes_of[f"{module}.{proj}"])
    norm("norm.weight")
    if not config.tie_embeddings:
        linear("lm_head.weight", *head[:3])
    return specs


def batch_shard(batch: Tensor, groups: Mapping[str, AxisGroup], pad_value: int | bool) -> Tensor:
    """This rank's rows of a global batch, split over data then depth (depth fastest).

    Rows are padded with ``pad_value`` up to a multiple of data * depth (padding rows carry
    ignored targets, so they change no loss or gradient).

    Shapes:
        batch: [B, T] -> [ceil(B / (D * Z)), T]
    """
    parts = groups["data"].size * groups["depth"].size
    index = groups["data"].rank * groups["depth"].size + groups["depth"].rank
    rows = ceil_div(batch.shape[0], parts)
    if rows * parts != batch.shape[0]:
        pad = batch.new_full((rows * parts - batch.shape[0], *batch.shape[1:]), pad_value)
        batch = torch.cat((batch, pad))
    return batch[index * rows : (index + 1) * rows]
