"""NEFTune: uniform noise on the token embeddings during training, the same on every grid.

Jain et al., "NEFTune: Noisy Embeddings Improve Instruction Finetuning" (2023,
https://arxiv.org/abs/2310.05914): in training, the embedding output ``X [B, T, D]`` becomes

    X + alpha / sqrt(T * D) * U,    U_btc ~ Uniform[-1, 1] independently,

with T the sequence length of the batch and D = d_model (the full width, on every grid).

Grid independence. ``U`` is not drawn from a per-rank random generator: entry (b, t, c) is a
hash of ``(seed, step, row_offset + b, t, c)`` (:func:`uniform_noise`, murmur3's 32-bit
finalizer chained over the key parts, in int64 tensor arithmetic that never overflows), so a
rank holding rows r0..r1 of the global batch and channels c0..c1 of d_model draws exactly its
part of the noise one process draws for the whole batch, on any device. It is the torch
counterpart of :func:`plexus.dropout.dropout_mask` (numpy uint32). :class:`NEFTune` holds the
key; :class:`llm.parallel.gpt.ParallelGPT` tells it where the rank's rows and channels sit.

Shapes legend: B local batch rows, T sequence length, C local channels (D, or D/C of a col
shard whose padded channels get no noise).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["NEFTune", "hash_key", "uniform_noise"]

MASK32 = 0xFFFFFFFF


def _mul32(x: Tensor, k: int) -> Tensor:
    """``x * k mod 2^32`` for int64 tensors of uint32 values: split x in 16-bit halves so
    no product exceeds 2^48 (int64 overflow is not defined behaviour)."""
    hi, lo = x >> 16, x & 0xFFFF
    return ((((hi * k) & 0xFFFF) << 16) + lo * k) & MASK32


def _fmix32(h: Tensor) -> Tensor:
    """murmur3's 32-bit finalizer (a bijection of uint32 that mixes every input bit)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _fmix32_int(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def hash_key(*parts: int) -> int:
    """A uint32 key from non-negative integers of up to 64 bits (each word mixed in)."""
    h = 0x5BD1E995
    for part in parts:
        if part < 0:
            raise ValueError(f"noise key parts must be >= 0, got {part}")
        for word in (part & MASK32, (part >> 32) & MASK32):
            h = _fmix32_int(h ^ word)
    return h


def uniform_noise(key: int, rows: Tensor, positions: Tensor, channels: Tensor) -> Tensor:
    """Keyed Uniform[-1, 1) noise: entry (i, j, k) depends only on (key, rows[i],
    positions[j], channels[k]), on any device.

    Each value is a multiple of 2^-23 (24 hash bits), exact in float32.

    Shapes:
        rows [R], positions [P], channels [C] (int64, values < 2^32) -> float32 [R, P, C]
    """
    h = _fmix32(rows ^ key)[:, None]  # [R, 1]
    h = _fmix32(h ^ positions[None, :])[..., None]  # [R, P, 1]
    h = _fmix32(h ^ channels)  # [R, P, C]
    return (h >> 8).float() * 2.0**-23 - 1.0


class NEFTune(nn.Module):
    """Adds ``alpha / sqrt(T * d_model) * U[-1, 1]`` to the token embeddings in training.

    Active only in training mode with gradients enabled (not in ``eval()``, not under
    ``torch.no_grad``: no noise in evaluation or generation) and for ``alpha > 0``. The noise
    is computed in float32 and added to ``x`` in float32, then cast back to ``x``'s dtype.

    Key of entry (b, t, c): ``(seed, step, row_offset + shard_index * B + b, t,
    channel_offset + c)`` (:func:`uniform_noise`). The trainer sets ``seed``, ``step`` and
    ``row_offset`` (the global row of the micro-batch's first row) with :meth:`set_noise`
    before each forward; :class:`~llm.parallel.gpt.ParallelGPT` sets ``shard_index`` (this rank's
    block of rows, :func:`llm.parallel.gpt.batch_shard`'s layout) and ``channel_offset`` (its first
    channel of d_model); one process keeps both at 0.

    Args:
        alpha: the noise scale (the paper uses 5, 10, 15); 0: off.
        d_model: D, the full width (the scale's D, and channels >= D are padding: no noise).

    Shapes:
        x: [B, T, C] -> [B, T, C]
    """

    def __init__(self, alpha: float, d_model: int) -> None:
        super().__init__()
        if not alpha >= 0:
            raise ValueError(f"neftune_alpha must be >= 0, got {alpha}")
        self.alpha, self.d_model = float(alpha), d_model
        self.seed = self.step = self.row_offset = 0
        self.shard_index = self.channel_offset = 0

    def set_noise(self, *, step: int, row_offset: int = 0, seed: int = 0) -> None:
        """Key the noise of the next forwards: optimizer ``step``, the global row index of
        the batch's first row (``micro_index * global_batch`` with gradient accumulation) and
        the run's ``seed``."""
        if min(step, row_offset, seed) < 0:
            raise ValueError(f"set_noise needs step, row_offset, seed >= 0, got {step}, "
                             f"{row_offset}, {seed}")
        self.step, self.row_offset, self.seed = step, row_offset, seed

    def forward(self, x: Tensor) -> Tensor:
        if self.alpha == 0 or not self.training or not torch.is_grad_enabled():
            return x
        batch, seq, width = x.shape
        first_row = self.row_offset + self.shard_index * batch
        rows = torch.arange(first_row, first_row + batch, device=x.device)  # [B]
        channels = torch.arange(self.channel_offset, self.channel_offset + width,
                                device=x.device)  # [C]
        noise = uniform_noise(hash_key(self.seed, self.step), rows,
                              torch.arange(seq, device=x.device), channels)  # [B, T, C]
        noise = noise.masked_fill(channels >= self.d_model, 0.0)  # a col shard's padding
        scale = self.alpha / math.sqrt(seq * self.d_model)
        return (x.float() + scale * noise).to(x.dtype)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, d_model={self.d_model}"
