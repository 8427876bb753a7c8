"""Graph preprocessing for Plexus: normalisation, permutations, adjacency blocks.

Pure arithmetic on numpy/scipy (no torch.distributed), so it is tested on its own.

Conventions (docs/design/plexus-3d.md sections 1-3, 6):

* ``edge_index[0]`` is the source, ``edge_index[1]`` the target; node ``t`` aggregates from its
  in-neighbours: ``Â[t, s] = 1/sqrt(d_t d_s)`` for an edge ``s -> t`` or ``s == t``, with
  ``d`` the in-degree in ``A + I`` (the convention of PyG's ``gcn_norm``). For undirected
  graphs (both directions stored) this is the symmetric ``D^-1/2 (A + I) D^-1/2``.
* Aggregations (:data:`AGGREGATIONS`): ``gcn`` uses ``Â``; ``mean`` (GraphSAGE,
  ``h_t = W1 x_t + W2 mean_{s -> t} x_s``) uses the mean adjacency ``A_mean``
  (:func:`mean_adjacency`) for the neighbour term and the permuted identity ``S``
  (:func:`permuted_identity`; one block of it, without the whole and without its values:
  :func:`permuted_identity_rows`), cut into the same blocks, for the root term: ``S_l F_l``,
  all-reduced over O like ``A_l F_l``, holds the input rows of the layer's output nodes.
* Permutations are arrays ``perm[new] = old``. Even layers use ``A' = Pr Â Pc^T``
  (``A'[i, j] = Â[pr[i], pc[j]]``) with input rows in ``Pc`` order and output in ``Pr``
  order; odd layers use ``A'' = Pc Â Pr^T``. ``none``: Pr = Pc = identity; ``single``:
  Pr = Pc (one symmetric permutation); ``double``: independent Pr and Pc.
* Which axis cuts the rows and columns of layer ``l``'s matrix: plexus.layout.

Shapes (N = padded node count):
    Â, A_mean, A', A''         [N, N] CSR float32
    S = Pr I Pc^T, Pc I Pr^T   [N, N] CSR float32, one 1 per real node, none on padding
    A_l block on rank (o, i, p): [N/P, N/O]  rows chunk p, cols chunk o (replicated over I)
    S_l block on rank (o, i, p): [N/P, N/O]  the same cut of S (about N/(P O) nonzeros)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from common.grid import round_up

PERMUTATIONS = ("none", "single", "double")
AGGREGATIONS = ("gcn", "mean")  # GCN's Â; GraphSAGE's mean of in-neighbours plus a root term


def normalized_adjacency(edge_index: np.ndarray, num_nodes: int) -> sp.csr_matrix:
    """``Â`` as CSR (float32), rows = targets, with one self-loop per node (existing ones merged).

    Duplicate edges are kept as multi-edges (weights add), as PyG's ``gcn_norm`` does.
    """
    src, dst = np.asarray(edge_index[0]), np.asarray(edge_index[1])
    keep = src != dst  # replace existing self-loops by exactly one, like add_remaining_self_loops
    loops = np.arange(num_nodes)
    rows = np.concatenate([dst[keep], loops])
    cols = np.concatenate([src[keep], loops])
    deg = np.bincount(rows, minlength=num_nodes).astype(np.float64)
    dinv = 1.0 / np.sqrt(deg)
    vals = (dinv[rows] * dinv[cols]).astype(np.float32)
    a = sp.csr_matrix((vals, (rows, cols)), shape=(num_nodes, num_nodes))
    a.sum_duplicates()
    return a


def mean_adjacency(edge_index: np.ndarray, num_nodes: int) -> sp.csr_matrix:
    """``A_mean`` as CSR (float32), rows = targets: ``A_mean[t, s] = m_ts / deg_t``.

    ``m_ts`` is the number of edges ``s -> t`` and ``deg_t`` the in-degree of ``t`` counting
    every edge, so ``(A_mean x)_t`` is the mean of ``x_s`` over the messages ``t`` receives:
    PyG's ``SAGEConv(aggr="mean")`` neighbour term, which scatter-means over edges. Hence
    duplicate edges count as separate messages (weight ``m_ts / deg_t``), self-loop edges are
    kept as ordinary messages (SAGEConv adds and removes none), and a node without
    in-neighbours has an empty row (its mean is 0). Values are computed in float64 and stored
    float32.
    """
    src, dst = np.asarray(edge_index[0]), np.asarray(edge_index[1])
    deg = np.bincount(dst, minlength=num_nodes).astype(np.float64)
    a = sp.csr_matrix((np.ones(dst.size), (dst, src)), shape=(num_nodes, num_nodes))
    a.sum_duplicates()  # data = m_ts, column indices sorted
    a.data = (a.data / np.repeat(deg, np.diff(a.indptr))).astype(np.float32)
    return a


def permuted_identity(rows: np.ndarray, cols: np.ndarray, num_real: int) -> sp.csr_matrix:
    """The identity of the ``num_real`` real nodes in the layout ``(rows, cols)``, in O(N).

    ``S[i, j] = 1`` iff ``rows[i] == cols[j] < num_real``: ``permuted(I, rows, cols)`` with
    ``I`` zero on padding, built without indexing an ``[N, N]`` matrix. With the orders of
    :func:`layer_orders` it is ``Pr I Pc^T`` (even layers) or ``Pc I Pr^T`` (odd), so
    ``S @ F`` maps a layer's input rows to its output rows (GraphSAGE's root term).

    Shapes: rows, cols [N] (``perm[new] = old``) -> [N, N] CSR float32 with num_real ones.
    """
    n = rows.size
    inv_cols = np.empty(n, dtype=np.int64)
    inv_cols[cols] = np.arange(n)
    real = rows < num_real
    indptr = np.concatenate([[0], np.cumsum(real)])
    indices = inv_cols[rows[real]]
    return sp.csr_matrix((np.ones(indices.size, dtype=np.float32), indices, indptr),
                         shape=(n, n))


def permuted_identity_rows(rows: np.ndarray, cols: np.ndarray, num_real: int, p: int,
                           num_p: int, o: int, num_o: int, *, inv_cols: np.ndarray | None = None,
                           chunk: int = 1 << 22) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Block ``(p, o)`` of :func:`permuted_identity` in its compact form, and the nonzeros of
    every ``(p, o)`` block (:func:`block_nnz` of the whole), without the ``[N, N]`` matrix.

    Row ``i`` of ``S`` holds its one at column ``inv_cols[rows[i]]`` (if ``rows[i]`` is a real
    node). So a row block is said by its rows' *owners* (the block of columns, a coordinate
    along O, that holds each row's one: the rank of O that holds its input row,
    plexus.root_rows) and, for the rows that block ``o`` owns, their columns inside it, in
    row order: the block's CSR without its values (all ones) or its row pointers (the
    running count of ``owners == o``). O(N) time in chunks of ``chunk`` rows, and beside the
    result one ``[N]`` array in memory, the inverse of ``cols`` (computed here unless given:
    ``inv_cols[cols[j]] = j``). A rank builds its root blocks this way
    (plexus.data.memory.root_blocks).

    Shapes: rows, cols [N] (``perm[new] = old``, may be memory-mapped) -> (int16 [N/num_p]
    owners, -1 for a padding node; int32 [nnz] columns (int64 from 2^31 columns); int64
    [num_p, num_o] counts)
    """
    n = rows.size
    nr, nc = n // num_p, n // num_o
    if num_o > np.iinfo(np.int16).max:
        raise ValueError(f"{num_o} ranks along O: at most {np.iinfo(np.int16).max}")
    if inv_cols is None:
        inv_cols = inverse_permutation(cols, chunk=chunk)
    counts = np.zeros(num_p * num_o, dtype=np.int64)
    for lo in range(0, n, chunk):
        r = np.asarray(rows[lo:lo + chunk])
        i = np.flatnonzero(r < num_real)
        counts += np.bincount(((lo + i) // nr) * num_o + inv_cols[r[i]] // nc,
                              minlength=num_p * num_o)
    r = np.asarray(rows[p * nr:(p + 1) * nr])
    real = r < num_real
    j = inv_cols[np.where(real, r, 0)]
    owners = np.where(real, j // nc, -1).astype(np.int16)
    index = np.int32 if nc < 2**31 else np.int64
    mine = (j[owners == o] - o * nc).astype(index)
    return owners, mine, counts.reshape(num_p, num_o)


def identity_csr(owners: np.ndarray, cols: np.ndarray, o: int, num_cols: int) -> sp.csr_matrix:
    """The CSR (float32 ones) of a block of ``S`` from its compact form
    (:func:`permuted_identity_rows`): the rows that ``o`` owns hold one each, at ``cols``.

    Shapes: owners [rows], cols [nnz] -> [rows, num_cols]
    """
    indptr = np.concatenate([[0], np.cumsum(owners == o)]).astype(cols.dtype)
    return sp.csr_matrix((np.ones(cols.size, dtype=np.float32), cols, indptr),
                         shape=(owners.size, num_cols))


def inverse_permutation(perm: np.ndarray, *, chunk: int = 1 << 22) -> np.ndarray:
    """``inv`` with ``inv[perm[j]] = j``, int64 [N], filled in chunks of ``perm`` (which may be
    memory-mapped)."""
    inv = np.empty(perm.size, dtype=np.int64)
    for lo in range(0, perm.size, chunk):
        inv[np.asarray(perm[lo:lo + chunk])] = np.arange(lo, min(lo + chunk, perm.size))
    return inv


def make_permutations(num_nodes: int, mode: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(pr, pc), each ``perm[new] = old`` over ``num_nodes`` (padded) nodes."""
    if mode not in PERMUTATIONS:
        raise ValueError(f"unknown permutation {mode!r}; choose from {PERMUTATIONS}")
    rng = np.random.default_rng(seed)
    if mode == "none":
        ident = np.arange(num_nodes)
        return ident, ident
    pr = rng.permutation(num_nodes)
    return (pr, pr) if mode == "single" else (pr, rng.permutation(num_nodes))


def layer_orders(layer: int, pr: np.ndarray, pc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(output row order, input row order) of ``layer``: (pr, pc) even, (pc, pr) odd."""
    return (pr, pc) if layer % 2 == 0 else (pc, pr)


def output_order(num_layers: int, pr: np.ndarray, pc: np.ndarray) -> np.ndarray:
    """Row order of the model's output: ``Pr`` after an odd number of layers, else ``Pc``."""
    return layer_orders(num_layers - 1, pr, pc)[0]


def permuted(a: sp.csr_matrix, rows: np.ndarray, cols: np.ndarray) -> sp.csr_matrix:
    """``a[rows][:, cols]`` (``A'[i, j] = a[rows[i], cols[j]]``) as CSR with sorted column
    indices (canonical order: the SpMM sums each row in column order, as on prepared blocks)."""
    out = a[rows][:, cols].tocsr()
    out.sort_indices()
    return out


def block(a: sp.csr_matrix, p: int, num_p: int, o: int, num_o: int) -> sp.csr_matrix:
    """Rows chunk ``p`` of ``num_p`` and columns chunk ``o`` of ``num_o`` of ``a``."""
    nr, nc = a.shape[0] // num_p, a.shape[1] // num_o
    return a[p * nr : (p + 1) * nr, o * nc : (o + 1) * nc].tocsr()


def block_nnz(a: sp.csr_matrix, num_p: int, num_o: int) -> np.ndarray:
    """Nonzeros of every (p, o) block of ``a``: int64 [num_p, num_o]."""
    coo = a.tocoo()
    nr, nc = a.shape[0] // num_p, a.shape[1] // num_o
    ids = (coo.row // nr) * num_o + coo.col // nc
    return np.bincount(ids, minlength=num_p * num_o).reshape(num_p, num_o)


@dataclass(frozen=True)
class Balance:
    """Max/mean nonzeros over the blocks of one adjacency layout."""

    max_nnz: int
    mean_nnz: float

    @property
    def ratio(self) -> float:
        return self.max_nnz / self.mean_nnz if self.mean_nnz else 1.0


def block_balance(
    edge_index: np.ndarray, num_nodes: int, k: int, mode: str, seed: int = 0
) -> Balance:
    """Balance of the even-layer matrix ``A'`` of ``Â`` (self-loops included) in ``k x k``
    blocks under a permutation mode."""
    n = round_up(num_nodes, k)
    a = normalized_adjacency(edge_index, num_nodes)
    a.resize((n, n))
    pr, pc = make_permutations(n, mode, seed)
    counts = block_nnz(permuted(a, pr, pc), k, k)
    return Balance(int(counts.max()), float(counts.mean()))
