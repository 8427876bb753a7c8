"""The 4D-parallel GPT equals the single-process GPT: loss and every gradient, many grids, with
the overlaps on and off; greedy generation; the grid check (the layout and the shards:
test_layout.py, test_shards.py).

Grids are ``data x depth x row x col``; sizes are chosen so that the vocabulary (61, prime),
d_ff (45) and the flat depth shards need padding, and in one case d_model (30) on col. The
4-rank and 8-rank cases run in the shared launches of conftest.py (``four_ranks``,
``eight_ranks``).
"""

import dataclasses

import pytest
import torch

from common.collectives import all_reduce
from common.comm_stats import CommStats
from common.grid import AXONN_AXES, AxisGroup, ProcessGrid
from llm.config import Overlap
from llm.goldfish import goldfish_loss, goldfish_mask
from llm.loss import goldfish_sums
from llm.model import GPT, GPTConfig
from llm.parallel.gpt import ParallelGPT, make_groups
from llm.parallel.layout import batch_shard
from tests.llm.helpers import assert_greedy_agrees, logits_sums
from tests.rounding import assert_orders_agree, order_bound

BASE = GPTConfig(vocab_size=61, num_layers=2, num_heads=4, num_kv_heads=2, d_model=32, d_ff=45,
                 max_seq_len=16)
ODD_D = {"d_model": 30, "num_heads": 3, "num_kv_heads": 1}  # d_model 30: padded on col = 4
SEED = 3


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
    model = GPT(config, seed=SEED)
    batches = make_batch(micro=micro)
    total = sum(int(((y != -100) & ~m).sum()) for _, y, m in batches)
    loss = 0.0
    for x, y, m in batches:  # the mean over the kept tokens of all micro-batches
        out = goldfish_loss(model(x), y, m)
        part = out.loss * out.num_kept / total
        part.backward()
        loss += part.item()
    return loss, {n: p.grad for n, p in model.named_parameters()}


def parallel_cases(ctx, cases):
    """Per rank: loss, full gradients, bytes per axis and overlap counts of each case."""
    results = []
    for grid_text, changes, overlap, micro in cases:
        config = dataclasses.replace(BASE, **changes)
        grid = ProcessGrid.parse(grid_text, AXONN_AXES)
        groups = make_groups(grid, ctx.rank, ctx.transport)
        stats = CommStats()
        # built on meta: each rank draws only its shards, keyed by SEED like serial()'s model
        model = ParallelGPT(GPT(config, device="meta"), groups, seed=SEED,
                            overlap=Overlap.parse(overlap), stats=stats)
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
        loss = all_reduce(kept_sum, groups["data+depth"]) / total
        results.append({"case": (grid_text, tuple(changes.items()), overlap, micro),
                        "loss": loss.item(), "grads": model.full_state_dict(grads=True),
                        "axes": {k: v.bytes for k, v in stats.by_axis().items()},
                        "overlapped": dataclasses.asdict(model.overlapped)})
    return results


GENERATE_GRID = "2x1x2x1"  # data 2 (3 prompts: padded), row 2 (the vocabulary gathered)


def generate_case(ctx):
    """Per rank: greedy tokens of the parallel model on GENERATE_GRID."""
    groups = make_groups(ProcessGrid.parse(GENERATE_GRID, AXONN_AXES), ctx.rank, ctx.transport)
    model = ParallelGPT(GPT(BASE, device="meta"), groups, seed=SEED)
    prompt = torch.randint(BASE.vocab_size, (3, 5), generator=torch.Generator().manual_seed(1))
    return model.generate_greedy(prompt, 6)


@pytest.mark.cross_shape
def test_parallel_greedy_generation_equals_serial(four_ranks):
    """The ranks' products of other heights: the same tokens but at a near-tie."""
    prompt = torch.randint(BASE.vocab_size, (3, 5), generator=torch.Generator().manual_seed(1))
    model = GPT(BASE, seed=SEED)
    want = model.generate(prompt, 6)
    for rank, result in enumerate(four_ranks):
        assert_greedy_agrees(model, result["generate"], want, f"rank {rank}")


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


CASES = {
    4: [("1x1x2x2", {}, "all", 1), ("1x2x2x1", {}, "all", 1), ("1x2x2x1", {}, "none", 1),
        ("2x1x1x2", {}, "all", 2), ("1x1x1x4", ODD_D, "all", 1), ("4x1x1x1", {}, "all", 1)],
    8: [("2x2x2x1", {}, "all", 1), ("1x2x2x2", {}, "all", 2), ("1x2x2x2", {}, "none", 2),
        ("1x1x4x2", {"num_kv_heads": 4}, "oar,oag", 1), ("1x2x1x4", ODD_D, "ors", 1)],
}


@pytest.mark.slow
@pytest.mark.cross_shape
def test_parallel_equals_serial_4_ranks(four_ranks):
    check_cases([r["parallel"] for r in four_ranks])


@pytest.mark.slow
@pytest.mark.cross_shape
def test_parallel_equals_serial_8_ranks(eight_ranks):
    check_cases([r["parallel"] for r in eight_ranks])


def check_cases(results):
    """Loss and gradients against one rank, to float rounding: the shards' products have other
    shapes and the grid's all-reduces sum partial products in another order. The bound: the
    forward's sums (tests/llm/helpers.py's logits_sums, d_ff 45 the longest), the loss's two
    (the log-sum-exp over the vocabulary, the mean over the targets) and the backward's as many
    again as forward and loss; the gradients normwise (each element by the tensor's largest).
    Overlap on against off is the same computation: bitwise."""
    terms, products = logits_sums(BASE, 16)
    terms, products = max(terms, 5 * 16), 2 * (products + 2)  # 80 targets
    bound = order_bound(terms, products=products)
    refs = {}
    for per_rank in zip(*results):  # one case on every rank
        grid_text, changes, overlap, micro = per_rank[0]["case"]
        key = (changes, micro)
        if key not in refs:
            refs[key] = serial(dataclasses.replace(BASE, **dict(changes)), micro)
        loss, grads = refs[key]
        tag = f"grid {grid_text} {dict(changes)} overlap={overlap} micro={micro}"
        for rank, r in enumerate(per_rank):
            assert abs(r["loss"] - loss) <= bound * abs(loss), f"{tag} rank {rank}: loss"
            assert set(r["grads"]) == set(grads), tag
            for name, want in grads.items():
                got = r["grads"][name]
                assert got.shape == want.shape, f"{tag}: {name} shape"
                assert_orders_agree(got, want, terms=terms, products=products,
                                    what=f"{tag} rank {rank}: grad of {name}")
        grid = ProcessGrid.parse(grid_text, AXONN_AXES)
        for axis in ("data", "depth", "row", "col"):  # communication only where size > 1
            assert (per_rank[0]["axes"].get(axis, 0) > 0) == (grid.size(axis) > 1), \
                f"{tag}: {axis}"
        # an overlap runs exactly where it is switched on and its group has several ranks
        switch, z = Overlap.parse(overlap), grid.size("depth")
        ran = {"oar": switch.oar and (grid.size("row") > 1 or grid.size("col") > 1),
               "ors": switch.ors and z > 1, "oag": switch.oag and z > 1}
        for rank, r in enumerate(per_rank):
            assert {k: v > 0 for k, v in r["overlapped"].items()} == ran, f"{tag} rank {rank}"
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


def fake_groups(**sizes):
    """Axis groups of rank 0 that never communicate (for checks before any collective)."""
    sizes = {a: sizes.get(a, 1) for a in AXONN_AXES}
    groups = {a: AxisGroup(a, None, n, 0) for a, n in sizes.items()}
    groups["data+depth"] = AxisGroup("data+depth", None, sizes["data"] * sizes["depth"], 0)
    groups["depth+row+col"] = AxisGroup("depth+row+col", None,
                                        sizes["depth"] * sizes["row"] * sizes["col"], 0)
    return groups


def test_grid_errors_show_the_arithmetic():
    """ParallelGPT refuses a model that does not split, before any communication."""
    def meta(config):
        return GPT(config, device="meta")

    with pytest.raises(ValueError, match=r"grid data=1,depth=1,row=4,col=1: kv heads: "
                                         r"num_kv_heads=2 % row=4 = 2"):
        ParallelGPT(meta(BASE), fake_groups(row=4), seed=0)
    with pytest.raises(ValueError, match=r"heads: num_heads=3 % row=2 = 1"):
        ParallelGPT(meta(dataclasses.replace(BASE, **ODD_D)), fake_groups(row=2), seed=0)
    tied = dataclasses.replace(BASE, tie_embeddings=True)
    with pytest.raises(ValueError, match="tie_embeddings=True needs depth = row = col = 1"):
        ParallelGPT(meta(tied), fake_groups(depth=2), seed=0)
    ParallelGPT(meta(tied), fake_groups(data=2), seed=0)  # data parallel: fine
    ParallelGPT(meta(BASE), fake_groups(data=2, depth=3), seed=0)  # any batch pads to data x depth
    ParallelGPT(GPT(BASE), fake_groups(depth=2))  # a full model is sliced


def test_shards_are_the_parameters_by_name_named_once(monkeypatch):
    """``shards()`` is the model's parameters by name; it walks the module tree once (each
    step's gradient sync and clipping read it), and its dict is the caller's own."""
    model = ParallelGPT(GPT(BASE, device="meta"), fake_groups(), seed=0)
    want = dict(model.model.named_parameters())
    first = model.shards()
    assert list(first) == list(want) and all(first[n] is want[n] for n in want)
    walks = []
    real = type(model.model).named_parameters
    monkeypatch.setattr(type(model.model), "named_parameters",
                        lambda self, *a, **k: walks.append(1) or real(self, *a, **k))
    first.clear()  # the caller's own dict
    again = model.shards()
    assert walks == [] and list(again) == list(want) and all(again[n] is want[n] for n in want)


def test_shards_follow_parameters_a_conversion_replaces():
    """A conversion that makes new parameter objects (torch's overwrite-on-conversion
    setting) names them again: ``shards()`` is never a stale list."""
    model = ParallelGPT(GPT(BASE, device="meta"), fake_groups(), seed=0)
    before = model.shards()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        model.to(torch.float64)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    now = dict(model.model.named_parameters())
    assert any(now[n] is not before[n] for n in now)  # new objects
    got = model.shards()
    assert list(got) == list(now) and all(got[n] is now[n] for n in now)
