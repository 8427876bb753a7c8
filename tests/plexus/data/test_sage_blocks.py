"""GraphSAGE's data side: mean-adjacency and root (permuted identity) blocks in the 3D layout.

Single process: every rank's shard is cut in turn and the blocks are reassembled, or combined
as the model would (sum over O of block @ input block), and compared with dense serial maths
and with PyG's ``SAGEConv(aggr="mean")``.
"""

import itertools

import numpy as np
import pytest
import torch

from plexus import layout
from plexus.data import InMemorySource, PreparedGraph
from plexus.data import partition as part
from plexus.data.graph import Graph
from tests.plexus.data.shards import directed_graph

GRIDS = [(1, 2, 4), (4, 1, 2), (2, 3, 1), (2, 2, 2), (1, 1, 1)]
NUM_LAYERS = 6


def sage_graph():
    """7 nodes, directed: duplicate edges (0->2 twice), a self-loop edge (3->3), a sink
    (5: no out-edges), an isolated node (6) and node 4 with no in-neighbours."""
    ei = [[0, 0, 1, 3, 3, 4, 4, 2, 1],
          [2, 2, 2, 3, 1, 0, 5, 5, 0]]
    x = np.random.default_rng(0).standard_normal((7, 5))
    return Graph.from_edge_index(ei, x, np.zeros(7, dtype=np.int64), num_classes=2, name="sage")


def dense_mean(graph, n_pad):
    """A_mean [n_pad, n_pad] in float64 from its definition (one loop over edges)."""
    a = np.zeros((n_pad, n_pad))
    for s, t in graph.edge_index.T.tolist():
        a[t, s] += 1.0
    deg = a.sum(axis=1, keepdims=True)
    return np.divide(a, deg, out=np.zeros_like(a), where=deg > 0)


def all_shards(source, shape):
    """{(x, y, z): shard} for every rank of a grid x*y*z."""
    widths = [source.num_features] + [8] * (NUM_LAYERS - 1) + [source.num_classes]
    dims = dict(zip("xyz", shape))
    return dims, {c: source.shard(dims, dict(zip("xyz", c)), widths)
                  for c in itertools.product(*(range(s) for s in shape))}


def assemble(dims, shards, layer, field):
    """The full [N, N] matrix of ``layer`` from every rank's ``field`` (adj/root) blocks;
    replicas over I must agree, and every a_t must be its a's transpose."""
    o_ax, _, p_ax = layout.roles(layer)
    n = next(iter(shards.values())).num_nodes_padded
    nr, nc = n // dims[p_ax], n // dims[o_ax]
    full = np.zeros((n, n), dtype=np.float32)
    seen = {}
    for coords, sh in shards.items():
        c = dict(zip("xyz", coords))
        b = getattr(sh, field)[layer % 6]
        blk = b.a.to_scipy().toarray()
        assert blk.shape == (nr, nc)
        assert np.array_equal(b.a_t.to_scipy().toarray(), blk.T)
        assert b.nnz == np.count_nonzero(blk)
        key = (c[p_ax], c[o_ax])
        if key in seen:  # replicated over I
            assert np.array_equal(seen[key], blk)
        seen[key] = blk
        full[key[0] * nr:(key[0] + 1) * nr, key[1] * nc:(key[1] + 1) * nc] = blk
    return full


@pytest.mark.parametrize("permutation", ["double", "single", "none"])
@pytest.mark.parametrize("shape", GRIDS, ids=lambda s: "x".join(map(str, s)))
def test_blocks_reassemble_to_permuted_matrices(shape, permutation):
    graph = directed_graph()  # 203 nodes: pads on every grid but 1x1x1
    source = InMemorySource(graph, permutation=permutation, seed=4, aggregation="mean")
    dims, shards = all_shards(source, shape)
    sh0 = next(iter(shards.values()))
    n, n_pad = graph.num_nodes, sh0.num_nodes_padded
    assert n_pad == layout.padded_num_nodes(n, dims)
    a_mean = dense_mean(graph, n_pad)
    eye = np.diag((np.arange(n_pad) < n).astype(np.float64))
    for layer in range(NUM_LAYERS):
        ro, co = part.layer_orders(layer, sh0.pr, sh0.pc)
        got_a = assemble(dims, shards, layer, "adj")
        np.testing.assert_allclose(got_a, a_mean[ro][:, co], rtol=1e-6, atol=0)
        got_s = assemble(dims, shards, layer, "root")
        assert np.array_equal(got_s, eye[ro][:, co])
        o_ax, _, p_ax = layout.roles(layer)
        counts = [sh.root[layer].nnz for sh in shards.values()]
        bal = sh0.root[layer].balance
        assert bal.max_nnz == max(counts)
        assert bal.mean_nnz * dims[o_ax] * dims[p_ax] == pytest.approx(n)
        assert sh0.adj[layer].balance.mean_nnz * dims[o_ax] * dims[p_ax] == pytest.approx(
            np.count_nonzero(a_mean))


@pytest.mark.cross_shape
@pytest.mark.parametrize("permutation", ["double", "single"])
@pytest.mark.parametrize("shape", GRIDS, ids=lambda s: "x".join(map(str, s)))
def test_block_products_give_the_serial_sage_layer(shape, permutation):
    """Per layer: H = sum_o A(p, o) F(o, i), R = sum_o S(p, o) F(o, i) (the model's all-reduce
    over O) give y = x W1 + (A_mean x) W2 in the output order; the transposes give the
    backward products A^T dH and S^T dR in the input order.

    The float32 block sums (over a row's or a column's nonzeros, at most 17 and 14 here, in
    any grouping over the blocks) against the float64 dense products (numpy's BLAS, another
    kernel): within gamma(k + 1) |A| |x| elementwise (k terms, and A's values rounded to
    float32; x and dH are float32 already): at most 0.51 of the 1e-5 + 1e-5 |want| allowed,
    on every grid (y too, through |W2|), so the tolerances hold on any CPU."""
    graph = directed_graph()
    source = InMemorySource(graph, permutation=permutation, seed=2, aggregation="mean")
    dims, shards = all_shards(source, shape)
    sh0 = next(iter(shards.values()))
    n, n_pad, d = graph.num_nodes, sh0.num_nodes_padded, 6
    rng = np.random.default_rng(1)
    x = np.zeros((n_pad, d))
    x[:n] = rng.standard_normal((n, d)).astype(np.float32)  # exact in the float32 blocks
    w1, w2 = rng.standard_normal((d, 3)), rng.standard_normal((d, 3))
    a_mean = dense_mean(graph, n_pad)
    y_serial = x @ w1 + (a_mean @ x) @ w2
    grad = rng.standard_normal((n_pad, d)).astype(np.float32).astype(np.float64)  # dH = dR
    for layer in range(NUM_LAYERS):
        o_ax, i_ax, p_ax = layout.roles(layer)
        ro, co = part.layer_orders(layer, sh0.pr, sh0.pc)
        f = torch.from_numpy(x[co]).float()  # the layer's input, in its input order
        g = torch.from_numpy(grad).float()
        nr, nc = n_pad // dims[p_ax], n_pad // dims[o_ax]
        h, r = torch.zeros(n_pad, d), torch.zeros(n_pad, d)
        dfa, dfs = torch.zeros(n_pad, d), torch.zeros(n_pad, d)
        for coords, sh in shards.items():
            c = dict(zip("xyz", coords))
            if c[i_ax] != 0:
                continue  # replicas over I hold the same blocks; one computes each (p, o)
            rows = slice(c[p_ax] * nr, (c[p_ax] + 1) * nr)
            cols = slice(c[o_ax] * nc, (c[o_ax] + 1) * nc)
            h[rows] += sh.adj[layer].a.matmul(f[cols])
            r[rows] += sh.root[layer].a.matmul(f[cols])
            dfa[cols] += sh.adj[layer].a_t.matmul(g[rows])
            dfs[cols] += sh.root[layer].a_t.matmul(g[rows])
        # S, S^T: one 1.0 per real row: each output is a copy plus zeros, exact on any kernel
        np.testing.assert_allclose(r.numpy(), x[ro], rtol=0, atol=0)
        np.testing.assert_allclose(h.numpy(), (a_mean @ x)[ro], rtol=1e-5, atol=1e-5)
        y = r.double().numpy() @ w1 + h.double().numpy() @ w2
        np.testing.assert_allclose(y, y_serial[ro], rtol=1e-5, atol=1e-5)
        a_perm = a_mean[ro][:, co]
        np.testing.assert_allclose(dfa.numpy(), a_perm.T @ grad, rtol=1e-5, atol=1e-5)
        real_in = (co < n)[:, None]
        inv_ro = np.argsort(ro)
        np.testing.assert_allclose(dfs.numpy(), np.where(real_in, grad[inv_ro[co]], 0),
                                   rtol=0, atol=0)


@pytest.mark.cross_shape
def test_mean_adjacency_is_pyg_sageconv_mean():
    """Duplicates are separate messages, self-loop edges ordinary ones, no in-edges -> 0.

    PyG's layer (ATen's scatter and linear) against numpy's and torch's dense products, in
    float64: three sums in turn (a mean of <= 3 messages, 5-term dot products, the two terms
    and the bias) of magnitudes below 3 agree within order_bound(5, products=3, float64) * 3
    ~ 1e-14, far inside the 1e-6 allowed (the same maths, another order and kernel)."""
    from torch_geometric.nn import SAGEConv

    graph = sage_graph()
    a = part.mean_adjacency(graph.edge_index.numpy(), graph.num_nodes)
    assert a.dtype == np.float32 and a.has_sorted_indices
    dense = a.toarray()
    assert dense[2, 0] == np.float32(2 / 3) and dense[2, 1] == np.float32(1 / 3)
    assert dense[3, 3] == 1.0  # the self-loop edge is 3's only message
    assert not dense[4].any() and not dense[6].any()  # no in-neighbours
    np.testing.assert_array_equal(dense, dense_mean(graph, 7).astype(np.float32))

    torch.manual_seed(0)
    conv = SAGEConv(5, 4, aggr="mean").double()
    x = graph.x.double()
    want = conv(x, graph.edge_index).detach().numpy()
    w2, b2 = conv.lin_l.weight.detach().numpy(), conv.lin_l.bias.detach().numpy()
    w1 = conv.lin_r.weight.detach().numpy()  # the root weight (no bias)
    got = x.numpy() @ w1.T + (dense.astype(np.float64) @ x.numpy()) @ w2.T + b2
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)

    # the same layer from a 2x1x2 grid's blocks (layer 0: O = x, I = y, P = z)
    source = InMemorySource(graph, permutation="double", seed=3, aggregation="mean")
    _, shards = all_shards(source, (2, 1, 2))
    sh0 = next(iter(shards.values()))
    n_pad = sh0.num_nodes_padded
    ro, co = part.layer_orders(0, sh0.pr, sh0.pc)
    xp = torch.zeros(n_pad, 5, dtype=torch.float64)
    xp[:7] = x
    f = xp[torch.from_numpy(co)]
    h, r = torch.zeros(n_pad, 5, dtype=torch.float64), torch.zeros(n_pad, 5, dtype=torch.float64)
    nb = n_pad // 2
    for (cx, _, cz), sh in shards.items():
        rows, cols = slice(cz * nb, (cz + 1) * nb), slice(cx * nb, (cx + 1) * nb)
        h[rows] += torch.from_numpy(sh.adj[0].a.to_scipy().toarray()).double() @ f[cols]
        r[rows] += torch.from_numpy(sh.root[0].a.to_scipy().toarray()).double() @ f[cols]
    y = (r.numpy() @ w1.T + h.numpy() @ w2.T + b2)
    real = ro < 7
    np.testing.assert_allclose(y[real], want[ro[real]], rtol=1e-6, atol=1e-6)


def test_gcn_default_has_no_root_and_mean_nnz():
    graph = directed_graph()
    dims = {"x": 2, "y": 1, "z": 2}
    coords = {"x": 1, "y": 0, "z": 0}
    gcn = InMemorySource(graph)
    assert gcn.aggregation == "gcn"
    shard = gcn.shard(dims, coords, [9, 8, 6])
    assert shard.root is None
    mean = InMemorySource(graph, aggregation="mean")
    assert mean.nnz == graph.num_edges
    ms = mean.shard(dims, coords, [9, 8, 6])
    assert sorted(ms.root) == sorted(ms.adj) == [0, 1]
    assert ms.adjacency_bytes() > sum(b.a.nbytes + b.a_t.nbytes for b in ms.adj.values())
    # the features, labels and masks do not depend on the aggregation
    assert torch.equal(ms.features_block, shard.features_block)
    assert torch.equal(ms.labels, shard.labels)


def test_unknown_aggregation(tmp_path):
    with pytest.raises(ValueError, match="unknown aggregation 'max'"):
        InMemorySource(directed_graph(), aggregation="max")
    with pytest.raises(ValueError, match="unknown aggregation"):
        PreparedGraph(tmp_path, aggregation="sum")
    with pytest.raises(FileNotFoundError, match="not a prepared dataset"):  # mean is fine
        PreparedGraph(tmp_path, aggregation="mean")
