"""The autograd operators of one Plexus GCN layer (docs/design/plexus-3d.md sections 1 and 4).

Each is a ``torch.autograd.Function`` with both passes written out, so the collectives and the
memory kept for backward are explicit: plexus.model composes them into the layer.

bf16 (``PlexusGCN(precision="bf16")``, docs/design/plexus-3d.md section 11): the SpMMs take a
bf16 X and sum in float32 (plexus.sparse); :class:`GatheredMatmul` keeps H in bf16 for ``dW``;
:class:`Rounded` (rounding H to bf16 values in place) and :class:`StoredIn` (the tensors
autograd saves, the norm's, kept in bf16) are plexus.bf16's, re-exported here. Gradients stay
float32 tensors throughout.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch

from common import collectives as coll
from common import dense, flat
from common.grid import AxisGroup
from plexus.bf16 import Rounded, StoredIn
from plexus.csr import numba_kernels
from plexus.sparse import sum_dtype
from plexus.triton_switch import launch, triton_function

__all__ = ["BitMask", "BlockedAggregation", "GatheredMatmul", "ReLU", "RecomputedMatmul",
           "RemadeInputMatmul", "Rounded", "SharedGradient", "SpMM", "StoredIn"]


class SharedGradient:
    """One input's gradient that several autograd Functions each add a term to, summed in one
    buffer: the first term's backward to run keeps its product here and hands autograd
    nothing for the input, the next ones add theirs into it, and the last hands autograd the
    sum. GraphSAGE's ``dF = A^T dH + S^T dR`` is then one [N/O, D_l/I] block where autograd
    would hold two and add them. Every one of ``terms`` backwards must run (each Function's
    input is the same tensor, so autograd runs all of them or none)."""

    def __init__(self, terms: int) -> None:
        self.terms, self.seen, self.buffer = terms, 0, None

    def add(self, make: Any, add_into: Any) -> torch.Tensor | None:
        """``make()``: this term as a new tensor; ``add_into(buffer)``: this term added into
        ``buffer``. Returns the sum after the last term, else None."""
        self.seen += 1
        if self.buffer is None:
            self.buffer = make()
        else:
            add_into(self.buffer)
        if self.seen < self.terms:
            return None
        out, self.buffer, self.seen = self.buffer, None, 0
        return out


def read_in(f: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``f`` as an SpMM reads it: in ``dtype`` (bf16: half the bytes of the rows it gathers),
    or as it is where ``dtype`` is None or ``f``'s own."""
    return f if dtype is None else dense.converted(f, dtype)


class SpMM(torch.autograd.Function):
    """``A @ F`` for a :class:`~plexus.sparse.BlockSparse` ``A``; backward ``A^T @ dH`` with
    the precomputed transpose (into ``shared``'s buffer where given: :class:`SharedGradient`).

    ``read_as``: the dtype the product reads ``F`` in (:func:`read_in`; bf16, summed in
    float32); ``F`` and its gradient stay float32 tensors in the autograd graph (a bf16 input
    there would have its gradient rounded to bf16).
    """

    @staticmethod
    def forward(ctx: Any, a, a_t, f, shared: SharedGradient | None = None,
                read_as: torch.dtype | None = None):
        ctx.a_t, ctx.shared = a_t, shared
        return a.matmul(read_in(f, read_as))

    @staticmethod
    def backward(ctx: Any, dh):
        if not ctx.needs_input_grad[2]:
            return None, None, None, None, None
        a_t, shared = ctx.a_t, ctx.shared
        if shared is None:
            return None, None, a_t.matmul(dh), None, None
        whole = (0, dh.shape[0], (0, dh.shape[0]))  # every column of A^T, added into out
        return None, None, shared.add(lambda: a_t.matmul(dh),
                                      lambda out: a_t.matmul(dh, out=out, cols=whole)), None, None


class BlockedAggregation(torch.autograd.Function):
    """``H = A @ F`` all-reduced over ``group`` (collective 2), in row blocks; backward ``dH``
    all-reduced over ``group`` (7) in the same blocks and ``dF = A^T dH`` accumulated block by
    block (docs/design/plexus-3d.md section 10).

    Forward: block ``b``'s rows of H are computed, then their all-reduce is started; with
    ``overlap`` it is asynchronous, so it travels while block ``b + 1`` computes (the MPI
    transport's communication thread on CPU, NCCL's stream on GPU); all are waited on at the
    end. Backward: every block's all-reduce of ``dH`` is started at once, and the columns of
    ``A^T`` that block ``b`` feeds are multiplied as soon as its all-reduce is done, while the
    later blocks' are still in flight. Without ``overlap`` the same collectives run
    synchronously in the same order: the two give the same bits.

    Exactness: each row of H is the row kernel's sum; on the numba kernels the backward's
    column ranges of ``A^T`` add each row's terms in column order, so dF has the bits of one
    unblocked ``A^T @ dH``. What may differ from the unblocked layer is the all-reduce's
    summation order, which MPI and NCCL may choose by message size (never for 2 ranks).

    ``shared``: dF is added into its buffer (:class:`SharedGradient`). ``spend_grad``: the
    caller's promise that the gradient reaching H is read by nothing else (H feeds one
    product): backward all-reduces it in place instead of a copy.

    ``narrow``: where ``group``'s messages are bf16 (``group.wire``), H is returned in bf16:
    each block's float32 product (one reused block of scratch) is rounded into H, which is
    then summed in place, its own message (common.collectives); the sum of bf16 messages is
    bf16 values anyway, so H is the same numbers without a float32 copy of it, or the pass
    that widens it. Its gradient arrives in bf16 too (autograd rounds ``dH`` to H's dtype,
    as the wire would), is summed in place likewise, and ``A^T`` reads it as bf16. Where the
    messages are float32, ``narrow`` changes nothing. ``read_as``: as :class:`SpMM`'s.

    Shapes: f [m, d] -> [n, d]; backward dh [n, d] -> df [m, d]
    """

    @staticmethod
    def forward(ctx: Any, a, a_t, f, group: AxisGroup, stats, num_blocks: int,
                overlap: bool, shared: SharedGradient | None = None, spend_grad: bool = False,
                narrow: bool = False, read_as: torch.dtype | None = None):
        bounds, parts = a.row_blocks(num_blocks)
        f = read_in(f.detach(), read_as)
        wide = sum_dtype(f.dtype)
        narrow = narrow and group.wire is not None and group.wire != wide
        out = dense.empty(a.shape[0], f.shape[1], dtype=group.wire if narrow else wide,
                          device=f.device)
        ranges = list(itertools.pairwise(bounds))
        scratch = (torch.empty(max(hi - lo for lo, hi in ranges), f.shape[1], dtype=wide,
                               device=f.device) if narrow and ranges else None)
        if narrow:  # numba, imported only here (as common.collectives imports it)
            from common import wire
        handles = []
        for (lo, hi), part in zip(ranges, parts):
            if scratch is None:
                part.matmul(f, out=out[lo:hi])
            else:  # rounded before the next block overwrites the scratch
                wire.to_bf16(part.matmul(f, out=scratch[:hi - lo]), out[lo:hi])
            handles.append(coll.all_reduce(out[lo:hi], group, stats=stats, async_op=overlap,
                                           inplace=True))
        if overlap:
            for h in handles:
                h.wait()
        ctx.a_t, ctx.bounds, ctx.group, ctx.stats, ctx.overlap = a_t, bounds, group, stats, overlap
        ctx.shared, ctx.spend_grad = shared, spend_grad
        return out

    @staticmethod
    def backward(ctx: Any, dh):
        bounds, group, stats, overlap = ctx.bounds, ctx.group, ctx.stats, ctx.overlap
        # reduced in place, block by block: over dH itself where it is ours to spend
        red = dh if ctx.spend_grad and dense.can_overwrite(dh) else dh.contiguous().clone()
        ranges = list(itertools.pairwise(bounds))
        handles = [coll.all_reduce(red[lo:hi], group, stats=stats, async_op=overlap,
                                   inplace=True) for lo, hi in ranges]
        df = None
        if ctx.needs_input_grad[2]:
            a_t = ctx.a_t

            def add_into(df: torch.Tensor) -> torch.Tensor:
                for (lo, hi), h in zip(ranges, handles):
                    if overlap:
                        h.wait()
                    a_t.matmul(red, out=df, cols=(lo, hi, tuple(bounds)))
                return df

            def make() -> torch.Tensor:
                return add_into(torch.zeros(a_t.shape[0], red.shape[1], dtype=sum_dtype(red.dtype),
                                            device=red.device))

            df = make() if ctx.shared is None else ctx.shared.add(make, add_into)
        elif overlap:
            for h in handles:
                h.wait()
        return None, None, df, None, None, None, None, None, None, None, None


class BitMask:
    """A bool tensor kept for backward as one bit per entry (a bool tensor takes a byte):
    the ReLU's and dropout's masks of a ``[N, D]`` block are the largest things a layer keeps
    besides ``H``. :meth:`unpack` gives the bool tensor back, or its negation (what
    ``masked_fill`` takes) without a second full-size temporary.

    On the CPU numpy packs and unpacks (one pass each); elsewhere torch's bit operations do.
    """

    __slots__ = ("bits", "device", "shape")

    def __init__(self, mask: torch.Tensor) -> None:
        self.shape, self.device = mask.shape, mask.device
        flat = mask.reshape(-1)
        if flat.device.type == "cpu":
            self.bits = torch.from_numpy(np.packbits(flat.numpy(), bitorder="little"))
        else:
            pad = -flat.numel() % 8
            if pad:  # (a pad of nothing would still copy the mask)
                flat = torch.nn.functional.pad(flat, (0, pad))
            eight = flat.view(-1, 8).to(torch.uint8)
            self.bits = (eight << _shifts(flat.device)).sum(1, dtype=torch.uint8)

    @classmethod
    def of_bits(cls, bits: torch.Tensor, shape: torch.Size, device: torch.device) -> BitMask:
        """A mask of ``shape`` from bits packed already in :meth:`__init__`'s order."""
        out = cls.__new__(cls)
        out.bits, out.shape, out.device = bits, shape, device
        return out

    def unpack(self, *, invert: bool = False) -> torch.Tensor:
        """The mask (``invert``: its negation), bool, in its shape and on its device."""
        n = self.shape.numel()
        if self.device.type == "cpu":
            bits = self.bits.numpy()
            bits = np.invert(bits) if invert else bits
            flat = torch.from_numpy(np.unpackbits(bits, count=n, bitorder="little"))
            return flat.view(torch.bool).reshape(self.shape)
        bits = ~self.bits if invert else self.bits
        flat = (bits[:, None] >> _shifts(self.device)) & 1
        return flat.reshape(-1)[:n].to(torch.bool).reshape(self.shape)

    def clear_(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (of the mask's shape) with ``+0.0`` where the mask is False, in place: the
        values of ``x.masked_fill_(~mask, 0.0)``. On a large float32 CPU block one numba pass
        reads the bits (``plexus.kernels.masked_by_bits``), with no bool mask made."""
        kernels = _relu_kernels(x)
        if kernels is None or tuple(x.shape) != tuple(self.shape):
            return x.masked_fill_(self.unpack(invert=True).to(x.device), 0.0)
        words = x.view(-1).numpy().view(np.uint32)
        kernels.masked_by_bits(words, self.bits.numpy(), words)
        return x


def _shifts(device: torch.device) -> torch.Tensor:
    """``[0, 1, ..., 7]`` (uint8), made on ``device`` (one small kernel on a GPU): a constant
    copied from host memory instead made each ReLU, both ways, wait for the GPU to finish its
    queue (a copy from pageable memory synchronizes the stream), four waits an epoch of a
    3-layer GCN."""
    return torch.arange(8, dtype=torch.uint8, device=device)


def _relu_kernels(t: torch.Tensor):
    """plexus.kernels for a ReLU pass over ``t`` in one fused pass (a contiguous float32 CPU
    block of 2^16 entries or more, where the kernels' threads pay), or None."""
    if (t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous()
            or t.numel() < 1 << 16):
        return None
    return numba_kernels()


def _on_gpu(name: str, t: torch.Tensor, *args: Any):
    """plexus.relu_triton's ``name`` of ``t`` and ``args`` where ``t`` is a contiguous
    float32 block on a GPU and Triton runs there, else None (the caller's torch path)."""
    if t.device.type != "cuda" or t.dtype != torch.float32 or not t.is_contiguous():
        return None
    fn = triton_function("relu_triton", name)
    return None if fn is None else launch(fn, t, *args)


class ReLU(torch.autograd.Function):
    """In-place ``relu`` of a fresh tensor that keeps only the mask ``out > 0``, one bit per
    entry (:class:`BitMask`; the output is the next layer's input, which is spent once its
    aggregation has run). Same values as ``torch.relu_`` both ways. On a large float32 CPU
    block each pass is one numba kernel (:func:`plexus.kernels.relu_pack`, ``masked_by_bits``)
    instead of four and three torch/numpy passes; on a GPU with Triton, one Triton kernel each
    (plexus.relu_triton). ``over_grad`` (the caller's promise that the
    gradient reaching the output is read by nothing else, as :func:`plexus.dropout.
    apply_dropout`'s ``spent``): backward writes over it instead of a new block."""

    @staticmethod
    def forward(ctx: Any, q, over_grad: bool = False):
        ctx.mark_dirty(q)
        ctx.over_grad = over_grad
        kernels = _relu_kernels(q)
        if kernels is None:
            bits = _on_gpu("relu_pack", q)
            if bits is not None:  # one Triton kernel: relu in place and the bits
                ctx.keep = BitMask.of_bits(bits, q.shape, q.device)
                return q
            out = torch.relu_(q)
            ctx.keep = BitMask(out > 0)
            return out
        bits = torch.empty(-(-q.numel() // 8), dtype=torch.uint8)
        kernels.relu_pack(q.view(-1).numpy(), bits.numpy())
        ctx.keep = BitMask.of_bits(bits, q.shape, q.device)
        return q

    @staticmethod
    def backward(ctx: Any, dy):
        kernels = _relu_kernels(dy)
        over = ctx.over_grad and dense.can_overwrite(dy)  # (an expanded gradient is not)
        if kernels is None or tuple(dy.shape) != tuple(ctx.keep.shape):
            if tuple(dy.shape) == tuple(ctx.keep.shape):  # one Triton kernel from the bits
                out = _on_gpu("masked_by_bits", dy, ctx.keep.bits, dy if over else None)
                if out is not None:
                    return out, None
            fill = dy.masked_fill_ if over else dy.masked_fill
            return fill(ctx.keep.unpack(invert=True), 0.0), None
        # a buffer of common.dense.empty either way, read in place by the dW it feeds (tn)
        out = dy if over else dense.empty_like(dy)
        kernels.masked_by_bits(dy.reshape(-1).numpy().view(np.uint32), ctx.keep.bits.numpy(),
                               out.view(-1).numpy().view(np.uint32))
        return out, None


class GatheredMatmul(torch.autograd.Function):
    """``H @ W`` with ``W`` all-gathered over P from its flat shard (common.flat), in both
    passes.

    The gathered ``W`` is not kept for backward: it is gathered again (collective 5), and
    ``dW`` is reduce-scattered back to flat shards (collective 6).

    ``keep``: the dtype ``H`` is kept in for ``dW`` (None: as it comes). With bf16, ``H`` may
    also come in bf16 (the cached ``H_0``; the sum of bf16 messages, ops.BlockedAggregation's
    ``narrow``): it is kept as it is, widened a row block at a time for the product
    (:func:`common.dense.mm`), which is float32 either way, and for ``dW``
    (:func:`common.dense.tn`: whole up to ``WIDEN_BYTES``, else a row block at a time); its
    ``dH`` is rounded to bf16 a row block at a time.
    ``gemm``: the backend of ``H W`` and ``dQ W^T`` (:func:`common.dense.mm`: oneDNN on the
    CPU by default) and of ``dW = H^T dQ``
    (:func:`common.dense.tn`: oneDNN where both were allocated by :func:`common.dense.empty`,
    as the SpMM's output and the ReLU's gradient are).

    ``into``: a fresh [N/P, D_l+1/O] product that ``H W`` is added into (GraphSAGE's ``R W_r``
    into ``H W``: one block, not two); its gradient is ``dQ``.

    ``kept``: the copy of ``H`` in ``keep`` to keep, made by the caller once for several
    products of the same ``H`` (GraphSAGE's weight-first layer: ``F' W`` and ``F' W_r`` keep
    one bf16 ``F'``, not one each); None: made here.

    Shapes: h [N/P, D_l/I], w_shard [ceil(D_l/I * D_l+1/O / P)], shape (D_l/I, D_l+1/O)
    -> [N/P, D_l+1/O]
    """

    @staticmethod
    def forward(ctx: Any, h, w_shard, group: AxisGroup, shape, stats, gathered=None,
                keep: torch.dtype | None = None, gemm: str = "auto", into=None, kept=None):
        """``gathered``: the handle of this W's all-gather issued earlier (async, so that it
        travels during the aggregation), or None to gather now."""
        ctx.group, ctx.shape, ctx.stats, ctx.gemm = group, shape, stats, gemm
        ctx.h_dtype = h.dtype  # a bf16 H takes a bf16 dH (rounded here, not by autograd)
        if kept is None:
            kept = h if keep is None else dense.converted(h, keep)
        ctx.save_for_backward(kept, w_shard)
        w = (flat.gather(w_shard, group, shape, stats=stats) if gathered is None
             else gathered.wait())
        if into is None:
            return dense.mm(h, w, backend=gemm)
        ctx.mark_dirty(into)
        return dense.mm(h, w, backend=gemm, out=into, accumulate=True)

    @staticmethod
    def backward(ctx: Any, dq):
        h, w_shard = ctx.saved_tensors
        group, shape, stats = ctx.group, ctx.shape, ctx.stats
        dw = dense.tn(h, dq, backend=ctx.gemm)  # a bf16 H widened by tn, in row blocks
        del h
        dh = None
        if ctx.needs_input_grad[0]:
            w = flat.gather(w_shard, group, shape, stats=stats).t()
            out = (None if ctx.h_dtype == w.dtype else
                   dense.empty(dq.shape[0], w.shape[1], dtype=ctx.h_dtype, device=dq.device))
            dh = dense.mm(dq, w, backend=ctx.gemm, out=out)
        return (dh, flat.reduce_scatter(dw, group, stats=stats), None, None, None, None,
                None, None, dq if ctx.needs_input_grad[8] else None, None)


def _gathered_weights(shards, gathered, group: AxisGroup, shape, stats) -> list[torch.Tensor]:
    """The full weights of the flat ``shards`` that are not None, each gathered over P now
    (collective 3) or waited for where ``gathered`` holds the handle of an earlier gather."""
    return [flat.gather(s, group, shape, stats=stats) if h is None else h.wait()
            for s, h in zip(shards, gathered) if s is not None]


class RecomputedMatmul(torch.autograd.Function):
    """``H W`` (GraphSAGE: ``H W + R W_r``) for a layer whose ``H`` (``R``) takes no gradient,
    computed row block by row block from ``blocks()`` and kept by neither pass: backward
    calls ``blocks()`` again and sums ``dW = sum_b H_b^T dQ_b``. plexus.model uses it for
    layer 0 with fixed input features and dropout, where ``blocks()`` aggregates
    ``dropout(F_0)`` with the pass's mask (docs/design/plexus-3d.md section 7): a step then
    holds one row block of ``H_0`` at a time instead of keeping all of it for backward.

    ``W`` is gathered over P as in :class:`GatheredMatmul` (3, 5) and ``dW`` reduce-scattered
    (6). Each row of ``Q`` and ``dW`` is summed over the blocks, so both agree with
    :class:`GatheredMatmul`'s single products to float rounding.

    ``blocks()`` yields ``(term, lo, hi, rows lo..hi of H (term 0) or R (term 1))``, float32,
    all of term 0 first; ``rows``: the height of H. ``gathered``: the handles of the weights'
    all-gathers issued earlier, or Nones. ``gemm``: the products' backend
    (:func:`common.dense.mm`, which writes ``H_b W`` into Q's rows).

    Shapes: w, w_r flat shards of ``shape`` (D_0/I, D_1/O) -> [rows, D_1/O]
    """

    @staticmethod
    def forward(ctx: Any, blocks, rows: int, group: AxisGroup, shape, stats, gathered, w,
                w_r=None, gemm: str = "auto"):
        ctx.blocks, ctx.group, ctx.shape, ctx.stats = blocks, group, shape, stats
        ctx.gemm = gemm
        ctx.save_for_backward(w, w_r)
        full = _gathered_weights((w, w_r), gathered, group, shape, stats)
        q = dense.empty(rows, shape[1], dtype=full[0].dtype, device=full[0].device)
        for term, lo, hi, x in blocks():
            if term == 0:  # into Q's rows
                dense.mm(x, full[0], backend=gemm, out=q[lo:hi])
            else:
                q[lo:hi] += dense.mm(x, full[1], backend=gemm)
        dense.hand_back_pooled()  # F' of the blocks, made again in backward: not kept idle
        return q

    @staticmethod
    def backward(ctx: Any, dq):
        dense.hand_back_pooled()  # H_0 made again: where a step's memory may peak
        w, w_r = ctx.saved_tensors
        dw: list[torch.Tensor | None] = [None, None]
        for term, lo, hi, x in ctx.blocks():
            with dense.tensor_cores(ctx.gemm, x):  # (the CPU's torch.mm, as it always was)
                part = x.t() @ dq[lo:hi]
            dw[term] = part if dw[term] is None else dw[term].add_(part)
        grads = [None if shard is None else flat.reduce_scatter(
            dw[t] if dw[t] is not None else dq.new_zeros(ctx.shape), ctx.group,
            stats=ctx.stats) for t, shard in enumerate((w, w_r))]
        return None, None, None, None, None, None, grads[0], grads[1], None


class RemadeInputMatmul(torch.autograd.Function):
    """``F' W`` (GraphSAGE: and ``F' W_r``) for an ``F'`` that takes no gradient and is cheap
    to make again: ``make()`` gives it in each pass and neither pass keeps it. plexus.model
    uses it for layer 0 with fixed input features and dropout where the layer multiplies
    first (docs/design/plexus-3d.md section 12): ``F' = dropout(F_0)`` is made from ``F_0``
    and the pass's mask, kept as bits.

    ``W`` is gathered over P as in :class:`GatheredMatmul` (3); backward sums
    ``dW = F'^T dG`` and reduce-scatters it (6). ``F'`` takes no gradient, so ``W`` is not
    gathered again (no 5). ``gathered``: the handles of the weights' all-gathers issued
    earlier, or Nones; ``gemm``: the products' backend (:func:`common.dense.mm`).

    Shapes: make() -> [N/O, D_0/I]; w, w_r flat shards of ``shape`` (D_0/I, D_1/O)
    -> one [N/O, D_1/O] per term, as a tuple
    """

    @staticmethod
    def forward(ctx: Any, make, group: AxisGroup, shape, stats, gathered, w, w_r=None,
                gemm: str = "auto"):
        ctx.make, ctx.group, ctx.shape, ctx.stats, ctx.gemm = make, group, shape, stats, gemm
        full = _gathered_weights((w, w_r), gathered, group, shape, stats)
        ctx.dtype = full[0].dtype  # of the products and their gradients (float32)
        f = make()
        f = f if f.dtype == ctx.dtype else f.to(ctx.dtype)
        out = tuple(dense.mm(f, x, backend=gemm) for x in full)
        del f
        dense.hand_back_pooled()  # F', made again in backward: not kept idle
        return out

    @staticmethod
    def backward(ctx: Any, *dgs):
        dense.hand_back_pooled()  # F' made again: where a step's memory may peak
        f = ctx.make()
        f = f if f.dtype == ctx.dtype else f.to(ctx.dtype)
        grads = [flat.reduce_scatter(
            dense.tn(f, dg, backend=ctx.gemm) if dg is not None else f.new_zeros(ctx.shape),
            ctx.group,
            stats=ctx.stats) for dg in dgs]
        return (None, None, None, None, None, grads[0],
                grads[1] if len(grads) > 1 else None, None)
