"""The 4D-parallel GPT equals the single-process GPT: loss and every gradient, many grids;
training on 8 ranks tracks training on 1; a checkpoint taken on 8 ranks continues on 1.

Grids are ``data x depth x row x col``; sizes are chosen so that the vocabulary (61, prime),
d_ff (45) and the flat depth shards need padding, and in one case d_model (30) on col. All
8-rank checks share ONE launch (starting 8 ranks on 2 cores costs tens of seconds); the 1-rank
runs need no process group and run in this process. Pure slicing is tested without
torch.distributed.
"""

import dataclasses
import itertools

import pytest
import torch

from common import collectives as C
from common.comm_stats import CommStats
from common.grid import AXONN_AXES, ProcessGrid
from llm.goldfish import goldfish_loss, goldfish_mask
from llm.loss import goldfish_sums
from llm.model import GPT, GPTConfig
from llm.parallel import (
    ParallelGPT,
    batch_shard,
    check_grid,
    make_groups,
    param_specs,
    shard_tensor,
)
from llm.tp import Overlap
from tests.distributed import run_ranks

BASE = GPTConfig(vocab_size=61, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=45,
                 max_seq_len=16)
ODD_D = {"d_model": 30, "n_head": 3, "n_kv_head": 1}  # d_model 30: padded on col = 4
SEED = 3


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny GEMMs gain nothing from threads; 2 threads on 2 busy cores slow steps tenfold."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_batch(num_rows=5, seq=16, micro=1):
    """``micro`` global micro-batches (5 rows: padded on every data x depth > 1), some
    ignored targets, and goldfish masks (hash, small h so that some targets drop)."""
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(micro):
        x = torch.randint(BASE.vocab_size, (num_rows, seq), generator=g)
        y = torch.randint(BASE.vocab_size, (num_rows, seq), generator=g)
        y[torch.rand(num_rows, seq, generator=g) < 0.1] = -100
        out.append((x, y, goldfish_mask(y, k=3, h=2)))
    return out


def serial(config, micro):
    torch.manual_seed(SEED)
    model = GPT(config)
    batches = make_batch(micro=micro)
    total = sum(int(((y != -100) & ~m).sum()) for _, y, m in batches)
    loss = 0.0
    for x, y, m in batches:  # the mean over the kept tokens of all micro-batches
        out = goldfish_loss(model(x), y, m)
        part = out.loss * out.num_kept / total
        part.backward()
        loss += part.item()
    return loss, {n: p.grad for n, p in model.named_parameters()}


def _parallel(ctx, cases):
    results = []
    for grid_text, changes, overlap, micro in cases:
        config = dataclasses.replace(BASE, **changes)
        grid = ProcessGrid.parse(grid_text, AXONN_AXES)
        groups = make_groups(grid, ctx.rank)
        torch.manual_seed(SEED)
        stats = CommStats()
        model = ParallelGPT(GPT(config), groups, overlap=Overlap.parse(overlap), stats=stats)
        batches = make_batch(micro=micro)
        total = sum(int(((y != -100) & ~m).sum()) for _, y, m in batches)
        kept_sum = torch.zeros(())
        for x, y, m in batches:
            logits = model(batch_shard(x, groups, 0))
            out = goldfish_sums(logits, batch_shard(y, groups, -100), batch_shard(m, groups, True),
                                num_kept=total, vocab_size=config.vocab_size, row=groups["row"],
                                stats=stats)
            out.loss.backward()
            model.finish_backward()
            kept_sum += out.kept_sum
        model.sync_gradients()
        loss = C.all_reduce(kept_sum, groups["data+depth"]) / total
        results.append({"case": (grid_text, tuple(changes.items()), overlap, micro),
                        "loss": loss.item(), "grads": model.full_state_dict(grads=True),
                        "axes": {k: v.bytes for k, v in stats.by_axis().items()}})
    return results


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


CASES = {
    4: [("1x1x2x2", {}, "all", 1), ("1x2x2x1", {}, "all", 1), ("1x2x2x1", {}, "none", 1),
        ("2x1x1x2", {}, "all", 2), ("1x1x1x4", ODD_D, "all", 1), ("4x1x1x1", {}, "all", 1)],
    8: [("2x2x2x1", {}, "all", 1), ("1x2x2x2", {}, "all", 2), ("1x2x2x2", {}, "none", 2),
        ("1x1x4x2", {"n_kv_head": 4}, "oar,oag", 1), ("1x2x1x4", ODD_D, "ors", 1)],
}


TRAIN_GRIDS = ("1x2x2x2",)  # depth, row and col; data > 1 is covered by the gradient cases
TRAIN_STEPS = 20


def make_trainer(groups, steps=TRAIN_STEPS, overlap="all"):
    """A 2-layer d_model-32 GPT on 16-byte windows, goldfish on, gradient accumulation 2."""
    from llm.trainer import DataConfig, GoldfishConfig, OptimConfig, TrainConfig, Trainer

    config = GPTConfig(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=48,
                       max_seq_len=16)
    return Trainer(config, DataConfig(seq_len=16, batch_size=6, eval_batches=1),
                   OptimConfig(lr=1e-2, warmup_steps=3), GoldfishConfig(k=4, h=3),
                   TrainConfig(steps=steps, grad_accum=2, overlap=overlap), groups, seed=5)


def one_rank_groups():
    return make_groups(ProcessGrid.axonn(1, 1, 1, 1), 0)  # no process group needed


def _linear_volumes(ctx, grid_text, overlap):
    """A normal Linear (14 -> 10) then a transposed one (10 -> 14), forward and backward:
    the (axis, op) -> (calls, bytes sent per rank) of this rank's collectives."""
    from llm.tp import DepthGrads, DepthWeights, ParallelLinear

    groups = make_groups(ProcessGrid.parse(grid_text, AXONN_AXES), ctx.rank)
    stats, ov = CommStats(), Overlap.parse(overlap)
    weights = DepthWeights(groups["depth"], prefetch=ov.oag, stats=stats)
    grads = DepthGrads(groups["depth"], defer=ov.ors, stats=stats)
    r, c, z = (groups[a].size for a in ("row", "col", "depth"))
    layers = [ParallelLinear(torch.randn(-(-(10 // r) * (14 // c) // z)), (10 // r, 14 // c),
                             transposed=False, groups=groups, weights=weights, grads=grads,
                             overlap=ov, stats=stats),
              ParallelLinear(torch.randn(-(-(14 // c) * (10 // r) // z)), (14 // c, 10 // r),
                             transposed=True, groups=groups, weights=weights, grads=grads,
                             overlap=ov, stats=stats)]
    weights.begin_forward()
    x = torch.randn(3, 2, 14 // c, requires_grad=True)  # [b, T, in/C]
    layers[1](layers[0](x)).sum().backward()
    grads.finish()
    assert all(layer.weight.grad is not None for layer in layers)
    return {k: (v.calls, v.bytes) for k, v in stats.records.items()}


def expected_linear_volumes(depth, row, col):
    """Section 2 of the spec, float32, b * T = 6 rows, padded flat shards."""
    shard = -(-(10 // row) * (14 // col) // depth)  # both blocks hold 10/R x 14/C entries
    gather = (depth - 1) * shard * 4  # ring all-gather of Z shards: (Z-1)/Z of Z*shard*4
    narrow, wide = 6 * (10 // row) * 4, 6 * (14 // col) * 4  # [6, 10/R] and [6, 14/C]
    out = {}
    if depth > 1:
        out[("depth", "all_gather")] = (4, 4 * gather)  # 2 Linears x (forward + backward)
        out[("depth", "reduce_scatter")] = (2, 2 * gather)
    if col > 1:  # normal forward y [6, 10/R], transposed backward dX [6, 10/R]
        out[("col", "all_reduce")] = (2, 2 * 2 * (col - 1) * narrow // col)
    if row > 1:  # normal backward dX [6, 14/C], transposed forward y [6, 14/C]
        out[("row", "all_reduce")] = (2, 2 * 2 * (row - 1) * wide // row)
    return out


VOLUME_CASES = [("1x2x2x2", "all"), ("1x2x2x2", "none"), ("2x4x1x1", "all"),
                ("1x1x2x4", "all")]


def _eight_ranks(ctx):
    out = {"parallel": _parallel(ctx, CASES[8]), "train": {},
           "volumes": [_linear_volumes(ctx, g, o) for g, o in VOLUME_CASES]}
    for grid_text in TRAIN_GRIDS:
        trainer = make_trainer(make_groups(ProcessGrid.parse(grid_text, AXONN_AXES), ctx.rank))
        history = []
        for _ in range(TRAIN_STEPS):
            history.append(trainer.train_step())
            if trainer.step == TRAIN_STEPS // 2 and grid_text == TRAIN_GRIDS[0]:
                state = trainer.state_dict()  # collective; full tensors on every rank
                out["state"] = state if ctx.rank == 0 else None
        history[-1].update(trainer.evaluate())
        out["train"][grid_text] = history
    return out


@pytest.fixture(scope="module")
def eight_ranks():
    return run_ranks(_eight_ranks, 8, timeout=600)


@pytest.mark.slow
def test_parallel_equals_serial_4_ranks():
    check_cases(run_ranks(_parallel, 4, CASES[4]))


@pytest.mark.slow
def test_parallel_equals_serial_8_ranks(eight_ranks):
    check_cases([r["parallel"] for r in eight_ranks])


@pytest.mark.slow
def test_linear_collectives_have_the_spec_volumes(eight_ranks):
    for (grid_text, overlap), *per_rank in zip(VOLUME_CASES,
                                               *[r["volumes"] for r in eight_ranks]):
        _, depth, row, col = (int(v) for v in grid_text.split("x"))
        want = expected_linear_volumes(depth, row, col)
        for rank, got in enumerate(per_rank):
            assert got == want, f"grid {grid_text} overlap {overlap} rank {rank}"


@pytest.mark.slow
def test_training_on_8_ranks_tracks_1_rank(eight_ranks):
    serial_rows = run_trainer(make_trainer(one_rank_groups()), TRAIN_STEPS)
    assert serial_rows[-1]["loss"] < 0.8 * serial_rows[0]["loss"]  # it learns
    assert serial_rows[0]["num_dropped"] > 0
    for grid_text in TRAIN_GRIDS:
        for rank, result in enumerate(eight_ranks):
            rows = result["train"][grid_text]
            for a, b in zip(serial_rows, rows, strict=True):
                tag = f"grid {grid_text} rank {rank} step {a['step']}"
                for key in ("loss", "loss_all", "loss_dropped", "grad_norm"):
                    assert abs(a[key] - b[key]) <= 1e-4 * abs(a[key]), f"{tag}: {key}"
                assert (a["num_kept"], a["num_dropped"]) == (b["num_kept"], b["num_dropped"])
            assert abs(rows[-1]["val_loss"] - serial_rows[-1]["val_loss"]) <= \
                1e-4 * serial_rows[-1]["val_loss"]


@pytest.mark.slow
def test_checkpoint_from_8_ranks_continues_on_1_rank(eight_ranks):
    state = eight_ranks[0]["state"]
    trainer = make_trainer(one_rank_groups())
    trainer.load_state_dict(state)
    assert trainer.step == TRAIN_STEPS // 2
    resumed = run_trainer(trainer, TRAIN_STEPS)
    parallel = eight_ranks[0]["train"][TRAIN_GRIDS[0]][TRAIN_STEPS // 2 :]
    for a, b in zip(resumed, parallel, strict=True):
        assert a["step"] == b["step"]
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"]), a["step"]


def run_trainer(trainer, steps):
    rows = []
    while trainer.step < steps:
        rows.append(trainer.train_step())
    rows[-1].update(trainer.evaluate())
    return rows


def check_cases(results):
    refs = {}
    for per_rank in zip(*results):  # one case on every rank
        grid_text, changes, overlap, micro = per_rank[0]["case"]
        key = (changes, micro)
        if key not in refs:
            refs[key] = serial(dataclasses.replace(BASE, **dict(changes)), micro)
        loss, grads = refs[key]
        tag = f"grid {grid_text} {dict(changes)} overlap={overlap} micro={micro}"
        for rank, r in enumerate(per_rank):
            assert abs(r["loss"] - loss) <= 1e-5 * abs(loss), f"{tag} rank {rank}: loss"
            assert set(r["grads"]) == set(grads), tag
            for name, want in grads.items():
                got = r["grads"][name]
                assert got.shape == want.shape, f"{tag}: {name} shape"
                assert rel(got, want) < 1e-5, f"{tag} rank {rank}: grad of {name} " \
                                              f"({rel(got, want):.2e})"
        for axis in ("data", "depth", "row", "col"):  # communication only where size > 1
            size = ProcessGrid.parse(grid_text, AXONN_AXES).size(axis)
            assert (per_rank[0]["axes"].get(axis, 0) > 0) == (size > 1), f"{tag}: {axis}"
    # overlap on and off: bitwise identical gradients
    by_case = {}
    for per_rank in zip(*results):
        grid_text, changes, overlap, micro = per_rank[0]["case"]
        by_case.setdefault((grid_text, changes, micro), []).append(per_rank)
    pairs = [runs for runs in by_case.values() if len(runs) > 1]
    assert pairs
    for first, second in pairs:
        for a, b in zip(first, second):
            assert a["loss"] == b["loss"]
            assert all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"])


# ----------------------------------------------------------------- pure layout tests
def assemble(shards, spec, sizes):
    """Rebuild a full tensor from every coordinate's shard (pure, the inverse of slicing)."""
    block = spec.block_shape(sizes)
    padded = torch.zeros([b * (sizes[a] if a else 1) for b, a in zip(block, spec.axes)])
    for coords, shard in shards.items():
        c = dict(zip(("depth", "row", "col"), coords))
        if spec.flat:
            if c["depth"]:
                continue
            flat = torch.cat([shards[(z, c["row"], c["col"])] for z in range(sizes["depth"])])
            shard = flat[: block[0] * block[1]].view(block) if len(block) == 2 else flat
        index = tuple(slice(c[a] * n, (c[a] + 1) * n) if a else slice(None)
                      for n, a in zip(block, spec.axes))
        padded[index] = shard
    return padded[tuple(slice(0, n) for n in spec.shape)]


@pytest.mark.parametrize("depth, row, col", [(1, 1, 1), (2, 1, 1), (1, 2, 2), (3, 2, 4),
                                             (2, 4, 1)])
def test_shards_cover_the_full_tensor(depth, row, col):
    config = dataclasses.replace(BASE, n_kv_head=4) if row == 4 else BASE
    sizes = {"data": 1, "depth": depth, "row": row, "col": col}
    check_grid(config, sizes)
    torch.manual_seed(0)
    model = GPT(config)
    specs = param_specs(config, sizes)
    assert set(specs) == {n for n, _ in model.named_parameters()}
    for name, full in model.state_dict().items():
        spec = specs[name]
        shards = {}
        for z, r, c in itertools.product(range(depth), range(row), range(col)):
            coords = {"data": 0, "depth": z, "row": r, "col": c}
            shards[(z, r, c)] = shard_tensor(full, spec, sizes, coords)
            want = (spec.shard_numel(sizes),) if spec.flat else spec.block_shape(sizes)
            assert shards[(z, r, c)].shape == want, name
        assert torch.equal(assemble(shards, spec, sizes), full), name


def test_layout_of_the_linears():
    sizes = {"data": 2, "depth": 2, "row": 2, "col": 4}
    specs = param_specs(BASE, sizes)
    q, o = specs["blocks.0.attn.q_proj.weight"], specs["blocks.1.attn.o_proj.weight"]
    assert q.axes == ("row", "col") and o.axes == ("col", "row") and q.flat and o.flat
    assert specs["blocks.0.mlp.gate_proj.weight"].block_shape(sizes) == (23, 8)  # 45 -> 46 / 2
    assert specs["blocks.0.mlp.down_proj.weight"].block_shape(sizes) == (8, 23)
    assert specs["lm_head.weight"].block_shape(sizes) == (31, 8)  # vocab 61 -> 62 / 2
    assert specs["blocks.0.mlp.gate_proj.weight"].shard_numel(sizes) == 92
    assert specs["norm.weight"].replicated == ("row", "depth")
    assert specs["tok_emb.weight"].axes == (None, "col")
    one = {a: 1 for a in AXONN_AXES}
    assert all(s.axes == (None,) * len(s.shape) and not s.flat
               for s in param_specs(BASE, one).values())


def test_grid_errors():
    sizes = {"data": 1, "depth": 1, "row": 4, "col": 1}
    with pytest.raises(ValueError, match=r"n_kv_head=2 must be divisible by row=4"):
        check_grid(BASE, sizes)
    tied = dataclasses.replace(BASE, tie_embeddings=True)
    with pytest.raises(ValueError, match="tie_embeddings"):
        check_grid(tied, {"data": 1, "depth": 2, "row": 1, "col": 1})
    check_grid(tied, {"data": 2, "depth": 1, "row": 1, "col": 1})  # data parallel: fine


def test_batch_shard_pads_and_splits_over_data_then_depth():
    from common.grid import AxisGroup

    batch = torch.arange(5 * 3).view(5, 3)
    rows = []
    for d, z in itertools.product(range(2), range(2)):
        groups = {"data": AxisGroup("data", None, 2, d), "depth": AxisGroup("depth", None, 2, z)}
        rows.append(batch_shard(batch, groups, -1))
    assert all(r.shape == (2, 3) for r in rows)
    assert torch.equal(torch.cat(rows)[:5], batch) and (torch.cat(rows)[5:] == -1).all()


def test_overlap_parse():
    assert Overlap.parse("all") == Overlap() and str(Overlap()) == "all"
    assert Overlap.parse("none") == Overlap(oar=False, ors=False, oag=False)
    assert Overlap.parse("oar, oag") == Overlap(ors=False)
    assert str(Overlap.parse("ors")) == "ors"
    with pytest.raises(ValueError, match="unknown"):
        Overlap.parse("oar,fast")
