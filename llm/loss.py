"""Next-token cross-entropy with the vocabulary split over row, and the goldfish sums.

The LM head's logits block is ``[B, T, V_pad/R]`` (vocabulary chunk ``r``; ids >= V are
padding), replicated over col. The per-token loss ``logsumexp(z) - z[target]`` needs a max,
a sum of exponentials and the target's logit over row; all three are all-reduced over row, so
the per-token loss is replicated over row and col. On one row member with no padding this is
plain ``cross_entropy``. Logits may come in bf16 (``--precision bf16``): they are upcast
first, so the softmax, its all-reduces over row and the loss are float32.

The trainer divides by the number of kept tokens in the GLOBAL batch (all micro-batches of
the step, every rank), so the per-rank losses add up to the mean over the global batch and the
gradients summed over depth and data are those of that mean.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn.functional import cross_entropy

from common.autograd import all_reduce_identity
from common.collectives import ReduceOp, all_reduce
from common.comm_stats import CommStats
from common.grid import AxisGroup


def token_losses(logits: Tensor, targets: Tensor, *, vocab_size: int, row: AxisGroup,
                 ignore_index: int = -100, stats: CommStats | None = None) -> Tensor:
    """Cross-entropy of every target (0 where ``ignore_index``), in float32.

    Args:
        logits: this rank's vocabulary chunk ``row.rank`` of the logits.
        targets: global token ids.
        vocab_size: V; ids >= V in the padded last chunks are excluded from the softmax.
        row: the group splitting the vocabulary.

    Shapes:
        logits: [B, T, V_pad/R], targets: int64 [B, T] -> [B, T]
    """
    width = logits.shape[-1]
    if row.size == 1 and width == vocab_size:  # fast path
        return cross_entropy(logits.reshape(-1, width).float(), targets.reshape(-1),
                             ignore_index=ignore_index, reduction="none").view_as(targets)
    offset = row.rank * width
    z = logits.float()  # [B, T, V_pad/R]
    ids = offset + torch.arange(width, device=logits.device)
    if offset + width > vocab_size:
        z = z.masked_fill(ids >= vocab_size, float("-inf"))
    with torch.no_grad():  # any shift is exact; the max only keeps exp() in range
        shift = all_reduce(z.max(dim=-1).values, row, op=ReduceOp.MAX, stats=stats)
    sum_exp = all_reduce_identity(torch.exp(z - shift[..., None]).sum(dim=-1), row, stats)
    local = targets - offset
    own = (local >= 0) & (local < width)
    picked = z.gather(-1, local.clamp(0, width - 1)[..., None])[..., 0]  # [B, T]
    target_logit = all_reduce_identity(torch.where(own, picked, 0.0), row, stats)
    per_token = shift + torch.log(sum_exp) - target_logit
    return torch.where(targets != ignore_index, per_token, 0.0)


class LossSums(NamedTuple):
    """Local pieces of the goldfish loss of one micro-batch.

    Attributes:
        loss: sum of kept-token losses / ``num_kept`` (the global count): backpropagate this.
        kept_sum: detached sum of kept-token losses on this rank.
        dropped_sum: detached sum of dropped-token losses on this rank.
    """

    loss: Tensor
    kept_sum: Tensor
    dropped_sum: Tensor


def goldfish_sums(logits: Tensor, targets: Tensor, mask: Tensor, *, num_kept: int,
                  vocab_size: int, row: AxisGroup, ignore_index: int = -100,
                  stats: CommStats | None = None) -> LossSums:
    """The goldfish loss of :func:`llm.goldfish.goldfish_loss`, split over the grid.

    Args:
        mask: True where the goldfish mask drops the target (all False: the standard loss).
        num_kept: kept targets in the whole step (every rank and micro-batch): the divisor.

    Shapes:
        logits: [B, T, V_pad/R], targets: int64 [B, T], mask: bool [B, T] -> scalars
    """
    per_token = token_losses(logits, targets, vocab_size=vocab_size, row=row,
                             ignore_index=ignore_index, stats=stats)  # [B, T]
    valid = targets != ignore_index
    kept, dropped = valid & ~mask, valid & mask
    kept_sum = torch.where(kept, per_token, 0.0).sum()
    dropped_sum = torch.where(dropped, per_token.detach(), 0.0).sum()
    return LossSums(kept_sum / max(num_kept, 1), kept_sum.detach(), dropped_sum)
