"""numba kernels behind plexus.sparse (imported only when numba is installed)."""

from __future__ import annotations

import numba


@numba.njit(parallel=True, fastmath=True, nogil=True, cache=True)
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
