"""bf16 as numba sees it (uint16 bit patterns), and the CPU passes of a sum whose messages
travel as bf16 (:func:`common.collectives.all_reduce` over a group ``on_wire(torch.bfloat16)``),
one pass each over memory:

    to_bf16(x, out)       float32 -> bf16, rounded to nearest even (torch's rounding)
    add_chunks(parts)     the float32 sum over j of parts[j] (bf16 [g, m]), j in order
    from_bf16(x, out)     bf16 -> float32 (exact)

torch's float32 += bf16 takes about 5 times as long as a copy on the CPU; these passes run at
about the speed of one. Single-threaded and without the GIL: under MPI they run
on the progress thread beside the compute. Their results are torch's, bit for bit, but for
the bits of a NaN (tests/common/test_wire.py). On other devices they are torch's operations.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_QUIET_NAN = 0x7FC0  # a NaN stays a NaN (torch's vector and scalar paths differ in the bits)


@intrinsic
def widen(typingctx, v):  # pragma: no cover - compiled
    """An element as float32: a float as it is; a uint16 as the bfloat16 whose bits it holds
    (``bits << 16`` reinterpreted as float32, exact). For numba kernels (plexus.kernels)."""
    if isinstance(v, types.Float):
        return v(v), lambda context, builder, sig, args: args[0]
    if v != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        wide = builder.shl(builder.zext(args[0], i32), ir.Constant(i32, 16))
        return builder.bitcast(wide, ir.FloatType())

    return types.float32(v), codegen


@numba.njit(inline="always")
def round_bits(b):  # pragma: no cover - compiled
    """The bf16 bits of the float32 whose bits ``b`` (int64) holds, rounded to nearest even
    (torch's rounding; a NaN becomes the quiet NaN). For numba kernels (plexus.norm_kernels)."""
    if (b & 0x7FFFFFFF) > 0x7F800000:
        return np.uint16(_QUIET_NAN)
    return np.uint16((b + 0x7FFF + ((b >> 16) & 1)) >> 16)


@numba.njit(nogil=True, cache=True)
def _to_bf16(bits: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    for i in range(bits.size):
        out[i] = round_bits(np.int64(bits[i]))


@numba.njit(nogil=True, cache=True)
def _add_chunks(parts: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    g, m = parts.shape
    for i in range(m):
        out[i] = widen(parts[0, i])  # type: ignore[call-arg]
    for j in range(1, g):
        for i in range(m):
            out[i] = out[i] + widen(parts[j, i])  # type: ignore[call-arg]


@numba.njit(nogil=True, cache=True)
def _from_bf16(x: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    for i in range(x.size):
        out[i] = widen(x[i])  # type: ignore[call-arg]


def _u16(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint16).numpy().reshape(-1)


def to_bf16(x: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (bf16, contiguous, ``x``'s number of elements) = ``x`` rounded to bf16."""
    if x.is_cpu and x.dtype == torch.float32 and x.is_contiguous() and out.is_contiguous():
        _to_bf16(x.view(torch.int32).numpy().reshape(-1).view(np.uint32), _u16(out))
    else:
        out.view(x.shape).copy_(x)


def add_chunks(parts: torch.Tensor) -> torch.Tensor:
    """The float32 sum over ``j`` of ``parts[j]`` (bf16 [g, m], contiguous), in order of j."""
    if not parts.is_cpu:
        total = parts[0].float()
        for j in range(1, parts.shape[0]):
            total += parts[j].float()
        return total
    out = torch.empty(parts.shape[1], dtype=torch.float32)
    _add_chunks(parts.view(torch.uint16).numpy(), out.numpy())
    return out


def from_bf16(x: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (float32) = ``x`` (bf16, contiguous, as many elements), exactly."""
    if x.is_cpu and out.dtype == torch.float32 and out.is_contiguous() and x.is_contiguous():
        _from_bf16(_u16(x), out.numpy().reshape(-1))
    else:
        out.copy_(x.view(out.shape))
