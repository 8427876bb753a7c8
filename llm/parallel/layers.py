"""Layers of the 4D-parallel GPT: the 3D tensor-parallel Linear, embedding and RMSNorm.

docs/design/llm-4d-goldfish.md section 2 (AxoNN, Singh et al.
https://arxiv.org/abs/2305.13525). A grid ``data x depth x row x col`` of sizes
``D x Z x R x C``; this module uses row, col and depth.

A *normal* Linear ``y = x W^T`` (W: out x in) stores the block ``W[out/R (row r), in/C (col c)]``,
flattened and split 1/Z over depth (:mod:`common.flat`)::

    forward:   W_blk = all-gather(W_shard) over depth
               y = all-reduce(x W_blk^T) over col
    backward:  W_blk = all-gather(W_shard) over depth again (not kept from forward)
               dX = all-reduce(dY W_blk) over row         (OAR: overlapped with the dW GEMM)
               dW_shard = reduce-scatter(dY^T x) over depth (ORS: waited when backward ends)

A *transposed* Linear swaps row and col: block ``W[out/C, in/R]``, forward all-reduce over row,
backward all-reduce over col. With the residual stream split over col (replicated over row),
q, k, v, gate and up are normal (heads and d_ff split over row) and o_proj and down_proj are
transposed, so attention and the MLP need no re-layout between their GEMMs. OAG prefetches the
next Linear's depth all-gather (forward order in forward, reverse order in backward).

Mixed precision (a compute ``dtype``, e.g. bf16; the parameters stay float32 master shards):
each shard is cast before its depth all-gather, the GEMMs and the row/col all-reduces of
activations run in the compute dtype, dW is reduce-scattered in the dtype :class:`DepthGrads`
is given and lands in the float32 ``.grad``; RMSNorm statistics stay float32.

Every overlap is a switch (:class:`Overlap`); the arithmetic is the same either way, so the
results are bitwise identical with overlap on or off. :class:`OverlapCounts` counts the
collectives that really overlapped (the evidence that a switch took effect).

Shapes legend (``B`` local batch rows, ``T`` sequence, ``D`` d_model padded to a multiple of C,
``V`` vocabulary padded to a multiple of R): residual stream ``[B, T, D/C]``; normal Linear
``[..., in/C] -> [..., out/R]``; transposed ``[..., in/R] -> [..., out/C]``; a flat weight shard
``[ceil(out_blk * in_blk / Z)]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.functional import embedding, linear

from common import flat
from common.autograd import all_reduce_all_reduce
from common.collectives import CommHandle, all_reduce
from common.comm_stats import CommStats
from common.grid import AxisGroup
from llm.config import Overlap

ORS_WINDOW = 2  # deferred dW reduce-scatters in flight beyond the newest (DepthGrads)


@dataclass
class OverlapCounts:
    """Collectives that overlapped with compute, per switch; zero where a switch is off or its
    group has one rank (nothing to overlap). Owned by the model, reset by the caller.

    Attributes:
        oar: backward dX all-reduces waited only after the dW GEMM.
        ors: depth reduce-scatters of dW waited only when backward ended.
        oag: depth all-gathers issued one Linear ahead (prefetches consumed).
    """

    oar: int = 0
    ors: int = 0
    oag: int = 0

    def reset(self) -> None:
        self.oar = self.ors = self.oag = 0


class DepthWeights:
    """The depth all-gathers of every parallel Linear's weight, with the OAG prefetch.

    Linears are registered in forward order. A pass is a forward (from :meth:`begin_forward`)
    or a backward (from the first ``get(backward=True)``). Each gathered block is used once
    per pass and then dropped (only the prefetched next one is held). A prefetch is issued
    only for a Linear not yet used in the current pass, so every prefetch is consumed in that
    pass and all ranks of a depth group issue the same collectives in the same order.

    Activation checkpointing reruns each block's forward inside the backward pass: a ``get``
    with ``backward=False`` during a backward pass is such a *recompute*. Its gathered blocks
    are kept until the backward of the same Linear takes them (autograd finishes a block's
    backward right after its recompute, so at most one transformer block's weights are
    held), so checkpointing adds no depth all-gather. A recompute prefetches ``index + 1``
    unless the backward already passed it (never across the block's end).

    Args:
        dtype: the compute dtype: shards are cast to it before they are gathered (bf16
            moves half the bytes of fp32); None keeps the shards' dtype.
    """

    def __init__(self, depth: AxisGroup, *, prefetch: bool, stats: CommStats | None,
                 counts: OverlapCounts | None = None, dtype: torch.dtype | None = None) -> None:
        self.depth, self.stats, self.dtype = depth, stats, dtype
        self.counts = OverlapCounts() if counts is None else counts
        self.prefetch = prefetch and depth.size > 1
        self.layers: list[ParallelLinear] = []
        self._pending: dict[int, CommHandle] = {}
        self._kept: dict[int, Tensor] = {}  # recomputed blocks, until their backward
        self._used: set[int] = set()  # Linears used in this pass (recomputes not counted)
        self._backward = self._recompute = False

    def register(self, layer: ParallelLinear) -> int:
        self.layers.append(layer)
        return len(self.layers) - 1

    def begin_forward(self) -> None:
        """Start a forward pass; prefetches the first Linear's weight."""
        self._new_pass(backward=False)
        if self.prefetch and self.layers:
            self._pending[0] = self._start(0)

    def end_pass(self) -> None:
        """Drop whatever the pass still holds (call when a backward pass ended)."""
        self._new_pass(backward=False)

    def get(self, index: int, *, backward: bool) -> Tensor:
        """The full block ``[out_blk, in_blk]`` of Linear ``index``; prefetches the next one."""
        if backward:
            if not self._backward:
                self._new_pass(backward=True)
            self._recompute = False
        elif self._backward and not self._recompute:  # a checkpointed block's recompute
            self._recompute, self._kept = True, {}
        weight = self._kept.pop(index, None) if backward else None
        if weight is None:
            handle = self._pending.pop(index, None)
            if handle is None:
                handle = self._start(index)
            else:
                self.counts.oag += 1
            weight = handle.wait()
            if self._recompute:
                self._kept[index] = weight
        if not self._recompute:
            self._used.add(index)
        nxt = index - 1 if backward else index + 1
        if (self.prefetch and 0 <= nxt < len(self.layers) and nxt not in self._used
                and nxt not in self._pending and nxt not in self._kept):
            self._pending[nxt] = self._start(nxt)
        return weight

    def _start(self, index: int) -> CommHandle:
        """The async gather of Linear ``index``'s block from its flat shards over depth."""
        layer = self.layers[index]
        shard = layer.weight.detach()
        if self.dtype is not None:
            shard = shard.to(self.dtype)  # cast before the gather: it moves compute-dtype bytes
        return flat.gather(shard, self.depth, layer.block_shape, stats=self.stats,
                           async_op=True)

    def _new_pass(self, backward: bool) -> None:
        for handle in self._pending.values():  # never left over in practice; keeps ranks in step
            handle.wait()
        self._pending, self._kept, self._used = {}, {}, set()
        self._backward, self._recompute = backward, False


class DepthGrads:
    """Reduce-scatters each Linear's dW block over depth into its flat shard's ``.grad``.

    With ``defer`` (ORS) the reduce-scatters are issued asynchronously, at most
    :data:`ORS_WINDOW` + 1 in flight: adding one more waits for the oldest, so the full dW
    blocks held at once stay bounded (the planner counts them:
    ``common.perf.gpt.ORS_WINDOW``); :meth:`finish` waits for the rest. Without ``defer``
    each is waited at once. Either way the same sums are accumulated
    into ``.grad`` in the same order. The sums arrive in the dtype of the dW block, or in
    ``dtype`` if given, and are accumulated into ``.grad`` in the parameter's dtype (bf16
    blocks into fp32 master shards).
    """

    def __init__(self, depth: AxisGroup, *, defer: bool, stats: CommStats | None,
                 counts: OverlapCounts | None = None, dtype: torch.dtype | None = None) -> None:
        self.depth, self.defer, self.stats, self.dtype = depth, defer, stats, dtype
        self.counts = OverlapCounts() if counts is None else counts
        self._pending: list[tuple[nn.Parameter, CommHandle]] = []

    def add(self, param: nn.Parameter, grad_block: Tensor) -> None:
        """Shapes: grad_block [out_blk, in_blk] -> param.grad [ceil(out_blk*in_blk / Z)]."""
        if self.dtype is not None:
            grad_block = grad_block.to(self.dtype)
        handle = flat.reduce_scatter(grad_block, self.depth, stats=self.stats, async_op=True)
        self._pending.append((param, handle))
        if not self.defer:
            self.finish()
            return
        if self.depth.size > 1:
            self.counts.ors += 1
        while len(self._pending) > ORS_WINDOW + 1:
            self._accumulate(*self._pending.pop(0))  # oldest first: the same order of sums

    def finish(self) -> None:
        """Wait for every pending reduce-scatter and accumulate it into ``.grad``."""
        for param, handle in self._pending:
            self._accumulate(param, handle)
        self._pending = []

    @staticmethod
    def _accumulate(param: nn.Parameter, handle: CommHandle) -> None:
        grad = handle.wait().to(param.dtype)
        if param.grad is None:
            param.grad = grad.view_as(param)  # a fresh tensor: safe to adopt
        else:
            param.grad += grad


class _LinearFn(torch.autograd.Function):
    """``y = x W^T`` with the collectives of the module docstring; dW goes to DepthGrads."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, layer: ParallelLinear) -> Tensor:
        w = layer.weights.get(layer.index, backward=False)  # [out_blk, in_blk]
        ctx.layer = layer
        ctx.save_for_backward(x)
        y = linear(x, w)  # [..., out_blk], partial over reduce_group
        return all_reduce(y, layer.reduce_group, stats=layer.stats, inplace=True)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, None, None]:
        layer: ParallelLinear = ctx.layer
        (x,) = ctx.saved_tensors
        w = layer.weights.get(layer.index, backward=True)  # [out_blk, in_blk]
        handle = None
        if ctx.needs_input_grad[0]:
            dx = torch.matmul(dy, w)  # [..., in_blk], partial over grad_group
            handle = all_reduce(dx, layer.grad_group, stats=layer.stats, async_op=True,
                                inplace=True)
            if not layer.overlap.oar:
                handle.wait()
            elif layer.grad_group.size > 1:
                layer.weights.counts.oar += 1  # waited below, after the dW GEMM
        out_blk, in_blk = layer.block_shape
        dw = dy.reshape(-1, out_blk).t() @ x.reshape(-1, in_blk)  # [out_blk, in_blk]
        layer.grads.add(layer.weight, dw)
        return (handle.wait() if handle is not None else None), None, None


class ParallelLinear(nn.Module):
    """One Linear of the 3D tensor-parallel scheme (see the module docstring).

    Args:
        weight_shard: this rank's flat shard of its weight block.
        block_shape: (out_blk, in_blk) of the block before flattening.
        transposed: False for a normal Linear (reduce over col, dX over row), True for a
            transposed one (reduce over row, dX over col).
        groups: the rank's axis groups (``row``, ``col``, ``depth`` are used).
        weights, grads: the model's shared :class:`DepthWeights` and :class:`DepthGrads`.
        overlap: the overlap switches.
        stats: byte accounting (may be None).

    Shapes:
        normal: x [..., in/C] -> [..., out/R]; transposed: x [..., in/R] -> [..., out/C]
    """

    def __init__(self, weight_shard: Tensor, block_shape: tuple[int, int], *, transposed: bool,
                 groups: dict[str, AxisGroup], weights: DepthWeights, grads: DepthGrads,
                 overlap: Overlap, stats: CommStats | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight_shard)
        self.block_shape = tuple(block_shape)
        self.transposed = transposed
        self.reduce_group = groups["row" if transposed else "col"]
        self.grad_group = groups["col" if transposed else "row"]
        self.weights, self.grads, self.overlap, self.stats = weights, grads, overlap, stats
        self.index = weights.register(self)

    def forward(self, x: Tensor) -> Tensor:
        if self.weights.dtype is not None:
            x = x.to(self.weights.dtype)  # a no-op on the compute-dtype residual stream
        return _LinearFn.apply(x, self.weight, self)

    def extra_repr(self) -> str:
        kind = "transposed" if self.transposed else "normal"
        return f"{kind}, block={self.block_shape}, shard={tuple(self.weight.shape)}"


class ParallelEmbedding(nn.Module):
    """Token embedding whose block ``E[:, D/C (col c)]`` is flattened and split over depth.

    Forward: all-gather over depth, then a lookup; backward: reduce-scatter over depth
    (synchronous: it is the last collective of the backward pass). Replicated over row.
    With a compute ``dtype`` the shard is cast before the gather and the output is in that
    dtype, but the lookup runs on a float32 copy of the table: its backward sums the
    gradients of every occurrence of a token, which bf16 would stall (10,000 x 0.01 sums to
    4, not 100).

    Shapes:
        idx: int64 [B, T] -> [B, T, D/C]
    """

    def __init__(self, weight_shard: Tensor, block_shape: tuple[int, int], depth: AxisGroup,
                 stats: CommStats | None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight_shard)
        self.block_shape, self.depth, self.stats = tuple(block_shape), depth, stats
        self.dtype = dtype

    def forward(self, idx: Tensor) -> Tensor:
        shard = self.weight if self.dtype is None else self.weight.to(self.dtype)
        table = flat.all_gather_reduce_scatter(shard, self.depth, self.block_shape,
                                               self.stats)  # [V, D/C]
        if self.dtype is None:
            return embedding(idx, table)
        return embedding(idx, table.float()).to(self.dtype)


class ParallelRMSNorm(nn.Module):
    """RMSNorm over a hidden dimension split over col: ``x / sqrt(sum(x^2) / dim + eps) * w``.

    The local sum of squares is all-reduced over col in forward, and its gradient in backward
    (every member's normalised chunk depends on the whole sum). Padded entries of the hidden
    are zero, so dividing by the true ``dim`` gives the serial result. The statistics are
    float32 whatever the dtype of ``x``; the output has the dtype of ``x``.

    Shapes:
        x: [..., D/C] -> [..., D/C]; weight [D/C]
    """

    def __init__(self, weight_shard: Tensor, dim: int, eps: float, col: AxisGroup,
                 stats: CommStats | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight_shard)
        self.dim, self.eps, self.col, self.stats = dim, eps, col, stats

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        sum_sq = xf.pow(2).sum(dim=-1, keepdim=True)  # [..., 1], partial over col
        sum_sq = all_reduce_all_reduce(sum_sq, self.col, self.stats)
        normed = xf * torch.rsqrt(sum_sq / self.dim + self.eps)
        return normed.type_as(x) * self.weight.to(x.dtype)
