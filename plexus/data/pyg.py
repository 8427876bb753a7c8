"""PyTorch Geometric node datasets by name, through PyG's own dataset classes, offline-safe.

    load_dataset("Planetoid/Cora", root="data")    # data/Cora/raw/ind.cora.x, ...
    load_dataset("Amazon/Photo", root="data")      # data/Photo/raw/amazon_electronics_photo.npz
    load_dataset("Reddit", root="data")            # data/Reddit/raw/reddit_{data,graph}.npz

A name is ``Family/Name`` (``Family`` is the ``torch_geometric.datasets`` class and ``Name`` its
``name`` argument) or, for a class that holds one graph, the class name alone; then the class's
root is ``root/<class name>``. PyG downloads whenever its raw files are missing, so the files
are checked first, by the class's own ``raw_paths``/``processed_paths`` (see :func:`_probe`);
missing ones raise :class:`DatasetNotFoundError` saying what to put where and never touch the
network unless ``download=True``.

Shapes: N nodes, F features, E directed edges (PyG stores an undirected edge both ways).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from plexus.data.errors import DatasetCorruptError, DatasetNotFoundError
from plexus.data.graph import Graph
from plexus.data.lock import parse_once

# How a family's graph is split into train/val/test (Graph.from_pyg):
PUBLIC = "public"  # the dataset's own bool [N] train/val/test masks
COLUMN0 = "column0"  # [N, S] masks of S official splits: the first one (WikiCS: 20 splits)
RANDOM = "random"  # no masks: graph.random_split(N, (0.3, 0.2, 0.5), seed) of the labeled nodes


@dataclass(frozen=True)
class PygSpec:
    """One PyG dataset: the class, its ``name`` argument and where its split comes from.

    Attributes:
        family: class name in ``torch_geometric.datasets``.
        name: the class's ``name`` argument; None for a class holding one graph (its root is
            then ``root/<family>``).
        split: PUBLIC, COLUMN0 or RANDOM (above).
        kwargs: further constructor arguments (pinned so the cached file is the one expected).
    """

    family: str
    name: str | None
    split: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.family if self.name is None else f"{self.family}/{self.name}"

    def args(self, root: Path) -> tuple[list[Any], dict[str, Any]]:
        """Constructor arguments of the class for data under ``root``."""
        if self.name is None:
            return [str(root / self.family)], dict(self.kwargs)
        return [str(root), self.name], dict(self.kwargs)

    def command(self, root: Path) -> str:
        """The one-liner that downloads this dataset with PyG itself."""
        args, kwargs = self.args(root)
        text = ", ".join([*(f'"{a}"' for a in args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        return (f"python -c 'from torch_geometric.datasets import {self.family}; "
                f"{self.family}({text})'")


def _specs() -> dict[str, PygSpec]:
    specs = [
        *(PygSpec("Planetoid", n, PUBLIC) for n in ("Cora", "CiteSeer", "PubMed")),
        *(PygSpec("Amazon", n, RANDOM) for n in ("Computers", "Photo")),
        *(PygSpec("Coauthor", n, RANDOM) for n in ("CS", "Physics")),
        *(PygSpec("CitationFull", n, RANDOM, {"to_undirected": True})
          for n in ("Cora", "Cora_ML", "CiteSeer", "DBLP", "PubMed")),
        PygSpec("Reddit", None, PUBLIC),
        PygSpec("Flickr", None, PUBLIC),
        PygSpec("WikiCS", None, COLUMN0, {"is_undirected": True}),
    ]
    return {s.key: s for s in specs}


PYG_DATASETS = MappingProxyType(_specs())


def pyg_patterns() -> list[str]:
    """The PyG names as patterns for listings: "Planetoid/<Cora|CiteSeer|PubMed>", "Reddit"."""
    families: dict[str, list[str]] = {}
    for spec in PYG_DATASETS.values():
        families.setdefault(spec.family, []).extend([] if spec.name is None else [spec.name])
    return [f"{f}/<{'|'.join(names)}>" if names else f for f, names in families.items()]


def is_pyg_name(name: str) -> bool:
    """True for a PyG dataset name or a name in a PyG family, in any case (``planetoid/Foo``:
    :func:`load_pyg` rejects it with the family's choices)."""
    return name in PYG_DATASETS or _family(name) is not None


def pyg_split_is_random(name: str) -> bool:
    """Whether :func:`load_pyg` splits ``name`` at random with its ``seed`` (RANDOM), so that
    another seed gives another split; True for a name it does not know (it refuses those)."""
    spec = next((s for s in PYG_DATASETS.values() if s.key.lower() == name.lower()), None)
    return spec is None or spec.split == RANDOM


def _family(name: str) -> str | None:
    """The PyG family ``name`` belongs to, matched without regard to case."""
    head = name.split("/")[0].lower()
    return next((s.family for s in PYG_DATASETS.values() if s.family.lower() == head), None)


def load_pyg(name: str, root: str | os.PathLike, *, seed: int = 0,
             download: bool = False) -> Graph:
    """Load a PyG node dataset through its ``torch_geometric.datasets`` class, as a Graph.

    Files live where the class puts them: ``root/<Name>/raw`` and ``root/<Name>/processed``
    (Planetoid/Cora: root/Cora/raw/ind.cora.{x,tx,allx,y,ty,ally,graph,test.index}; Amazon/Photo:
    root/Photo/raw/amazon_electronics_photo.npz; CitationFull lower-cases the folder:
    root/cora_ml/raw/cora_ml.npz; Reddit: root/Reddit/raw/reddit_{data,graph}.npz). Either
    the raw files or the processed cache must be there; on first use the class parses the raw
    files and writes the cache.

    Split rule: Planetoid (the public split of Yang et al. 2016: 20 nodes per class, 500, 1000),
    Reddit and Flickr use their own masks; WikiCS the first of its 20 official splits; Amazon,
    Coauthor and CitationFull, which have none, a random split of the labeled nodes in
    proportions (0.3, 0.2, 0.5) drawn with ``seed`` (:func:`plexus.data.graph.random_split`).
    Edges are as PyG stores them (the real datasets are undirected: both directions present).

    Args:
        name: a key of PYG_DATASETS, e.g. "Planetoid/Cora", "Coauthor/CS", "Reddit".
        root: folder of the dataset folders.
        seed: seed of the random split (ignored where the dataset has its own).
        download: let PyG fetch missing files (needs internet).

    Raises:
        ValueError: unknown name (the message lists the choices).
        DatasetNotFoundError: files missing and download False; names the missing files, the
            folder they belong in and the command that fetches them.
        DatasetCorruptError: the files are present but PyG cannot parse them.
    """
    spec, root = _spec(name), Path(root)
    cls = _pyg_class(spec.family)
    args, kwargs = spec.args(root)
    probe = _probe(cls)(*args, **kwargs)
    if not download:
        raw_missing = [p for p in probe.raw_paths if not os.path.isfile(p)]
        if raw_missing and not all(os.path.isfile(p) for p in probe.processed_paths):
            raise DatasetNotFoundError(_not_found_message(spec, root, probe, raw_missing))
        cls = _offline(cls)
    try:  # the ranks of a job load at once: one parses the raw files, the others wait
        dataset = parse_once(Path(probe.processed_dir),
                             lambda: all(os.path.isfile(p) for p in probe.processed_paths),
                             lambda: cls(*args, **kwargs))
    except DatasetNotFoundError:
        raise
    except Exception as e:
        if download and isinstance(e, OSError):  # urllib's errors are OSErrors
            raise DatasetNotFoundError(f"{name}: torch_geometric.datasets.{spec.family} could "
                                       f"not download into {root} ({e})") from e
        raise DatasetCorruptError(
            f"{name} under {root} could not be read by torch_geometric.datasets.{spec.family} "
            f"({type(e).__name__}: {e}); a raw or processed file is truncated or of another "
            "format: delete the processed/ folder and copy the raw files again") from e
    return _to_graph(dataset[0], spec, seed)


def _spec(name: str) -> PygSpec:
    if name in PYG_DATASETS:
        return PYG_DATASETS[name]
    family = _family(name)
    choices = [k for k, s in PYG_DATASETS.items() if s.family == family] or list(PYG_DATASETS)
    close = [k for k in PYG_DATASETS if k.lower() == name.lower()]
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ValueError(f"unknown {family or 'PyG'} dataset {name!r}{hint}; choices: "
                     f"{', '.join(choices)}")


def _to_graph(data: Any, spec: PygSpec, seed: int) -> Graph:
    """Graph.from_pyg with the spec's split; features float32 [N, F], labels int64 [N]."""
    kwargs: dict[str, Any] = {"seed": seed, "name": spec.key}
    if spec.split == RANDOM:
        data.train_mask = data.val_mask = data.test_mask = None
    elif spec.split == COLUMN0:
        for split, attr in (("train", "train_mask"), ("val", "val_mask"), ("test", "test_mask")):
            mask = getattr(data, attr)
            kwargs[f"{split}_idx"] = (mask if mask.dim() == 1 else mask[:, 0]).nonzero().view(-1)
    return Graph.from_pyg(data, **kwargs)


def _not_found_message(spec: PygSpec, root: Path, probe: Any, raw_missing: list[str]) -> str:
    raw_dir, processed_dir = Path(probe.raw_dir), Path(probe.processed_dir)
    processed = ", ".join(Path(p).name for p in probe.processed_paths)
    return (f"{spec.key} not found: {raw_dir} lacks "
            f"{', '.join(Path(p).name for p in raw_missing)} (and {processed_dir} holds no "
            f"processed {processed}).\nRun once on a machine with internet:\n    "
            f"{spec.command(root)}\nand copy {raw_dir} to this machine, so that "
            f"{raw_missing[0]} exists; or pass download=True (load_dataset(..., "
            "download=True)) on a machine with internet.")


def _pyg_class(family: str) -> Any:
    import torch_geometric.datasets

    return getattr(torch_geometric.datasets, family)


def _probe(cls: Any) -> Any:
    """``cls`` that only computes its paths: the class's own ``__init__`` (name normalisation,
    root) runs, but not PyG's download, processing or loading, so nothing is read or written."""

    def skip(self: Any, *args: Any, **kwargs: Any) -> None:
        pass

    return type(f"Probe{cls.__name__}", (cls,),
                {"_download": skip, "_process": skip, "load": skip})


def _offline(cls: Any) -> Any:
    """``cls`` that never downloads and prints nothing.

    PyG calls ``download()`` whenever a raw file is missing, even if the processed cache is
    there; then there is nothing to fetch and the cache is loaded. Otherwise (a file removed
    since the check) this raises instead of going to the network.
    """

    def download(self: Any) -> None:
        if not all(os.path.isfile(p) for p in self.processed_paths):
            missing = [p for p in self.raw_paths if not os.path.isfile(p)]
            raise DatasetNotFoundError(f"{cls.__name__} under {self.root} lacks "
                                       f"{', '.join(missing)}")

    quiet = property(lambda self: False, lambda self, value: None)  # PyG's "Processing..."
    return type(f"Offline{cls.__name__}", (cls,), {"download": download, "log": quiet})
