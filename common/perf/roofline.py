"""The compute model's primitives (docs/design/perf-model.md): the bytes a CSR SpMM moves
(memory-bound, the gathered rows rounded up to the cache line) and a float32 GEMM's roofline
time. common.perf.gcn and common.perf.gat build an epoch's compute from them. Pure Python.
"""

from __future__ import annotations

from common.grid import ceil_div
from common.perf.gcn_workload import F32

__all__ = ["gemm_seconds", "spmm_bytes"]


def spmm_bytes(rows: int, nnz: float, width: int, *, index_bytes: int, cache_line: int,
               x_bytes: int = F32) -> float:
    """Bytes a CSR SpMM ``[rows, *] @ [*, width]`` moves without reuse of the gathered rows
    (of ``x_bytes`` an element: 2 for a bf16 X; the output is float32)."""
    row = ceil_div(width * x_bytes, cache_line) * cache_line
    return nnz * (index_bytes + F32) + (rows + 1) * index_bytes + nnz * row + rows * width * F32


def gemm_seconds(m: int, k: int, n: int, flops: float, memory_bandwidth: float) -> float:
    """Roofline time of a float32 GEMM ``[m, k] @ [k, n]``."""
    return max(2.0 * m * k * n / flops, F32 * (m * k + k * n + m * n) / memory_bandwidth)
