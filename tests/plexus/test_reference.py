"""plexus.reference: the dense serial model's adjacency is PyG's, and its initial weights are
the ones every rank of the parallel model slices (plexus.weights)."""

import numpy as np
import pytest

from plexus.reference import gcn_adjacency


@pytest.mark.cross_shape
def test_serial_reference_agrees_with_pyg(tiny_graph):
    """The dense reference's Â and the data side's equal PyG's gcn_norm on the same graph (an
    independent check of the normalisation convention)."""
    from torch_geometric.nn.conv.gcn_conv import gcn_norm
    from torch_geometric.utils import to_dense_adj

    from plexus.data.partition import normalized_adjacency

    graph = tiny_graph
    ei, w = gcn_norm(graph.edge_index, None, graph.num_nodes, add_self_loops=True)
    dense_pyg = to_dense_adj(ei, edge_attr=w, max_num_nodes=graph.num_nodes)[0].T  # rows=target
    ours = normalized_adjacency(graph.edge_index.numpy(), graph.num_nodes).toarray()
    np.testing.assert_allclose(ours, dense_pyg.numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(gcn_adjacency(graph).numpy(), dense_pyg.numpy(), rtol=1e-6,
                               atol=1e-7)
