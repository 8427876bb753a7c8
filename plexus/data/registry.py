"""Dataset names to graphs and shard sources: what ``--dataset`` means.

    load_dataset("planted")                       # an in-memory Graph
    open_source("ogbn-arxiv", root="data")        # a ShardSource for the trainer
    open_source("data/rmat-24-k8")                # a prepared dataset: mapped per rank
    open_source("ogbn-papers100M", root="data")   # prepared once into data/prepared/, mapped

    load_dataset("Planetoid/Cora", root="data")   # through torch_geometric.datasets.Planetoid

Names: ``planted`` (built-in, learnable), ``rmat`` (scale 12), ``rmat-<scale>``, the OGB node
datasets (read by the real ``ogb`` loaders from ``root``), the PyG node datasets
(``Family/Name``, read by PyG's own dataset classes from ``root``: :mod:`plexus.data.pyg`), or
a directory written by ``python -m plexus.prepare`` (as a path, or as a name under ``root``).
Big datasets (ogbn-papers100M, ogbn-products, ``.npy`` edge files, OGB datasets over 1 GiB) are
prepared once into ``root/prepared`` and memory-mapped (:mod:`plexus.data.cache`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from plexus.data import cache
from plexus.data.generators import planted_partition, rmat_graph
from plexus.data.graph import Graph
from plexus.data.mapped import PreparedGraph
from plexus.data.memory import InMemorySource
from plexus.data.ogb import OGB_DATASETS, load_ogb
from plexus.data.pyg import is_pyg_name, load_pyg, pyg_patterns, pyg_split_is_random
from plexus.data.schema import DEFAULT_ROOT, is_prepared
from plexus.data.shard import ShardSource

RMAT_DEFAULT_SCALE = 12  # "rmat": 4,096 nodes, 65,536 generated edges


def available_datasets() -> list[str]:
    """Names :func:`load_dataset` accepts, some as patterns: "rmat-<scale>" stands for
    rmat-10, rmat-14, ...; "Planetoid/<Cora|CiteSeer|PubMed>" for Planetoid/Cora, ..."""
    return ["planted", "rmat", "rmat-<scale>", *OGB_DATASETS, *pyg_patterns()]


def load_dataset(name: str, root: str | os.PathLike | None = None, seed: int = 0, *,
                 download: bool = False, symmetrize: bool = False) -> Graph:
    """Load a dataset by name as an in-memory :class:`Graph`.

    Args:
        name: one of :func:`available_datasets`: "planted" (the learnable default), "rmat"
            (scale 12), "rmat-<scale>" (edge factor 16), an OGB name, or a PyG name such as
            "Planetoid/Cora", "Amazon/Photo", "Coauthor/CS", "Reddit" (:mod:`plexus.data.pyg`).
        root: folder of the OGB and PyG dataset folders; default "data" (relative to the
            working dir). Unused by the generated datasets.
        seed: seed of the generated datasets and of random splits; OGB and PyG datasets with
            their own split ignore it (:func:`plexus.data.pyg.load_pyg` says which have none).
        download: let the OGB or PyG loader fetch missing files (needs internet).
        symmetrize: make the graph undirected: add the missing reverse edges, dropping
            duplicates and self-loops (:meth:`Graph.to_undirected`); an undirected graph is
            returned unchanged.

    Raises:
        ValueError: unknown name (the message lists the available ones).
        DatasetNotFoundError: OGB or PyG files missing (see :func:`plexus.data.ogb.load_ogb`,
            :func:`plexus.data.pyg.load_pyg`).
    """
    graph = _load(name, DEFAULT_ROOT if root is None else root, seed, download)
    if symmetrize and not graph.is_undirected():
        graph = graph.to_undirected()
    return graph


def _load(name: str, root: str | os.PathLike, seed: int, download: bool) -> Graph:
    if name == "planted":
        return planted_partition(seed=seed)
    if name == "rmat":
        return rmat_graph(RMAT_DEFAULT_SCALE, seed=seed)
    if match := re.fullmatch(r"rmat-(\d+)", name):
        return rmat_graph(int(match.group(1)), seed=seed)
    if name in OGB_DATASETS:
        return load_ogb(name, root, download=download)
    if is_pyg_name(name):
        return load_pyg(name, root, seed=seed, download=download)
    raise ValueError(f"unknown dataset {name!r}; available: {', '.join(available_datasets())}"
                     " or a directory written by python -m plexus.prepare")


def open_source(name: str, *, root: str | os.PathLike | None = None,
                permutation: str | None = None, seed: int = 0,
                pad_multiple: int = 1, symmetrize: bool = False,
                aggregation: str = "gcn", prepare: str = "auto", blocks: int = 8,
                is_writer: bool = True, verbose: bool = False,
                token: str | None = None) -> ShardSource:
    """The shard source of ``--dataset NAME``: a prepared directory (``NAME`` as a path, or
    ``ROOT/NAME``) is memory-mapped per rank; a big dataset goes through the prepared cache
    ``ROOT/prepared/<name>-k<blocks>-<permutation>-s<seed>[-sym]`` (written once, then
    memory-mapped: :func:`plexus.data.cache.prepared_cache`); any other name is loaded whole.

    ``prepare`` decides the cache: ``auto`` uses it for ogbn-papers100M, ogbn-products,
    ``.npy`` edge files and OGB datasets whose estimated size (nodes * features * 4 + edges *
    16 bytes, from the file headers) exceeds ``cache.IN_MEMORY_LIMIT_BYTES`` (1 GiB);
    ``always`` uses it for every OGB name or edge file; ``never`` loads the graph whole. A
    prepared dataset holds the blocks of both aggregations, so GCN and GraphSAGE share it.

    Args:
        name: a dataset name (:func:`load_dataset`) or a prepared directory.
        root: default "data".
        permutation: ``none``/``single``/``double``; None: ``double`` in memory, a prepared
            dataset's own. A prepared dataset refuses a different one.
        seed: permutation seed of in-memory graphs (and the seed of generated ones); a
            prepared dataset uses its own.
        pad_multiple: in-memory graphs: pad the node count to a multiple of this too.
        symmetrize: in-memory graphs: made undirected (see :func:`load_dataset`); a prepared
            dataset must have been prepared symmetric, it cannot be changed when mapped.
        aggregation: ``gcn`` (``Â``) or ``mean`` (GraphSAGE's mean adjacency and root blocks;
            :class:`~plexus.data.memory.InMemorySource`, :class:`PreparedGraph`).
        prepare: ``auto``, ``always`` or ``never`` (above).
        blocks: k of a cache prepared now (every grid axis must divide it).
        is_writer: this rank prepares the cache (one rank per job, global rank 0); the others
            wait for it, polling the filesystem (``root`` must be shared by every node).
        verbose: print the cache's progress (one rank per node, local rank 0).
        token: the same on every rank, new per job (see ``prepared_cache``).

    Raises:
        ValueError: unknown name, a permutation the prepared dataset was not made with,
            symmetrize for a prepared dataset holding a directed graph, a cache that does not
            match, or ``prepare`` impossible for the name.
        DatasetNotFoundError, DatasetCorruptError: missing or unreadable files.
        PrepareFailedError: (waiting ranks) the writer failed to prepare the cache.
    """
    root = Path(DEFAULT_ROOT if root is None else root)
    for path in (Path(name), root / name):
        if is_prepared(path):
            source = PreparedGraph(path, aggregation=aggregation)
            if permutation is not None and permutation != source.permutation:
                raise ValueError(
                    f"{path} was prepared with --permutation {source.permutation} (seed "
                    f"{source.seed}); train with --permutation {source.permutation} or "
                    f"prepare it again with --permutation {permutation}")
            if symmetrize and not source.symmetric:
                raise ValueError(
                    f"{path} holds a directed graph and a prepared dataset cannot be "
                    "symmetrized when it is mapped: prepare it again with python -m "
                    "plexus.prepare --source ... --out ... --symmetrize (the flag applies to "
                    ".npy edge files and directed OGB datasets), or train on it as it is")
            return source  # its files are the graph: no setting of this run made it
    settings = {"seed": seed if _seeded(name) else None, "symmetrize": symmetrize}
    if _use_cache(name, root, prepare):
        path = cache.prepared_cache(name, root, blocks=blocks, permutation=permutation or "double",
                                    seed=seed, symmetrize=symmetrize, is_writer=is_writer,
                                    token=token, verbose=verbose, quiet=not verbose)
        return PreparedGraph(path, aggregation=aggregation, settings=settings)
    graph = load_dataset(name, root=root, seed=seed, symmetrize=symmetrize)
    return InMemorySource(graph, permutation=permutation or "double", seed=seed,
                          pad_multiple=pad_multiple, aggregation=aggregation, settings=settings)


def _seeded(name: str) -> bool:
    """Whether ``seed`` generates or randomly splits dataset ``name`` (so that another seed
    is another graph): the generated graphs, the synthetic task of an edge file, and the PyG
    datasets without a split of their own."""
    if name in ("planted", "rmat") or re.fullmatch(r"rmat-\d+", name) or cache.is_edge_file(name):
        return True
    return is_pyg_name(name) and pyg_split_is_random(name)


def _use_cache(name: str, root: Path, prepare: str) -> bool:
    """Whether ``name`` goes through the prepared cache (see :func:`open_source`)."""
    if prepare not in cache.PREPARE_MODES:
        raise ValueError(f"unknown prepare mode {prepare!r}; choose from {cache.PREPARE_MODES}")
    edge_file = cache.is_edge_file(name)
    if prepare == "never" or not cache.cacheable(name):
        if edge_file:
            raise ValueError(f"{name} is an edge file, which is read only through the prepared "
                             "cache: use --prepare auto or always (or python -m plexus.prepare)")
        if prepare == "always":
            raise ValueError(f"--prepare always: {name!r} cannot be prepared automatically "
                             "(only OGB datasets and .npy edge files can); prepare it with "
                             f"python -m plexus.prepare --source {name} --out DIR and train on "
                             "DIR, or use --prepare auto")
        return False
    return prepare == "always" or cache.wants_cache(name, root)
