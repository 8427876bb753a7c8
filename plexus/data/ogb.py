"""OGB node-property datasets through the unmodified ``ogb`` loaders, offline-safe.

Handles the offline pitfalls of ogb 1.3.6 (docs/design/data.md): the RELEASE_v1.txt prompt on
stdin, the bare torch.load of its own cache under torch >= 2.6, the network version check, and turns
missing or unreadable files into errors that say what to put where.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import urllib.request
import warnings
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from plexus.data.errors import DatasetCorruptError, DatasetNotFoundError
from plexus.data.graph import Graph, labels_to_int64
from plexus.data.lock import parse_once
from plexus.data.schema import DEFAULT_ROOT


@dataclass(frozen=True)
class OgbSpec:
    """What ogb 1.3.6 (nodeproppred/master.csv and dataset.py) expects on disk."""

    name: str
    url: str
    download_name: str  # top folder of the zip, renamed to dir_name after extraction
    split: str
    raw_files: tuple[str, ...]
    zip_size: str
    version: int = 1

    @property
    def dir_name(self) -> str:
        return self.name.replace("-", "_")


_OGB_URL = "http://snap.stanford.edu/ogb/data/nodeproppred/{}.zip"  # as in ogb's master.csv
_CSV_RAW = ("edge.csv.gz", "num-node-list.csv.gz", "num-edge-list.csv.gz", "node-feat.csv.gz",
            "node-label.csv.gz")
OGB_DATASETS = MappingProxyType({
    "ogbn-arxiv": OgbSpec("ogbn-arxiv", _OGB_URL.format("arxiv"), "arxiv", "time",
                           (*_CSV_RAW, "node_year.csv.gz"), "0.08 GB"),
    "ogbn-products": OgbSpec("ogbn-products", _OGB_URL.format("products"), "products",
                              "sales_ranking", _CSV_RAW, "1.4 GB"),
    "ogbn-papers100M": OgbSpec("ogbn-papers100M", _OGB_URL.format("papers100M-bin"),
                                "papers100M-bin", "time", ("data.npz", "node-label.npz"),
                                "57 GB"),
})


def load_ogb(name: str, root: str | os.PathLike = DEFAULT_ROOT, *, download: bool = False,
             timeout_s: float = 30.0) -> Graph:
    """Load an OGB node dataset through the unmodified ``ogb.nodeproppred.NodePropPredDataset``.

    Files live at ``root/<name with '-' -> '_'>`` (e.g. data/ogbn_arxiv/raw/edge.csv.gz). Before
    calling the loader this checks the files are present, writes the RELEASE_v1.txt marker if
    it is missing (else ogb asks a yes/no question on stdin) and creates processed/; the loader
    then parses the raw files once and caches them in processed/data_processed, which later
    loads read with torch.load (allowed here for the duration of the call only). Edges keep the
    dataset's direction (ogbn-arxiv and ogbn-papers100M are directed citation graphs: node t
    aggregates from s for edge (s, t)); ogbn-products stores both directions. Labels that are
    NaN (papers100M) become -1. The split is the official ``get_idx_split()``.

    Args:
        name: "ogbn-arxiv", "ogbn-products" or "ogbn-papers100M".
        root: folder holding the dataset folders.
        download: if files are missing, fetch the zip from ogb's URL with ogb's own download
            helpers (no size prompt) and unpack it in place.
        timeout_s: seconds to wait for the download server to answer before giving up.

    Raises:
        DatasetNotFoundError: files missing and download False, impossible or failed; the
            message says which files to put where and the URL to fetch them from.
    """
    if name not in OGB_DATASETS:
        raise ValueError(f"unknown OGB dataset {name!r}; supported: {', '.join(OGB_DATASETS)}")
    spec, root = OGB_DATASETS[name], Path(root)
    ddir = root / spec.dir_name
    missing = missing_files(spec, ddir)
    if missing and not download:
        raise DatasetNotFoundError(  # the loader's callers: the Python API, the dataset script
            not_found_message(spec, root, missing) + "\nOr, on a machine with internet, "
            f"let it download them: python datasets/ogb/prepare.py --name {name} --root "
            f"{root} --download (in Python: load_dataset({name!r}, {str(root)!r}, download=True)).")
    if missing:
        download_dataset(spec, root, missing, timeout_s)
        if still := missing_files(spec, ddir):
            raise DatasetNotFoundError(not_found_message(spec, root, still)
                                       + "\n(after downloading)")
    release = ddir / f"RELEASE_v{spec.version}.txt"
    if not release.exists():  # files present, marker missing: ogb would prompt on stdin
        release.write_text(f"{name} release v{spec.version}; marker written by plexus\n")
    (ddir / "processed").mkdir(exist_ok=True)
    nodeproppred = import_ogb_nodeproppred()
    with _environ(TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1", TORCH_FORCE_WEIGHTS_ONLY_LOAD=None), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY")
        try:  # the ranks of a job load at once: one parses the raw files, the others wait
            dataset = parse_once(ddir / "processed",
                                 (ddir / "processed" / "data_processed").is_file,
                                 lambda: nodeproppred.NodePropPredDataset(name=name,
                                                                          root=str(root)))
            split = dataset.get_idx_split()
        except Exception as e:
            raise DatasetCorruptError(
                f"{name} under {ddir} could not be read ({type(e).__name__}: {e}); a raw or "
                f"cached file is truncated or corrupt: delete {ddir / 'processed'} and copy "
                "the raw files again") from e
    graph, labels = dataset[0]
    if graph["node_feat"] is None:
        raise ValueError(f"{name} under {ddir} has no node features (raw node-feat missing?)")
    return Graph(
        edge_index=_tensor(graph["edge_index"], np.int64),
        x=_tensor(graph["node_feat"], np.float32),
        y=labels_to_int64(_tensor(labels, labels.dtype)),
        num_classes=int(dataset.num_classes),
        train_idx=_tensor(split["train"], np.int64).reshape(-1),
        val_idx=_tensor(split["valid"], np.int64).reshape(-1),
        test_idx=_tensor(split["test"], np.int64).reshape(-1),
        name=name,
    )


def _tensor(a: np.ndarray, dtype: Any) -> torch.Tensor:
    """Share a's memory when it is contiguous and writable (pandas >= 3 hands out read-only)."""
    a = np.ascontiguousarray(a, dtype=dtype)
    return torch.from_numpy(a if a.flags.writeable else a.copy())


def missing_files(spec: OgbSpec, ddir: Path) -> list[str]:
    """Paths under ddir the loader needs and does not find (raw files or their cache; splits)."""
    missing = []
    if not (ddir / "processed" / "data_processed").is_file():
        missing += [f"raw/{f}" for f in spec.raw_files if not (ddir / "raw" / f).is_file()]
    split_dir = ddir / "split" / spec.split
    if not (split_dir / "split_dict.pt").is_file():
        missing += [f"split/{spec.split}/{s}.csv.gz" for s in ("train", "valid", "test")
                    if not (split_dir / f"{s}.csv.gz").is_file()]
    return missing


def not_found_message(spec: OgbSpec, root: Path, missing: list[str]) -> str:
    ddir = root / spec.dir_name
    msg = (f"{spec.name} not found: {ddir} lacks {', '.join(missing)}.\n"
           f"Download {spec.url} (about {spec.zip_size}), unzip it in {root} and rename the "
           f"folder '{spec.download_name}' it creates to '{spec.dir_name}', so that "
           f"{ddir / missing[0]} exists.")
    if (root / spec.download_name / "raw").is_dir():
        msg += f"\nFound {root / spec.download_name}: rename it to {ddir}."
    return msg


def download_dataset(spec: OgbSpec, root: Path, missing: list[str], timeout_s: float) -> None:
    """Fetch and unpack spec.url into root/dir_name; network errors -> DatasetNotFoundError."""
    try:  # probe with a timeout: ogb's own urlopen calls have none and can hang offline
        with urllib.request.urlopen(spec.url, timeout=timeout_s) as response:
            size_gb = int(response.headers.get("Content-Length") or 0) / 2**30
    except (OSError, ValueError) as err:
        raise DatasetNotFoundError(f"{not_found_message(spec, root, missing)}\nDownload failed: "
                                   f"{err}") from err
    import_ogb_nodeproppred()  # sets OUTDATED_IGNORE before the first ogb import
    from ogb.utils.url import download_url, extract_zip

    logging.getLogger(__name__).info("downloading %s (%.2f GB) from %s", spec.name, size_gb,
                                     spec.url)
    root.mkdir(parents=True, exist_ok=True)
    try:
        path = download_url(spec.url, str(root))
        extract_zip(path, str(root))
    except (OSError, RuntimeError, zipfile.BadZipFile) as err:
        raise DatasetNotFoundError(f"{not_found_message(spec, root, missing)}\nDownload failed: "
                                   f"{err}") from err
    os.unlink(path)
    extracted, ddir = root / spec.download_name, root / spec.dir_name
    ddir.mkdir(exist_ok=True)
    for entry in extracted.iterdir():  # merge into ddir, replacing same-named entries
        target = ddir / entry.name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        shutil.move(str(entry), str(target))
    extracted.rmdir()


def import_ogb_nodeproppred() -> Any:
    """Import ogb.nodeproppred (slow: it pulls in scikit-learn and torch_geometric)."""
    os.environ["OUTDATED_IGNORE"] = "1"  # silences ogb's `outdated` version-check warnings
    import ogb.nodeproppred

    return ogb.nodeproppred


@contextlib.contextmanager
def _environ(**values: str | None) -> Iterator[None]:
    """Set (or, with None, unset) environment variables for the duration of a block."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------- metric


def ogb_accuracy(name: str, y_true: Any, y_pred: Any) -> float:
    """Accuracy of predicted classes, through ``ogb.nodeproppred.Evaluator`` for OGB names.

    Args:
        name: dataset name; OGB names use the official evaluator, others plain accuracy.
        y_true: int [n] or [n, 1] labels (numpy or torch).
        y_pred: int [n] or [n, 1] predicted classes (argmax of the logits).

    Returns:
        The fraction of the n nodes with y_pred == y_true.
    """
    yt, yp = _as_column(y_true), _as_column(y_pred)
    if yt.shape != yp.shape or yt.shape[0] == 0:
        raise ValueError(f"y_true {yt.shape} and y_pred {yp.shape} must hold the same n > 0 "
                         "nodes")
    if name in OGB_DATASETS:
        evaluator = import_ogb_nodeproppred().Evaluator(name)
        return float(evaluator.eval({"y_true": yt, "y_pred": yp})["acc"])
    return float((yt == yp).mean())


def _as_column(a: Any) -> np.ndarray:
    """int64 [n, 1] numpy copy of a [n] or [n, 1] numpy array or tensor."""
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu().numpy()
    return np.asarray(a).astype(np.int64).reshape(-1, 1)
