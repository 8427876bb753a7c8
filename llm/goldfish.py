"""The goldfish loss: leave about 1/k of the target tokens out of the next-token loss.

Hans et al., "Be like a Goldfish, Don't Memorize! Mitigating Memorization in Generative LLMs"
(NeurIPS 2024, https://arxiv.org/abs/2406.10209). A dropped token is never supervised, so a
model trained for many epochs on a document cannot learn to reproduce it verbatim, while it
still sees every token as context.

Shapes legend:
    B: batch size, T: sequence length (number of targets per row), V: vocabulary size,
    h: context width of the hash (number of labels hashed per decision),
    N = T - h + 1: number of positions that have a full window of h labels.

Strategies (the mask is True where a target is DROPPED):
    ``static``: positions ``start, start + k, start + 2k, ...`` in every row.
    ``hash``: bit-compatible with the paper's released runs (k in {3, 4, 8, 32, 128}, h = 13).
        With ``table = torch.rand(1_000_003)`` from a CPU generator seeded with 2971215073,
        position ``p >= h - 1`` is dropped iff ``table[key mod 1_000_003] < 1/k`` where
        ``key = targets[p-h+1] * ... * targets[p]`` in int64 with two's-complement wrap-around
        and the remainder is taken non-negative. Positions ``p < h - 1`` are never dropped.
        Known flaws, kept for compatibility: the product ignores token order, and every window
        that contains token id 0 has key 0, so all of them share one decision.
    ``hash-ordered``: an extra order-aware variant (never used unless asked for): the key is a
        polynomial rolling hash ``x <- x * P + (token + 1)`` over the same window (wrap-around in
        int64, +1 so that id 0 contributes), followed by an xor-shift, then the same table
        lookup. Same windows, same never-dropped prefix, same drop rate of about 1/k.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn.functional import cross_entropy

from llm.config import STRATEGIES

__all__ = [
    "STRATEGIES",
    "TABLE_SEED",
    "TABLE_SIZE",
    "GoldfishLoss",
    "drop_mask",
    "goldfish_loss",
    "goldfish_mask",
    "hash_table",
]

TABLE_SIZE = 1_000_003
TABLE_SEED = 2971215073

# Odd 64-bit multiplier of the order-aware rolling hash (the FNV-1 64-bit prime).
_ORDERED_MULTIPLIER = 1_099_511_628_211
_LOW_35_BITS = (1 << 35) - 1


@functools.lru_cache(maxsize=8)
def hash_table(device: str = "cpu") -> Tensor:
    """The paper's lookup table of uniform floats, generated on CPU and copied to ``device``.

    Generating on CPU makes the masks identical on every device (CUDA generators differ).
    Cached per device string; treat the result as read-only.

    Shapes:
        returns: float32 [1_000_003]
    """
    generator = torch.Generator("cpu").manual_seed(TABLE_SEED)
    table = torch.rand(TABLE_SIZE, generator=generator)
    return table.to(device)


def _check_args(k: int, h: int, strategy: str, start: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"goldfish k must be an integer >= 1 (drop about 1/k tokens), got {k!r}")
    if isinstance(h, bool) or not isinstance(h, int) or h < 1:
        raise ValueError(f"goldfish context width h must be an integer >= 1, got {h!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown goldfish strategy {strategy!r}; choose one of {STRATEGIES}")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"goldfish static start must be an integer >= 0, got {start!r}")


def _product_keys(targets: Tensor, h: int) -> Tensor:
    """Product of each window of h labels, wrapping like C int64 (checked against Python ints).

    Shapes:
        targets: int64 [B, T] -> returns int64 [B, N]
    """
    windows = targets.unfold(1, h, 1)  # [B, N, h], a view (no copy)
    return windows.prod(dim=-1)  # [B, N]; int64 multiply wraps mod 2**64, order-independent


def _ordered_keys(targets: Tensor, h: int) -> Tensor:
    """Order-aware rolling hash of each window of h labels.

    Shapes:
        targets: int64 [B, T] -> returns int64 [B, N]
    """
    n = targets.shape[1] - h + 1
    key = torch.zeros_like(targets[:, :n])  # [B, N]
    for j in range(h):  # h passes over [B, N] instead of a [B, N, h] temporary
        key = key * _ORDERED_MULTIPLIER + (targets[:, j : j + n] + 1)
    # xor in the high bits (a logical shift: arithmetic shift, then keep the low 35 bits) so the
    # final "mod prime" depends on the whole 64-bit state
    return key ^ ((key >> 29) & _LOW_35_BITS)


def goldfish_mask(
    targets: Tensor, k: int, h: int = 13, strategy: str = "hash", start: int = 0
) -> Tensor:
    """Which targets the goldfish loss drops (True = dropped, not supervised).

    Args:
        targets: integer token ids (the labels, already shifted by one against the inputs).
        k: drop about 1/k of the targets; k = 1 drops everything the strategy can reach.
        h: context width for the hash strategies (the paper uses 13); ignored by ``static``.
        strategy: ``"hash"`` (the paper's, default), ``"static"`` or ``"hash-ordered"``.
        start: first dropped position of the ``static`` strategy; ignored by the others.

    Returns:
        Bool mask on ``targets.device``.

    Shapes:
        targets: int [B, T] -> returns bool [B, T]

    Raises:
        ValueError: for a bad k, h, start, strategy name or targets shape.
    """
    _check_args(k, h, strategy, start)
    if targets.dim() != 2 or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(
            f"goldfish targets must be an integer tensor [B, T], got {targets.dtype} "
            f"of shape {tuple(targets.shape)}"
        )
    batch, seq = targets.shape
    mask = torch.zeros(batch, seq, dtype=torch.bool, device=targets.device)  # [B, T]
    if strategy == "static":
        mask[:, start::k] = True
        return mask
    if seq < h:  # no position has a full window of h labels
        return mask
    labels = targets.to(torch.int64)  # [B, T]
    keys = _product_keys(labels, h) if strategy == "hash" else _ordered_keys(labels, h)
    keys = torch.remainder(keys, TABLE_SIZE)  # [B, N], non-negative
    table = hash_table(str(targets.device))  # [TABLE_SIZE]
    # "tensor < python float" compares in float32, exactly as the paper's code does
    mask[:, h - 1 :] = table[keys] < 1.0 / k
    return mask


def drop_mask(targets: Tensor, config) -> Tensor:
    """The dropped targets of a :class:`llm.config.GoldfishConfig` (``k``, ``h``, ``strategy``,
    ``start``): :func:`goldfish_mask`, or all False when ``k = 0`` (the standard loss).

    Shapes:
        targets: int64 [B, T] -> bool [B, T], True = dropped
    """
    if config.k == 0:
        return torch.zeros_like(targets, dtype=torch.bool)
    return goldfish_mask(targets, config.k, config.h, config.strategy, config.start)


class GoldfishLoss(NamedTuple):
    """Result of :func:`goldfish_loss`.

    Attributes:
        loss: mean cross-entropy over kept targets; the value to backpropagate (0 with a zero
            gradient when nothing is kept).
        kept_loss: the same mean, detached, for logging.
        dropped_loss: detached mean cross-entropy over dropped targets (0 when none).
        num_kept: number of kept targets (int64 scalar tensor); ignore_index not counted.
        num_dropped: number of dropped targets (int64 scalar tensor); ignore_index not counted.
    """

    loss: Tensor
    kept_loss: Tensor
    dropped_loss: Tensor
    num_kept: Tensor
    num_dropped: Tensor


def goldfish_loss(
    logits: Tensor, targets: Tensor, mask: Tensor, ignore_index: int = -100
) -> GoldfishLoss:
    """Next-token cross-entropy averaged over the targets the goldfish mask keeps.

    ``loss = sum_{kept} CE(logits_i, targets_i) / |kept|`` where kept = not dropped and not
    ``ignore_index``. The dropped targets' loss is reported separately (detached) to watch
    whether the model still predicts them. Cross-entropy is computed in float32.

    Args:
        logits: unnormalised scores.
        targets: int64 labels; ``ignore_index`` marks padding.
        mask: True where dropped, from :func:`goldfish_mask` (all False = the standard loss).
        ignore_index: label value that is neither kept nor dropped.

    Shapes:
        logits: [B, T, V], targets: int64 [B, T], mask: bool [B, T] -> scalars

    Raises:
        ValueError: if the shapes disagree.
    """
    if logits.dim() != 3 or logits.shape[:2] != targets.shape or mask.shape != targets.shape:
        raise ValueError(
            f"goldfish_loss needs logits [B, T, V] and targets, mask [B, T]; got logits "
            f"{tuple(logits.shape)}, targets {tuple(targets.shape)}, mask {tuple(mask.shape)}"
        )
    vocab = logits.shape[-1]
    per_token = cross_entropy(
        logits.reshape(-1, vocab).float(), targets.reshape(-1), ignore_index=ignore_index,
        reduction="none",
    ).view_as(targets)  # [B, T], 0 where ignored
    valid = targets != ignore_index  # [B, T]
    kept = valid & ~mask
    dropped = valid & mask
    num_kept = kept.sum()
    num_dropped = dropped.sum()
    # where() rather than multiply: a non-finite loss on a dropped token must not leak in
    loss = torch.where(kept, per_token, 0.0).sum() / num_kept.clamp(min=1)
    dropped_loss = torch.where(dropped, per_token.detach(), 0.0).sum() / num_dropped.clamp(min=1)
    return GoldfishLoss(loss, loss.detach(), dropped_loss, num_kept, num_dropped)
