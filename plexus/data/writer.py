"""The writer of prepared datasets: a graph as k x k memory-mappable block files, streaming the
edges. Its command line is ``python -m plexus.prepare`` (:mod:`plexus.prepare`); the reader is
:class:`plexus.data.mapped.PreparedGraph`; the files' layout: :mod:`plexus.data.schema`.

    from plexus.data.writer import prepare
    from plexus.data.sources import rmat_source
    prepare(rmat_source(24, 64, seed=0, num_features=16), "data/rmat-24-k8", blocks=8)

No step holds the whole edge list. Peak memory is O(B + M + N): B edges per chunk
(``chunk_edges`` of the source), M nonzeros of the largest block (about nnz / k^2 after the
double permutation), N nodes (degrees, permutations, labels). The steps:

1. stream the edges in chunks: count and drop self-loops, optionally symmetrise, map every
   edge to the permuted matrices (``A' = Pr Â Pc^T`` and, for directed graphs,
   ``A'' = Pc Â Pr^T``) and append its in-block key to the bucket file of its block;
2. per block: sort, merge duplicate edges (or count them as multi-edges), add up in-degrees;
3. per block, from the same keys, the two aggregations' blocks as CSR (their transposes are
   made where a reader needs them, plexus.data.mapped):
   the GCN's ``Â`` (one self-loop per node, ``m_ts / sqrt(d_t d_s)`` in float64, stored
   float32, exactly as plexus.data.partition.normalized_adjacency) and the mean adjacency
   ``A_mean`` of GraphSAGE (``m_ts / deg_t``, the self-loop edges put back as messages,
   exactly as plexus.data.partition.mean_adjacency: :func:`mean_self_loops`);
4. features, labels and split codes by row chunks, in the permuted orders.

Every file's SHA-256 goes into ``manifest.json`` as it is written.

The output is written under ``OUT.partial`` and renamed at the end: an interrupted run leaves
no half-written dataset at OUT, and an existing OUT is never overwritten without ``force``,
nor with it unless OUT is a prepared dataset (it holds a plexus manifest) that holds none of
the source's inputs.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from common.grid import round_up
from plexus.data import partition as part
from plexus.data.schema import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    MATRICES,
    MEAN_DIR,
    SPLIT_CODES,
    file_record,
    progress,
)
from plexus.data.sources import EdgeSource, NodeData

# ----------------------------------------------------------------------------- the pipeline


def _save(path: Path, arr: np.ndarray, files: dict, root: Path) -> None:
    """np.save, then record the file's size and SHA-256 in ``files``."""
    np.save(path, arr)
    _record(path, files, root)


def _record(path: Path, files: dict, root: Path) -> None:
    rel, rec = file_record(path, root)
    files[rel] = rec


def _index_dtype(nnz: int, rows: int):
    return np.int32 if max(nnz, rows) < 2**31 else np.int64


def prepare(source: EdgeSource, out: str | os.PathLike, *, blocks: int = 8,
            permutation: str = "double", seed: int = 0, force: bool = False,
            quiet: bool = False) -> dict:
    """Write ``source`` to ``out`` as ``blocks x blocks`` block files; returns the manifest.

    Args:
        source: the edges and node data (:mod:`plexus.data.sources`: ``rmat_source``,
            ``graph_source``, ``edge_file_source``, ``ogb_source``).
        out: output directory; must not exist unless ``force``.
        blocks: k; training grids need axis sizes that divide k.
        permutation: ``none``, ``single`` or ``double`` (docs/design/plexus-3d.md section 6).
        seed: permutation seed (training with this dataset uses these permutations).
        force: replace an existing ``out`` (only after the new one is complete), which must
            be a prepared dataset: a folder without a plexus manifest is refused.
        quiet: no progress bars.
    """
    if blocks < 1:
        raise ValueError(f"--blocks must be >= 1, got {blocks}")
    if permutation not in part.PERMUTATIONS:
        raise ValueError(f"unknown permutation {permutation!r}; choose from {part.PERMUTATIONS}")
    out = Path(out)
    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists; choose another --out or pass --force "
                              "to replace it once the new one is complete")
    for path in _input_paths(source):
        if path.resolve().is_relative_to(out.resolve()):
            raise ValueError(f"--out {out} holds the input it would be prepared from ({path}); "
                             "choose an --out outside it")
    if out.exists():
        _check_replaceable(out)
    t_start = time.perf_counter()
    k, n = blocks, source.num_nodes
    n_pad = round_up(max(n, 1), k)
    bs = n_pad // k
    work = Path(f"{out}.partial")
    if work.exists():
        shutil.rmtree(work)  # left by an interrupted run of ours
    (work / "buckets").mkdir(parents=True)
    _check_space(work, source)
    mats = ("even",) if source.symmetric else MATRICES
    pr, pc = part.make_permutations(n_pad, permutation, seed)
    inv = {"pr": np.argsort(pr), "pc": np.argsort(pc)}
    # (row order, col order) of each matrix: A' rows in Pr order, cols in Pc order; A'' swapped
    orders = {"even": ("pr", "pc"), "odd": ("pc", "pr")}
    files: dict[str, dict] = {}
    key_dtype = np.int64
    loops = np.zeros(n, dtype=np.int64)  # self-loop edges per node, as read
    try:
        # 1. bucket the edges by block
        edges_in = 0
        with progress(source.num_edges, "1/4 bucket edges", "edge", quiet) as bar:
            for chunk in source.chunks():
                edges_in += chunk.shape[1]
                bar.update(chunk.shape[1])
                src, dst = chunk[0], chunk[1]
                if chunk.shape[1] and (min(src.min(), dst.min()) < 0
                                       or max(src.max(), dst.max()) >= n):
                    raise ValueError(f"edge ids must be in [0, {n}); this chunk has "
                                     f"[{min(src.min(), dst.min())}, "
                                     f"{max(src.max(), dst.max())}]; "
                                     f"{_node_count_hint(source)}")
                keep = src != dst
                if not keep.all():  # few: a sparse count, not a bincount of N per chunk
                    ids, times = np.unique(src[~keep], return_counts=True)
                    loops[ids] += times
                src, dst = src[keep], dst[keep]
                if source.symmetrize:
                    src, dst = np.concatenate([src, dst]), np.concatenate([dst, src])
                for mat in mats:
                    ro, co = orders[mat]
                    r, c = inv[ro][dst], inv[co][src]  # rows are targets
                    bid = (r // bs) * k + c // bs
                    key = (r % bs) * bs + c % bs
                    del r, c
                    order = np.argsort(bid.astype(np.int16 if k * k < 2**15 else np.int64),
                                       kind="stable")
                    counts = np.bincount(bid, minlength=k * k)
                    key = key[order].astype(key_dtype)
                    del order, bid
                    lo = 0
                    for b in np.flatnonzero(counts):
                        with open(work / "buckets" / f"{mat}-{b}.bin", "ab") as f:
                            key[lo:lo + counts[b]].tofile(f)
                        lo += counts[b]
                del src, dst, keep
        # 2. per block: sort, merge duplicates, in-degrees (rows of A' are targets, Pr order)
        deg_rows = np.zeros(n_pad, dtype=np.int64)
        block_nnz = {m: np.zeros((k, k), dtype=np.int64) for m in mats}
        multi = False
        with progress(len(mats) * k * k, "2/4 sort blocks", "block", quiet) as bar:
            for mat in mats:
                for b in range(k * k):
                    bucket = work / "buckets" / f"{mat}-{b}.bin"
                    keys = (np.fromfile(bucket, dtype=key_dtype) if bucket.exists()
                            else np.zeros(0, dtype=key_dtype))
                    keys, counts = _sorted_unique(keys, source.dedupe)
                    if counts is not None:
                        if counts.size and counts.max() > 1:
                            multi = True
                            counts.astype(np.int32).tofile(bucket.with_suffix(".cnt"))
                    # a new file, not a rewrite: truncating a file with unwritten pages
                    # makes ext4 flush it synchronously (auto_da_alloc)
                    keys.tofile(bucket.with_suffix(".srt"))
                    bucket.unlink(missing_ok=True)
                    if mat == "even":
                        i = b // k
                        deg_rows[i * bs:(i + 1) * bs] += np.bincount(
                            keys // bs, weights=counts, minlength=bs).astype(np.int64)
                    bar.update()
        in_degree = np.zeros(n_pad, dtype=np.int64)
        in_degree[pr] = deg_rows  # row i of A' is node pr[i]
        del deg_rows
        real = np.arange(n_pad) < n
        dinv = np.zeros(n_pad, dtype=np.float64)
        dinv[real] = 1.0 / np.sqrt(in_degree[real] + 1.0)  # + 1: the self-loop
        mean_loops = mean_self_loops(loops, source.symmetrize, source.dedupe)
        deg = np.zeros(n_pad, dtype=np.float64)  # A_mean's row sums: every message counts
        deg[:n] = in_degree[:n] + mean_loops
        perm = {"pr": pr, "pc": pc}
        mean_nnz = {m: np.zeros((k, k), dtype=np.int64) for m in mats}
        # 3. per block: self-loops, values, the CSR of Â and of A_mean
        with progress(len(mats) * k * k, "3/4 write blocks", "block", quiet) as bar:
            for mat in mats:
                ro, co = orders[mat]
                dinv_r, dinv_c = dinv[perm[ro]], dinv[perm[co]]
                deg_r, deg_c = deg[perm[ro]], deg[perm[co]]
                v = np.arange(n)  # self-loop of node v sits at (inv_row[v], inv_col[v])
                loop_r, loop_c = inv[ro][v], inv[co][v]
                loop_bid = (loop_r // bs) * k + loop_c // bs
                loop_order = np.argsort(loop_bid, kind="stable")
                loop_start = np.concatenate([[0], np.cumsum(np.bincount(loop_bid,
                                                                        minlength=k * k))])
                loop_key = ((loop_r % bs) * bs + loop_c % bs)[loop_order]
                loop_m = mean_loops[loop_order]
                del v, loop_r, loop_c, loop_bid, loop_order
                for b in range(k * k):
                    i, j = divmod(b, k)
                    bucket = work / "buckets" / f"{mat}-{b}.srt"
                    keys = np.fromfile(bucket, dtype=key_dtype)
                    cnt_file = bucket.with_suffix(".cnt")
                    counts = np.fromfile(cnt_file, dtype=np.int32) if cnt_file.exists() else None
                    seg = slice(loop_start[b], loop_start[b + 1])  # this block's loops
                    srt = np.argsort(loop_key[seg])
                    lk, lm = loop_key[seg][srt], loop_m[seg][srt]
                    pos = np.searchsorted(keys, lk)  # no edge key equals a loop key
                    # Â: every node's self-loop
                    g_keys = np.insert(keys, pos, lk)
                    g_counts = None if counts is None else np.insert(counts, pos, 1)
                    rows, cols = np.divmod(g_keys, bs)
                    vals = (dinv_r[i * bs + rows] * dinv_c[j * bs + cols]).astype(np.float32)
                    if g_counts is not None:
                        vals *= g_counts.astype(np.float32)  # multi-edges: weights add up
                    _write_csr(work / mat / f"{i}_{j}", rows, cols, vals, bs, files, work)
                    block_nnz[mat][i, j] = g_keys.size
                    del g_keys, g_counts, rows, cols, vals
                    # A_mean: the self-loop edges of the input, m_ts / deg_t
                    has = lm > 0
                    m_keys = np.insert(keys, pos[has], lk[has])
                    mult = np.insert(np.ones(keys.size, dtype=np.int32) if counts is None
                                     else counts, pos[has], lm[has])
                    rows, cols = np.divmod(m_keys, bs)
                    vals = (mult / deg_r[i * bs + rows]).astype(np.float32)
                    _write_csr(work / MEAN_DIR / mat / f"{i}_{j}", rows, cols, vals, bs,
                               files, work)
                    if source.symmetric:  # A_mean'' (j, i) is this structure transposed,
                        # its rows divided by the degrees of A'' rows: its values in the
                        # order of this block's nonzeros
                        odd = work / MEAN_DIR / "odd" / f"{j}_{i}"
                        odd.mkdir(parents=True)
                        _save(odd / "values.npy",
                              (mult / deg_c[j * bs + cols]).astype(np.float32), files, work)
                    mean_nnz[mat][i, j] = m_keys.size
                    del keys, counts, m_keys, mult, rows, cols, vals
                    bucket.unlink(missing_ok=True)
                    cnt_file.unlink(missing_ok=True)
                    bar.update()
        shutil.rmtree(work / "buckets")
        # 4. node data by row chunks
        nd = source.node_data(in_degree[:n])
        try:
            _write_node_data(work, nd, source, pr, pc, n, k, bs, files, quiet)
        finally:
            nd.cleanup()
        (work / "perm").mkdir()
        _save(work / "perm" / "pr.npy", pr, files, work)
        _save(work / "perm" / "pc.npy", pc, files, work)
        split_counts = {s: int((nd.split == c).sum()) for s, c in SPLIT_CODES.items()}
        nnz = int(block_nnz["even"].sum())
        manifest = {
            "format": FORMAT_NAME, "version": FORMAT_VERSION, "name": source.name,
            "source": source.description, "num_nodes": n, "num_nodes_padded": n_pad,
            "num_edges": nnz - n, "nnz": nnz, "edges_read": edges_in,
            "num_features": source.num_features, "num_classes": source.num_classes,
            "blocks": k, "block_size": bs, "symmetric": source.symmetric,
            "multi_edges": multi, "dedupe": source.dedupe, "permutation": permutation,
            "seed": seed, "split_counts": split_counts,
            "block_nnz": {m: block_nnz[m].tolist() for m in mats},
            "mean": {"nnz": int(mean_nnz["even"].sum()),
                     "self_loops": int(mean_loops.sum()),
                     "block_nnz": {m: mean_nnz[m].tolist() for m in mats}},
            "prepare_seconds": round(time.perf_counter() - t_start, 3),
            "files": files,
        }
        with open(work / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
        if out.exists():  # --force: replace only now that the new dataset is complete
            shutil.rmtree(out)
        os.replace(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return manifest


def _node_count_hint(source: EdgeSource) -> str:
    """What to check when an edge names a node past the count: an edge file's count is the
    user's (``--num-nodes``); a dataset's comes with its files, so those are damaged."""
    kind = source.description.get("kind")
    if kind == "edge-file":
        return "check --num-nodes (python -m plexus.prepare) or the edge file"
    if kind == "ogb":
        return ("the dataset's node count and its edges disagree: its files are damaged or "
                "mixed; download them again")
    return "the source's node count and its edges disagree"


def _input_paths(source: EdgeSource) -> list[Path]:
    """The files or folders ``source`` reads, as its description names them."""
    src = source.description
    if src.get("kind") == "edge-file":
        return [Path(src["path"])]
    if src.get("kind") == "ogb":
        from plexus.data.ogb import OGB_DATASETS

        return [Path(src["root"]) / OGB_DATASETS[src["name"]].dir_name]
    return []


def _check_replaceable(out: Path) -> None:
    """``force`` deletes ``out`` once the new dataset is complete: only a prepared dataset
    (of any format version: ``--force`` is how a stale one is rebuilt) may go, never a folder
    of other files that happens to have the name."""
    try:
        with open(out / MANIFEST) as f:
            ours = json.load(f).get("format") == FORMAT_NAME
    except (OSError, ValueError, AttributeError):
        ours = False
    if not ours:
        raise ValueError(f"--force replaces only a prepared dataset, and {out} holds no "
                         f"{MANIFEST} of format {FORMAT_NAME!r} (python -m plexus.prepare did "
                         "not write it); choose another --out, or move or delete it yourself")


def _sorted_unique(keys: np.ndarray, dedupe: bool):
    """(sorted distinct keys, how often each occurs or None with ``dedupe``); sorts in place
    (numpy's hash-based np.unique is several times slower on these sizes)."""
    keys.sort()
    first = np.ones(keys.size, dtype=bool)
    np.not_equal(keys[1:], keys[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    del first
    counts = None if dedupe else np.diff(starts, append=keys.size).astype(np.int32)
    return keys[starts], counts


def _check_space(work: Path, source: EdgeSource) -> None:
    """Fail early when the disk clearly cannot hold the buckets plus the blocks."""
    if source.num_edges is None:
        return
    nnz = source.num_edges * (2 if source.symmetrize else 1) * (1 if source.symmetric else 2)
    # buckets (8 B a key), then Â's and A_mean's CSR (at most 16 B a nonzero each)
    need = nnz * (8 + 16 + 16) + source.num_nodes * (source.num_features * 4 + 64)
    free = shutil.disk_usage(work).free
    if need > free:
        raise OSError(f"preparing needs up to {need / 2**30:.1f} GiB of disk at {work}, "
                      f"only {free / 2**30:.1f} GiB are free; choose another --out")


def _write_csr(folder: Path, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, bs: int,
               files: dict, root: Path) -> None:
    """The CSR of one [bs, bs] block from its nonzeros in row-major order (rows ascending,
    columns ascending within a row)."""
    folder.mkdir(parents=True)
    idx = _index_dtype(rows.size, bs)
    indptr = np.zeros(bs + 1, dtype=idx)
    np.cumsum(np.bincount(rows, minlength=bs), out=indptr[1:])
    _save(folder / "indptr.npy", indptr, files, root)
    _save(folder / "indices.npy", cols.astype(idx), files, root)
    _save(folder / "values.npy", vals, files, root)


def mean_self_loops(loops: np.ndarray, symmetrize: bool, dedupe: bool) -> np.ndarray:
    """Self-loop edges per node as messages of the mean aggregation, from ``loops`` (int64
    [N], self-loop edges as read), so that A_mean is plexus.data.partition.mean_adjacency of
    the graph the in-memory path loads:

    * as read (no flag): each one a message, duplicates too (SAGEConv adds and removes none);
    * ``symmetrize`` (ogbn-products): twice, itself and its reverse, as ogb's loader appends
      the reverse of every stored edge;
    * ``symmetrize`` and ``dedupe`` (R-MAT, ``--symmetrize``): none, as
      plexus.data.graph.to_undirected_edges drops them;
    * ``dedupe`` alone: one per node that has any (duplicates merge).

    (The GCN drops them all and adds one normalised self-loop per node.)
    """
    if dedupe:
        return np.zeros_like(loops) if symmetrize else np.minimum(loops, 1)
    return 2 * loops if symmetrize else loops.copy()


def _write_node_data(work: Path, nd: NodeData, source: EdgeSource, pr, pc, n, k, bs, files,
                     quiet) -> None:
    for sub in ("features", "labels", "split"):
        (work / sub).mkdir()
    if nd.labels.shape != (n,) or nd.split.shape != (n,):
        raise ValueError(f"labels and split must be [{n}] arrays")
    bad = (nd.labels < -1) | (nd.labels >= source.num_classes)
    if bad.any():
        v = int(np.flatnonzero(bad)[0])
        raise ValueError(f"label {int(nd.labels[v])} of node {v} is outside [0, "
                         f"{source.num_classes}) (-1 = unlabeled)")
    if not np.isin(nd.split, (0, *SPLIT_CODES.values())).all():
        raise ValueError(f"split codes must be 0 (none) or {SPLIT_CODES}; found "
                         f"{sorted(set(np.unique(nd.split).tolist()))}")
    for s, code in SPLIT_CODES.items():  # an unlabelled split node would count as class 0
        members = nd.split == code
        if unlabeled := int((nd.labels[members] < 0).sum()):
            raise ValueError(f"{unlabeled} of {int(members.sum())} {s} nodes are unlabeled "
                             "(y = -1); a split may only hold labeled nodes")
    f = source.num_features
    step = max(1, (1 << 26) // max(4 * f, 1))  # rows per gather: about 64 MiB
    with progress(n, "4/4 features", "row", quiet) as bar:
        for c in range(k):
            ids = pc[c * bs:(c + 1) * bs]
            path = work / "features" / f"{c}.npy"
            x = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(bs, f))
            for lo in range(0, bs, step):
                part_ids = ids[lo:lo + step]
                real = np.flatnonzero(part_ids < n)
                block = np.zeros((part_ids.size, f), dtype=np.float32)
                if real.size:
                    srt = np.argsort(part_ids[real])
                    rows = nd.features(part_ids[real][srt])
                    if not np.isfinite(rows).all():
                        raise ValueError("features contain NaN or infinity; clean the input")
                    block[real[srt]] = rows
                x[lo:lo + part_ids.size] = block
                bar.update(real.size)
            x.flush()
            del x
            _record(path, files, work)
    for name, order in (("pr", pr), ("pc", pc)):
        for c in range(k):
            ids = order[c * bs:(c + 1) * bs]
            real = ids < n
            safe = np.where(real, ids, 0)
            _save(work / "labels" / f"{name}_{c}.npy",
                  np.where(real, nd.labels[safe], -1).astype(np.int64), files, work)
            _save(work / "split" / f"{name}_{c}.npy",
                  np.where(real, nd.split[safe], 0).astype(np.int8), files, work)
