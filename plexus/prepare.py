"""Prepare a graph for Plexus as k x k memory-mappable block files, streaming the edges.

    python -m plexus.prepare --source rmat --scale 24 --edge-factor 64 --features 16 \\
        --out data/rmat-24-k8                       # 1B generated edges, never all in memory
    python -m plexus.prepare --source ogbn-papers100M --root data --out data/papers100M-k8
    python -m plexus.prepare --source edges.npy --num-nodes 1000000 --out data/mygraph
    python -m plexus.prepare --source planted --out data/planted-k8    # small, built-in
    python -m plexus.train --dataset data/rmat-24-k8 --grid 2x2x2      # train on it

No step holds the whole edge list. Peak memory is O(B + M + N): B edges per chunk
(``--chunk-edges``), M nonzeros of the largest block (about nnz / k^2 after the double
permutation), N nodes (degrees, permutations, labels). The steps:

1. stream the edges in chunks: drop self-loops, optionally symmetrise, map every edge to the
   permuted matrices (``A' = Pr Â Pc^T`` and, for directed graphs, ``A'' = Pc Â Pr^T``) and
   append its in-block key to the bucket file of its block;
2. per block: sort, merge duplicate edges (or count them as multi-edges), add up in-degrees;
3. per block: add the self-loops, normalise (``1/sqrt(d_t d_s)`` in float64, stored float32,
   exactly as plexus.partition.normalized_adjacency), write CSR and transposed CSR;
4. features, labels and split codes by row chunks, in the permuted orders.

Every file's SHA-256 goes into ``manifest.json`` as it is written.

Layout of ``OUT`` (N_pad = N rounded up to k; bs = N_pad / k):

    manifest.json                 sizes, k, permutation and seed, per-block nnz, checksums
    perm/pr.npy, perm/pc.npy      int64 [N_pad], perm[new] = old
    even/R_C/{indptr,indices,values,t_indptr,t_indices,t_values}.npy
                                  block (R, C) of A' [bs, bs] as CSR (int32 indices) and the
                                  CSR of its transpose; odd/R_C/... the same for A'' (directed
                                  graphs only: for symmetric ones A'' = A'^T)
    features/C.npy                float32 [bs, F]: rows chunk C of the features in Pc order
    labels/{pr,pc}_C.npy          int64 [bs]: labels of rows chunk C in Pr / Pc order (-1 none)
    split/{pr,pc}_C.npy           int8 [bs]: 0 none, 1 train, 2 val, 3 test

The output is written under ``OUT.partial`` and renamed at the end: an interrupted run leaves
no half-written dataset at OUT, and an existing OUT is never overwritten without ``--force``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from plexus import partition as part

FORMAT_VERSION = 1
SPLIT_CODES = {"train": 1, "val": 2, "test": 3}
MATRICES = ("even", "odd")


# ----------------------------------------------------------------------------- sources


@dataclass
class NodeData:
    """Per-node data of a source, produced once degrees are known.

    Attributes:
        features: ``rows -> float32 [len(rows), F]`` for original node ids (ascending).
        labels: int64 [N], -1 = unlabeled.
        split: int8 [N] split codes (SPLIT_CODES; 0 = in no split).
    """

    features: Callable[[np.ndarray], np.ndarray]
    labels: np.ndarray
    split: np.ndarray
    cleanup: Callable[[], None] = lambda: None


@dataclass
class EdgeSource:
    """Where the edges and node data come from.

    Attributes:
        name: dataset name recorded in the manifest.
        num_nodes: N.
        num_features, num_classes: F and C.
        chunks: a fresh iterator of int64 [2, B] (source, target) chunks per call.
        num_edges: edges the iterator yields (for progress; None if unknown).
        symmetrize: add the reverse of every edge (the result is undirected).
        undirected: the edges already hold both directions (so A'' = A'^T needs no files).
        dedupe: merge duplicate edges into one; otherwise they are multi-edges whose weights
            add up (as plexus.partition.normalized_adjacency and PyG's gcn_norm do).
        node_data: ``in_degree -> NodeData``; ``in_degree`` int64 [N] counts edges after
            dropping self-loops (and duplicates, with ``dedupe``).
    """

    name: str
    num_nodes: int
    num_features: int
    num_classes: int
    chunks: Callable[[], Iterator[np.ndarray]]
    num_edges: int | None
    symmetrize: bool
    undirected: bool
    dedupe: bool
    node_data: Callable[[np.ndarray], NodeData]
    description: dict = field(default_factory=dict)

    @property
    def symmetric(self) -> bool:
        return self.symmetrize or self.undirected


def rmat_source(scale: int, edge_factor: int = 16, seed: int = 0, *, num_features: int = 128,
                num_classes: int = 32, split_fractions=(0.3, 0.2, 0.5),
                chunk_edges: int = 1 << 23, tmp_dir: str | os.PathLike = ".") -> EdgeSource:
    """The graph of :func:`plexus.datasets.rmat_graph` (same edges, features, labels, split),
    streamed: symmetrised, self-loops and duplicates dropped."""
    from plexus.datasets import rmat_edges

    n = 1 << scale
    if n < num_classes:
        raise ValueError(f"R-MAT scale {scale} gives {n} nodes, fewer than {num_classes} "
                         "classes; raise --scale")

    def node_data(in_degree: np.ndarray) -> NodeData:
        return _synthetic_node_data(in_degree, num_features, num_classes, seed,
                                    split_fractions, tmp_dir)

    return EdgeSource(
        name=f"rmat-{scale}", num_nodes=n, num_features=num_features, num_classes=num_classes,
        chunks=lambda: rmat_edges(scale, edge_factor, seed, chunk_edges=chunk_edges),
        num_edges=edge_factor << scale, symmetrize=True, undirected=False, dedupe=True,
        node_data=node_data,
        description={"kind": "rmat", "scale": scale, "edge_factor": edge_factor, "seed": seed})


def graph_source(graph, chunk_edges: int = 1 << 23) -> EdgeSource:
    """An in-memory :class:`~plexus.graph.Graph` (small graphs, tests): its edges as stored."""
    ei = graph.edge_index.numpy()

    def chunks():
        for lo in range(0, ei.shape[1], chunk_edges):
            yield ei[:, lo:lo + chunk_edges].astype(np.int64)

    def node_data(_deg):
        split = np.zeros(graph.num_nodes, dtype=np.int8)
        for s, code in SPLIT_CODES.items():
            split[graph.split_idx(s).numpy()] = code
        x = graph.x.numpy()
        return NodeData(features=lambda rows: x[rows], labels=graph.y.numpy(), split=split)

    return EdgeSource(
        name=graph.name, num_nodes=graph.num_nodes, num_features=graph.num_features,
        num_classes=graph.num_classes, chunks=chunks, num_edges=ei.shape[1], symmetrize=False,
        undirected=graph.is_undirected(), dedupe=False, node_data=node_data,
        description={"kind": "graph", "name": graph.name})


def edge_file_source(path: str | os.PathLike, num_nodes: int, *, symmetrize: bool = False,
                     num_features: int = 128, num_classes: int = 32, seed: int = 0,
                     split_fractions=(0.3, 0.2, 0.5), chunk_edges: int = 1 << 23,
                     tmp_dir: str | os.PathLike = ".") -> EdgeSource:
    """A binary edge list: a ``.npy`` file of integer [2, E] (source row, target row) or
    [E, 2], read through a memory map in chunks. Node data is the synthetic task of the
    R-MAT graphs (uniform random features, degree-bucket labels, random split)."""
    path = Path(path)
    try:
        edges = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read edge file {path}: {e}; expected a .npy array of "
                         "integers shaped [2, E] or [E, 2]") from e
    if edges.ndim != 2 or 2 not in edges.shape or edges.dtype.kind not in "iu":
        raise ValueError(f"edge file {path} holds {edges.dtype} {edges.shape}; expected "
                         "integers shaped [2, E] or [E, 2]")
    if num_nodes < num_classes:
        raise ValueError(f"--num-nodes {num_nodes} is smaller than --classes {num_classes}")
    rows_first = edges.shape[0] == 2
    total = edges.shape[1] if rows_first else edges.shape[0]

    def chunks():
        for lo in range(0, total, chunk_edges):
            piece = edges[:, lo:lo + chunk_edges] if rows_first else edges[lo:lo + chunk_edges].T
            yield np.asarray(piece, dtype=np.int64)

    def node_data(in_degree):
        return _synthetic_node_data(in_degree, num_features, num_classes, seed,
                                    split_fractions, tmp_dir)

    return EdgeSource(
        name=path.stem, num_nodes=num_nodes, num_features=num_features,
        num_classes=num_classes, chunks=chunks, num_edges=total, symmetrize=symmetrize,
        undirected=False, dedupe=symmetrize, node_data=node_data,
        description={"kind": "edge-file", "path": str(path.resolve())})


def ogb_source(name: str, root: str | os.PathLike = "data", *, chunk_edges: int = 1 << 23,
               tmp_dir: str | os.PathLike = ".") -> EdgeSource:
    """An OGB node dataset read from its raw files in chunks (never the whole edge list).

    ``root/<name with '-' -> '_'>/raw`` holds CSV files (ogbn-arxiv, ogbn-products: pandas
    reads them in chunks) or ``data.npz`` (ogbn-papers100M: the ``edge_index`` member is
    streamed out of the zip, one reader per row, whether it is stored or compressed).
    Directions, multi-edges, NaN labels and the official split are read as ogb's own loader
    reads them (plexus.ogb_io): ogbn-products' edges are stored once and get their reverse.
    """
    from plexus.ogb_io import _OGB, DatasetNotFoundError, _missing_files, _not_found

    if name not in _OGB:
        raise ValueError(f"unknown OGB dataset {name!r}; supported: {', '.join(_OGB)}")
    spec = _OGB[name]
    ddir = Path(root) / spec.dir_name
    if missing := _missing_files(spec, ddir):
        raise DatasetNotFoundError(_not_found(spec, Path(root), missing))
    raw = ddir / "raw"
    npz = (raw / "data.npz").is_file()
    if npz:
        with zipfile.ZipFile(raw / "data.npz") as zf:
            num_nodes = int(_npz_read(zf, "num_nodes_list")[0])
            n_edges = int(_npz_header(zf, "edge_index")[0][1])
            num_features = int(_npz_header(zf, "node_feat")[0][1])
    else:
        import pandas as pd

        num_nodes = int(pd.read_csv(raw / "num-node-list.csv.gz", header=None)[0].sum())
        n_edges = int(pd.read_csv(raw / "num-edge-list.csv.gz", header=None)[0].sum())
        num_features = pd.read_csv(raw / "node-feat.csv.gz", header=None, nrows=1).shape[1]
    y = _ogb_labels(raw, npz, num_nodes)
    num_classes = max(_ogb_num_classes(name), int(y.max()) + 1)  # as the ogb loader says

    def chunks():
        if npz:
            with zipfile.ZipFile(raw / "data.npz") as zf:
                yield from _npz_edge_chunks(zf, chunk_edges)
        else:
            import pandas as pd

            for df in pd.read_csv(raw / "edge.csv.gz", header=None, chunksize=chunk_edges,
                                  dtype=np.int64):
                yield np.ascontiguousarray(df.to_numpy().T)

    def node_data(_deg):
        import pandas as pd

        split = np.zeros(num_nodes, dtype=np.int8)
        for s, code in (("train", 1), ("valid", 2), ("test", 3)):
            idx = pd.read_csv(ddir / "split" / spec.split / f"{s}.csv.gz", header=None)[0]
            split[idx.to_numpy()] = code
        path = Path(tmp_dir) / f"features-{os.getpid()}.npy"
        x = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32,
                                      shape=(num_nodes, num_features))
        lo = 0
        for rows in _ogb_feature_chunks(raw, npz, chunk_edges // max(num_features, 1) + 1):
            x[lo:lo + rows.shape[0]] = rows
            lo += rows.shape[0]
        x.flush()
        return NodeData(features=lambda r: np.asarray(x[r]), labels=y, split=split,
                        cleanup=lambda: path.unlink(missing_ok=True))

    return EdgeSource(
        name=name, num_nodes=num_nodes, num_features=num_features, num_classes=num_classes,
        chunks=chunks, num_edges=n_edges, symmetrize=name == "ogbn-products",
        undirected=False, dedupe=False, node_data=node_data,
        description={"kind": "ogb", "name": name, "root": str(Path(root).resolve())})


def _ogb_num_classes(name: str) -> int:
    """"num classes" of ``name`` in ogb's own master.csv (what NodePropPredDataset reports)."""
    import pandas as pd

    from plexus.ogb_io import _import_ogb_nodeproppred

    master = Path(_import_ogb_nodeproppred().__file__).parent / "master.csv"
    return int(pd.read_csv(master, index_col=0, keep_default_na=False)[name]["num classes"])


def _npz_header(zf: zipfile.ZipFile, key: str):
    with zf.open(f"{key}.npy") as f:
        version = np.lib.format.read_magic(f)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                else np.lib.format.read_array_header_2_0)  # 2.0 and 3.0: same layout
        shape, fortran, dtype = read(f)
        return shape, fortran, dtype, f.tell()


def _npz_read(zf: zipfile.ZipFile, key: str) -> np.ndarray:
    with zf.open(f"{key}.npy") as f:
        return np.lib.format.read_array(f)


def _npz_rows(zf: zipfile.ZipFile, key: str, rows_per_chunk: int, skip_rows: int = 0,
              num_rows: int | None = None):
    """Stream a C-order 2-D npz member in row chunks (after ``skip_rows``)."""
    shape, fortran, dtype, offset = _npz_header(zf, key)
    if fortran:
        raise ValueError(f"{key} in the npz is Fortran-ordered; re-save it in C order")
    width = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    row_bytes = width * dtype.itemsize
    total = shape[0] if num_rows is None else num_rows
    with zf.open(f"{key}.npy") as f:
        f.seek(offset + skip_rows * row_bytes)  # compressed members: decompresses to skip
        done = 0
        while done < total:
            n = min(rows_per_chunk, total - done)
            buf = f.read(n * row_bytes)
            if len(buf) != n * row_bytes:
                raise ValueError(f"{key} in the npz is truncated")
            yield np.frombuffer(buf, dtype=dtype).reshape(n, *shape[1:])
            done += n


def _npz_edge_chunks(zf: zipfile.ZipFile, chunk_edges: int):
    """edge_index [2, E] streamed as [2, B] chunks: one reader per row of the member."""
    shape, fortran, dtype, offset = _npz_header(zf, "edge_index")
    e = shape[1]
    if fortran:
        raise ValueError("edge_index in the npz is Fortran-ordered; re-save it in C order")
    with zf.open("edge_index.npy") as a, zf.open("edge_index.npy") as b:
        a.seek(offset)
        b.seek(offset + e * dtype.itemsize)
        for lo in range(0, e, chunk_edges):
            n = min(chunk_edges, e - lo)
            src = np.frombuffer(a.read(n * dtype.itemsize), dtype=dtype)
            dst = np.frombuffer(b.read(n * dtype.itemsize), dtype=dtype)
            if src.size != n or dst.size != n:
                raise ValueError("edge_index in the npz is truncated")
            yield np.stack([src, dst]).astype(np.int64)


def _ogb_labels(raw: Path, npz: bool, n: int) -> np.ndarray:
    if npz:
        with zipfile.ZipFile(raw / "node-label.npz") as zf:
            lab = _npz_read(zf, "node_label").reshape(-1)
    else:
        import pandas as pd

        lab = pd.read_csv(raw / "node-label.csv.gz", header=None)[0].to_numpy()
    lab = np.asarray(lab, dtype=np.float64)
    if lab.shape != (n,):
        raise ValueError(f"{raw} labels have shape {lab.shape}, expected ({n},)")
    return np.where(np.isnan(lab), -1, lab).astype(np.int64)


def _ogb_feature_chunks(raw: Path, npz: bool, rows: int):
    if npz:
        with zipfile.ZipFile(raw / "data.npz") as zf:
            for x in _npz_rows(zf, "node_feat", rows):
                yield x.astype(np.float32)
    else:
        import pandas as pd

        for df in pd.read_csv(raw / "node-feat.csv.gz", header=None, chunksize=rows,
                              dtype=np.float32):
            yield df.to_numpy()


def _synthetic_node_data(in_degree: np.ndarray, num_features: int, num_classes: int,
                         seed: int, split_fractions, tmp_dir) -> NodeData:
    """The Plexus paper's synthetic task, exactly as plexus.datasets.rmat_graph draws it:
    uniform [0, 1) features (one seeded stream, drawn here in row chunks into a temporary
    memory-mapped file), C equal-size in-degree buckets as labels, a random split."""
    n = in_degree.shape[0]
    order = np.argsort(in_degree, kind="stable")
    y = np.empty(n, dtype=np.int64)
    y[order] = np.arange(n, dtype=np.int64) * num_classes // n
    del order
    path = Path(tmp_dir) / f"features-{os.getpid()}.npy"
    x = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, num_features))
    rng = np.random.default_rng([seed, 2])
    step = max(1, (1 << 24) // max(num_features, 1))
    for lo in range(0, n, step):
        x[lo:lo + step] = rng.random((min(step, n - lo), num_features), dtype=np.float32)
    x.flush()
    return NodeData(features=lambda rows: np.asarray(x[rows]), labels=y,
                    split=_split_codes(n, split_fractions, seed),
                    cleanup=lambda: path.unlink(missing_ok=True))


def _split_codes(n: int, fractions, seed: int) -> np.ndarray:
    from plexus.graph import random_split

    split = np.zeros(n, dtype=np.int8)
    for code, idx in zip(SPLIT_CODES.values(), random_split(n, fractions, seed=seed)):
        split[idx.numpy()] = code
    return split


# ----------------------------------------------------------------------------- the pipeline


def _progress(total, desc: str, unit: str, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, disable=quiet,
                file=sys.stderr, dynamic_ncols=True, mininterval=1.0)


def _save(path: Path, arr: np.ndarray, files: dict, root: Path) -> None:
    """np.save + SHA-256 of the file as written (read back while still in the page cache)."""
    np.save(path, arr)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    files[str(path.relative_to(root))] = {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def _index_dtype(nnz: int, rows: int):
    return np.int32 if max(nnz, rows) < 2**31 else np.int64


def prepare(source: EdgeSource, out: str | os.PathLike, *, blocks: int = 8,
            permutation: str = "double", seed: int = 0, force: bool = False,
            quiet: bool = False) -> dict:
    """Write ``source`` to ``out`` as ``blocks x blocks`` block files; returns the manifest.

    Args:
        source: the edges and node data (:func:`rmat_source`, :func:`graph_source`,
            :func:`edge_file_source`).
        out: output directory; must not exist unless ``force``.
        blocks: k; training grids need axis sizes that divide k.
        permutation: ``none``, ``single`` or ``double`` (plexus-3d.md section 6).
        seed: permutation seed (training with this dataset uses these permutations).
        force: replace an existing ``out`` (only after the new one is complete).
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
    t_start = time.perf_counter()
    k, n = blocks, source.num_nodes
    n_pad = part.round_up(max(n, 1), k)
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
    try:
        # 1. bucket the edges by block
        edges_in = 0
        with _progress(source.num_edges, "1/4 bucket edges", "edge", quiet) as bar:
            for chunk in source.chunks():
                edges_in += chunk.shape[1]
                bar.update(chunk.shape[1])
                src, dst = chunk[0], chunk[1]
                if chunk.shape[1] and (min(src.min(), dst.min()) < 0
                                       or max(src.max(), dst.max()) >= n):
                    raise ValueError(f"edge ids must be in [0, {n}); this chunk has "
                                     f"[{min(src.min(), dst.min())}, "
                                     f"{max(src.max(), dst.max())}]; check --num-nodes")
                keep = src != dst
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
        with _progress(len(mats) * k * k, "2/4 sort blocks", "block", quiet) as bar:
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
        perm = {"pr": pr, "pc": pc}
        # 3. per block: self-loops, values, CSR and transposed CSR
        with _progress(len(mats) * k * k, "3/4 write blocks", "block", quiet) as bar:
            for mat in mats:
                ro, co = orders[mat]
                dinv_r, dinv_c = dinv[perm[ro]], dinv[perm[co]]
                v = np.arange(n)  # self-loop of node v sits at (inv_row[v], inv_col[v])
                loop_r, loop_c = inv[ro][v], inv[co][v]
                loop_bid = (loop_r // bs) * k + loop_c // bs
                loop_order = np.argsort(loop_bid, kind="stable")
                loop_start = np.concatenate([[0], np.cumsum(np.bincount(loop_bid,
                                                                        minlength=k * k))])
                loop_key = ((loop_r % bs) * bs + loop_c % bs)[loop_order]
                del v, loop_r, loop_c, loop_bid, loop_order
                for b in range(k * k):
                    i, j = divmod(b, k)
                    bucket = work / "buckets" / f"{mat}-{b}.srt"
                    keys = np.fromfile(bucket, dtype=key_dtype)
                    cnt_file = bucket.with_suffix(".cnt")
                    counts = np.fromfile(cnt_file, dtype=np.int32) if cnt_file.exists() else None
                    lk = np.sort(loop_key[loop_start[b]:loop_start[b + 1]])
                    pos = np.searchsorted(keys, lk)
                    keys = np.insert(keys, pos, lk)
                    if counts is not None:
                        counts = np.insert(counts, pos, 1)
                    _write_block(work / mat / f"{i}_{j}", keys, counts, bs,
                                 dinv_r[i * bs:(i + 1) * bs], dinv_c[j * bs:(j + 1) * bs],
                                 files, work)
                    block_nnz[mat][i, j] = keys.size
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
            "format": "plexus-blocks", "version": FORMAT_VERSION, "name": source.name,
            "source": source.description, "num_nodes": n, "num_nodes_padded": n_pad,
            "num_edges": nnz - n, "nnz": nnz, "edges_read": edges_in,
            "num_features": source.num_features, "num_classes": source.num_classes,
            "blocks": k, "block_size": bs, "symmetric": source.symmetric,
            "multi_edges": multi, "dedupe": source.dedupe, "permutation": permutation,
            "seed": seed, "split_counts": split_counts,
            "block_nnz": {m: block_nnz[m].tolist() for m in mats},
            "prepare_seconds": round(time.perf_counter() - t_start, 3),
            "files": files,
        }
        with open(work / "manifest.json", "w") as f:
            json.dump(manifest, f, indent=1)
        if out.exists():  # --force: replace only now that the new dataset is complete
            shutil.rmtree(out)
        os.replace(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return manifest


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
    need = nnz * (8 + 16) + source.num_nodes * (source.num_features * 4 + 64)
    free = shutil.disk_usage(work).free
    if need > free:
        raise OSError(f"preparing needs up to {need / 2**30:.1f} GiB of disk at {work}, "
                      f"only {free / 2**30:.1f} GiB are free; choose another --out")


def _write_block(folder: Path, keys: np.ndarray, counts, bs: int, dinv_r: np.ndarray,
                 dinv_c: np.ndarray, files: dict, root: Path) -> None:
    """CSR and transposed CSR of one block from its sorted unique keys (row * bs + col)."""
    folder.mkdir(parents=True)
    rows = keys // bs
    cols = keys - rows * bs
    vals = (dinv_r[rows] * dinv_c[cols]).astype(np.float32)
    if counts is not None:
        vals *= counts.astype(np.float32)  # multi-edges: weights add up
    idx = _index_dtype(keys.size, bs)
    indptr = np.zeros(bs + 1, dtype=idx)
    np.cumsum(np.bincount(rows, minlength=bs), out=indptr[1:])
    indices = cols.astype(idx)
    _save(folder / "indptr.npy", indptr, files, root)
    _save(folder / "indices.npy", indices, files, root)
    _save(folder / "values.npy", vals, files, root)
    t_indptr = np.zeros(bs + 1, dtype=idx)
    np.cumsum(np.bincount(cols, minlength=bs), out=t_indptr[1:])
    try:
        from plexus._kernels import csr_transpose
    except ImportError:  # numpy: a stable sort keeps rows ascending inside each column
        order = np.argsort(cols, kind="stable")
        t_indices, t_values = rows[order].astype(idx), vals[order]
    else:  # a counting sort by column, O(nnz)
        t_indices, t_values = np.empty_like(indices), np.empty_like(vals)
        csr_transpose(indptr, indices, vals, t_indptr, t_indices, t_values)
    _save(folder / "t_indptr.npy", t_indptr, files, root)
    _save(folder / "t_indices.npy", t_indices, files, root)
    _save(folder / "t_values.npy", t_values, files, root)


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
    f = source.num_features
    step = max(1, (1 << 26) // max(4 * f, 1))  # rows per gather: about 64 MiB
    with _progress(n, "4/4 features", "row", quiet) as bar:
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
            _rehash(path, files, work)
    for name, order in (("pr", pr), ("pc", pc)):
        for c in range(k):
            ids = order[c * bs:(c + 1) * bs]
            real = ids < n
            safe = np.where(real, ids, 0)
            _save(work / "labels" / f"{name}_{c}.npy",
                  np.where(real, nd.labels[safe], -1).astype(np.int64), files, work)
            _save(work / "split" / f"{name}_{c}.npy",
                  np.where(real, nd.split[safe], 0).astype(np.int8), files, work)


def _rehash(path: Path, files: dict, root: Path) -> None:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    files[str(path.relative_to(root))] = {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def verify(path: str | os.PathLike, quiet: bool = True) -> list[str]:
    """Files of a prepared dataset whose size or SHA-256 differ from the manifest (or are
    missing); an empty list means intact."""
    root = Path(path)
    with open(root / "manifest.json") as f:
        manifest = json.load(f)
    bad = []
    with _progress(len(manifest["files"]), "verify", "file", quiet) as bar:
        for rel, meta in manifest["files"].items():
            p = root / rel
            if not p.is_file() or p.stat().st_size != meta["bytes"]:
                bad.append(rel)
            else:
                got: dict = {}
                _rehash(p, got, root)
                if got[rel]["sha256"] != meta["sha256"]:
                    bad.append(rel)
            bar.update()
    return bad


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m plexus.prepare",
        description="Write a graph as k x k memory-mappable block files for plexus.train, "
        "streaming the edges (peak memory: a chunk of edges, one block, O(nodes)).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--source", default=None,
                   help="rmat (streamed R-MAT generator), ogbn-arxiv / ogbn-products / "
                   "ogbn-papers100M (raw files under --root, read in chunks), a .npy edge file "
                   "([2, E] or [E, 2] integers), or a built-in name (planted, rmat-SCALE: "
                   "loaded in memory, for small graphs)")
    p.add_argument("--out", default=None, help="output directory (must not exist)")
    p.add_argument("--blocks", type=int, default=8,
                   help="k: k x k blocks; training grid axis sizes must divide k")
    p.add_argument("--permutation", choices=part.PERMUTATIONS, default="double")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the permutations and of generated data")
    p.add_argument("--root", default="data", help="OGB: directory of the dataset folders")
    p.add_argument("--scale", type=int, default=20, help="R-MAT: log2 of the node count")
    p.add_argument("--edge-factor", type=int, default=16, help="R-MAT: edges per node")
    p.add_argument("--features", type=int, default=128, help="R-MAT / edge file: feature width")
    p.add_argument("--classes", type=int, default=32, help="R-MAT / edge file: classes")
    p.add_argument("--num-nodes", type=int, default=None, help="edge file: node count")
    p.add_argument("--symmetrize", action="store_true",
                   help="edge file: add reverse edges and drop duplicates (undirected graph)")
    p.add_argument("--chunk-edges", type=int, default=1 << 23, help="edges per chunk")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument("--verify", metavar="DIR", default=None,
                   help="only check the checksums of a prepared dataset")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if args.verify is None and (args.source is None or args.out is None):
        p.error("--source and --out are required (or --verify DIR)")
    return args


def source_from_args(args: argparse.Namespace, tmp_dir: str) -> EdgeSource:
    if args.source == "rmat":
        return rmat_source(args.scale, args.edge_factor, args.seed,
                           num_features=args.features, num_classes=args.classes,
                           chunk_edges=args.chunk_edges, tmp_dir=tmp_dir)
    if args.source.startswith("ogbn-"):
        return ogb_source(args.source, args.root, chunk_edges=args.chunk_edges, tmp_dir=tmp_dir)
    if args.source.endswith(".npy"):
        if args.num_nodes is None:
            raise ValueError("an edge file needs --num-nodes")
        return edge_file_source(args.source, args.num_nodes, symmetrize=args.symmetrize,
                                num_features=args.features, num_classes=args.classes,
                                seed=args.seed, chunk_edges=args.chunk_edges, tmp_dir=tmp_dir)
    from plexus.datasets import load_dataset

    return graph_source(load_dataset(args.source, seed=args.seed),
                        chunk_edges=args.chunk_edges)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.verify is not None:
            bad = verify(args.verify, quiet=args.quiet)
            print(f"{args.verify}: " + ("intact" if not bad else
                                        f"{len(bad)} damaged or missing file(s): "
                                        + ", ".join(bad[:10])))
            return 1 if bad else 0
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        source = source_from_args(args, tmp_dir=str(out.parent))
        m = prepare(source, out, blocks=args.blocks, permutation=args.permutation,
                    seed=args.seed, force=args.force, quiet=args.quiet)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    nnz = np.asarray(m["block_nnz"]["even"])
    print(f"{out}: {m['num_nodes']:,} nodes, {m['num_edges']:,} edges ({m['nnz']:,} nonzeros "
          f"with self-loops) in {m['blocks']}x{m['blocks']} blocks, max/mean nonzeros per "
          f"block {nnz.max() / max(nnz.mean(), 1):.3f}; {m['prepare_seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

