"""GraphSAGE's root term ``R = S F'`` exchanged by owner (docs/design/plexus-3d.md section 4).

``S_l`` [N/P, N/O] is this rank's block of the permuted identity: output row ``i`` of the
layer is input row ``j`` of exactly one rank of O (its *owner*), or of none (a padding
node). As an SpMM all-reduced over O, every rank of O sends a whole ``[N/P, D_l/I]`` block
of which its own rows are ``1/O``, and the rest zeros: an all-reduce moves twice the block.
Here each rank of O sends only the rows it owns, and the others place them:

* forward: the owned rows of ``F'`` (in row order) are all-gathered over O, each rank's
  padded to the most rows any owner has; every rank puts the gathered rows in row order.
  The same values as the SpMM's sum (one nonzero term per row), in half the bytes.
* backward: ``dR`` (partial over O: each rank of O multiplied its own columns of
  ``W_r``) is laid out by owner and reduce-scattered over O, so each rank receives the sum
  of its own rows only, which it adds into ``dF`` at their input rows. Half the bytes of
  the all-reduce, and no ``S^T`` product.

Both passes run in :data:`PIECES` ranges of the block's rows, so that the messages and
what they are unpacked from are a part of the block, not the whole. Messages travel in the
group's wire dtype (bf16 under ``--precision bf16``), sums in float32
(common.collectives). Which rank owns which row comes from the permutations when the shard is
built (:func:`plexus.data.partition.permuted_identity_rows`), so no collective sets this up.

Shapes: F' [N/O, D_l/I] -> R [rows, D_l/I] (rows: the layer's N/P, or its labelled rows)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from common import collectives as coll
from common.comm_stats import CommStats, ring_bytes
from common.grid import AxisGroup
from plexus.data.shard import RootBlock
from plexus.sparse import sum_dtype

__all__ = ["PIECES", "ExchangedRows", "RootExchange"]

PIECES = 4  # ranges of rows each pass exchanges one after another


class RootExchange:
    """Where every row of a root block comes from: built once per block from its owners.

    The rows are exchanged in :data:`PIECES` ranges of rows; in each, every owner sends its
    rows of the range in row order (a slice of its list), padded to the most any owner
    sends there (one more where the range holds padding nodes, which read that always-empty
    last slot of owner 0).

    Args:
        block: this rank's block of ``S``, compact (plexus.data.shard.RootBlock): its rows'
            ``owners`` (the coordinate along O of the rank that holds each output row's
            input row, -1 for a padding node) and ``cols`` (the input rows this rank sends,
            in row order: read, not copied), ``me`` (this rank's coordinate along O).
        size: the size of O.
        pieces: ranges of rows (:data:`PIECES`).

    Attributes:
        rows: output rows; sent: rows each range's messages hold in all, padding included
            (``size`` times its width, summed over the ranges).
    """

    def __init__(self, block: RootBlock, size: int, *, pieces: int = PIECES) -> None:
        owners, me = np.asarray(block.owners).astype(np.int64), block.me
        rows = owners.size
        if owners.max(initial=-1) >= size or not 0 <= me < size:
            raise ValueError(f"a row's owner is outside O's {size} ranks")
        real = owners >= 0
        # k: a row's place in its owner's list (row order), by a stable sort on the owner
        order = np.argsort(np.where(real, owners, size), kind="stable")
        counts = np.bincount(owners[real], minlength=size)
        num_real = int(real.sum())
        k = np.zeros(rows, dtype=np.int64)
        k[order[:num_real]] = np.arange(num_real) - np.repeat(
            np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
        self.bounds = [rows * j // pieces for j in range(pieces + 1)]
        # starts[j][o]: owner o's rows before range j (the first k it sends there); each
        # row's slot in its range's gathered messages: owner * width + its place among them
        starts = np.zeros((pieces + 1, size), dtype=np.int64)
        slots = np.empty(rows, dtype=np.int64)
        self.widths = []
        for j in range(pieces):
            lo, hi = self.bounds[j], self.bounds[j + 1]
            part, mine = owners[lo:hi], real[lo:hi]
            starts[j + 1] = starts[j] + np.bincount(part[mine], minlength=size)
            width = max(1, int((starts[j + 1] - starts[j]).max(initial=0)) + (not mine.all()))
            self.widths.append(width)
            own = np.where(mine, part, 0)
            # a padding node reads owner 0's last slot, always empty
            slots[lo:hi] = np.where(mine, own * width + k[lo:hi] - starts[j][own], width - 1)
        self.size, self.me, self.rows, self.starts = size, me, rows, starts
        self.sent = size * sum(self.widths)
        index = np.int32 if max(self.sent, rows, block.shape[1]) < 2**31 - 1 else np.int64
        self._host = {"slots": slots.astype(index),
                      "cols": block.cols.astype(index, copy=False)}
        self._on: dict[torch.device, dict[str, torch.Tensor]] = {}

    def arrays(self, device: torch.device) -> dict[str, torch.Tensor]:
        """``slots`` (each row's slot in its range's gathered messages) and ``cols`` (this
        rank's input rows, in its list's order) on ``device`` (moved once)."""
        if device not in self._on:
            self._on[device] = {name: torch.from_numpy(arr).to(device)
                                for name, arr in self._host.items()}
        return self._on[device]

    def pieces(self, device: torch.device):
        """Yield ``(lo, hi, width, slots, counts, mine)`` per range of rows ``lo..hi``: its
        messages' width, each row's slot in the gathered ``[size * width]`` messages, the
        rows each owner sends there, and the slice of :meth:`arrays`'s ``cols`` this rank
        sends."""
        slots = self.arrays(device)["slots"]
        for j, width in enumerate(self.widths):
            lo, hi = self.bounds[j], self.bounds[j + 1]
            counts = (self.starts[j + 1] - self.starts[j]).tolist()
            yield lo, hi, width, slots[lo:hi], counts, slice(int(self.starts[j][self.me]),
                                                             int(self.starts[j + 1][self.me]))


def _record(stats: CommStats | None, counted: CommStats | None, group: AxisGroup, op: str,
            plan: RootExchange, rows: torch.Tensor) -> None:
    """Count a pass's pieces (in ``counted``) into ``stats`` as one call of ``op`` over
    ``group``, its padding marked: the bytes beyond those of ``plan.rows`` rows of
    ``rows``'s width and the messages' dtype (the rows' content)."""
    if stats is None or counted is None or group.size == 1:
        return
    rec = counted.records[(group.name, op)]
    item = group.wire.itemsize if group.wire is not None else rows.element_size()
    content = ring_bytes(op, plan.rows * rows.shape[1] * item, group.size)
    stats.record(group.name, op, rec.bytes, rec.seconds, rec.exposed,
                 padding=rec.bytes - content)


class ExchangedRows(torch.autograd.Function):
    """``R = S F'`` by owner over ``group`` (O), both passes (module docstring).

    ``dtype``: the messages' and R's dtype (the wire's, or the dtype R is kept in).
    ``shared``: dF is added into its buffer (plexus.ops.SharedGradient), beside the
    adjacency term's ``A^T dH``.

    Shapes: f [N/O, d] -> [plan.rows, d]; backward dR [plan.rows, d] -> dF [N/O, d]
    """

    @staticmethod
    def forward(ctx: Any, f, plan: RootExchange, group: AxisGroup, stats: CommStats | None,
                dtype: torch.dtype, shared=None):
        f = f.detach()
        cols = plan.arrays(f.device)["cols"]
        counted = CommStats() if stats is not None else None
        out = torch.empty(plan.rows, f.shape[1], dtype=dtype, device=f.device)
        for lo, hi, width, slots, _, mine in plan.pieces(f.device):
            msg = torch.empty(width, f.shape[1], dtype=dtype, device=f.device)
            n = mine.stop - mine.start
            msg[:n] = f.index_select(0, cols[mine])
            msg[n:] = 0
            got = coll.all_gather(msg, group, stats=counted)  # [size * width, d]
            torch.index_select(got, 0, slots, out=out[lo:hi])
        _record(stats, counted, group, "all_gather", plan, out)
        ctx.plan, ctx.group, ctx.stats, ctx.shared = plan, group, stats, shared
        ctx.f_shape, ctx.f_dtype = tuple(f.shape), f.dtype
        return out

    @staticmethod
    def backward(ctx: Any, dr):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        plan, group, stats = ctx.plan, ctx.group, ctx.stats
        cols = plan.arrays(dr.device)["cols"]
        wide = sum_dtype(ctx.f_dtype)
        counted = CommStats() if stats is not None else None

        def add_into(df: torch.Tensor) -> torch.Tensor:
            for lo, hi, width, slots, counts, mine in plan.pieces(dr.device):
                send = torch.empty(plan.size, width, dr.shape[1], dtype=dr.dtype,
                                   device=dr.device)
                send.view(-1, dr.shape[1]).index_put_((slots,), dr[lo:hi])
                for o, count in enumerate(counts):  # past each owner's rows: zeros
                    send[o, count:] = 0
                got = coll.reduce_scatter(send.view(-1, dr.shape[1]), group, stats=counted)
                n = mine.stop - mine.start
                if n:
                    df.index_add_(0, cols[mine], got[:n].to(df.dtype))
            _record(stats, counted, group, "reduce_scatter", plan, dr)
            return df

        def make() -> torch.Tensor:
            return add_into(torch.zeros(ctx.f_shape, dtype=wide, device=dr.device))

        df = make() if ctx.shared is None else ctx.shared.add(make, add_into)
        return df, None, None, None, None, None
