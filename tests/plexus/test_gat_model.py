"""The 3D-parallel GAT (plexus.gat_model.PlexusGAT) equals the serial GAT
(plexus.gat_reference.SerialGAT, float64) of the same seed: logits of every node and the
gradients of every weight, attention vector and bias, with dropout on the inputs and on the
coefficients, on 1x1x1 and on 2x2x2, 1x2x4 and 4x1x2 (203 nodes: every grid pads; the double
permutation), for two and three layers; and one rank's logits are PyG's ``GATConv`` stack's."""

from __future__ import annotations

import pytest
import torch

from common.grid import ProcessGrid
from plexus import layout
from plexus.gat_reference import SerialGAT
from tests.distributed import run_ranks
from tests.plexus.data.shards import model_source, small_graph

HEADS, HIDDEN, SEED, STEP, RATE = 4, 8, 6, 3, 0.3
GRIDS = {1: ["1x1x1"], 8: ["2x2x2", "1x2x4", "4x1x2"]}


def _widths(graph, num_layers):
    return layout.layer_widths(graph.num_features, HIDDEN, num_layers, graph.num_classes)


def _proj(graph):
    gen = torch.Generator().manual_seed(21)
    return torch.randn(graph.num_nodes, graph.num_classes, generator=gen, dtype=torch.float64)


def _close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """float32 against float64: within 1e-4 relative, or 1e-6 of the largest entry."""
    top = ref.abs().max().item() if ref.numel() else 0.0
    return torch.allclose(got.double(), ref, rtol=1e-4, atol=1e-6 * max(1.0, top))


def _parallel(ctx, grids):
    from plexus.gat_model import PlexusGAT

    graph = small_graph()
    proj = _proj(graph)
    out = []
    for grid_text in grids:
        grid = ProcessGrid.parse(grid_text)
        groups = ctx.create_groups(grid)
        for num_layers in (2, 3):
            shard = model_source(graph, "gat").shard(grid.shape, grid.coords(ctx.rank),
                                                     _widths(graph, num_layers))
            net = PlexusGAT(shard, groups, heads=HEADS, seed=SEED, dropout=RATE,
                            attention_dropout=RATE)
            net.train()
            logits = net(step=STEP)
            o_ax = layout.roles(num_layers - 1)[0]
            cols = logits.shape[1]
            lo = groups[o_ax].rank * cols
            rows = torch.from_numpy(shard.out_rows.astype("int64"))
            real = rows >= 0
            want = torch.zeros_like(logits, dtype=torch.float64)
            keep = min(graph.num_classes, lo + cols) - lo
            if keep > 0:
                want[real, :keep] = proj[rows[real], lo:lo + keep]
            (logits.double() * want).sum().backward()
            out.append({"case": (grid_text, num_layers), "rows": rows, "lo": lo,
                        "logits": logits.detach().double(),
                        "grads": {name: p.grad.clone() for name, p in net.named_parameters()},
                        "coords": grid.coords(ctx.rank), "shapes": net.shapes})
    return out


def _check(results):
    graph = small_graph()
    proj = _proj(graph)
    n, classes = graph.num_nodes, graph.num_classes
    for cases in zip(*results, strict=True):
        grid_text, num_layers = cases[0]["case"]
        tag = f"{grid_text}, {num_layers} layers"
        serial = SerialGAT(graph, _widths(graph, num_layers), heads=HEADS, seed=SEED,
                           dropout=RATE, attention_dropout=RATE)
        serial.train()
        want = serial(step=STEP)
        (want * proj).sum().backward()
        got = torch.full((n, classes), float("nan"), dtype=torch.float64)
        for r in cases:
            real = r["rows"] >= 0
            keep = min(classes, r["lo"] + r["logits"].shape[1]) - r["lo"]
            if keep > 0:
                got[r["rows"][real], r["lo"]:r["lo"] + keep] = r["logits"][real, :keep]
        assert not torch.isnan(got).any(), f"{tag}: some logits were on no rank"
        scale = want.abs().max().item()
        assert (got - want.detach()).abs().max().item() <= 1e-5 * scale, f"{tag}: logits"
        grid = ProcessGrid.parse(grid_text)
        for layer in range(num_layers):
            o_ax, i_ax, p_ax = layout.roles(layer)
            heads_w = serial.weights[layer].grad.shape[1] // HEADS
            for r in cases:
                co = r["coords"]
                grads = r["grads"]
                # the rank's heads of the attention vectors (padded classes: zero columns)
                kc = HEADS // grid.shape[i_ax]
                for name, full in (("att_src", serial.att_src), ("att_dst", serial.att_dst)):
                    mine = grads[f"{name}.{layer}"]
                    ref = full[layer].grad[co[i_ax] * kc:(co[i_ax] + 1) * kc]
                    assert _close(mine[:, :heads_w], ref), f"{tag}: d{name} {layer} on {co}"
                    assert torch.all(mine[:, heads_w:] == 0)
                if len(serial.biases):
                    mine = grads[f"biases.{layer}"]
                    lo = co[o_ax] * mine.numel()
                    ref = serial.biases[layer].grad[lo:lo + mine.numel()]
                    assert _close(mine[:ref.numel()], ref), f"{tag}: db of layer {layer} on {co}"
                    assert torch.all(mine[ref.numel():] == 0), f"{tag}: db's padding"
            # W: the flat chunks over P of the rank's rows, the same on every rank of O
            for i in range(grid.shape[i_ax]):
                mine = [s for s in cases if s["coords"][i_ax] == i]
                for s in mine:  # the gradient is summed over O: every rank of O holds it
                    twin = next(t for t in mine if t["coords"][p_ax] == s["coords"][p_ax]
                                and t["coords"][o_ax] == 0)
                    assert torch.equal(s["grads"][f"weights.{layer}"],
                                       twin["grads"][f"weights.{layer}"]), tag
                ranks = sorted((s for s in mine if s["coords"][o_ax] == 0),
                               key=lambda s: s["coords"][p_ax])
                rows_w, cols_w = ranks[0]["shapes"][layer]
                flat_w = torch.cat([s["grads"][f"weights.{layer}"] for s in ranks])
                block = flat_w[:rows_w * cols_w].view(rows_w, HEADS, -1).double()
                ref = serial.weights[layer].grad.view(-1, HEADS, heads_w)[
                    i * rows_w:(i + 1) * rows_w]
                assert _close(block[:ref.shape[0], :, :heads_w], ref), \
                    f"{tag}: dW of layer {layer}, I rank {i}"
                assert torch.all(block[ref.shape[0]:] == 0) and torch.all(
                    block[:, :, heads_w:] == 0), f"{tag}: dW's padding"


@pytest.mark.cross_shape
@pytest.mark.parametrize("world", sorted(GRIDS))
def test_the_3d_gat_is_the_serial_gat(world):
    _check(run_ranks(_parallel, world, GRIDS[world]))


def _one_rank_logits(ctx, num_layers):
    from plexus.gat_model import PlexusGAT

    graph = small_graph()
    grid = ProcessGrid.parse("1x1x1")
    shard = model_source(graph, "gat").shard(grid.shape, grid.coords(ctx.rank),
                                             _widths(graph, num_layers))
    net = PlexusGAT(shard, ctx.create_groups(grid), heads=HEADS, seed=SEED)
    net.eval()
    logits = net().detach()
    out = torch.empty(graph.num_nodes, logits.shape[1])
    rows = torch.from_numpy(shard.out_rows.astype("int64"))
    out[rows[rows >= 0]] = logits[rows >= 0]
    return out[:, :graph.num_classes]


@pytest.mark.parametrize("num_layers", [2, 3])
def test_one_rank_is_pygs_gatconv_stack(num_layers):
    """One rank's logits are PyG's ``GATConv`` stack's with the same weights (float32, no
    dropout): the semantics are GATConv's, not similar ones."""
    pyg_nn = pytest.importorskip("torch_geometric.nn")
    from plexus.gat_reference import init_gat

    graph = small_graph()
    widths = _widths(graph, num_layers)
    ours = run_ranks(_one_rank_logits, 1, num_layers)[0]
    h = graph.x.float()
    for layer, p in enumerate(init_gat(widths, HEADS, SEED)):
        last = layer == num_layers - 1
        c = p["att_src"].shape[1]
        conv = pyg_nn.GATConv(widths[layer], c, heads=HEADS, concat=not last,
                              negative_slope=0.2, add_self_loops=True, bias=True)
        with torch.no_grad():
            conv.lin.weight.copy_(p["w"].t())
            conv.att_src.copy_(p["att_src"].view(1, HEADS, c))
            conv.att_dst.copy_(p["att_dst"].view(1, HEADS, c))
            conv.bias.zero_()
        h = conv(h, graph.edge_index)
        h = h if last else torch.relu(h)
    assert torch.allclose(ours, h.detach(), rtol=1e-5, atol=1e-5), (ours - h).abs().max()
