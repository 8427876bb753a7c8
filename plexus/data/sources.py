"""Where plexus.data.writer reads a graph from: edge chunks plus per-node data, never all edges.

Each source is an :class:`EdgeSource`: a fresh iterator of int64 [2, B] (source, target)
chunks, flags for symmetrising and duplicate handling, and a callback that produces the node
data (features by row, labels, split codes) once in-degrees are known.

    rmat_source        the streamed R-MAT graph of plexus.data.generators.rmat_graph
    ogb_source         OGB raw files: CSV via pandas chunks, npz members streamed from the zip
    edge_file_source   a memory-mapped .npy edge list with the synthetic R-MAT task
    graph_source       an in-memory Graph (small graphs, tests)
"""

from __future__ import annotations

import gzip
import os
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from plexus.data.schema import DEFAULT_ROOT, SPLIT_CODES


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
            add up (as plexus.data.partition.normalized_adjacency and PyG's gcn_norm do).
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
    """The graph of :func:`plexus.data.generators.rmat_graph` (same edges, features, labels, split),
    streamed: symmetrised, self-loops and duplicates dropped."""
    from plexus.data.generators import rmat_edges

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
    """An in-memory :class:`~plexus.data.graph.Graph` (small graphs, tests): its edges as stored."""
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
        description={"kind": "edge-file", "path": str(path.resolve()), **file_stamp(path)})


def ogb_source(name: str, root: str | os.PathLike = DEFAULT_ROOT, *, chunk_edges: int = 1 << 23,
               tmp_dir: str | os.PathLike = ".") -> EdgeSource:
    """An OGB node dataset read from its raw files in chunks (never the whole edge list).

    ``root/<name with '-' -> '_'>/raw`` holds CSV files (ogbn-arxiv, ogbn-products: pandas
    reads them in chunks) or ``data.npz`` (ogbn-papers100M: the ``edge_index`` member is
    streamed out of the zip, one reader per row, whether it is stored or compressed).
    Directions, multi-edges, NaN labels and the official split are read as ogb's own loader
    reads them (plexus.data.ogb): ogbn-products' edges are stored once and get their reverse.
    Labels and splits are checked here, before any edge is read, by the rules and in the words
    of the in-memory :class:`~plexus.data.graph.Graph`: labels in [0, C) with C ogb's own
    class count, every split node labelled, splits in [0, N) and disjoint. The description
    records the size and time of every file read (:func:`ogb_input_stamps`), so that a cache
    prepared from them is not reused once they change.

    Raises:
        DatasetNotFoundError: a file is missing.
        DatasetCorruptError: a file is truncated or unreadable, or its labels or split break
            the rules above (the message names the file).
    """
    from plexus.data.errors import DatasetNotFoundError
    from plexus.data.ogb import OGB_DATASETS, missing_files, not_found_message

    if name not in OGB_DATASETS:
        raise ValueError(f"unknown OGB dataset {name!r}; supported: {', '.join(OGB_DATASETS)}")
    spec = OGB_DATASETS[name]
    ddir = Path(root) / spec.dir_name
    if missing := missing_files(spec, ddir):
        raise DatasetNotFoundError(not_found_message(spec, Path(root), missing))
    stamps = ogb_input_stamps(name, root)  # before reading: a change while preparing shows
    if len(stamps) < len(ogb_inputs(name)):  # ogb's processed cache stands in for raw files
        lacking = sorted(set(ogb_inputs(name)) - set(stamps))
        raise DatasetNotFoundError(f"{name}: preparing reads the raw files, and {ddir} lacks "
                                   f"{', '.join(lacking)}; copy them there")
    raw = ddir / "raw"
    npz = (raw / "data.npz").is_file()
    num_nodes, n_edges, num_features = ogb_sizes(raw)
    label_file = raw / ("node-label.npz" if npz else "node-label.csv.gz")
    with _reading(label_file, name):
        y = _ogb_labels(raw, npz, num_nodes)
    num_classes = _ogb_num_classes(name)  # as ogb's loader reports it, whatever the labels say
    splits = {}
    for s in ("train", "valid", "test"):
        path = ddir / "split" / spec.split / f"{s}.csv.gz"
        with _reading(path, name):
            splits[s] = _csv_ids(path)
    _check_node_data(y, splits, num_nodes, num_classes, label_file,
                     ddir / "split" / spec.split)

    def chunks():
        with _reading(raw / ("data.npz" if npz else "edge.csv.gz"), name):
            if npz:
                with zipfile.ZipFile(raw / "data.npz") as zf:
                    yield from _npz_edge_chunks(zf, chunk_edges)
            else:
                import pandas as pd

                for df in pd.read_csv(raw / "edge.csv.gz", header=None, chunksize=chunk_edges,
                                      dtype=np.int64):
                    yield np.ascontiguousarray(df.to_numpy().T)

    def node_data(_deg):
        split = np.zeros(num_nodes, dtype=np.int8)
        for s, code in (("train", SPLIT_CODES["train"]), ("valid", SPLIT_CODES["val"]),
                        ("test", SPLIT_CODES["test"])):
            split[splits[s]] = code
        path = Path(tmp_dir) / f"features-{os.getpid()}.npy"
        x = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32,
                                      shape=(num_nodes, num_features))
        lo = 0
        try:
            with _reading(raw / ("data.npz" if npz else "node-feat.csv.gz"), name):
                for rows in _ogb_feature_chunks(raw, npz,
                                                chunk_edges // max(num_features, 1) + 1):
                    x[lo:lo + rows.shape[0]] = rows
                    lo += rows.shape[0]
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        x.flush()
        return NodeData(features=lambda r: np.asarray(x[r]), labels=y, split=split,
                        cleanup=lambda: path.unlink(missing_ok=True))

    return EdgeSource(
        name=name, num_nodes=num_nodes, num_features=num_features, num_classes=num_classes,
        chunks=chunks, num_edges=n_edges, symmetrize=name == "ogbn-products",
        undirected=False, dedupe=False, node_data=node_data,
        description={"kind": "ogb", "name": name, "root": str(Path(root).resolve()),
                     "inputs": stamps})


def file_stamp(path: str | os.PathLike) -> dict[str, int]:
    """``{"bytes", "mtime_ns"}`` of an input file: what a prepared cache compares to tell that
    its input was replaced or rewritten since (a checksum would read the whole input, as long
    as preparing it takes)."""
    st = Path(path).stat()
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def ogb_inputs(name: str) -> list[str]:
    """The files of OGB dataset ``name`` that :func:`ogb_source` reads, relative to its
    folder (``node_year`` is not read: the time split is in ``split/``)."""
    from plexus.data.ogb import OGB_DATASETS

    spec = OGB_DATASETS[name]
    return ([f"raw/{f}" for f in spec.raw_files if f != "node_year.csv.gz"]
            + [f"split/{spec.split}/{s}.csv.gz" for s in ("train", "valid", "test")])


def ogb_input_stamps(name: str, root: str | os.PathLike) -> dict[str, dict[str, int]]:
    """:func:`file_stamp` of every file of :func:`ogb_inputs` that exists under ``root``."""
    from plexus.data.ogb import OGB_DATASETS

    ddir = Path(root) / OGB_DATASETS[name].dir_name
    return {rel: file_stamp(ddir / rel) for rel in ogb_inputs(name) if (ddir / rel).is_file()}


@contextmanager
def _reading(path: Path, name: str):
    """Errors of a truncated or damaged raw file (a gzip stream that ends early, a bad zip,
    text pandas cannot parse) as a DatasetCorruptError naming the file, as the in-memory
    loader names them (plexus.data.ogb.load_ogb)."""
    from plexus.data.errors import DatasetCorruptError

    try:
        yield
    except DatasetCorruptError:
        raise
    except (EOFError, zlib.error, zipfile.BadZipFile, gzip.BadGzipFile, ValueError,
            KeyError) as e:
        raise DatasetCorruptError(
            f"{name}: {path} could not be read ({type(e).__name__}: {e}); the file is "
            f"truncated or corrupt: copy the raw files of {name} again") from e


def _csv_ids(path: Path) -> np.ndarray:
    """int64 [n] node ids of a one-column split file (any other column or text: an error)."""
    import pandas as pd

    frame = pd.read_csv(path, header=None)
    if frame.shape[1] != 1 or frame[0].dtype.kind not in "iu":
        raise ValueError(f"expected one column of integer node ids, found {frame.shape[1]} "
                         f"column(s) of {frame.dtypes.iloc[0] if frame.shape[1] else 'nothing'}")
    return frame[0].to_numpy().astype(np.int64)


def _check_node_data(y: np.ndarray, splits: dict[str, np.ndarray], n: int, c: int,
                     label_file: Path, split_dir: Path) -> None:
    """The in-memory Graph's label and split rules (plexus.data.graph.check_labels and
    check_splits, whose words these are) on OGB raw data, naming the file at fault: the
    prepared path must refuse what the in-memory one refuses."""
    import torch

    from plexus.data.errors import DatasetCorruptError
    from plexus.data.graph import check_labels, check_splits

    try:
        check_labels(torch.from_numpy(y), n, c)
    except ValueError as e:
        raise DatasetCorruptError(f"{label_file}: {e} (C: ogb's class count of this "
                                  "dataset)") from e
    try:
        check_splits({"train": torch.from_numpy(splits["train"]),
                      "val": torch.from_numpy(splits["valid"]),
                      "test": torch.from_numpy(splits["test"])}, torch.from_numpy(y), n)
    except ValueError as e:
        raise DatasetCorruptError(f"{split_dir}: {e}") from e


def ogb_sizes(raw: str | os.PathLike) -> tuple[int, int, int]:
    """(nodes, stored edges, feature width) of an OGB node dataset's ``raw`` folder, from the
    npz headers (ogbn-papers100M) or the CSV count files, without reading the graph.

    Raises:
        DatasetCorruptError: a file is truncated or unreadable (the message names it).
    """
    raw = Path(raw)
    name = raw.parent.name
    if (raw / "data.npz").is_file():
        with _reading(raw / "data.npz", name), zipfile.ZipFile(raw / "data.npz") as zf:
            return (int(_npz_read(zf, "num_nodes_list").sum()),
                    int(_npz_header(zf, "edge_index")[0][1]),
                    int(_npz_header(zf, "node_feat")[0][1]))
    import pandas as pd

    sizes = []
    for file, read in (("num-node-list", lambda f: int(pd.read_csv(f, header=None)[0].sum())),
                       ("num-edge-list", lambda f: int(pd.read_csv(f, header=None)[0].sum())),
                       ("node-feat", lambda f: pd.read_csv(f, header=None, nrows=1).shape[1])):
        with _reading(raw / f"{file}.csv.gz", name):
            sizes.append(read(raw / f"{file}.csv.gz"))
    return tuple(sizes)


def _ogb_num_classes(name: str) -> int:
    """"num classes" of ``name`` in ogb's own master.csv (what NodePropPredDataset reports).
    The file is found without importing ``ogb.nodeproppred``, which pulls in torch_geometric,
    scikit-learn and pandas: seconds of start-up, and resident memory that the preparing
    rank would keep through training."""
    import csv
    import importlib.util

    os.environ["OUTDATED_IGNORE"] = "1"  # (ogb's version check, as import_ogb_nodeproppred)
    spec = importlib.util.find_spec("ogb.nodeproppred")  # imports ogb, not the subpackage
    if spec is None or spec.origin is None:
        raise ImportError("ogb.nodeproppred was not found; pip install ogb")
    with open(Path(spec.origin).parent / "master.csv", newline="") as f:
        rows = list(csv.reader(f))
    column = rows[0].index(name)
    (classes,) = [row[column] for row in rows if row[0] == "num classes"]
    return int(classes)


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
    """The Plexus paper's synthetic task, exactly as plexus.data.generators.rmat_graph draws it:
    uniform [0, 1) features (one seeded stream, drawn here in row chunks into a temporary
    memory-mapped file), C equal-size in-degree buckets as labels, a random split."""
    from plexus.data.generators import degree_bucket_labels

    n = in_degree.shape[0]
    y = degree_bucket_labels(in_degree, num_classes)
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
    from plexus.data.graph import random_split

    split = np.zeros(n, dtype=np.int8)
    for code, idx in zip(SPLIT_CODES.values(), random_split(n, fractions, seed=seed)):
        split[idx.numpy()] = code
    return split
