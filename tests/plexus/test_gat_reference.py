"""The serial GAT (plexus.gat_reference.SerialGAT) is PyG's ``GATConv`` stack:

- with the same weights, no dropout, its logits equal a stack of ``GATConv`` layers (heads
  concatenated, then averaged in the last, bias, ReLU between) to float64 rounding, on a graph
  with isolated nodes and self-loops of its own (replaced by one, as ``GATConv`` does), and
  its gradients those of the stack;
- the coefficients sum to 1 over each node's in-neighbours and itself, and are 0 elsewhere,
  with no NaN where a node has only itself;
- the attention dropout masks depend only on (edge, head, seed, step, layer): the same edges
  in another order get the same mask, and the drop rate is near ``p``;
- bad widths and rates are refused by name.
"""

import itertools

import pytest
import torch

from plexus.data.graph import Graph
from plexus.dropout import edge_keep_mask
from plexus.gat_reference import SerialGAT, attention_mask

pyg_nn = pytest.importorskip("torch_geometric.nn")


def _graph(num_nodes=40, num_edges=150, features=6, classes=3, seed=0) -> Graph:
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, num_nodes - 3, (num_edges,), generator=gen)  # 3 isolated nodes
    dst = torch.randint(0, num_nodes - 3, (num_edges,), generator=gen)
    pairs = torch.unique(torch.stack([src, dst]), dim=1)  # a set of edges, some self-loops
    x = torch.randn(num_nodes, features, generator=gen)
    y = torch.randint(0, classes, (num_nodes,), generator=gen)
    idx = torch.arange(num_nodes)
    return Graph(edge_index=pairs, x=x, y=y, num_classes=classes, train_idx=idx[:20],
                 val_idx=idx[20:30], test_idx=idx[30:])


def _pyg_stack(model: SerialGAT, widths: list[int], heads: int) -> torch.nn.ModuleList:
    convs = torch.nn.ModuleList()
    last = len(widths) - 2
    for layer, (d_in, d_out) in enumerate(itertools.pairwise(widths)):
        c = d_out if layer == last else d_out // heads
        conv = pyg_nn.GATConv(d_in, c, heads=heads, concat=layer != last, negative_slope=0.2,
                              add_self_loops=True, bias=True).double()
        with torch.no_grad():
            conv.lin.weight.copy_(model.weights[layer].detach().t())
            conv.att_src.copy_(model.att_src[layer].detach().view(1, heads, c))
            conv.att_dst.copy_(model.att_dst[layer].detach().view(1, heads, c))
            conv.bias.copy_(torch.linspace(-0.5, 0.5, d_out, dtype=torch.float64))
            model.biases[layer].copy_(conv.bias)
        convs.append(conv)
    return convs


@pytest.mark.parametrize("heads, widths", [(1, [6, 8, 3]), (4, [6, 8, 8, 3])])
def test_serial_gat_is_pygs_gatconv_stack(heads, widths):
    graph = _graph()
    model = SerialGAT(graph, widths, heads=heads, seed=3)
    convs = _pyg_stack(model, widths, heads)
    x = graph.x.double()
    h = x
    for layer, conv in enumerate(convs):
        h = conv(h, graph.edge_index)
        if layer < len(convs) - 1:
            h = torch.relu(h)
    ours = model()
    assert ours.shape == (graph.num_nodes, widths[-1])
    assert torch.allclose(ours, h, rtol=1e-12, atol=1e-12), (ours - h).abs().max()
    ours.square().sum().backward()
    h.square().sum().backward()
    for layer, conv in enumerate(convs):
        c = conv.att_src.shape[-1]
        pairs = [(model.weights[layer].grad, conv.lin.weight.grad.t()),
                 (model.att_src[layer].grad, conv.att_src.grad.view(heads, c)),
                 (model.att_dst[layer].grad, conv.att_dst.grad.view(heads, c)),
                 (model.biases[layer].grad, conv.bias.grad)]
        for ours_g, theirs in pairs:
            assert torch.allclose(ours_g, theirs, rtol=1e-10, atol=1e-12), layer


def test_coefficients_are_a_softmax_over_in_neighbours_and_self():
    graph = _graph()
    model = SerialGAT(graph, [6, 8, 3], heads=2, seed=1)
    alpha = model.coefficients(0, model.features)
    mask = attention_mask(graph)
    assert not torch.isnan(alpha).any()
    assert torch.equal(alpha > 0, mask[:, :, None].expand_as(alpha))
    assert torch.allclose(alpha.sum(1), torch.ones(graph.num_nodes, 2, dtype=torch.float64))
    isolated = graph.num_nodes - 1  # only itself
    assert torch.all(alpha[isolated, isolated] == 1)


def test_attention_dropout_masks_are_keyed_by_edge_and_head():
    gen = torch.Generator().manual_seed(0)
    dst = torch.randint(0, 10_000, (50_000,), generator=gen)
    src = torch.randint(0, 10_000, (50_000,), generator=gen)
    keep = edge_keep_mask(0.3, seed=5, step=2, layer=1, dst=dst, src=src, heads=4)
    assert keep.shape == (50_000, 4)
    assert abs(1 - keep.float().mean().item() - 0.3) < 0.01
    order = torch.randperm(50_000, generator=gen)
    again = edge_keep_mask(0.3, seed=5, step=2, layer=1, dst=dst[order], src=src[order],
                           heads=4)
    assert torch.equal(again, keep[order])
    part = edge_keep_mask(0.3, seed=5, step=2, layer=1, dst=dst, src=src, heads=4, of=range(1, 3))
    assert torch.equal(part, keep[:, 1:3])  # a rank's heads: their columns of the whole
    other = edge_keep_mask(0.3, seed=5, step=3, layer=1, dst=dst, src=src, heads=4)
    assert not torch.equal(other, keep)


def test_training_mode_drops_coefficients_and_inputs_reproducibly():
    graph = _graph()
    model = SerialGAT(graph, [6, 8, 3], heads=2, seed=1, dropout=0.5, attention_dropout=0.5)
    model.train()
    a, b = model(step=4), model(step=4)
    assert torch.equal(a, b)
    assert not torch.equal(a, model(step=5))
    model.eval()
    assert not torch.equal(a, model(step=4))


def test_bad_recipes_are_refused_by_name():
    graph = _graph()
    with pytest.raises(ValueError, match="multiple of heads=3"):
        SerialGAT(graph, [6, 8, 3], heads=3)
    with pytest.raises(ValueError, match="attention_dropout"):
        SerialGAT(graph, [6, 8, 3], heads=2, attention_dropout=1.0)
