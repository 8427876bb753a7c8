"""What plexus data looks like: split names and codes, and the on-disk format of a prepared
dataset (format version, manifest, checksums). The writer (plexus.data.writer) and the
reader (plexus.data.mapped) both use this module; neither imports the other.

Layout of a prepared dataset ``OUT`` (N_pad = N rounded up to k; bs = N_pad / k):

    manifest.json                 sizes, k, permutation and seed, per-block nnz, checksums
    perm/pr.npy, perm/pc.npy      int64 [N_pad], perm[new] = old
    even/R_C/{indptr,indices,values}.npy
                                  block (R, C) of A' [bs, bs] as CSR (int32 indices where they
                                  fit); odd/R_C/... the same for A'' (directed graphs only: for
                                  symmetric ones A'' = A'^T, made by the reader). No transpose
                                  is stored: a reader makes the ones it needs.
    mean/even/R_C/...             the same three files for the mean adjacency (GraphSAGE):
                                  Pr A_mean Pc^T; mean/odd/R_C/... Pc A_mean Pr^T: all three
                                  for directed graphs, only values.npy for symmetric ones (the
                                  structure is mean/even/C_R's transposed, the values in the
                                  order of mean/even/C_R's nonzeros; A_mean is not symmetric:
                                  rows are divided by their degree)
    features/C.npy                float32 [bs, F]: rows chunk C of the features in Pc order
    labels/{pr,pc}_C.npy          int64 [bs]: labels of rows chunk C in Pr / Pc order (-1 none)
    split/{pr,pc}_C.npy           int8 [bs]: 0 none, 1 train, 2 val, 3 test
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from plexus.data.errors import DatasetCorruptError

SPLITS = ("train", "val", "test")
SPLIT_CODES = {"train": 1, "val": 2, "test": 3}  # 0: in no split
DEFAULT_ROOT = "data"  # --root default: OGB folders (data/ogbn_arxiv) and prepared datasets

FORMAT_NAME = "plexus-blocks"
FORMAT_VERSION = 3  # 3: no transposed files; 2: the mean adjacency's blocks; 1: the GCN's
VERSION_CHANGES = {2: "adds the mean aggregation's blocks for --model sage",
                   3: "stores each block once, without its transpose: about half the disk"}
MANIFEST = "manifest.json"
MATRICES = ("even", "odd")  # A' = Pr Â Pc^T (even layers), A'' = Pc Â Pr^T (odd layers)
MEAN_DIR = "mean"  # the mean adjacency's blocks: mean/even/R_C, mean/odd/R_C


class StaleFormatError(DatasetCorruptError):
    """A prepared dataset of another format version (an older or newer plexus wrote it)."""


def is_prepared(path: str | os.PathLike) -> bool:
    """True if ``path`` is a directory written by plexus.prepare (it holds a manifest)."""
    return (Path(path) / MANIFEST).is_file()


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the prepared dataset at ``path``, checked for format and version.

    Raises:
        FileNotFoundError: no manifest.json at ``path``.
        DatasetCorruptError: the manifest is unreadable or of another format.
        StaleFormatError: the manifest is of another format version (the message holds the
            command that prepares it again: :func:`rebuild_command`).
    """
    path = Path(path)
    mf = path / MANIFEST
    if not mf.is_file():
        raise FileNotFoundError(
            f"{path} is not a prepared dataset (no {MANIFEST}); write one with "
            f"python -m plexus.prepare --source ... --out {path}")
    try:
        with open(mf) as f:
            m = json.load(f)
    except (OSError, ValueError) as e:
        raise DatasetCorruptError(f"{mf} is unreadable ({e}); prepare the dataset again "
                                  "with python -m plexus.prepare") from e
    if m.get("format") != FORMAT_NAME:
        raise DatasetCorruptError(
            f"{mf} is format {m.get('format')!r} version {m.get('version')!r}; this "
            f"version reads {FORMAT_NAME} version {FORMAT_VERSION}: prepare it again")
    version = m.get("version")
    if version != FORMAT_VERSION:
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise StaleFormatError(
                f"{path} is a prepared dataset of format version {version}, written by a newer "
                f"plexus; this one reads version {FORMAT_VERSION}: upgrade plexus, or prepare "
                f"it again with this one: {rebuild_command(path, m)}")
        since = [change for v, change in sorted(VERSION_CHANGES.items())
                 if not isinstance(version, int) or v > version] or [
                     VERSION_CHANGES[FORMAT_VERSION]]
        raise StaleFormatError(
            f"{path} is a prepared dataset of format version {version!r}; this plexus reads "
            f"version {FORMAT_VERSION} (which {'; '.join(since)}): prepare it again with "
            f"{rebuild_command(path, m)}")
    return m


def rebuild_command(path: str | os.PathLike, m: dict[str, Any]) -> str:
    """The ``python -m plexus.prepare`` command that writes the dataset of manifest ``m``
    again into ``path`` (``--force``: the old one is replaced once the new one is complete),
    from the source, sizes and settings the manifest records (every format version has
    them); ``--source ...`` where the source cannot be named on the command line."""
    src = m.get("source") or {}
    kind = src.get("kind")
    args = ["--source", "..."]
    if kind == "ogb":
        args = ["--source", src["name"], "--root", src.get("root", DEFAULT_ROOT)]
        if m.get("dedupe") and src["name"] != "ogbn-products":  # symmetrised when prepared
            args.append("--symmetrize")
    elif kind == "edge-file":
        args = ["--source", src["path"], "--num-nodes", str(m["num_nodes"]),
                "--features", str(m["num_features"]), "--classes", str(m["num_classes"])]
        if m.get("symmetric"):
            args.append("--symmetrize")
    elif kind == "rmat" and src.get("seed") == m.get("seed"):  # one --seed sets both
        args = ["--source", "rmat", "--scale", str(src["scale"]), "--edge-factor",
                str(src["edge_factor"]), "--features", str(m["num_features"]), "--classes",
                str(m["num_classes"])]
    elif kind == "graph":
        args = ["--source", src.get("name", m.get("name", "..."))]
    args += ["--blocks", str(m.get("blocks", "K")), "--permutation",
             str(m.get("permutation", "double")), "--seed", str(m.get("seed", 0)),
             "--out", str(path), "--force"]
    return "python -m plexus.prepare " + " ".join(shlex.quote(a) for a in args)


def file_record(path: Path, root: Path) -> tuple[str, dict[str, Any]]:
    """(path relative to ``root``, {"bytes", "sha256"}) of a written file, as the manifest
    stores it (read back right after writing, while it is in the page cache)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return str(path.relative_to(root)), {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def progress(total: int, desc: str, unit: str, quiet: bool):
    """A tqdm bar on stderr with rate and ETA (disabled with ``quiet``)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, disable=quiet,
                file=sys.stderr, dynamic_ncols=True, mininterval=1.0)


def verify(path: str | os.PathLike, quiet: bool = True) -> list[str]:
    """Files of a prepared dataset whose size or SHA-256 differ from the manifest (or are
    missing); an empty list means intact."""
    root = Path(path)
    manifest = read_manifest(root)
    bad = []
    with progress(len(manifest["files"]), "verify", "file", quiet) as bar:
        for rel, meta in manifest["files"].items():
            p = root / rel
            if not p.is_file() or p.stat().st_size != meta["bytes"]:
                bad.append(rel)
            elif file_record(p, root)[1]["sha256"] != meta["sha256"]:
                bad.append(rel)
            bar.update()
    return bad
