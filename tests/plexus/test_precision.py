"""bf16 storage in plexus (``PlexusGCN(precision="bf16")``, ``plexus.train --precision bf16``;
docs/design/plexus-3d.md section 11).

- The SpMM of a bf16 X is bit for bit the float32 SpMM of ``X.float()`` on every kernel
  (cache-blocked with any slice width and feature tiles, row kernel, torch), across blocks of
  a block row, with int32 and int64 indices, and range by range (the overlapped backward).
- :class:`plexus.ops.StoredIn` keeps a saved float32 activation in bf16, once, and leaves
  parameters, columns and constants alone.
- In bf16 on the CPU the first layer's SpMM gathers the bf16 features, later layers their
  float32 ``F'`` (a GPU rounds those to bf16 as it reads them), and backward's ``A^T dH``
  reads float32 gradients.
- One rank, bf16 against fp32 (GCN with the cached ``H_0``; GraphSAGE with batch norm,
  residual and dropout; GCN with layer norm): the loss within 2e-3 relative (8e-4 seen), the
  logits within 1e-2 norm-wise (2.6e-3 seen), every weight gradient within 0.05 (2.4e-2 seen:
  a ReLU mask flips where Q is within a bf16 rounding of 0); the feature shard, the cached
  ``H_0`` and every ``H_l`` kept for ``dW`` are bf16 (half the bytes), weights and gradients
  float32.
- Eight ranks, bf16 parallel against bf16 serial on 1x2x4, 4x1x2 and 2x2x2 (203 nodes: every
  grid pads), unblocked GCN and overlapped GraphSAGE with batch norm, residual and dropout:
  every message of the model's collectives travels in bf16 (common.collectives' wire) where
  the serial run moves none, so the logits, the loss (relative) and the gradients differ by at
  most ``u_bf16`` times the roundings on their path (``wire_roundings``; docs/design/
  plexus-3d.md section 11). The bytes each rank moves equal common.perf.gcn's with
  ``precision="bf16"`` (half of float32's for (2)-(8)), and the planner's feature, kept-H and
  cached-H_0 bytes equal the model's tensors, in bf16 and in fp32.
- The command line trains with ``--precision bf16``; a bad value and bf16 with trainable
  features are refused with a clear message.
- GPU (``pytest -m gpu``, skipped without CUDA): torch's SpMM of a bf16 X on CUDA is bit for bit
  that of its float32 values, and one CUDA rank in bf16 follows the CPU's bf16 run (GCN, and
  GraphSAGE with batch norm and residual) to 1e-2 relative in every epoch's loss.
"""

import itertools

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from common.comm_stats import CommStats
from common.grid import AxisGroup, ProcessGrid
from common.perf import gcn as perf
from plexus import ops
from plexus.config import ModelConfig
from plexus.data.memory import InMemorySource
from plexus.layout import layer_widths, roles
from plexus.loss import sharded_cross_entropy
from plexus.model import PlexusGCN
from plexus.sparse import BlockSparse, CSRBlock
from plexus.transpose import TransposedSparse
from tests.distributed import run_module, run_ranks
from tests.plexus.data.shards import model_source, small_graph
from tests.plexus.test_model import full_logits, rel
from tests.rounding import unit_roundoff

BF16 = torch.bfloat16
HIDDEN = 6
# (model, layers, dropout, norm, residual, bias, labelled_rows_only, overlap)
CASES = [("gcn", 3, 0.0, "none", False, False, False, False),  # bare: the planner's model
         ("sage", 4, 0.5, "batch", True, True, True, True)]


# ------------------------------------------------------------------ the SpMM
def _blocks(seed: int) -> BlockSparse:
    """A 2 x 2 grid of blocks (one empty, one with int64 indices), 300 x 250."""
    rng = np.random.default_rng(seed)
    parts = [[sp.random(r, c, density=0.06, format="csr", dtype=np.float32, random_state=rng)
              for c in (110, 140)] for r in (180, 120)]
    blocks = [[CSRBlock.from_scipy(m) for m in row] for row in parts]
    b = blocks[1][0]
    blocks[1][0] = CSRBlock(b.indptr.astype(np.int64), b.indices.astype(np.int64), b.values,
                            b.shape)
    blocks[0][1] = None
    return BlockSparse(blocks, [180, 120], [110, 140])


@pytest.mark.parametrize("kernel", ["numba", "numba-rows", "torch"])
def test_bf16_spmm_is_the_float32_spmm_of_its_values(kernel, threads):
    if kernel != "torch":
        pytest.importorskip("numba")
    a = _blocks(0).to("cpu", kernel=kernel)
    x = torch.randn(250, 24, generator=torch.Generator().manual_seed(1)).to(BF16)
    wide = x.float()
    got, want = a.matmul(x), a.matmul(wide)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    if kernel == "numba":
        for width in (1, 7, 64, 250):
            assert torch.equal(a.matmul(x, slice_cols=width), a.matmul(wide, slice_cols=width))
        assert torch.equal(a.matmul(x, feature_tile=8), a.matmul(wide, feature_tile=8))
    bounds = (0, 60, 130, 250)  # the ranges of the overlapped backward, added in order
    outs = [torch.zeros(300, 24) for _ in range(2)]
    for lo, hi in itertools.pairwise(bounds):
        a.matmul(x, out=outs[0], cols=(lo, hi, bounds))
        a.matmul(wide, out=outs[1], cols=(lo, hi, bounds))
    assert torch.equal(outs[0], outs[1])
    if kernel != "torch":  # the numba ranges add each row's terms in column order
        assert torch.equal(outs[0], want)
    with pytest.raises(ValueError, match="float32"):
        a.matmul(x, out=torch.empty(300, 24, dtype=BF16))


def test_stored_in_keeps_float32_activations_in_bf16_once():
    hooks = ops.StoredIn(BF16)
    d = torch.randn(5, 4, requires_grad=True) * 1.0  # an activation (needs a gradient)
    first, second = hooks.pack_hook(d), hooks.pack_hook(d)
    assert first.t is second.t and first.t.dtype == BF16  # d * d keeps one copy
    assert torch.equal(hooks.unpack_hook(first), d.detach().to(BF16).float())
    for t in (torch.nn.Parameter(torch.randn(5, 4)), torch.randn(5, 4),
              torch.randn(5, 1, requires_grad=True) * 1.0):  # a weight, a constant, a column
        assert hooks.pack_hook(t) is t
    x = torch.randn(6, 3, requires_grad=True)
    with ops.StoredIn(BF16):
        y = x * 2.0
        (y * y).sum().backward()
    assert torch.allclose(x.grad, 8 * x.detach(), rtol=1e-2)  # 2 * (2x) * 2, from bf16 y



@pytest.mark.parametrize("numel", [7, (1 << 18) * 3 + 5])  # one block, and several
def test_rounded_in_blocks_has_the_bits_of_a_whole_rounding(numel):
    from plexus import bf16

    x = torch.randn(numel) * 1e3
    x[:4] = torch.tensor([float("nan"), float("inf"), 3.3895e38, -1.0e-40])  # to inf, subnormal
    x = x.reshape(-1, 1)
    want = x.clone().copy_(x.to(BF16))
    got = bf16.round_(x.clone(), BF16)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    leaf = x.clone().requires_grad_()
    src = leaf * 1.0  # not fresh for the in-place form: the copy leaves it as it is
    before = src.detach().clone()
    copied = ops.Rounded.apply(src, BF16, True)
    assert torch.equal(copied.view(torch.int32), want.view(torch.int32))
    assert torch.equal(src.detach().view(torch.int32), before.view(torch.int32))
    assert copied.data_ptr() != src.data_ptr()
    copied.sum().backward()
    assert torch.equal(leaf.grad, torch.ones_like(x))  # the straight-through gradient


# ------------------------------------------------------------------ the model
def _one_rank_groups() -> dict[str, AxisGroup]:
    return {a: AxisGroup(a, None, 1, 0) for a in "xyz"}


def _kept_h(logits: torch.Tensor) -> list[torch.Tensor]:
    """The H (and R) every GatheredMatmul of the graph behind ``logits`` keeps for dW."""
    seen, stack, kept = set(), [logits.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "GatheredMatmulBackward":
            kept.append(node.saved_tensors[0])
        stack.extend(n for n, _ in node.next_functions)
    return kept


def _passes(shard, groups, case, precision, stats_first=None):
    """Two training passes of ``case`` (the first caches H_0 where it can); the loss,
    logits, gradients and the H kept by the second, before its backward."""
    kind, num_layers, dropout, norm, residual, bias, rows_only, overlap = case
    model = PlexusGCN(shard, groups, model=kind, seed=5, dropout=dropout, norm=norm,
                      residual=residual, bias=bias, labelled_rows_only=rows_only,
                      overlap=overlap, precision=precision)
    o_ax, _, p_ax = roles(num_layers - 1)
    out = {}
    for step, stats in ((1, stats_first), (2, None)):
        model.zero_grad(set_to_none=True)
        logits = model(stats, step=step)
        if step == 2:
            out["kept_h"] = [(t.dtype, t.nbytes, t.data_ptr()) for t in _kept_h(logits)]
        loss = sharded_cross_entropy(logits, model.output_rows(shard.labels),
                                     model.output_rows(shard.masks["train"]),
                                     num_classes=shard.num_classes,
                                     count=shard.split_counts["train"],
                                     group_o=groups[o_ax], group_p=groups[p_ax])
        loss.backward()
    held = model.output_rows(torch.from_numpy(shard.out_rows)).numpy()
    out.update(
        loss=loss.item(), logits=logits.detach().float(), rows=held,
        class_offset=groups[o_ax].rank * logits.shape[1],
        grads={name: model.gather(k, t.grad, layer).float()
               for name, t, k, layer in model.sharded_state() if t.grad is not None},
        grad_dtypes={t.grad.dtype for t in model.parameters() if t.grad is not None},
        features=(model.features.dtype, model.features.nbytes),
        h0=None if model._h0 is None else [(t.dtype, t.nbytes, t.data_ptr())
                                           for t in model._h0 if t is not None])
    return out


def _shard(graph, case, shape, coords):
    kind, num_layers = case[0], case[1]
    widths = layer_widths(graph.num_features, HIDDEN, num_layers, graph.num_classes)
    source = model_source(graph, kind)
    return source.shard(shape, coords, widths)


ONE_RANK = [CASES[0], CASES[1], ("gcn", 3, 0.3, "layer", True, True, False, False)]


@pytest.mark.parametrize("case", ONE_RANK, ids=["gcn-cached", "sage-batch", "gcn-layer"])
def test_bf16_tracks_fp32_and_stores_bf16_on_one_rank(case, threads):
    graph = small_graph()
    one = {"x": 1, "y": 1, "z": 1}
    runs = {p: _passes(_shard(graph, case, one, {"x": 0, "y": 0, "z": 0}), _one_rank_groups(),
                       case, p) for p in ("fp32", "bf16")}
    f32, b16 = runs["fp32"], runs["bf16"]
    assert abs(b16["loss"] - f32["loss"]) <= 2e-3 * abs(f32["loss"])
    assert rel(b16["logits"], f32["logits"]) < 1e-2
    for name, want in f32["grads"].items():
        got = b16["grads"][name]
        assert rel(got, want) < 0.05 or (got - want).norm() < 1e-6, name
    assert b16["grad_dtypes"] == f32["grad_dtypes"] == {torch.float32}
    assert f32["features"] == (torch.float32, 2 * b16["features"][1])
    assert b16["features"][0] == BF16
    assert {d for d, _, _ in f32["kept_h"]} == {torch.float32}
    assert {d for d, _, _ in b16["kept_h"]} == {BF16}
    assert [2 * b for _, b, _ in b16["kept_h"]] == [b for _, b, _ in f32["kept_h"]]
    if case[2] == 0:  # no dropout: H_0 cached, in bf16
        assert [d for d, _, _ in b16["h0"]] == [BF16]
        assert [d for d, _, _ in f32["h0"]] == [torch.float32]
        assert 2 * b16["h0"][0][1] == f32["h0"][0][1]


@pytest.mark.parametrize("case", [("gcn", 3, 0.5, "none", False, False, False, False),
                                  ("sage", 3, 0.5, "batch", False, True, False, True)],
                         ids=["gcn-dropout", "sage-overlap"])
def test_on_the_cpu_later_layers_aggregate_float32_and_backward_stays_float32(case,
                                                                             monkeypatch):
    """In bf16 on the CPU the first layer's SpMM gathers the bf16 features and the later
    layers' their float32 ``F'`` (a GPU reads those in bf16 too: tests/plexus/test_gpu.py),
    and every SpMM of backward reads a float32 gradient."""
    graph = small_graph()
    shard = _shard(graph, case, {"x": 1, "y": 1, "z": 1}, {"x": 0, "y": 0, "z": 0})
    kind, _, dropout, norm, residual, bias, rows_only, overlap = case
    groups = _one_rank_groups()
    model = PlexusGCN(shard, groups, model=kind, seed=5, dropout=dropout, norm=norm,
                      residual=residual, bias=bias, labelled_rows_only=rows_only,
                      overlap=overlap, precision="bf16")
    read = []
    for cls, which in ((BlockSparse, "A"), (TransposedSparse, "A^T")):
        monkeypatch.setattr(cls, "matmul", lambda self, x, real=cls.matmul, which=which, **kw:
                            read.append((which, x.dtype)) or real(self, x, **kw))
    for step in (1, 2):  # the second reads the cached or remade first layer
        model.zero_grad(set_to_none=True)
        read.clear()
        logits = model(step=step)
        forward = list(read)
        read.clear()
        sharded_cross_entropy(logits, model.output_rows(shard.labels),
                              model.output_rows(shard.masks["train"]),
                              num_classes=shard.num_classes,
                              count=shard.split_counts["train"], group_o=groups["x"],
                              group_p=groups["x"]).backward()
        assert set(forward) == {("A", BF16), ("A", torch.float32)}, (step, forward)
        # backward: A^T dH on float32 gradients (and layer 0's aggregation remade, in bf16)
        assert ("A^T", torch.float32) in read, (step, read)
        assert set(read) <= {("A^T", torch.float32), ("A", BF16)}, (step, read)
    assert {t.grad.dtype for t in model.parameters() if t.grad is not None} == {torch.float32}


def _parallel(ctx, grids):
    out = []
    graph = small_graph()
    for grid_text in grids:
        grid = ProcessGrid.parse(grid_text)
        groups = ctx.create_groups(grid)
        coords = grid.coords(ctx.rank)
        for case in CASES:
            stats = CommStats()
            run = _passes(_shard(graph, case, grid.shape, coords), groups, case, "bf16", stats)
            run["bytes"] = {a: r.bytes - r.padding for a, r in stats.by_axis().items()}
            if case == CASES[0]:
                run["fp32"] = _passes(_shard(graph, case, grid.shape, coords), groups, case,
                                      "fp32")
            out.append({"case": (grid_text, case), "shape": grid.shape, **run})
    return out


GRIDS = ["1x2x4", "4x1x2", "2x2x2"]
U_BF16 = unit_roundoff(BF16)


def wire_roundings(shape: dict, num_layers: int) -> tuple[int, int]:
    """(forward, backward): how many bf16 roundings of the wire (common.collectives) lie on
    the path of a logit and of a weight gradient, which bound the parallel run's normwise
    distance from the serial one (which moves nothing) at that many ``u`` to first order
    (docs/design/plexus-3d.md section 11): a sum over a group rounds twice (each rank's
    message, then the result), a gather once; (2) and (7) over O, (3), (5), (6) and (8)
    over P, (4) over I."""
    fwd = back = 0
    for layer in range(num_layers):
        o, i, p = (shape[a] > 1 for a in roles(layer))
        fwd += 2 * o + p + 2 * i
        back += 2 * o + 3 * p  # (7); (8), (5) and (6)
    return fwd, back


@pytest.mark.slow
def test_bf16_parallel_equals_bf16_serial_and_the_planner():
    graph = small_graph()
    results = run_ranks(_parallel, 8, GRIDS)
    serial = {case: _passes(_shard(graph, case, {"x": 1, "y": 1, "z": 1},
                                   {"x": 0, "y": 0, "z": 0}), _one_rank_groups(), case, "bf16")
              for case in CASES}
    for per_rank in zip(*results):
        grid_text, case = per_rank[0]["case"]
        tag, ref = f"grid {grid_text} case {case}", serial[case]
        logits = full_logits(per_rank, "logits", "rows", torch.zeros(graph.num_nodes,
                                                                     graph.num_classes,
                                                                     dtype=torch.float64),
                             graph.num_classes)
        want = full_logits([ref], "logits", "rows", logits, graph.num_classes)
        held = ~torch.isnan(want[:, 0])
        assert torch.equal(held, ~torch.isnan(logits[:, 0])), tag
        fwd, back = wire_roundings(per_rank[0]["shape"], case[1])
        assert rel(logits[held], want[held]) < fwd * U_BF16, tag
        for r in per_rank:
            assert abs(r["loss"] - ref["loss"]) <= fwd * U_BF16 * abs(ref["loss"]), tag
            for name, g in ref["grads"].items():
                err = rel(r["grads"][name], g)
                # a bias before batch norm has a zero gradient in exact arithmetic: its
                # rounding noise is checked in absolute terms
                assert err < (fwd + back) * U_BF16 or (r["grads"][name] - g).norm() < 1e-6, \
                    f"{tag}: grad of {name} ({err})"
        if case != CASES[0]:
            continue
        shape = per_rank[0]["shape"]
        for r in per_rank:
            for precision, run in (("bf16", r), ("fp32", r["fp32"])):
                work = perf.GCNWorkload(num_nodes=graph.num_nodes, nnz=1,
                                        num_features=graph.num_features,
                                        num_classes=graph.num_classes, num_layers=case[1],
                                        hidden=HIDDEN, labelled_rows_only=False,
                                        precision=precision)
                parts = perf.gcn_memory_parts(work, shape)
                assert run["features"][1] == parts["features"], (tag, precision)
                kept = {ptr: b for _, b, ptr in run["kept_h"]}  # distinct storages
                assert sum(kept.values()) == parts["kept_h"], (tag, precision)
                # the cached H_0 is the H_0 kept for dW (one storage), counted once
                assert {ptr for _, _, ptr in run["h0"]} <= kept.keys(), (tag, precision)
            from common.perf.model import bytes_by_axis

            planned = bytes_by_axis(perf.gcn_collectives(work_bf16(graph, case), shape,
                                                         first_epoch=True, loss=False), shape)
            assert r["bytes"] == {a: b for a, b in planned.items() if b}, tag


def work_bf16(graph, case):
    return perf.GCNWorkload(num_nodes=graph.num_nodes, nnz=1, num_features=graph.num_features,
                            num_classes=graph.num_classes, num_layers=case[1], hidden=HIDDEN,
                            labelled_rows_only=False, precision="bf16")


def test_bf16_planner_memory_and_bytes_are_smaller():
    """bf16 shrinks the feature shard, the kept H (the cached H_0 among them) and every
    message of the model's collectives (1)-(8), and nothing else; fp32 is the default."""
    work = perf.ogbn_products()
    bf16 = perf.ogbn_products(precision="bf16")
    s = {"x": 2, "y": 2, "z": 2}
    f32, b16 = perf.gcn_memory_parts(work, s), perf.gcn_memory_parts(bf16, s)
    assert work.precision == "fp32" and perf.gcn_memory(bf16, s) < perf.gcn_memory(work, s)
    for part in ("features", "kept_h"):
        assert b16[part] == f32[part] / 2, part
    for part in ("adjacency", "weights"):
        assert b16[part] == f32[part], part
    for first_epoch in (True, False):  # every message of (1)-(8) in bf16; the loss's fp32
        f, b = (perf.gcn_collectives(w, s, first_epoch=first_epoch) for w in (work, bf16))
        assert len(f) == len(b)
        assert [c.full_bytes for c in b[:-2]] == [c.full_bytes // 2 for c in f[:-2]]
        assert b[-2:] == f[-2:]
    with pytest.raises(ValueError, match="precision"):
        perf.ogbn_products(precision="fp16")
    with pytest.raises(ValueError, match="bf16"):
        perf.ogbn_products(precision="bf16", learn_features=True)


# ------------------------------------------------------------------ config and CLI
def test_bad_precision_is_refused_clearly(capsys):
    with pytest.raises(ValueError, match="unknown precision 'fp16'; choose from"):
        ModelConfig(precision="fp16")
    with pytest.raises(ValueError, match="learn_features"):
        ModelConfig(precision="bf16", learn_features=True)
    shard = _shard(small_graph(), CASES[0], {"x": 1, "y": 1, "z": 1}, {"x": 0, "y": 0, "z": 0})
    with pytest.raises(ValueError, match="cannot train them"):
        PlexusGCN(shard, _one_rank_groups(), learn_features=True, precision="bf16")
    from plexus.train import parse_args

    assert parse_args([]).precision == "fp32"
    with pytest.raises(SystemExit) as stop:
        parse_args(["--precision", "half"])
    assert stop.value.code == 2
    assert "--precision: invalid choice: 'half' (choose from fp32, bf16)" in \
        capsys.readouterr().err.replace("'fp32', 'bf16'", "fp32, bf16")


def test_cli_trains_in_bf16():
    r = run_module("plexus.train", ["--dataset", "rmat-10", "--hidden", "8", "--epochs", "2",
                                    "--log-every", "1", "--precision", "bf16"], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "precision bf16" in r.stdout and "epoch    2/2" in r.stdout


# ------------------------------------------------------------------ GPU
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_cuda_spmm_of_bf16_is_the_float32_spmm_of_its_values():
    a = _blocks(0).to("cuda")
    x = torch.randn(250, 24, device="cuda").to(BF16)
    got = a.matmul(x)
    assert got.dtype == torch.float32 and got.device.type == "cuda"
    assert torch.equal(got, a.matmul(x.float()))


def _cuda_losses(device, **options):
    from plexus.config import aggregation_of, split_config
    from plexus.data.generators import planted_partition
    from plexus.trainer import train_gcn

    graph = planted_partition(num_nodes=301, seed=4)
    cfg = {"num_layers": 3, "hidden": 16, "epochs": 5, "precision": "bf16", **options}
    source = InMemorySource(graph, aggregation=aggregation_of(cfg.get("model", "gcn")))
    res = train_gcn(source, ProcessGrid.plexus(1, 1, 1), 0, device=device,
                    **split_config(**cfg))
    assert res.model.features.dtype == BF16 and res.model.features.device.type == device
    return [r["loss"] for r in res.history]


@pytest.mark.cross_shape
@pytest.mark.parametrize("options", [{}, {"model": "sage", "norm": "batch", "residual": True,
                                          "num_layers": 4}], ids=["gcn", "sage-batch-residual"])
@pytest.mark.gpu
@needs_cuda
def test_one_cuda_rank_in_bf16_follows_the_cpu_run(options):
    cpu, cuda = _cuda_losses("cpu", **options), _cuda_losses("cuda", **options)
    assert len(cuda) == 5 and all(abs(a - b) <= 1e-2 * abs(a) for a, b in zip(cpu, cuda)), \
        (cpu, cuda)
