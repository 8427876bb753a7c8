"""numba kernels behind plexus.sparse and plexus.slicing (imported only when numba is installed).

Shapes legend (SpMM): ``rows`` output rows of one CSR block, ``m`` its columns, ``d`` the width
of X, ``S`` column slices, ``T`` feature tiles of width ``t`` (``d = T * t``), ``K`` row chunks.

X may be float32 or bfloat16; numba has no bfloat16, so a bf16 X arrives as its uint16 bit
patterns and :func:`_widen` turns each element into the float32 it stands for (exact: a bf16
is the top half of a float32) as the kernel reads it. The sums are float32 either way, in the
same order: the product of a bf16 X is bit for bit that of the float32 ``X.float()``.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from common.wire import widen as _widen

# fastmath "contract" only: fused multiply-adds, but no reassociation, so the sum over a row's
# nonzeros runs in index order whether the row is one block or several (bit-identical results
# for in-memory and prepared shards)


@numba.njit(parallel=True, fastmath={"contract"}, nogil=True, cache=True)
def csr_spmm(indptr, indices, values, x, out, accumulate):  # pragma: no cover - compiled
    """``out[i] (+)= sum_j values[j] * x[indices[j]]`` for every row ``i``, rows in parallel.

    Each output row is written by one thread, in nonzero order, so the result is the same on
    every run. ``accumulate=False`` overwrites ``out`` (no separate zero-fill pass). ``x``
    float32, or bfloat16 bits as uint16 (:func:`_widen`).
    """
    d = x.shape[1]
    for i in numba.prange(indptr.shape[0] - 1):
        acc = out[i]
        if not accumulate:
            for k in range(d):
                acc[k] = 0.0
        for j in range(indptr[i], indptr[i + 1]):
            v = values[j]
            xr = x[indices[j]]
            for k in range(d):
                acc[k] += v * _widen(xr[k])


@intrinsic
def _prefetch(typingctx, row):  # pragma: no cover - compiled
    """Prefetch every cache line of a contiguous 1-D array view (``x[r]``) into all cache
    levels (``llvm.prefetch``, read, locality 3); a hint only, it changes no result."""
    if not isinstance(row, types.Array) or row.ndim != 1:
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        i8p = ir.IntType(8).as_pointer()
        base = builder.bitcast(ary.data, i8p)
        nbytes = builder.mul(builder.extract_value(ary.shape, 0), ary.itemsize)
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
            "llvm.prefetch.p0")
        flags = [ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)]
        line = context.get_constant(types.intp, 64)
        with cgutils.for_range_slice(builder, context.get_constant(types.intp, 0), nbytes,
                                     line) as (off, _):
            builder.call(fn, [builder.gep(base, [off]), *flags])
        return context.get_dummy_value()

    return types.void(row), codegen


@numba.njit(parallel=True, nogil=True, cache=True)
def csr_slice_cuts(indptr, indices, starts, cuts):  # pragma: no cover - compiled
    """``cuts[s - 1, i]``: where row ``i``'s first nonzero whose column is >= ``starts[s]``
    lies, counted from the row's start ``indptr[i]`` (so a ``uint16`` holds it where no row
    has 65,536 nonzeros: plexus.slicing).

    Column slice ``s`` (columns ``starts[s] .. starts[s + 1]``) of row ``i`` is then the
    nonzeros :func:`_segment` gives. Columns must be sorted within a row (CSR as scipy and
    plexus.data write it). ``cuts`` is ``[S - 1, rows]``, ``starts`` ``[S + 1]``.
    """
    for i in numba.prange(indptr.shape[0] - 1):
        j = indptr[i]
        end = indptr[i + 1]
        for s in range(1, starts.shape[0] - 1):
            while j < end and indices[j] < starts[s]:
                j += 1
            cuts[s - 1, i] = j - indptr[i]


@numba.njit(inline="always")
def _segment(indptr, cuts, s, last, i):  # pragma: no cover - compiled
    """The nonzeros ``lo .. hi`` of row ``i`` in column slice ``s`` of ``last + 1``:
    from the row's start (slice 0) or its cut ``s - 1`` to its cut ``s`` or its end (the last
    slice); the cuts count from the row's start (:func:`csr_slice_cuts`)."""
    lo = indptr[i] if s == 0 else indptr[i] + cuts[s - 1, i]
    hi = indptr[i + 1] if s == last else indptr[i] + cuts[s, i]
    return lo, hi


@numba.njit(inline="always", fastmath={"contract"})
def _spmm_chunk(indptr, cuts, s, last, r0, r1, indices, values, x, out, q, zero,
                lookahead):  # pragma: no cover
    """Rows ``r0 .. r1`` of column slice ``s`` and feature tile ``q``: ``out[i, q] (+)= sum
    over j in lo .. hi of values[j] * x[indices[j], q]``, in nonzero order (``lo .. hi``: row
    ``i``'s :func:`_segment` of the slice).

    A cursor walks ``lookahead`` nonzeros ahead through the same rows and slice and prefetches
    the X rows they will read: the rows are random, so the hardware prefetcher cannot guess them.
    """
    t = x.shape[2]
    pr = r0  # the cursor: row pr, its next nonzero pj, the end pe of its segment
    pj, pe = _segment(indptr, cuts, s, last, r0)
    for _ in range(lookahead):
        while pj == pe and pr + 1 < r1:
            pr += 1
            pj, pe = _segment(indptr, cuts, s, last, pr)
        if pj < pe:
            _prefetch(x[indices[pj], q])
            pj += 1
    for i in range(r0, r1):
        acc = out[i, q]
        if zero:
            for k in range(t):
                acc[k] = 0.0
        lo, hi = _segment(indptr, cuts, s, last, i)
        for j in range(lo, hi):
            while pj == pe and pr + 1 < r1:
                pr += 1
                pj, pe = _segment(indptr, cuts, s, last, pr)
            if pj < pe:
                _prefetch(x[indices[pj], q])
                pj += 1
            v = values[j]
            xr = x[indices[j], q]
            for k in range(t):
                acc[k] += v * _widen(xr[k])


@numba.njit(parallel=True, fastmath={"contract"}, nogil=True, cache=True)
def csr_spmm_sliced(indptr, cuts, chunks, indices, values, x, out, accumulate,
                    lookahead, s_lo, s_hi):  # pragma: no cover - compiled
    """Cache-blocked ``out (+)= A @ x``: column slice by column slice, row chunks in parallel.

    ``x`` is ``[m, T, t]`` and ``out`` ``[rows, T, t]`` (a free reshape of ``[m, d]`` and
    ``[rows, d]``); ``cuts`` ``[S - 1, rows]`` from :func:`csr_slice_cuts` (uint16, or
    indptr's dtype where a row is longer); ``chunks`` ``[K + 1]`` row boundaries. For each
    feature tile, slice ``s`` adds its nonzeros into the output rows before slice ``s + 1``
    starts, so the X rows of one slice stay in cache while every output row takes its terms
    from them.

    Exactness: each output element is one float accumulator in ``out`` receiving the row's
    nonzeros in index order (slices ascend in column, columns ascend within a row), starting
    from 0 (``accumulate=False``: the first slice zeroes) or from ``out`` -- the same terms in
    the same order as :func:`csr_spmm`, so the result is bit-identical to it.

    Only slices ``s_lo .. s_hi`` run (all: ``0, S``); running the ranges of a partition of the
    slices one after the other, in increasing order, adds the same terms in the same order as
    one call (the overlapped backward of plexus.ops.BlockedAggregation).
    """
    last = cuts.shape[0]
    for q in range(x.shape[1]):
        for s in range(s_lo, s_hi):
            zero = s == 0 and not accumulate
            for c in numba.prange(chunks.shape[0] - 1):
                if chunks[c] < chunks[c + 1]:
                    _spmm_chunk(indptr, cuts, s, last, chunks[c], chunks[c + 1], indices,
                                values, x, out, q, zero, lookahead)


@numba.njit(inline="always")
def _prefetch_next(indptr, indices, cursor, out, pr, pj, r1, end):  # pragma: no cover
    """Move the prefetch cursor (row ``pr``, nonzero ``pj``) to the next nonzero of the
    cell's rows below ``r1`` whose column is below ``end``, prefetch the output row it will
    add into and step past it; the cursor's new ``(pr, pj)``."""
    while pr < r1 and not (pj < indptr[pr + 1] and indices[pj] < end):
        pr += 1
        if pr < r1:
            pj = cursor[pr]
    if pr < r1:
        _prefetch(out[indices[pj]])
        pj += 1
    return pr, pj


@numba.njit(inline="always", fastmath={"contract"})
def _spmm_t_cell(indptr, indices, values, x, out, cursor, r0, r1, end,
                 lookahead):  # pragma: no cover
    """Rows ``r0 .. r1`` of one row chunk and the column slice ending at column ``end``:
    ``out[indices[j]] += values[j] * x[i]`` for the nonzeros ``j`` of row ``i`` from
    ``cursor[i]`` while their column is below ``end``; ``cursor[i]`` moves past them.

    The output rows are random: a second cursor walks ``lookahead`` of these nonzeros ahead
    and prefetches the rows they will add into (as :func:`_spmm_chunk` does for X's rows)."""
    d = x.shape[1]
    pr = r0  # the prefetch cursor: row pr, its next nonzero pj
    pj = cursor[r0] if r0 < r1 else 0
    for _ in range(lookahead):
        pr, pj = _prefetch_next(indptr, indices, cursor, out, pr, pj, r1, end)
    for i in range(r0, r1):
        j = cursor[i]
        e = indptr[i + 1]
        if j < e and indices[j] < end:
            xr = x[i]
            while j < e and indices[j] < end:
                pr, pj = _prefetch_next(indptr, indices, cursor, out, pr, pj, r1, end)
                v = values[j]
                acc = out[indices[j]]
                for k in range(d):
                    acc[k] += v * _widen(xr[k])
                j += 1
            cursor[i] = j


@numba.njit(parallel=True, fastmath={"contract"}, nogil=True, cache=True)
def csr_spmm_t(indptr, indices, values, x, out, accumulate, starts, chunks, cursor,
               r_lo, r_hi, lookahead):  # pragma: no cover - compiled
    """``out (+)= A[r_lo:r_hi]^T @ x[r_lo:r_hi]`` from A's own CSR: the transposed product
    without a transposed copy of A.

    ``x`` is ``[rows, d]`` (float32, or bf16 bits as uint16), ``out`` ``[m, d]`` float32;
    ``starts`` ``[S + 1]`` cuts A's columns (``out``'s rows) into slices, ``chunks``
    ``[C + 1]`` its rows into chunks; ``cursor`` ``[rows]`` is scratch of indptr's dtype.
    A wavefront: at step ``t`` slice ``s`` takes row chunk ``t - s``, so the slices run in
    parallel, each writing only its own rows of ``out``, and every slice meets the chunks in
    increasing order while each row's cursor walks its nonzeros once, slice after slice.

    Exactness: every ``out[c]`` receives the terms of column ``c`` in increasing row order,
    one float accumulator, starting from 0 (``accumulate=False``) or from ``out`` -- the
    order in which :func:`csr_spmm` sums row ``c`` of the transpose stored as CSR with rows
    ascending in each column (plexus.csr.CSRBlock.transpose, plexus.data.writer): the same
    bits.
    """
    num_s = starts.shape[0] - 1
    num_c = chunks.shape[0] - 1
    d = out.shape[1]
    if not accumulate:
        for s in numba.prange(num_s):
            for c in range(starts[s], starts[s + 1]):
                for k in range(d):
                    out[c, k] = 0.0
    for i in numba.prange(r_hi - r_lo):
        cursor[r_lo + i] = indptr[r_lo + i]
    for step in range(num_c + num_s - 1):
        for s in numba.prange(num_s):
            c = step - s
            if c >= 0 and c < num_c:
                r0 = max(chunks[c], r_lo)
                r1 = min(chunks[c + 1], r_hi)
                if r0 < r1:
                    _spmm_t_cell(indptr, indices, values, x, out, cursor, r0, r1,
                                 starts[s + 1], lookahead)


@numba.njit(parallel=True, nogil=True, cache=True)
def csr_check(indptr, indices, values, num_cols):  # pragma: no cover - compiled
    """The first problem of a CSR block, as a code: 0 none, 1 indptr does not start at 0 or
    end at ``len(indices)``, 2 indptr decreases, 3 a column index outside ``[0, num_cols)``,
    4 a value that is NaN or infinite. One pass over the arrays, no temporaries."""
    rows = indptr.shape[0] - 1
    if indptr[0] != 0 or indptr[rows] != indices.shape[0]:
        return 1
    bad_ptr = 0
    for i in numba.prange(rows):
        if indptr[i + 1] < indptr[i]:
            bad_ptr += 1
    if bad_ptr:
        return 2
    bad_col = 0
    bad_val = 0
    for j in numba.prange(indices.shape[0]):
        c = indices[j]
        if c < 0 or c >= num_cols:
            bad_col += 1
        v = values[j]
        if not np.isfinite(v):
            bad_val += 1
    if bad_col:
        return 3
    if bad_val:
        return 4
    return 0


_M32 = np.uint64(0xFFFFFFFF)


@numba.njit(inline="always")
def _mix32(x):  # pragma: no cover - compiled
    """plexus.dropout._mix32 on one value below 2^32, in uint64 arithmetic masked to 32 bits
    (numba widens integer products to 64 bits): the same value."""
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & _M32
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & _M32
    return x ^ (x >> np.uint64(16))


@numba.njit(parallel=True, nogil=True, cache=True)
def keep_mask(rows, cols, key, threshold, out):  # pragma: no cover - compiled
    """``out[i, j] = mix(mix(rows[i] ^ key) ^ cols[j]) * 0x9E3779B1 ^ key) >= threshold``,
    rows in parallel: plexus.dropout.keep_mask's hash, entry for entry (rows and cols uint32,
    key and threshold uint64 below 2^32, out bool [rows, cols])."""
    for i in numba.prange(rows.shape[0]):
        r = _mix32(np.uint64(rows[i]) ^ key)
        for j in range(cols.shape[0]):
            h = _mix32((((r ^ np.uint64(cols[j])) * np.uint64(0x9E3779B1)) & _M32) ^ key)
            out[i, j] = h >= threshold


RELU_CHUNK = 4096  # bytes of bits (32768 entries) per parallel chunk of the ReLU kernels


@numba.njit(parallel=True, nogil=True, cache=True)
def relu_pack(q, bits):  # pragma: no cover - compiled
    """In-place ``relu`` of the flat ``q`` and its mask ``q > 0`` packed into ``bits`` one bit
    an entry (entry ``8 j + k`` is bit ``k`` of byte ``j``: numpy's ``packbits`` with
    ``bitorder="little"``), in one pass. ``q < 0`` becomes 0; -0 and NaN stay as they are with
    bit 0, as ``torch.relu_`` and ``q > 0`` leave them. Whole bytes branch-free, in parallel
    chunks."""
    n = q.shape[0]
    full = n // 8
    for c in numba.prange((full + RELU_CHUNK - 1) // RELU_CHUNK):
        for j in range(c * RELU_CHUNK, min(full, (c + 1) * RELU_CHUNK)):
            b = np.uint8(0)
            for k in range(8):
                v = q[8 * j + k]
                pos = v > 0
                b |= np.uint8(pos) << np.uint8(k)
                q[8 * j + k] = np.float32(0) if v < 0 else v
            bits[j] = b
    if full < bits.shape[0]:  # the last, partial byte
        b = np.uint8(0)
        for i in range(8 * full, n):
            v = q[i]
            if v > 0:
                b |= np.uint8(1) << np.uint8(i - 8 * full)
            elif v < 0:
                q[i] = 0
        bits[full] = b


# byte -> the 8 words that keep (all ones) or clear (zero) the entries of its set bits
_BIT_WORDS = np.array([[0xFFFFFFFF if (b >> k) & 1 else 0 for k in range(8)]
                       for b in range(256)], dtype=np.uint32)


@numba.njit(parallel=True, nogil=True, cache=True)
def masked_by_bits(dy, bits, out):  # pragma: no cover - compiled
    """``out = dy`` where the bit of the entry is set, else +0 (flat uint32 views of float32
    arrays; the bit order of :func:`relu_pack`): the ReLU's backward in one pass, each byte's
    eight entries ANDed with a table row (the same bits as ``masked_fill``)."""
    n = dy.shape[0]
    full = n // 8
    for c in numba.prange((full + RELU_CHUNK - 1) // RELU_CHUNK):
        for j in range(c * RELU_CHUNK, min(full, (c + 1) * RELU_CHUNK)):
            words = _BIT_WORDS[bits[j]]
            for k in range(8):
                out[8 * j + k] = dy[8 * j + k] & words[k]
    for i in range(8 * full, n):
        out[i] = dy[i] & _BIT_WORDS[bits[full], i - 8 * full]


@numba.njit(inline="always")
def _mix64(z):  # pragma: no cover - compiled
    """splitmix64's finaliser: a bijection of uint64 with good avalanche."""
    z = (z ^ (z >> numba.uint64(30))) * numba.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> numba.uint64(27))) * numba.uint64(0x94D049BB133111EB)
    return z ^ (z >> numba.uint64(31))


@numba.njit(parallel=True, nogil=True, cache=True)
def rmat_chunk(first, key, scale, t1, t2, t3, scramble_keys, src, dst):  # pragma: no cover
    """R-MAT edges ``first .. first+len(src)`` into ``src``/``dst`` (see plexus.data.generators).

    Level ``l`` of edge ``e`` draws ``u = mix64(key + (e * scale + l) * golden) >> 11``
    scaled to [0, 1), so every edge is a pure function of (key, e): chunks can be generated
    in any order and in parallel. ``scramble_keys`` (4 uint64, or empty) applies the node-id
    bijection of plexus.data.generators._scramble.
    """
    golden = numba.uint64(0x9E3779B97F4A7C15)
    mask = numba.uint64((1 << scale) - 1)
    shift = numba.uint64(max(1, scale // 2))
    for i in numba.prange(src.shape[0]):
        e = numba.uint64(first + i)
        r = numba.uint64(0)
        c = numba.uint64(0)
        for level in range(scale):
            z = _mix64(key + (e * numba.uint64(scale) + numba.uint64(level)) * golden)
            u = (z >> numba.uint64(11)) * (1.0 / 9007199254740992.0)
            bit = numba.uint64(1) << numba.uint64(level)
            if u >= t2:
                r |= bit
            if (u >= t1 and u < t2) or u >= t3:
                c |= bit
        if scramble_keys.shape[0] == 4:
            for k in (0, 2):
                r = (r * (scramble_keys[k] | numba.uint64(1))) & mask
                r ^= r >> shift
                r = (r + scramble_keys[k + 1]) & mask
                c = (c * (scramble_keys[k] | numba.uint64(1))) & mask
                c ^= c >> shift
                c = (c + scramble_keys[k + 1]) & mask
        src[i] = numba.int64(r)
        dst[i] = numba.int64(c)


@numba.njit(nogil=True, cache=True)
def csr_transpose(indptr, indices, values, t_indptr, t_indices, t_values):  # pragma: no cover
    """Scatter a CSR matrix into the CSR of its transpose (a counting sort by column).

    ``t_indptr`` must already hold the column starts (cumulative column counts). Rows are
    visited in order, so row indices stay ascending within every column, as a stable sort
    by column would leave them.
    """
    nxt = t_indptr[:-1].copy()
    for i in range(indptr.shape[0] - 1):
        for j in range(indptr[i], indptr[i + 1]):
            c = indices[j]
            p = nxt[c]
            nxt[c] = p + 1
            t_indices[p] = i
            t_values[p] = values[j]
