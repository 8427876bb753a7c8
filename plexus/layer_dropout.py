"""``F' = dropout(F_l)`` on this rank's block of a layer's input, with the serial model's masks.

The mask of entry (node, column) is hashed from the node and column ids
(:func:`plexus.dropout.keep_mask`), so a rank draws exactly the entries of the block it holds
and any grid drops what one rank drops. :class:`LayerDropout` holds the ids of this rank's
rows and columns of every layer's ``F_l``, made once per device. On a GPU with Triton the mask
is hashed inside the kernel that applies it, forward and backward
(:func:`plexus.dropout.drop_block`); elsewhere it is drawn, applied and kept as bits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from common.grid import AxisGroup
from plexus import layout
from plexus.data import partition
from plexus.data.shard import GraphShard
from plexus.dropout import drop_block, dropped, hashed_dropout, keep_mask, step_tensor
from plexus.ops import BitMask
from plexus.shards import node_chunk
from plexus.triton_switch import uses_triton


class HashedMask(NamedTuple):
    """A mask kept as its key: ``layer`` and ``step`` (the step tensor the Triton kernels
    read, :meth:`LayerDropout.step_of`)."""

    layer: int
    step: torch.Tensor


class LayerDropout:
    """Dropout with rate ``p`` and ``seed`` on the blocks ``F_l`` [N/O, D_l/I] of ``shard``
    held by the rank of ``groups`` (training passes only: the model calls it in training)."""

    def __init__(self, p: float, seed: int, shard: GraphShard,
                 groups: dict[str, AxisGroup]) -> None:
        self.p, self.seed, self.shard, self.groups = p, seed, shard, groups
        self._ids: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self._steps: dict[torch.device, tuple[int, torch.Tensor]] = {}  # on CUDA devices

    def step_of(self, step: int, device) -> int | torch.Tensor:
        """``step`` as the masks of a pass on ``device`` take it: where the Triton kernels hash
        them (:func:`plexus.triton_switch.uses_triton`) the int64 [1] tensor there that they read
        (written when the step changes, and never while a CUDA graph is being captured: the
        graph's replays read what :meth:`set_step` writes before each), elsewhere the int."""
        device = torch.device(device)
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not uses_triton(device):  # (the torch hash takes the int: no read back)
            if capturing:  # a graph would replay this step's masks every epoch
                raise RuntimeError("dropout masks in a CUDA graph need Triton's kernels, "
                                   "which do not run here")
            return step
        held = self._steps.get(device)
        if held is None:
            if capturing:  # (the tensor would be made, and its step written, by the graph)
                raise RuntimeError("the dropout step's tensor must exist before a capture")
            held = self._steps[device] = (step, step_tensor(step, device))
        elif held[0] != step and not capturing:
            held[1].fill_(step)
            held = self._steps[device] = (step, held[1])
        return held[1]

    def set_step(self, step: int) -> None:
        """Write ``step`` where the kernels on every CUDA device read it (before a CUDA
        graph's replay)."""
        for device in list(self._steps):
            self.step_of(step, device)

    def kept(self, layer: int, step: int, device) -> BitMask | HashedMask:
        """The mask of ``layer``'s input at ``step``, to apply again later (a pass remade or
        recomputed in backward, :meth:`__call__`'s ``kept``): where the Triton kernels run,
        its key (the kernel that applies it hashes it again: nothing of the block's size is
        kept), else the mask drawn now, as bits."""
        device = torch.device(device)
        if uses_triton(device):
            return HashedMask(layer, self.step_of(step, device))
        return BitMask(self.mask(layer, step, device))

    def __call__(self, layer: int, f: torch.Tensor, step: int,
                 kept: BitMask | HashedMask | None = None) -> torch.Tensor:
        """F' = dropout(F_l) with the mask of ``step``; ``kept``: the mask drawn already, as
        bits (then no graph is built: F' of fixed features, recomputed or remade)."""
        if self.p == 0:
            return f
        if isinstance(kept, HashedMask):  # (no graph: F' of fixed features)
            rows, cols = self.ids(kept.layer, f.device)
            out = hashed_dropout(f, self.p, seed=self.seed, step=kept.step, layer=kept.layer,
                                 rows=rows, cols=cols, grad=False)
            if out is not None:
                return out
            # (bf16 F_0, whose scaling is not the kernel's): the mask from the same key,
            # the step read on the device by the keep kernel
            kept = BitMask(keep_mask(self.p, seed=self.seed, step=kept.step, layer=kept.layer,
                                     rows=rows, cols=cols, device=f.device))
        if f.dtype != torch.float32:  # bf16 F_0 (no gradient): scaled in float32, rounded once
            scaled = f.mul(1.0 / (1.0 - self.p))
            if kept is not None:
                return kept.clear_(scaled)
            return scaled.masked_fill_(~self.mask(layer, step, f.device), 0.0)
        if kept is not None:
            return dropped(f, kept, self.p)
        # F_l is read by nothing after this, F' feeds the aggregation or H W alone: in place.
        # On a GPU one Triton kernel each way hashes the mask where it applies it
        rows, cols = self.ids(layer, f.device)
        return drop_block(f, self.p, seed=self.seed, step=self.step_of(step, f.device),
                          layer=layer, rows=rows, cols=cols, spent=True)

    def mask(self, layer: int, step: int, device) -> torch.Tensor:
        """The keep-mask of ``layer``'s input at ``step``, bool [N/O, D_l/I], drawn on
        ``device`` from the ids of this rank's rows and columns (:meth:`ids`)."""
        rows, cols = self.ids(layer, device)
        return keep_mask(self.p, seed=self.seed, step=self.step_of(step, device), layer=layer,
                         rows=rows, cols=cols, device=device)

    def ids(self, layer: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The global ids of this rank's rows (nodes) and columns of ``layer``'s input, on
        ``device``: made once per device (a copy from host memory every step would make the
        host wait for a GPU)."""
        device = torch.device(device)
        if (layer, device) not in self._ids:
            o_ax, i_ax, _ = layout.roles(layer)
            order = partition.layer_orders(layer % 2, self.shard.pr, self.shard.pc)[1]
            width = self.shard.widths_padded[layer] // self.groups[i_ax].size
            cols = torch.arange(width) + self.groups[i_ax].rank * width
            self._ids[layer, device] = (node_chunk(order, self.groups[o_ax]).to(device),
                                        cols.to(device))
        return self._ids[layer, device]
