"""plexus.data.registry: dataset names to graphs and shard sources."""

import pytest

from plexus.data import InMemorySource, PreparedGraph, available_datasets, load_dataset, open_source
from plexus.data.generators import planted_partition
from plexus.data.prepare import prepare
from plexus.data.sources import graph_source


def test_registry_names():
    assert {"planted", "rmat", "ogbn-arxiv", "ogbn-products", "ogbn-papers100M"} <= set(
        available_datasets())
    assert load_dataset("rmat-8", seed=2).num_nodes == 256
    assert load_dataset("planted", seed=1).name == "planted"
    with pytest.raises(ValueError, match="available: planted, rmat"):
        load_dataset("cora")




def test_open_source_picks_the_kind_and_guards_the_permutation(tmp_path):
    src = open_source("planted", seed=1, permutation="single")
    assert isinstance(src, InMemorySource) and src.permutation == "single"
    prepare(graph_source(planted_partition(num_nodes=120, seed=1)), tmp_path / "p", blocks=2,
            permutation="double", quiet=True)
    for how in ({"name": str(tmp_path / "p")}, {"name": "p", "root": tmp_path}):
        got = open_source(**how)
        assert isinstance(got, PreparedGraph) and got.permutation == "double"
        assert got.num_nodes == 120 and got.storage == "memory-mapped"
    with pytest.raises(ValueError, match="prepared with --permutation double"):
        open_source(str(tmp_path / "p"), permutation="none")
    assert open_source(str(tmp_path / "p"), permutation="double").blocks == 2
