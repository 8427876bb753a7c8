"""The ReLU of :class:`plexus.ops.ReLU` on a GPU as one Triton kernel each way, imported only
where ``triton`` is installed (:mod:`plexus.triton_switch`).

Forward, :func:`relu_pack`: ``q < 0`` becomes 0 in place (-0 and NaN stay, as
``torch.relu_`` leaves them) and the mask ``q > 0`` is packed one bit an entry in the same pass
(entry ``8 j + k`` is bit ``k`` of byte ``j``: :class:`plexus.ops.BitMask`'s order), where torch
takes a compare, a pad, a cast, a shift and a sum. Backward, :func:`masked_by_bits`: ``dy``
where the bit is set, else +0, read from the bits in one pass, where torch unpacks them into a
bool mask first. The same values and bits as the CPU's kernels (plexus.kernels ``relu_pack``,
``masked_by_bits``); without a GPU the kernels run in Triton's interpreter
(tests/plexus/test_relu_triton.py).

Shapes: q, dy, out [any] float32 contiguous; bits [ceil(numel / 8)] uint8
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["masked_by_bits", "relu_pack"]

BLOCK_BYTES = 128  # a program's bytes of bits (1024 entries)


@triton.jit
def _entries(n, block_bytes: tl.constexpr):
    """(this program's bytes [B], their entries [B, 8], which entries exist)."""
    byte = tl.program_id(0).to(tl.int64) * block_bytes + tl.arange(0, block_bytes)
    idx = byte.to(tl.int64)[:, None] * 8 + tl.arange(0, 8)[None, :]
    return byte, idx, idx < n


@triton.jit
def _relu_pack_kernel(q_ptr, bits_ptr, n, n_bytes, block_bytes: tl.constexpr):
    byte, idx, inside = _entries(n, block_bytes)
    q = tl.load(q_ptr + idx, mask=inside, other=0.0)
    tl.store(q_ptr + idx, tl.where(q < 0, 0.0, q), mask=inside)
    weight = tl.full([8], 1, tl.int32) << tl.arange(0, 8)
    packed = tl.sum((q > 0).to(tl.int32) * weight[None, :], axis=1)
    tl.store(bits_ptr + byte, packed.to(tl.uint8), mask=byte < n_bytes)


@triton.jit
def _masked_kernel(dy_ptr, bits_ptr, out_ptr, n, n_bytes, block_bytes: tl.constexpr):
    byte, idx, inside = _entries(n, block_bytes)
    packed = tl.load(bits_ptr + byte, mask=byte < n_bytes, other=0).to(tl.int32)
    keep = ((packed[:, None] >> tl.arange(0, 8)[None, :]) & 1) != 0
    dy = tl.load(dy_ptr + idx, mask=inside, other=0.0)
    tl.store(out_ptr + idx, tl.where(keep, dy, 0.0), mask=inside)


def _check(t: torch.Tensor, what: str) -> None:
    if t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError(f"{what} must be a contiguous float32 tensor, not {t.dtype}"
                         f"{'' if t.is_contiguous() else ' (strided)'}")


def relu_pack(q: torch.Tensor) -> torch.Tensor:
    """``relu`` of ``q`` in place and its mask ``q > 0`` as bits (returned, uint8)."""
    _check(q, "q")
    n = q.numel()
    bits = torch.empty(-(-n // 8), dtype=torch.uint8, device=q.device)
    if n:
        _relu_pack_kernel[(triton.cdiv(bits.numel(), BLOCK_BYTES),)](
            q, bits, n, bits.numel(), block_bytes=BLOCK_BYTES)
    return bits


def masked_by_bits(dy: torch.Tensor, bits: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``dy`` where the entry's bit is set, else +0, into ``out`` (``dy`` itself: in place;
    None: a new tensor)."""
    _check(dy, "dy")
    out = torch.empty_like(dy) if out is None else out
    n = dy.numel()
    if bits.numel() != -(-n // 8):
        raise ValueError(f"{bits.numel()} bytes of bits for {n} entries")
    if n:
        _masked_kernel[(triton.cdiv(bits.numel(), BLOCK_BYTES),)](
            dy, bits, out, n, bits.numel(), block_bytes=BLOCK_BYTES)
    return out
