"""numba kernels of graph attention on a block (plexus.gat; imported only when numba is
installed): the aggregation with one coefficient per edge and head, and the scores' gradient
per edge and head, each row's edges in order by one thread (no atomics, the same result on
every run).

Shapes: indptr [rows + 1], indices [nnz] (a row-major pattern: the column of each edge, or for
the transpose the row), edges [nnz] (each position's edge, or [0]: the position itself),
weight [nnz, K], x [m, K, c] -> out [rows, K, c]; sddmm: a [rows, K, c], b [m, K, c] ->
out [nnz, K]
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(parallel=True, fastmath={"contract"}, nogil=True, cache=True)
def heads_spmm(indptr, indices, edges, weight, x, out):  # pragma: no cover - compiled
    """``out[i, h] = sum over the edges e of row i of weight[edge(e), h] * x[indices[e], h]``."""
    heads, width = x.shape[1], x.shape[2]
    mapped = edges.shape[0] > 0
    for i in numba.prange(indptr.shape[0] - 1):
        acc = out[i]
        for h in range(heads):
            for k in range(width):
                acc[h, k] = 0.0
        for e in range(indptr[i], indptr[i + 1]):
            row = x[indices[e]]
            w = weight[edges[e] if mapped else e]
            for h in range(heads):
                wh = w[h]
                for k in range(width):
                    acc[h, k] += wh * row[h, k]


@numba.njit(parallel=True, fastmath={"contract"}, nogil=True, cache=True)
def heads_sddmm(indptr, indices, a, b, out):  # pragma: no cover - compiled
    """``out[e, h] = a[i, h] . b[indices[e], h]`` for every edge e of row i."""
    heads, width = a.shape[1], a.shape[2]
    for i in numba.prange(indptr.shape[0] - 1):
        ai = a[i]
        for e in range(indptr[i], indptr[i + 1]):
            bj = b[indices[e]]
            for h in range(heads):
                s = 0.0
                for k in range(width):
                    s += ai[h, k] * bj[h, k]
                out[e, h] = s


@numba.njit(parallel=True, fastmath={"contract"}, nogil=True, cache=True)
def scores(indptr, indices, t, s, slope, e_out, positive_out, m_out):  # pragma: no cover
    """``e = LeakyReLU(t[i] + s[j])`` on every edge (and whether ``t[i] + s[j] > 0``), and
    each row's maximum ``m[i]`` (``-inf`` for a row without edges), per head."""
    heads = t.shape[1]
    for i in numba.prange(indptr.shape[0] - 1):
        for h in range(heads):
            m_out[i, h] = -np.inf
        for e in range(indptr[i], indptr[i + 1]):
            j = indices[e]
            for h in range(heads):
                u = t[i, h] + s[j, h]
                positive_out[e, h] = u > 0
                v = u if u > 0 else u * slope
                e_out[e, h] = v
                if v > m_out[i, h]:
                    m_out[i, h] = v


@numba.njit(parallel=True, fastmath={"contract"}, nogil=True, cache=True)
def exp_rows(indptr, e_io, m, z_out):  # pragma: no cover - compiled
    """``e <- exp(e - m[i])`` on every edge of row i, and each row's sum ``z[i]``."""
    heads = m.shape[1]
    for i in numba.prange(indptr.shape[0] - 1):
        for h in range(heads):
            z_out[i, h] = 0.0
        for e in range(indptr[i], indptr[i + 1]):
            for h in range(heads):
                v = np.exp(e_io[e, h] - m[i, h])
                e_io[e, h] = v
                z_out[i, h] += v


@numba.njit(parallel=True, fastmath={"contract"}, nogil=True, cache=True)
def divide_rows(indptr, x_io, z):  # pragma: no cover - compiled
    """``x <- x / z[i]`` on every edge of row i."""
    heads = z.shape[1]
    for i in numba.prange(indptr.shape[0] - 1):
        for e in range(indptr[i], indptr[i + 1]):
            for h in range(heads):
                x_io[e, h] /= z[i, h]


@numba.njit(parallel=True, fastmath={"contract"}, nogil=True, cache=True)
def dot_rows(indptr, a, b, out):  # pragma: no cover - compiled
    """``out[i] = sum over the edges e of row i of a[e] * b[e]``, per head."""
    heads = a.shape[1]
    for i in numba.prange(indptr.shape[0] - 1):
        for h in range(heads):
            out[i, h] = 0.0
        for e in range(indptr[i], indptr[i + 1]):
            for h in range(heads):
                out[i, h] += a[e, h] * b[e, h]


@numba.njit(parallel=True, fastmath={"contract"}, nogil=True, cache=True)
def scores_grad(indptr, alpha, dalpha_io, r, positive, slope, dt_out):  # pragma: no cover
    """``du = alpha * (dalpha - r[i])``, times ``slope`` where the score was not positive,
    written over ``dalpha``; and each row's sum ``dt[i]`` of ``du``."""
    heads = r.shape[1]
    for i in numba.prange(indptr.shape[0] - 1):
        for h in range(heads):
            dt_out[i, h] = 0.0
        for e in range(indptr[i], indptr[i + 1]):
            for h in range(heads):
                du = (dalpha_io[e, h] - r[i, h]) * alpha[e, h]
                if not positive[e, h]:
                    du *= slope
                dalpha_io[e, h] = du
                dt_out[i, h] += du


@numba.njit(parallel=True, fastmath={"contract"}, nogil=True, cache=True)
def gather_sum(indptr, edges, x, out):  # pragma: no cover - compiled
    """``out[j] = sum of x[edges[p]]`` over the positions p of row j of a (transposed)
    pattern: the column sums of per-edge values, a column a thread."""
    heads = x.shape[1]
    for j in numba.prange(indptr.shape[0] - 1):
        for h in range(heads):
            out[j, h] = 0.0
        for p in range(indptr[j], indptr[j + 1]):
            e = edges[p]
            for h in range(heads):
                out[j, h] += x[e, h]
