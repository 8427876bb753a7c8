"""plexus.model with the full recipe equals the dense serial model (plexus.reference) on every
grid.

Bias, dropout (grid-independent masks), batch and layer norm, feature normalisation, residual
connections, GCN and GraphSAGE: the loss, the logits of a training pass (the last layer on the
labelled rows) and of an eval-mode pass after it (every row), and the gradient of every
weight, root weight, bias and norm parameter match plain dense float64 autograd to 1e-5
(norm-wise relative), on lopsided grids and a node count that pads.
"""

import pytest
import torch

from plexus.dropout import dropout_mask
from plexus.layout import layer_widths, roles
from plexus.reference import SerialGCN
from tests.distributed import run_ranks
from tests.plexus.data.shards import model_source, small_graph
from tests.plexus.test_model import full_logits, rel

HIDDEN, SEED, STEP = 6, 5, 3

CASES = [  # (model, layers, dropout, norm, learn_features, normalize_features, bias, residual)
    ("gcn", 3, 0.5, "batch", False, True, True, True),
    ("sage", 4, 0.3, "layer", True, False, True, True),
    ("sage", 2, 0.5, "batch", False, False, True, False),
    ("sage", 3, 0.0, "none", True, False, False, False),  # bare: bytes == the perf model's
]


def serial_reference(graph, model, num_layers, dropout, norm, learn, normalize, bias,
                     residual):
    """The dense float64 model of plexus.reference with the recipe: loss, the logits of a
    training pass and of an eval-mode pass after it, and every gradient by name."""
    widths = layer_widths(graph.num_features, HIDDEN, num_layers, graph.num_classes)
    ref = SerialGCN(graph, widths, model=model, learn_features=learn, seed=SEED,
                    dropout=dropout, bias=bias, norm=norm, normalize_features=normalize,
                    residual=residual)
    return train_and_evaluate(ref, graph, STEP)


def train_and_evaluate(ref, graph, step):
    """A serial model's training pass at ``step`` (loss on the training nodes, backward), then
    an eval-mode pass: loss, both passes' logits and every gradient by name."""
    logits = ref(step=step)
    loss = torch.nn.functional.cross_entropy(logits[graph.train_idx], graph.y[graph.train_idx])
    loss.backward()
    ref.eval()
    with torch.no_grad():
        eval_logits = ref()
    grads = {name: t.grad for name, t in ref.named_tensors().items() if t.grad is not None}
    return {"loss": loss.item(), "logits": logits.detach(), "eval": eval_logits, "grads": grads}


def _parallel(ctx, grids, fused):
    from plexus import norms
    from tests.plexus.test_norms import counting_fused_calls

    # fused: the batch norm's numba kernels (plexus.norm_kernels) on these small blocks too
    norms.FUSED_MIN_ENTRIES = 0 if fused else 1 << 62
    with counting_fused_calls() as fused_calls:
        return _cases(ctx, grids, fused_calls)


def _cases(ctx, grids, fused_calls):
    from common.grid import ProcessGrid
    from plexus.model import PlexusGCN

    out = []
    for grid_text in grids:
        for case in CASES:
            model_kind, num_layers, dropout, norm, learn, normalize, bias, residual = case
            graph = small_graph()
            grid = ProcessGrid.parse(grid_text)
            groups = ctx.create_groups(grid)
            widths = layer_widths(graph.num_features, HIDDEN, num_layers, graph.num_classes)
            source = model_source(graph, model_kind)
            shard = source.shard(grid.shape, grid.coords(ctx.rank), widths)
            model = PlexusGCN(shard, groups, model=model_kind, learn_features=learn, seed=SEED,
                              dropout=dropout, bias=bias, norm=norm,
                              normalize_features=normalize, residual=residual,
                              labelled_rows_only=True)
            got = one_pass(model, shard, groups, graph.num_classes, num_layers)
            held = model.output_rows(torch.from_numpy(shard.out_rows)).numpy()
            out.append({**got, "case": (grid_text, *case), "shape": grid.shape, "rows": held,
                        "all_rows": shard.out_rows, "rows_last": got["logits"].shape[0],
                        "fused_calls": fused_calls[0]})
    return out


def one_pass(model, shard, groups, num_classes, num_layers):
    """A training pass of ``model`` at :data:`STEP` (forward, the sharded loss of the training
    split, backward), then an evaluation pass of every row; what the parallel-equals-serial
    checks read: the loss, both passes' logits (the training pass's of the rows it computes),
    every gathered gradient, the bytes of the model's collectives (their content: common.perf
    counts no padding) and this rank's first class column."""
    from common.comm_stats import CommStats
    from plexus.loss import sharded_cross_entropy

    o_ax, _, p_ax = roles(num_layers - 1)
    stats = CommStats()  # the model's collectives only (the loss gets none)
    model.train()
    logits = model(stats, step=STEP)
    loss = sharded_cross_entropy(logits, model.output_rows(shard.labels),
                                 model.output_rows(shard.masks["train"]),
                                 num_classes=num_classes, count=shard.split_counts["train"],
                                 group_o=groups[o_ax], group_p=groups[p_ax])
    loss.backward()
    model.eval()
    with torch.no_grad():
        eval_logits = model(all_rows=True)
    grads = {name: model.gather(kind, t.grad, layer)
             for name, t, kind, layer in model.sharded_state() if t.grad is not None}
    return {"loss": loss.item(), "logits": logits.detach(), "eval": eval_logits,
            "grads": grads, "class_offset": groups[o_ax].rank * logits.shape[1],
            "bytes": {k: v["bytes"] - v["padding"] for k, v in stats.as_dict().items()}}


def assert_loss_and_grads(per_rank, ref, tag):
    """Every rank's loss and gathered gradients equal the serial model's (``ref``) to 1e-5."""
    for r in per_rank:
        assert abs(r["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), tag
        assert sorted(r["grads"]) == sorted(ref["grads"]), tag
        for name, want in ref["grads"].items():
            got = r["grads"][name].double()
            # a bias before batch norm has a zero gradient: compare it absolutely
            assert rel(got, want) < 1e-5 or (got - want).norm() < 1e-6, \
                f"{tag}: grad of {name} differs ({rel(got, want)})"


def _assert_matches(results):
    graph = small_graph()
    for per_rank in zip(*results):
        grid_text, *case = per_rank[0]["case"]
        tag = f"grid {grid_text} case {case}"
        ref = serial_reference(graph, *case)
        assert_loss_and_grads(per_rank, ref, tag)
        if case == list(CASES[-1]):  # the bare SAGE model: bytes as common.perf predicts
            from common.perf.gcn import GCNWorkload, gcn_collectives
            from common.perf.model import bytes_by_axis

            shape = per_rank[0]["shape"]
            for r in per_rank:  # R labelled rows of this rank: a share R P / N of the nodes
                share = r["rows_last"] * shape[roles(case[1] - 1)[2]] / graph.num_nodes
                work = GCNWorkload(model="sage", num_nodes=graph.num_nodes, nnz=1,
                                   num_features=graph.num_features,
                                   num_classes=graph.num_classes, num_layers=case[1],
                                   hidden=HIDDEN, learn_features=True,
                                   labelled_fraction=share, labelled_rows_only=True)
                assert work.output_rows(shape) == r["rows_last"], tag
                want = {k: v for k, v in bytes_by_axis(gcn_collectives(work, shape, loss=False),
                                                       shape).items() if v}
                got = {}
                for key, b in r["bytes"].items():
                    got[key.split("/")[0]] = got.get(key.split("/")[0], 0) + b
                got = {k: v for k, v in got.items() if v}
                assert got == want, f"{tag}: bytes {got} != model {want}"
        labelled = graph.mask("train") | graph.mask("val") | graph.mask("test")
        got = full_logits(per_rank, "logits", "rows", ref["logits"], graph.num_classes)
        assert not torch.isnan(got[labelled]).any(), f"{tag}: logits not held by any rank"
        assert rel(got[labelled], ref["logits"][labelled]) < 1e-5, f"{tag}: logits differ"
        got = full_logits(per_rank, "eval", "all_rows", ref["eval"], graph.num_classes)
        assert not torch.isnan(got).any(), f"{tag}: eval logits not held by any rank"
        assert rel(got, ref["eval"]) < 1e-5, f"{tag}: eval logits differ"


def test_recipe_serial_reference_agrees_with_pyg_sage():
    """The dense SAGE reference is PyG's SAGEConv(aggr="mean") with the same weights."""
    from torch_geometric.nn import SAGEConv

    graph = small_graph()
    conv = SAGEConv(graph.num_features, 4, aggr="mean").double()
    ref = SerialGCN(graph, [graph.num_features, 4], model="sage", bias=True)
    with torch.no_grad():
        ref.weights[0].copy_(conv.lin_l.weight.T)
        ref.root_weights[0].copy_(conv.lin_r.weight.T)
        ref.biases[0].copy_(conv.lin_l.bias)
        want = conv(graph.x.double(), graph.edge_index)
        assert rel(ref(), want) < 1e-6  # A_mean is float32


def test_dropout_mask_is_grid_independent_and_has_the_rate():
    full = dropout_mask(0.3, seed=1, step=2, layer=1, rows=torch.arange(500),
                        cols=torch.arange(40))
    rows, cols = torch.randperm(500)[:77], torch.arange(11, 29)
    part = dropout_mask(0.3, seed=1, step=2, layer=1, rows=rows, cols=cols)
    assert torch.equal(full[rows][:, cols], part)
    assert abs(float((full > 0).float().mean()) - 0.7) < 0.02
    assert torch.allclose(full[full > 0], torch.tensor(1 / 0.7))
    other = dropout_mask(0.3, seed=1, step=3, layer=1, rows=torch.arange(500),
                         cols=torch.arange(40))
    assert not torch.equal(full, other)  # a new mask every step


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.97])
def test_the_numba_dropout_hash_draws_the_numpy_bits(p, monkeypatch):
    """Blocks of 2^16 entries or more hash in a numba kernel, smaller ones (and every block
    without numba) in numpy: a rank's mask must not depend on which ran."""
    pytest.importorskip("numba")
    from plexus import dropout, kernels

    rows = torch.cat([torch.arange(2000) * 7919, torch.tensor([2**32 + 5, 2**33 - 1])])
    cols = torch.arange(3, 70)  # 2002 x 67 entries: the kernel's
    fast = dropout.keep_mask(p, seed=4, step=9, layer=2, rows=rows, cols=cols)
    assert len(kernels.keep_mask.signatures) > 0
    monkeypatch.setattr(dropout, "numba_kernels", lambda: None)
    slow = dropout.keep_mask(p, seed=4, step=9, layer=2, rows=rows, cols=cols)
    assert torch.equal(fast, slow)
    assert abs(float(fast.float().mean()) - (1 - p)) < 0.01


def _torch_hash_bits(p, device, monkeypatch):
    """(keep_mask's bits from torch's int64 hash on ``device``, in chunks of 512 entries,
    numpy's bits) of a block whose node ids pass 2^32 and whose rows do not fill the last
    chunk."""
    from plexus import dropout

    rows = torch.cat([torch.arange(2000) * 7919, torch.tensor([2**32 + 5, 2**33 - 1])])
    cols = torch.arange(3, 70)
    monkeypatch.setattr(dropout, "TORCH_MASK_ENTRIES", 512)
    monkeypatch.setattr(dropout, "numba_kernels", lambda: None)
    want = dropout.keep_mask(p, seed=4, step=9, layer=2, rows=rows, cols=cols)
    k, threshold = dropout._mask_key(p, 4, 9, 2)
    got = dropout._keep_mask_torch(rows.to(device), cols.to(device), int(k), int(threshold))
    return got, want


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.97])
def test_the_torch_dropout_hash_draws_the_numpy_bits(p, monkeypatch):
    """A GPU draws its masks with torch's int64 operations (no [a, b] mask copied from the
    host): the same hash, exact without 64-bit overflow, bit for bit numpy's."""
    got, want = _torch_hash_bits(p, "cpu", monkeypatch)
    assert got.dtype == torch.bool and torch.equal(got, want)
    assert abs(float(got.float().mean()) - (1 - p)) < 0.01


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_dropout_mask_is_drawn_there_with_the_cpu_bits(monkeypatch):
    from plexus import dropout

    got, want = _torch_hash_bits(0.5, "cuda", monkeypatch)
    assert got.is_cuda and torch.equal(got.cpu(), want)
    rows, cols = torch.arange(300, device="cuda"), torch.arange(20, device="cuda")
    mask = dropout.keep_mask(0.3, seed=1, step=2, layer=1, rows=rows, cols=cols, device="cuda")
    assert mask.is_cuda and torch.equal(mask.cpu(), dropout.keep_mask(
        0.3, seed=1, step=2, layer=1, rows=rows.cpu(), cols=cols.cpu()))


@pytest.mark.cross_shape
@pytest.mark.parametrize("world, grids, fused", [
    (1, ["1x1x1"], False),
    (1, ["1x1x1"], True),
    # the batch norm as a large CPU block runs it: plexus.norm_kernels
    pytest.param(8, ["1x2x4", "4x1x2", "2x2x2"], True, marks=pytest.mark.slow),
])
def test_recipe_equals_serial(world, grids, fused):
    results = run_ranks(_parallel, world, grids, fused)
    # the batch-norm cases ran the kernels (or, unfused, not)
    assert all((r[-1]["fused_calls"] > 0) == fused for r in results)
    _assert_matches(results)
