"""plexus.data.registry: dataset names to graphs and shard sources."""

import numpy as np
import pytest
import torch

from plexus.data import (
    Graph,
    InMemorySource,
    PreparedGraph,
    available_datasets,
    load_dataset,
    open_source,
    registry,
)
from plexus.data.generators import planted_partition
from plexus.data.sources import graph_source
from plexus.data.writer import prepare


def test_registry_names():
    assert {"planted", "rmat", "ogbn-arxiv", "ogbn-products", "ogbn-papers100M"} <= set(
        available_datasets())
    assert load_dataset("rmat-8", seed=2).num_nodes == 256
    assert load_dataset("planted", seed=1).name == "planted"
    with pytest.raises(ValueError, match="available: planted, rmat"):
        load_dataset("cora")


def _directed(num_nodes: int = 40, seed: int = 0) -> Graph:
    """A random directed graph with a duplicate edge and a self-loop."""
    rng = np.random.default_rng(seed)
    ei = rng.integers(0, num_nodes, (2, 3 * num_nodes))
    ei = np.concatenate([ei, ei[:, :1], [[3], [3]]], axis=1)
    return Graph.from_edge_index(ei, rng.random((num_nodes, 4)), rng.integers(0, 3, num_nodes),
                                 seed=seed, name="directed")


def test_symmetrize_adds_every_reverse_edge_and_keeps_the_node_data(monkeypatch):
    directed = _directed()
    monkeypatch.setattr(registry, "_load", lambda *args: directed)
    assert not load_dataset("directed").is_undirected()
    g = load_dataset("directed", symmetrize=True)
    edges = set(map(tuple, g.edge_index.T.tolist()))
    assert all((t, s) in edges for s, t in edges) and g.is_undirected()
    assert len(edges) == g.num_edges  # no duplicates
    wanted = {(s, t) for s, t in directed.edge_index.T.tolist() if s != t}
    assert edges == wanted | {(t, s) for s, t in wanted}  # self-loops dropped
    assert g.x is directed.x and g.y is directed.y and g.num_classes == directed.num_classes
    assert all(torch.equal(g.split_idx(s), directed.split_idx(s)) for s in ("train", "val", "test"))
    src = open_source("directed", symmetrize=True, permutation="none")
    assert isinstance(src, InMemorySource) and src.graph.is_undirected()
    assert src.num_edges == g.num_edges


def test_symmetrize_is_a_no_op_for_an_undirected_graph():
    g = load_dataset("planted", seed=1)
    assert g.is_undirected()
    assert torch.equal(load_dataset("planted", seed=1, symmetrize=True).edge_index, g.edge_index)


def test_symmetrize_refuses_a_directed_prepared_dataset(tmp_path):
    prepare(graph_source(_directed(120)), tmp_path / "d", blocks=2, quiet=True)
    prepare(graph_source(planted_partition(num_nodes=120, seed=1)), tmp_path / "u", blocks=2,
            quiet=True)
    with pytest.raises(ValueError, match=r"directed graph .*plexus.prepare .*--symmetrize"):
        open_source(str(tmp_path / "d"), symmetrize=True)
    assert not open_source(str(tmp_path / "d")).symmetric
    assert open_source(str(tmp_path / "u"), symmetrize=True).symmetric


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
