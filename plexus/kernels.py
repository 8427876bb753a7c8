"""numba kernels behind plexus.sparse (imported only when numba is installed)."""

from __future__ import annotations

import numba


# fastmath "contract" only: fused multiply-adds, but no reassociation, so the sum over a row's
# nonzeros runs in index order whether the row is one block or several (bit-identical results
# for in-memory and prepared shards)
@numba.njit(parallel=True, fastmath={"contract"}, nogil=True, cache=True)
def csr_spmm(indptr, indices, values, x, out, accumulate):  # pragma: no cover - compiled
    """``out[i] (+)= sum_j values[j] * x[indices[j]]`` for every row ``i``, rows in parallel.

    Each output row is written by one thread, in nonzero order, so the result is the same on
    every run. ``accumulate=False`` overwrites ``out`` (no separate zero-fill pass).
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
                acc[k] += v * xr[k]


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
