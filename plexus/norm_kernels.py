"""numba kernels of the batch norm (and the ReLU after it) on the CPU, behind plexus.norms
(imported only when numba is installed).

A block ``q [R, D]`` (float32, row-major) is cut into chunks of :data:`CHUNK_ROWS` rows, one
chunk a parallel task. The column sums add each chunk's rows in order in float32, and the
chunks' sums in order of the chunk in float64: the same bits on any number of threads. The
centred block kept for backward is float32, or bf16 held as its uint16 bit patterns (rounded
to nearest even, as ``Tensor.to(torch.bfloat16)``). The ReLU's mask is one bit an entry, in
the order of :func:`plexus.kernels.relu_pack` (entry ``8 j + k`` of the flat block is bit
``k`` of byte ``j``); a chunk's row count is a multiple of 8, so no byte straddles two
chunks.

Passes over the block (a pass reads or writes it once): forward two reads for the mean and the
variance, then one that reads ``q`` and writes the output and the centred block; backward one
that reads the gradient and the centred block for its column sums, and one that reads them
again and writes ``dq``.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import overload

from common.wire import round_bits as _round_bits
from common.wire import widen as _widen
from plexus.kernels import _BIT_WORDS

CHUNK_ROWS = 1024  # rows per parallel task (a multiple of 8: see the module docstring)


def num_chunks(rows: int) -> int:
    """Chunks of :data:`CHUNK_ROWS` rows covering ``rows`` (at least one)."""
    return max(1, -(-rows // CHUNK_ROWS))


@numba.njit(inline="always")
def _bf16(v):  # pragma: no cover - compiled
    """The bits of float32 ``v`` rounded to bf16 (:func:`common.wire.round_bits`)."""
    return _round_bits(np.int64(np.float32(v).view(np.uint32)))


def _store(keep, r, j, v):  # pragma: no cover - replaced by the overload when compiled
    """``keep[r, j] = v``: as it is into float32, its bf16 bits into uint16."""


@overload(_store, inline="always")
def _store_typed(keep, r, j, v):  # pragma: no cover - compiled
    if keep.dtype == types.uint16:
        def store_bf16(keep, r, j, v):
            keep[r, j] = _bf16(v)
        return store_bf16

    def store(keep, r, j, v):
        keep[r, j] = v
    return store


@numba.njit(parallel=True, nogil=True, cache=True)
def column_sums(q, mask, mean, squares, out):  # pragma: no cover - compiled
    """``out[c, j]`` (float64 [chunks, D]) = the sum over the real rows ``r`` (``mask[r] !=
    0``) of chunk ``c`` of ``q[r, j]``, or with ``squares`` of ``(q[r, j] - mean[j])^2``
    (added in float32 within the chunk)."""
    rows, d = q.shape
    for c in numba.prange(out.shape[0]):
        acc = np.zeros(d, dtype=np.float32)
        for r in range(c * CHUNK_ROWS, min(rows, (c + 1) * CHUNK_ROWS)):
            if mask[r] == 0:
                continue
            if squares:
                for j in range(d):
                    v = q[r, j] - mean[j]
                    acc[j] += v * v
            else:
                for j in range(d):
                    acc[j] += q[r, j]
        for j in range(d):
            out[c, j] = acc[j]


@numba.njit(inline="always")
def _relu_bytes(flat, bits, first, last):  # pragma: no cover - compiled
    """In-place ReLU of the entries of bytes ``first`` to ``last`` of ``bits`` in the flat
    block, their masks ``> 0`` packed into those bytes."""
    n = flat.shape[0]
    for b in range(first, last):
        byte = np.uint8(0)
        for k in range(8):
            i = 8 * b + k
            if i < n:
                v = flat[i]
                byte |= np.uint8(v > 0) << np.uint8(k)
                flat[i] = np.float32(0) if v < 0 else v
        bits[b] = byte


@numba.njit(parallel=True, nogil=True, cache=True)
def normalize(q, mean, scale, shift, out, keep, relu, bits):  # pragma: no cover - compiled
    """``keep = q - mean`` (float32, or uint16: its bf16 bits) and ``out = keep_f32 * scale +
    shift`` from the unrounded centred value, then with ``relu`` the ReLU of it in place and its
    mask ``out > 0`` in ``bits`` (:func:`plexus.kernels.relu_pack`'s values: negatives become
    +0, -0 and NaN stay with bit 0). ``out`` may be ``q``."""
    rows, d = q.shape
    flat = out.reshape(-1)
    whole = d % 8 == 0  # each row's mask is whole bytes: packed while the row is in cache
    for c in numba.prange((rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        r0, r1 = c * CHUNK_ROWS, min(rows, (c + 1) * CHUNK_ROWS)
        for r in range(r0, r1):
            for j in range(d):
                v = q[r, j] - mean[j]
                _store(keep, r, j, v)
                y = v * scale[j] + shift[j]
                out[r, j] = np.float32(0) if relu and y < 0 else y
            if relu and whole:
                base = (r * d) >> 3
                for b in range(d >> 3):
                    byte = np.uint8(0)
                    for k in range(8):
                        byte |= np.uint8(out[r, 8 * b + k] > 0) << np.uint8(k)
                    bits[base + b] = byte
        if relu and not whole:
            _relu_bytes(flat, bits, (r0 * d) // 8, (r1 * d + 7) // 8)


@numba.njit(inline="always")
def _behind_relu(dy, dyu, bits, relu, r, g, gu):  # pragma: no cover - compiled
    """Row ``r`` of the gradient behind the ReLU into ``g``: ``dy`` where the entry's bit is
    set, else +0 (the bits of ``masked_fill``); ``dyu``, ``gu``: uint32 views of ``dy``, ``g``.
    A row of whole bytes ANDs each byte's eight entries with a table row."""
    d = g.shape[0]
    if not relu:
        g[:] = dy[r]
    elif d % 8 == 0:
        base = (r * d) >> 3
        for b in range(d >> 3):
            byte = bits[base + b]
            for k in range(8):
                gu[8 * b + k] = dyu[r, 8 * b + k] & _BIT_WORDS[byte, k]
    else:
        for j in range(d):
            i = r * d + j
            g[j] = dy[r, j] if (bits[i >> 3] >> np.uint8(i & 7)) & 1 else np.float32(0)


@numba.njit(parallel=True, nogil=True, cache=True)
def gradient_sums(dy, keep, mask, relu, bits, out):  # pragma: no cover - compiled
    """Per chunk ``c`` (``out`` float64 [chunks, 3, D]): the column sums of the gradient ``g``
    (``dy`` behind the ReLU's mask with ``relu``), of ``g * keep`` and, for a bf16 ``keep``,
    of ``keep`` over the real rows (its offset from zero once rounded; 0 for float32), every
    row of ``dy [R, D]`` (added in float32 within the chunk)."""
    rows, d = dy.shape
    dyu = dy.view(np.uint32)
    offset = keep.itemsize == 2
    for c in numba.prange(out.shape[0]):
        s0 = np.zeros(d, dtype=np.float32)
        s1 = np.zeros(d, dtype=np.float32)
        s2 = np.zeros(d, dtype=np.float32)
        gu = np.empty(d, dtype=np.uint32)
        g = gu.view(np.float32)
        for r in range(c * CHUNK_ROWS, min(rows, (c + 1) * CHUNK_ROWS)):
            _behind_relu(dy, dyu, bits, relu, r, g, gu)
            for j in range(d):
                k = _widen(keep[r, j])  # type: ignore[call-arg]
                s0[j] += g[j]
                s1[j] += g[j] * k
            if offset and mask[r] != 0:
                for j in range(d):
                    s2[j] += _widen(keep[r, j])  # type: ignore[call-arg]
        for j in range(d):
            out[c, 0, j] = s0[j]
            out[c, 1, j] = s1[j]
            out[c, 2, j] = s2[j]


@numba.njit(parallel=True, nogil=True, cache=True)
def input_gradient(dy, keep, mask, relu, bits, scale, k1, k2, out):  # pragma: no cover
    """``out = g * scale - mask (k1 + keep * k2)``, ``g`` as in :func:`gradient_sums`; ``out``
    may be ``dy``."""
    rows, d = dy.shape
    dyu = dy.view(np.uint32)
    for c in numba.prange((rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        gu = np.empty(d, dtype=np.uint32)
        g = gu.view(np.float32)
        for r in range(c * CHUNK_ROWS, min(rows, (c + 1) * CHUNK_ROWS)):
            _behind_relu(dy, dyu, bits, relu, r, g, gu)
            m = mask[r]
            for j in range(d):
                k = _widen(keep[r, j])  # type: ignore[call-arg]
                out[r, j] = g[j] * scale[j] - m * (k1[j] + k * k2[j])
