"""Graph attention on the blocks of a P x O split (plexus.gat.BlockAttention) against the serial
GAT layer (plexus.gat_reference.SerialGAT.attend), in float64, with attention dropout.

On grids whose O (x) and P (z) split the 203 nodes with padding (2x1x2, 4x1x1, 1x1x4 and
3x1x2), every rank takes its block of the adjacency with self-loops, the rows of ``G`` for its
columns and the per-node terms ``t`` (its rows) and ``s`` (its columns):

- ``Q`` summed over O equals the serial layer's rows to float64 rounding (the softmax's
  maximum and sum all-reduced over O: a row's columns on several ranks give the serial
  coefficients), and the padding rows are zeros, not NaN;
- the gradients of ``f``, ``W``, ``att_src`` and ``att_dst`` summed over the ranks equal the
  serial ones (``dt`` partial over O, ``dG`` and ``ds`` partial over P, as documented);
- attention dropout drops the coefficients the serial model drops (keyed by edge and head).

And the whole layer on the 3D grid (plexus.gat.attention_layer: G1-G5, the heads over I, the
rows' term moved by owner) on 2x2x2, 1x2x4 and 4x1x2: every rank's ``Q``, its block of
``dF'`` and the weights' gradients summed over O and P are the serial layer's; and two layers
joined on GCN's rotation of roles (G7, then G6: plexus.gat.heads_to_columns) are the serial
two-layer model, logits and every gradient.
"""

from __future__ import annotations

import math

import pytest
import torch

from common import collectives as coll
from common.grid import ProcessGrid, round_up
from plexus.dropout import edge_keep_mask
from plexus.gat import block_attention
from plexus.gat_reference import SerialGAT, attention_mask
from tests.distributed import run_ranks
from tests.plexus.data.shards import small_graph

HEADS, WIDTH, SEED, STEP, RATE = 2, 3, 4, 2, 0.3
GRIDS = {4: ["2x1x2", "4x1x1", "1x1x4"], 6: ["3x1x2"]}


def _serial():
    """The serial layer 0 (training mode, attention dropout), its input and the loss's
    projection; ``(q, grads)`` of ``sum(q * proj)``."""
    graph = small_graph()
    model = SerialGAT(graph, [graph.num_features, HEADS * WIDTH, graph.num_classes],
                      heads=HEADS, attention_dropout=RATE, seed=SEED)
    model.train()
    gen = torch.Generator().manual_seed(9)
    f = torch.randn(graph.num_nodes, graph.num_features, generator=gen, dtype=torch.float64)
    proj = torch.randn(graph.num_nodes, HEADS * WIDTH, generator=gen, dtype=torch.float64)
    return graph, model, f, proj


def _block_edges(mask: torch.Tensor, n_pad: int, p: int, num_p: int, o: int, num_o: int):
    """(rows, cols) of block (p, o) of the adjacency with self-loops padded to ``n_pad``
    nodes (no permutation), in row order."""
    n = mask.shape[0]
    padded = torch.zeros(n_pad, n_pad, dtype=torch.bool)
    padded[:n, :n] = mask
    nr, nc = n_pad // num_p, n_pad // num_o
    return padded[p * nr:(p + 1) * nr, o * nc:(o + 1) * nc].nonzero(as_tuple=True)


def _identity_exchange(n: int, n_pad: int, p: int, num_p: int, o: int, num_o: int):
    """The root rows by owner (plexus.root_rows.RootExchange) of block (p, o) of the padded
    identity: a layer's rows and columns in one order."""
    from plexus.data.partition import Balance, permuted_identity_rows
    from plexus.data.shard import RootBlock
    from plexus.root_rows import RootExchange

    ident = torch.arange(n_pad).numpy()
    owners, mine, counts = permuted_identity_rows(ident, ident, n, p, num_p, o, num_o)
    root = RootBlock(owners, mine, o, n_pad // num_o,
                     Balance(int(counts.max()), float(counts.mean())))
    return RootExchange(root, num_o)


def _parallel(ctx, grids):
    graph, model, f, proj = _serial()
    n = graph.num_nodes
    mask = attention_mask(graph)
    out = []
    for grid_text in grids:
        grid = ProcessGrid.parse(grid_text)
        groups = ctx.create_groups(grid)
        coords = grid.coords(ctx.rank)
        num_o, num_p, o, p = grid.shape["x"], grid.shape["z"], coords["x"], coords["z"]
        n_pad = round_up(n, math.lcm(num_o, num_p))
        nr, nc = n_pad // num_p, n_pad // num_o
        rows, cols = _block_edges(mask, n_pad, p, num_p, o, num_o)
        leaves = {name: t.detach().clone().requires_grad_(True) for name, t in (
            ("f", f), ("w", model.weights[0]), ("att_src", model.att_src[0]),
            ("att_dst", model.att_dst[0]))}
        f_pad = torch.cat([leaves["f"], leaves["f"].new_zeros(n_pad - n, f.shape[1])])
        g = (f_pad @ leaves["w"]).view(n_pad, HEADS, WIDTH)
        g_cols = g[o * nc:(o + 1) * nc]
        s = torch.einsum("jkc,kc->jk", g_cols, leaves["att_src"])
        t = torch.einsum("ikc,kc->ik", g[p * nr:(p + 1) * nr], leaves["att_dst"])
        keep = edge_keep_mask(RATE, seed=SEED, step=STEP, layer=0, dst=rows + p * nr,
                              src=cols + o * nc, heads=HEADS).to(torch.float64) / (1 - RATE)
        q = block_attention(g_cols, t, s, (rows, cols), groups["x"], keep=keep)
        proj_pad = torch.cat([proj, proj.new_zeros(n_pad - n, proj.shape[1])])
        (q.reshape(nr, -1) * proj_pad[p * nr:(p + 1) * nr]).sum().backward()
        whole = coll.all_reduce(q.detach().reshape(nr, -1), groups["x"])
        out.append({"grid": grid_text, "rows": (p * nr, (p + 1) * nr), "q": whole,
                    "grads": {name: leaf.grad for name, leaf in leaves.items()}})
    return out


def _check(results):
    graph, model, f, proj = _serial()
    f = f.clone().requires_grad_(True)
    q = model.attend(0, f, STEP)
    (q * proj).sum().backward()
    want = {"f": f.grad, "w": model.weights[0].grad, "att_src": model.att_src[0].grad,
            "att_dst": model.att_dst[0].grad}
    n = graph.num_nodes
    for cases in zip(*results, strict=True):
        tag = cases[0]["grid"]
        for r in cases:
            lo, hi = r["rows"]
            got = r["q"]
            assert torch.isfinite(got).all(), f"{tag}: NaN or inf in Q"
            real = min(hi, n) - lo
            if real > 0:
                assert torch.allclose(got[:real], q[lo:lo + real].detach(), rtol=1e-10,
                                      atol=1e-12), f"{tag}: Q rows {lo}..{hi}"
            assert torch.all(got[max(real, 0):] == 0), f"{tag}: padding rows are not zero"
        for name, grad in want.items():
            summed = sum(r["grads"][name] for r in cases)
            assert torch.allclose(summed, grad, rtol=1e-10, atol=1e-12), \
                f"{tag}: d{name} differs by {(summed - grad).abs().max():.3g}"


@pytest.mark.cross_shape
@pytest.mark.parametrize("world", sorted(GRIDS))
def test_block_attention_is_the_serial_layer(world):
    _check(run_ranks(_parallel, world, GRIDS[world]))


def test_a_row_without_edges_and_bad_shapes():
    """One rank: a row with no nonzero gives zeros and zero gradients; shapes that do not fit
    are refused by name."""
    from common.grid import AxisGroup

    group = AxisGroup("x", None, 1, 0)
    rows, cols = torch.tensor([0, 0, 2]), torch.tensor([0, 1, 1])
    g = torch.randn(2, 1, 3, dtype=torch.float64, requires_grad=True)
    t = torch.randn(3, 1, dtype=torch.float64, requires_grad=True)
    s = torch.randn(2, 1, dtype=torch.float64, requires_grad=True)
    q = block_attention(g, t, s, (rows, cols), group)
    assert torch.all(q[1] == 0) and torch.isfinite(q).all()
    assert torch.allclose(q[2], g[1].detach())  # one edge: alpha = 1
    q.sum().backward()
    assert t.grad[1].item() == 0 and torch.isfinite(g.grad).all()
    with pytest.raises(ValueError, match="do not fit"):
        block_attention(g, t[:, :0], s, (rows, cols), group)
    with pytest.raises(ValueError, match=r"keep .* is not \[nnz, K'\]"):
        block_attention(g, t, s, (rows, cols), group, keep=torch.ones(2, 1))


# (O, I, P) = (x, y, z): layer 0's roles; the heads split over I
LAYER_GRIDS = {8: ["2x2x2", "1x2x4", "4x1x2"]}


def _layer(ctx, grids):
    """plexus.gat.attention_layer on each grid: every rank's ``Q`` (rows p, heads i) and the
    gradients of its leaves (its block of ``f``, its rows of ``W``, its heads of the
    attention vectors)."""
    from plexus import layout
    from plexus.gat import attention_layer

    graph, model, f, proj = _serial()
    n, d = f.shape
    mask = attention_mask(graph)
    out = []
    for grid_text in grids:
        grid = ProcessGrid.parse(grid_text)
        groups = ctx.create_groups(grid)
        coords = grid.coords(ctx.rank)
        roles = layout.roles(0)
        (num_o, num_i, num_p), (o, i, p) = ((grid.shape[a] for a in roles),
                                            (coords[a] for a in roles))
        n_pad, d_pad = round_up(n, num_o * num_p), round_up(d, num_i)
        nr, nc, dc, kc = n_pad // num_p, n_pad // num_o, d_pad // num_i, HEADS // num_i
        rows, cols = _block_edges(mask, n_pad, p, num_p, o, num_o)
        f_pad = torch.zeros(n_pad, d_pad, dtype=torch.float64)
        f_pad[:n, :d] = f
        w_pad = torch.zeros(d_pad, HEADS * WIDTH, dtype=torch.float64)
        w_pad[:d] = model.weights[0].detach()
        leaves = {"f": f_pad[o * nc:(o + 1) * nc, i * dc:(i + 1) * dc],
                  "w": w_pad[i * dc:(i + 1) * dc],
                  "att_src": model.att_src[0].detach()[i * kc:(i + 1) * kc],
                  "att_dst": model.att_dst[0].detach()[i * kc:(i + 1) * kc]}
        leaves = {k: v.clone().requires_grad_(True) for k, v in leaves.items()}
        keep = edge_keep_mask(RATE, seed=SEED, step=STEP, layer=0, dst=rows + p * nr,
                              src=cols + o * nc, heads=HEADS)[:, i * kc:(i + 1) * kc]
        q = attention_layer(leaves["f"], leaves["w"], leaves["att_src"], leaves["att_dst"],
                            (rows, cols), _identity_exchange(n, n_pad, p, num_p, o, num_o),
                            groups, roles,
                            keep=keep.to(torch.float64) / (1 - RATE))
        proj_pad = torch.zeros(n_pad, HEADS, WIDTH, dtype=torch.float64)
        proj_pad[:n] = proj.view(n, HEADS, WIDTH)
        (q * proj_pad[p * nr:(p + 1) * nr, i * kc:(i + 1) * kc]).sum().backward()
        out.append({"grid": grid_text, "o": o, "i": i, "p": p, "q": q.detach(),
                    "sizes": (nr, nc, dc, kc),
                    "grads": {k: v.grad for k, v in leaves.items()}})
    return out


@pytest.mark.cross_shape
@pytest.mark.parametrize("world", sorted(LAYER_GRIDS))
def test_the_layer_on_the_grid_is_the_serial_layer(world):
    """``Q`` (rows p, heads i) of every rank, its block of ``dF'`` whole (gathered over P),
    and ``dW``, ``datt_src``, ``datt_dst`` summed over the ranks of O and P that hold the same
    rows and heads: the serial layer's, in float64, with attention dropout."""
    results = run_ranks(_layer, world, LAYER_GRIDS[world])
    graph, model, f, proj = _serial()
    f = f.clone().requires_grad_(True)
    q = model.attend(0, f, STEP).view(graph.num_nodes, HEADS, WIDTH)
    (q * proj.view(graph.num_nodes, HEADS, WIDTH)).sum().backward()
    n, d = f.shape
    for cases in zip(*results, strict=True):
        tag = cases[0]["grid"]
        nr, nc, dc, kc = cases[0]["sizes"]
        sums: dict = {}
        for r in cases:
            o, i, p = r["o"], r["i"], r["p"]
            want_q = torch.zeros(nr, kc, WIDTH, dtype=torch.float64)
            real = max(0, min(n - p * nr, nr))
            want_q[:real] = q.detach()[p * nr:p * nr + real, i * kc:(i + 1) * kc]
            assert torch.allclose(r["q"], want_q, rtol=1e-10, atol=1e-12), f"{tag}: Q"
            want_f = torch.zeros(nc, dc, dtype=torch.float64)
            rows_f, cols_f = max(0, min(n - o * nc, nc)), max(0, min(d - i * dc, dc))
            want_f[:rows_f, :cols_f] = f.grad[o * nc:o * nc + rows_f, i * dc:i * dc + cols_f]
            assert torch.allclose(r["grads"]["f"], want_f, rtol=1e-10, atol=1e-12), \
                f"{tag}: dF' of rank (o, i, p) = {(o, i, p)}"
            for name in ("w", "att_src", "att_dst"):
                sums[name, i] = sums.get((name, i), 0) + r["grads"][name]
        for (name, i), got in sums.items():
            full = {"w": model.weights[0].grad, "att_src": model.att_src[0].grad,
                    "att_dst": model.att_dst[0].grad}[name]
            lo, hi = (i * dc, (i + 1) * dc) if name == "w" else (i * kc, (i + 1) * kc)
            want = torch.zeros_like(got)
            want[:max(0, min(hi, full.shape[0]) - lo)] = full[lo:hi]
            assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), \
                f"{tag}: d{name} of I rank {i} differs by {(got - want).abs().max():.3g}"


MODEL_HEADS, MODEL_WIDTH = 4, 2  # hidden 8: the heads split over I = 1, 2 or 4


def _model(ctx, grids):
    """Two GAT layers on GCN's rotation of roles (layer 0 (x, y, z), layer 1 (z, x, y)):
    attention_layer, heads_to_columns (G7), ReLU, attention_layer (whose ``dF'`` is whole: not
    summed over its P again), heads_to_columns (G6). Every rank's logits and its leaves'
    gradients."""
    from plexus import layout
    from plexus.gat import attention_layer, heads_to_columns

    graph, model, f, proj = _serial_model()
    n, d = f.shape
    heads = MODEL_HEADS
    mask = attention_mask(graph)
    out = []
    for grid_text in grids:
        grid = ProcessGrid.parse(grid_text)
        groups = ctx.create_groups(grid)
        coords = grid.coords(ctx.rank)
        n_pad = round_up(n, math.prod(grid.shape.values()))
        widths = [round_up(d, grid.shape[layout.roles(0)[1]]), heads * MODEL_WIDTH,
                  round_up(graph.num_classes, grid.shape[layout.roles(1)[0]])]
        leaves, pieces = {}, {}
        for layer in range(2):
            roles = layout.roles(layer)
            (num_o, num_i, num_p), (o, i, p) = ((grid.shape[a] for a in roles),
                                                (coords[a] for a in roles))
            nr, nc = n_pad // num_p, n_pad // num_o
            dc, kc = widths[layer] // num_i, heads // num_i
            c = MODEL_WIDTH if layer == 0 else widths[2]
            w = torch.zeros(widths[layer], heads, c, dtype=torch.float64)
            true_c = MODEL_WIDTH if layer == 0 else graph.num_classes
            w[:model.weights[layer].shape[0], :, :true_c] = model.weights[layer].detach().view(
                -1, heads, true_c)
            att = {}
            for name, full in (("att_src", model.att_src[layer]),
                               ("att_dst", model.att_dst[layer])):
                att[name] = torch.zeros(heads, c, dtype=torch.float64)
                att[name][:, :true_c] = full.detach()
            leaves[f"w{layer}"] = w.view(widths[layer], -1)[i * dc:(i + 1) * dc]
            for name in att:
                leaves[f"{name}{layer}"] = att[name][i * kc:(i + 1) * kc]
            rows, cols = _block_edges(mask, n_pad, p, num_p, o, num_o)
            keep = edge_keep_mask(RATE, seed=SEED, step=STEP, layer=layer, dst=rows + p * nr,
                                  src=cols + o * nc, heads=heads)[:, i * kc:(i + 1) * kc]
            pieces[layer] = (roles, (rows, cols), _identity_exchange(n, n_pad, p, num_p, o, num_o),
                             keep.to(torch.float64) / (1 - RATE))
        roles0 = layout.roles(0)
        o0, i0 = coords[roles0[0]], coords[roles0[1]]
        nc0, dc0 = n_pad // grid.shape[roles0[0]], widths[0] // grid.shape[roles0[1]]
        f_pad = torch.zeros(n_pad, widths[0], dtype=torch.float64)
        f_pad[:n, :d] = f
        leaves["f"] = f_pad[o0 * nc0:(o0 + 1) * nc0, i0 * dc0:(i0 + 1) * dc0]
        leaves = {k: v.clone().requires_grad_(True) for k, v in leaves.items()}
        x = leaves["f"]
        for layer in range(2):
            roles, pattern, exchange, keep = pieces[layer]
            q = attention_layer(x, leaves[f"w{layer}"], leaves[f"att_src{layer}"],
                                leaves[f"att_dst{layer}"], pattern, exchange, groups, roles,
                                keep=keep)
            x = heads_to_columns(q, groups, roles, last=layer == 1)
            x = torch.relu(x) if layer == 0 else x
        roles1 = layout.roles(1)
        o1, p1 = coords[roles1[0]], coords[roles1[2]]
        nr1, cc1 = n_pad // grid.shape[roles1[2]], widths[2] // grid.shape[roles1[0]]
        proj_pad = torch.zeros(n_pad, widths[2], dtype=torch.float64)
        proj_pad[:n, :graph.num_classes] = proj
        (x * proj_pad[p1 * nr1:(p1 + 1) * nr1, o1 * cc1:(o1 + 1) * cc1]).sum().backward()
        out.append({"grid": grid_text, "coords": coords, "shape": grid.shape,
                    "n_pad": n_pad, "widths": widths, "logits": x.detach(),
                    "grads": {k: v.grad for k, v in leaves.items()}})
    return out


def _serial_model():
    graph = small_graph()
    model = SerialGAT(graph, [graph.num_features, MODEL_HEADS * MODEL_WIDTH, graph.num_classes],
                      heads=MODEL_HEADS, attention_dropout=RATE, seed=SEED, bias=False)
    model.train()
    gen = torch.Generator().manual_seed(11)
    f = torch.randn(graph.num_nodes, graph.num_features, generator=gen, dtype=torch.float64)
    proj = torch.randn(graph.num_nodes, graph.num_classes, generator=gen, dtype=torch.float64)
    return graph, model, f, proj


def _serial_forward(model, f):
    """SerialGAT's forward on the input ``f`` (no input dropout): its layers' attention, the
    ReLU between them."""
    x = f
    for layer in range(model.num_layers):
        x = model.attend(layer, x, STEP)
        x = torch.relu(x) if layer < model.num_layers - 1 else x
    return x


@pytest.mark.cross_shape
@pytest.mark.parametrize("world", sorted(LAYER_GRIDS))
def test_two_layers_on_gcns_rotation_are_the_serial_model(world):
    """Two layers joined by G7 (a hidden layer's heads to the next input's layout) and ended
    by G6 (the mean over heads): the logits of every rank and every gradient are the serial
    model's (float64, attention dropout in both layers)."""
    from plexus import layout

    results = run_ranks(_model, world, LAYER_GRIDS[world])
    graph, model, f, proj = _serial_model()
    f = f.clone().requires_grad_(True)
    logits = _serial_forward(model, f)
    (logits * proj).sum().backward()
    n, d, classes = graph.num_nodes, graph.num_features, graph.num_classes
    for cases in zip(*results, strict=True):
        tag = cases[0]["grid"]
        sums: dict = {}
        for r in cases:
            shape, coords, n_pad, widths = r["shape"], r["coords"], r["n_pad"], r["widths"]
            o1, _, p1 = (coords[a] for a in layout.roles(1))
            nr1, cc1 = n_pad // shape[layout.roles(1)[2]], widths[2] // shape[layout.roles(1)[0]]
            want = torch.zeros(n_pad, widths[2], dtype=torch.float64)
            want[:n, :classes] = logits.detach()
            assert torch.allclose(r["logits"], want[p1 * nr1:(p1 + 1) * nr1,
                                                    o1 * cc1:(o1 + 1) * cc1],
                                  rtol=1e-10, atol=1e-12), f"{tag}: logits of {coords}"
            o0, i0, _ = (coords[a] for a in layout.roles(0))
            nc0, dc0 = n_pad // shape[layout.roles(0)[0]], widths[0] // shape[layout.roles(0)[1]]
            want_f = torch.zeros(n_pad, widths[0], dtype=torch.float64)
            want_f[:n, :d] = f.grad
            assert torch.allclose(r["grads"]["f"], want_f[o0 * nc0:(o0 + 1) * nc0,
                                                          i0 * dc0:(i0 + 1) * dc0],
                                  rtol=1e-10, atol=1e-12), f"{tag}: dF of {coords}"
            for layer in range(2):
                i = coords[layout.roles(layer)[1]]
                for name in ("w", "att_src", "att_dst"):
                    key = (f"{name}{layer}", i)
                    sums[key] = sums.get(key, 0) + r["grads"][f"{name}{layer}"]
        for (name, i), got in sums.items():
            layer, kind = int(name[-1]), name[:-1]
            full = {"w": model.weights, "att_src": model.att_src,
                    "att_dst": model.att_dst}[kind][layer].grad
            c = MODEL_WIDTH if layer == 0 else cases[0]["widths"][2]
            true_c = MODEL_WIDTH if layer == 0 else classes
            if kind == "w":
                padded = torch.zeros(cases[0]["widths"][layer], MODEL_HEADS, c,
                                     dtype=torch.float64)
                padded[:full.shape[0], :, :true_c] = full.view(full.shape[0], MODEL_HEADS,
                                                               true_c)
                rows = got.shape[0]
                want = padded.view(padded.shape[0], -1)[i * rows:(i + 1) * rows]
            else:
                padded = torch.zeros(MODEL_HEADS, c, dtype=torch.float64)
                padded[:, :true_c] = full
                want = padded[i * got.shape[0]:(i + 1) * got.shape[0]]
            assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), \
                f"{tag}: d{name} of I rank {i} differs by {(got - want).abs().max():.3g}"


def test_the_kernels_and_the_passes_over_edges_in_chunks_agree(monkeypatch):
    """A block's aggregation, its transpose and the scores' gradient by the numba kernels
    (plexus.gat_kernels, where numba is installed), and by torch a few edges at a time
    (plexus.gat.EDGE_CHUNK), agree to float64 rounding."""
    from common.grid import AxisGroup
    from plexus import gat

    group = AxisGroup("x", None, 1, 0)
    gen = torch.Generator().manual_seed(2)
    dense = torch.rand(30, 20, generator=gen) < 0.3
    rows, cols = dense.nonzero(as_tuple=True)
    keep = (torch.rand(rows.numel(), 3, generator=gen) < 0.7).double() / 0.7

    def run():
        draw = torch.Generator().manual_seed(3)
        g, t, s = (torch.randn(*shape, generator=draw, dtype=torch.float64).requires_grad_(True)
                   for shape in ((20, 3, 4), (30, 3), (20, 3)))
        q = gat.block_attention(g, t, s, (rows, cols), group, keep=keep)
        (q * torch.linspace(-1, 1, q.numel(), dtype=torch.float64).view_as(q)).sum().backward()
        return q.detach(), g.grad, t.grad, s.grad

    whole = run()
    monkeypatch.setattr(gat, "EDGE_CHUNK", 7)
    monkeypatch.setattr(gat, "_kernels", lambda *ts: None)
    for a, b in zip(run(), whole, strict=True):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)
