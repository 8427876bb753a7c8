"""Cross-entropy and accuracy with the class axis sharded (docs/design/plexus-3d.md
section 5).

The logits block is [rows, C_pad/O]: rows of chunk p of the output order (all N/P, or only the
labelled ones when the model's last layer computes those; ``PlexusGCN.output_rows`` selects
the labels and masks of the same rows), classes chunk o, replicated over I. Padded classes
count as -inf; padded rows and rows outside the mask contribute nothing. The loss is the sum
over masked rows divided by the global number of masked rows, identical (replicated) on every
rank.
"""

from __future__ import annotations

import torch

from common import autograd
from common import collectives as coll
from common.comm_stats import CommStats
from common.grid import AxisGroup


def _class_ids(logits: torch.Tensor, group_o: AxisGroup) -> torch.Tensor:
    width = logits.shape[1]
    return group_o.rank * width + torch.arange(width, device=logits.device)


def _has_padded_classes(logits: torch.Tensor, group_o: AxisGroup, num_classes: int) -> bool:
    """Whether this rank's class chunk reaches past ``num_classes``: from the shapes, so a
    GPU need not be waited for (``bool(padded.any())`` would)."""
    return (group_o.rank + 1) * logits.shape[1] > num_classes


def sharded_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_classes: int,
    count: int,
    group_o: AxisGroup,
    group_p: AxisGroup,
    stats: CommStats | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean cross-entropy over the masked rows of the whole graph.

    Args:
        logits: [rows, C_pad/O] local block (rows: N/P, or the model's labelled rows).
        labels: integer [rows] global class ids (-1 where unlabeled or padding).
        mask: bool [rows] rows that count (e.g. the training split).
        num_classes: C; classes >= C are padding.
        count: number of masked rows in the whole graph (the divisor).
        group_o, group_p: the groups splitting classes and rows.
        rows: ``mask.nonzero()[:, 0]`` when the caller has it (the trainer finds it once:
            on a GPU, ``nonzero`` waits for the device).

    Returns:
        A scalar, the same on every rank.
    """
    # the softmax runs on the masked rows only (the same rows on every rank of group_o), so
    # its temporaries and what backward keeps are [masked, C/O], not [rows, C/O]; the per-row
    # all-reduces keep the logits' row count (common.perf.gcn counts them so)
    rows = mask.nonzero()[:, 0] if rows is None else rows
    n = logits.shape[0]

    def full(v: torch.Tensor, fill: float) -> torch.Tensor:  # [masked] -> [n]
        return v.new_full((n,), fill).index_put((rows,), v)

    # (the shard's labels are narrow integers: widened for the masked rows only)
    sel, lab = logits.index_select(0, rows), labels.index_select(0, rows).long()
    cls = _class_ids(sel, group_o)
    padded = cls >= num_classes
    z = (sel.masked_fill(padded, float("-inf"))
         if _has_padded_classes(sel, group_o, num_classes) else sel)
    with torch.no_grad():
        m = coll.all_reduce(full(z.max(dim=1).values, float("-inf")), group_o,
                            op=coll.ReduceOp.MAX, stats=stats)[rows]
    sum_exp = autograd.all_reduce_identity(full((z - m[:, None]).exp_().sum(dim=1), 0.0),
                                           group_o, stats)[rows]
    local = lab - cls[0]
    own = (local >= 0) & (local < sel.shape[1])
    picked = torch.where(own, z.gather(1, local.clamp(0, sel.shape[1] - 1)[:, None])[:, 0],
                         torch.zeros((), dtype=z.dtype, device=z.device))
    target = autograd.all_reduce_identity(full(picked, 0.0), group_o, stats)[rows]
    per_row = m + torch.log(sum_exp) - target
    return autograd.all_reduce_identity(per_row.sum(), group_p, stats) / max(count, 1)


@torch.no_grad()
def sharded_argmax(
    logits: torch.Tensor, *, num_classes: int, group_o: AxisGroup,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """Predicted class of every local row: int64 [rows]; ties go to the lowest class id."""
    cls = _class_ids(logits, group_o)
    padded = cls >= num_classes
    z = (logits.masked_fill(padded, float("-inf"))
         if _has_padded_classes(logits, group_o, num_classes) else logits)
    val, idx = z.max(dim=1).values, z.argmax(dim=1)  # argmax: first maximum on ties
    if group_o.size == 1:
        return idx
    vals = coll.all_gather(val[None], group_o, stats=stats)  # [O, N/P]
    ids = coll.all_gather((idx + cls[0])[None], group_o, stats=stats)
    best = vals.argmax(dim=0)
    return ids.gather(0, best[None])[0]


@torch.no_grad()
def correct_counts(
    pred: torch.Tensor, labels: torch.Tensor, masks: dict[str, torch.Tensor],
    group_p: AxisGroup, stats: CommStats | None = None,
) -> dict[str, int]:
    """Correct predictions per split over the whole graph (summed over P)."""
    names = sorted(masks)
    local = torch.stack([(masks[s] & (pred == labels)).sum() for s in names]).to(torch.int64)
    total = coll.all_reduce(local, group_p, stats=stats)
    return {s: int(v) for s, v in zip(names, total.tolist())}
