"""Everything up to a rank's shard: graphs, datasets, preparation and the shard sources.

The trainer sees one protocol, :class:`~plexus.data.shard.ShardSource` (sizes,
``grid_problems(shape)``, ``shard(shape, coords, widths) -> GraphShard``), with two
implementations: :class:`~plexus.data.memory.InMemorySource` (a whole :class:`Graph` on every
rank: small graphs and the test oracle) and :class:`~plexus.data.mapped.PreparedGraph` (a
prepared dataset, memory-mapped per rank). :func:`~plexus.data.registry.open_source` turns
``--dataset`` into one.

Modules:
    graph       the in-memory Graph (validated at construction), PyG conversion, splits
    generators  planted partition and R-MAT graphs
    ogb         OGB node datasets through the real ``ogb`` loaders, offline-safe; Evaluator
    pyg         PyTorch Geometric datasets by name (Planetoid/Cora, ...) through PyG's classes
    registry    dataset names -> Graph / ShardSource
    partition   normalisation, permutations, blocks, balance (pure numpy/scipy)
    shard       GraphShard, AdjBlock and the ShardSource protocol
    memory      InMemorySource
    schema      split names and codes, the prepared format (version, manifest, checksums)
    sources     streamed edge sources for the writer (R-MAT, OGB raw files, edge files)
    writer      prepare(): a graph into k x k block files, streaming (CLI: plexus.prepare)
    mapped      PreparedGraph: a prepared dataset, memory-mapped per rank
    cache       big datasets prepared once under ROOT/prepared on first use, then mapped
    job         opening a dataset on every rank of a job: the cache's k, the job token
    errors      DatasetNotFoundError, DatasetCorruptError

Importing this package loads only the light modules; sources and the writer load on use.
"""

from plexus.data.errors import DatasetCorruptError, DatasetNotFoundError
from plexus.data.graph import Graph
from plexus.data.mapped import PreparedGraph
from plexus.data.memory import InMemorySource
from plexus.data.registry import available_datasets, load_dataset, open_source
from plexus.data.schema import SPLITS
from plexus.data.shard import GraphShard, ShardSource

__all__ = [
    "SPLITS",
    "DatasetCorruptError",
    "DatasetNotFoundError",
    "Graph",
    "GraphShard",
    "InMemorySource",
    "PreparedGraph",
    "ShardSource",
    "available_datasets",
    "load_dataset",
    "open_source",
]
