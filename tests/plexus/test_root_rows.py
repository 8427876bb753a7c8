"""GraphSAGE's root term by owner (plexus.root_rows) against the SpMM with ``S`` all-reduced
over O that it replaces.

On 2x2x2, 1x2x4, 4x1x2 and 3x1x2 (203 nodes: every grid pads), for every layer layout and for
the last layer's labelled rows:

- forward, ``R`` is bit for bit ``S F`` all-reduced over O, in float32 and with bf16 messages
  (a row's one nonzero term is its value; the bf16 message is that value rounded);
- backward, ``dF`` equals ``S^T`` of ``dR`` all-reduced over O: bit for bit with bf16 messages
  (both sum the ranks' messages in float32 in group order), to float rounding in float32 (the
  transport orders the sum of three or more ranks);
- the bytes each pass moves are those of its messages (``sent`` rows: the block's rows and
  each range's padding, :data:`plexus.root_rows.PIECES` ranges), no more than an all-reduce
  of the rows moves.
"""

import torch

from common import collectives as coll
from common.comm_stats import CommStats, ring_bytes
from common.grid import ProcessGrid
from plexus import layout
from plexus.layout import layer_widths
from plexus.root_rows import PIECES, ExchangedRows, RootExchange
from tests.distributed import run_ranks
from tests.plexus.data.shards import model_source, small_graph

WIDTH = 5
GRIDS = {8: ["2x2x2", "1x2x4", "4x1x2"], 6: ["3x1x2"]}


def _cases(ctx, grids):
    out = []
    graph = small_graph()
    widths = layer_widths(graph.num_features, WIDTH, 3, graph.num_classes)
    for grid_text in grids:
        grid = ProcessGrid.parse(grid_text)
        groups = ctx.create_groups(grid)
        coords = grid.coords(ctx.rank)
        shard = model_source(graph, "sage").shard(grid.shape, coords, widths)
        shard.restrict_last_layer(root=True)
        for layer in range(3):
            o_ax = layout.roles(layer)[0]
            blocks = [shard.root[layout.layout_of(layer)]]
            if layer == 2:
                blocks.append(shard.labelled_root)
            for blk in blocks:
                for wire in (None, torch.bfloat16):
                    out.append(_one(grid_text, layer, blk, groups[o_ax], coords[o_ax], wire))
    return out


def _one(grid_text, layer, blk, group, me, wire):
    group = group.on_wire(wire)
    n_in = blk.a.shape[1]
    gen = torch.Generator().manual_seed(17 + layer)
    f_all = torch.randn(n_in * group.size, WIDTH, generator=gen)
    f = f_all[me * n_in:(me + 1) * n_in].clone().requires_grad_(True)
    gen_r = torch.Generator().manual_seed(100 * layer + me)  # dR: partial, per rank of O
    dr = torch.randn(blk.a.shape[0], WIDTH, generator=gen_r)
    if wire is not None:
        dr = dr.to(wire)
    # the SpMM it replaces: S F (its messages in the wire's dtype) and S^T of the summed dR
    want = coll.all_reduce(blk.a.matmul(f.detach()), group)
    if wire is not None:
        want = want.to(wire)
    summed = coll.all_reduce(dr.float() if wire is None else dr, group)
    want_df = blk.a_t.matmul(summed.float())
    assert blk.me == me
    plan = RootExchange(blk, group.size)
    stats = CommStats()
    got = ExchangedRows.apply(f, plan, group, stats, wire or torch.float32)
    got.backward(dr)
    return {"tag": f"{grid_text} layer {layer} rows {plan.rows} wire {wire}",
            "size": group.size, "rows": plan.rows, "sent": plan.sent, "wire": wire,
            "r": (got.detach().float(), want.float()), "df": (f.grad, want_df),
            "bytes": sum(v["bytes"] for v in stats.as_dict().values()),
            "row_bytes": WIDTH * (2 if wire is not None else 4)}


def _check(results):
    for per_rank in results:
        for r in per_rank:
            tag = r["tag"]
            got, want = r["r"]
            assert torch.equal(got, want), f"{tag}: R differs from S F"
            got, want = r["df"]
            if r["wire"] is not None or r["size"] <= 2:
                assert torch.equal(got, want), f"{tag}: dF differs from S^T dR"
            else:
                assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), tag
            g = r["size"]
            assert r["rows"] <= r["sent"] <= r["rows"] + g * PIECES * 10, tag
            if g > 1:  # both passes: an all-gather and a reduce-scatter of the messages,
                # at most the all-reduce of the rows each
                moved = 2 * ring_bytes("all_gather", r["sent"] * r["row_bytes"], g)
                assert r["bytes"] == moved, f"{tag}: bytes {r['bytes']} != {moved}"
                assert moved <= 2 * ring_bytes("all_reduce", r["rows"] * r["row_bytes"], g), tag
            else:
                assert r["bytes"] == 0, tag


def test_root_rows_by_owner_equal_the_spmm_they_replace():
    for world, grids in GRIDS.items():
        _check(run_ranks(_cases, world, grids))
