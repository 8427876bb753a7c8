"""Plain helpers of the plexus tests: small graphs and shard comparison (tests/conftest.py
wraps ``small_graph`` as the ``tiny_graph`` fixture)."""

import numpy as np
import torch

from plexus.data import SPLITS, Graph, InMemorySource
from plexus.data.generators import planted_partition
from plexus.layout import layer_widths


def directed_graph(n=203, e=1500, seed=5):
    """Directed, with self-loops, duplicate edges, unlabeled nodes; 203 nodes pad to 208."""
    rng = np.random.default_rng(seed)
    ei = rng.integers(0, n, (2, e))
    ei[:, :40] = ei[:, 40:80]  # 40 duplicated edges
    ei[1, 80:90] = ei[0, 80:90]  # 10 self-loops
    y = rng.integers(-1, 6, n)
    return Graph.from_edge_index(ei, rng.standard_normal((n, 9)), y, num_classes=6,
                                 name="directed")


def assert_same_blocks(a, b, what="adj"):
    """The blocks ``a[l]`` and ``b[l]`` (dicts of AdjBlock) hold the same matrices, bit for
    bit: same structure, same float32 bits in the same order of every row, same balance."""
    assert sorted(a) == sorted(b), what
    for layer in a:
        for m in ("a", "a_t"):
            x, y = getattr(a[layer], m).to_scipy(), getattr(b[layer], m).to_scipy()
            assert x.shape == y.shape
            d = (x != y)
            assert d.nnz == 0, f"{what} layer {layer} {m}: {d.nnz} entries differ"
            assert x.nnz == y.nnz == getattr(a[layer], m).nnz, f"{what} layer {layer} {m}"
            for blocks in (getattr(a[layer], m), getattr(b[layer], m)):  # the SpMM's order
                if m == "a":
                    assert all(blk.to_scipy().has_sorted_indices
                               for _, _, blk in blocks.present())
                else:  # the transpose reads the block's own CSR: no second copy
                    assert blocks.base is (a if blocks is getattr(a[layer], m) else b)[layer].a
            x.sort_indices()
            y.sort_indices()
            assert np.array_equal(x.indptr, y.indptr) and np.array_equal(x.indices, y.indices)
            assert np.array_equal(x.data.view(np.int32), y.data.view(np.int32)), \
                f"{what} layer {layer} {m}: values differ in their bits"
        assert a[layer].nnz == b[layer].nnz, f"{what} layer {layer}"
        assert a[layer].balance == b[layer].balance, f"{what} layer {layer}"


def assert_same_shard(a, b):
    assert a.num_nodes_padded == b.num_nodes_padded
    assert a.widths_padded == b.widths_padded
    assert np.array_equal(a.pr, b.pr) and np.array_equal(a.pc, b.pc)
    assert_same_blocks(a.adj, b.adj, "adj")
    assert (a.root is None) == (b.root is None)
    if a.root is not None:
        assert_same_blocks(a.root, b.root, "root")
    assert torch.equal(a.features_block, b.features_block)
    assert torch.equal(a.labels, b.labels)
    for s in SPLITS:
        assert torch.equal(a.masks[s], b.masks[s])
    assert a.split_counts == b.split_counts
    assert np.array_equal(a.out_rows, b.out_rows)


def widths(graph, num_layers: int, hidden: int) -> list[int]:
    return layer_widths(graph.num_features, hidden, num_layers, graph.num_classes)


def memory_shard(graph, shape, coords, num_layers, hidden, *, permutation="double", seed=0,
                 pad_multiple=1, aggregation="gcn"):
    """The in-memory source's shard: the oracle the prepared shards are compared with."""
    source = InMemorySource(graph, permutation=permutation, seed=seed, pad_multiple=pad_multiple,
                            aggregation=aggregation)
    return source.shard(shape, coords, widths(graph, num_layers, hidden))


def model_source(graph, kind: str) -> InMemorySource:
    """The in-memory source the model tests train on: the double permutation of seed 11, with
    the aggregation of ``kind`` (GraphSAGE's mean adjacency, else GCN's)."""
    return InMemorySource(graph, permutation="double", seed=11,
                          aggregation="mean" if kind == "sage" else "gcn")


def small_graph(num_nodes=203, seed=3):
    """203 nodes: a prime, so every grid but 1x1x1 pads; a few unlabeled/unsplit nodes."""
    return planted_partition(num_nodes=num_nodes, num_classes=5, num_features=7, avg_degree=5,
                             split_fractions=(0.5, 0.2, 0.2), seed=seed)
