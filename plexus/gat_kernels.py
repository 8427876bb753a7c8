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
