"""The GPT step model: AxoNN's rule of thumb, refused grids, the automatic micro-batch, and
the llm trainer's counted bytes per group against the model's volumes."""

import pytest

from common.perf import gpt as P
from common.perf.machine import load_profile

# Llama-2-7B / -70B shapes (llm.model.gpt7b, gpt70b), written out so these tests stay pure
GPT7B = dict(vocab_size=32000, n_layer=32, n_head=32, d_model=4096, d_ff=11008)
GPT70B = dict(vocab_size=32000, n_layer=80, n_head=64, n_kv_head=8, d_model=8192, d_ff=28672)


def bf16(sizes, batch, seq_len=2048, **kw):
    return P.GPTWorkload(**sizes, seq_len=seq_len, global_batch=batch, param_bytes=2,
                         grad_bytes=2, activation_bytes=2, **kw)


def split(pred):
    s = pred.shape
    return s["data"] * s["depth"], s["row"] * s["col"]


@pytest.mark.parametrize("sizes, ranks", [(GPT7B, 64), (GPT7B, 256), (GPT70B, 1024)])
def test_rule_of_thumb_large_batch_depth_data_small_batch_row_col(sizes, ranks):
    """AxoNN: a large global batch prefers depth + data, a small one row/col (Perlmutter)."""
    machine = load_profile("perlmutter-a100")
    large = P.plan_gpt(bf16(sizes, 1024), ranks, machine).best
    small = P.plan_gpt(bf16(sizes, 4), ranks, machine).best
    dz, rc = split(large)
    assert dz > rc, large.label()
    dz, rc = split(small)
    assert rc > dz, small.label()


def test_large_model_large_batch_shards_over_depth():
    best = P.plan_gpt(bf16(GPT70B, 1024), 1024, load_profile("perlmutter-a100")).best
    assert best.shape["depth"] > 1 and best.fits, best.label()


def test_grids_that_do_not_divide_are_refused():
    work = P.GPTWorkload(vocab_size=100, n_layer=2, n_head=6, d_model=48, d_ff=96, seq_len=8,
                         global_batch=4, micro_batch=4)
    assert "heads" in P.check_grid(work, {"data": 1, "depth": 1, "row": 4, "col": 1})
    assert "batch" in P.check_grid(work, {"data": 8, "depth": 1, "row": 1, "col": 1})
    assert P.check_grid(work, {"data": 2, "depth": 2, "row": 3, "col": 5}) == ""
    plan = P.plan_gpt(work, 8, load_profile("local-cpu"))
    assert all(not p.invalid for p in plan.runnable)
    assert any("heads" in p.invalid for p in plan.predictions)
    with pytest.raises(ValueError, match="micro_batch must divide"):
        P.GPTWorkload(vocab_size=100, n_layer=2, n_head=6, d_model=48, d_ff=96, seq_len=8,
                      global_batch=4, micro_batch=3)


def test_automatic_micro_batch_is_the_largest_that_fits():
    machine = load_profile("perlmutter-a100")
    shape = {"data": 8, "depth": 2, "row": 2, "col": 2}
    pred = P.predict_gpt(bf16(GPT7B, 1024), shape, machine)
    micro = pred.extra["micro_batch"]
    assert pred.fits and 1024 % micro == 0 and micro % 16 == 0
    bigger = [b for b in range(micro + 1, 1025) if 1024 % b == 0 and b % 16 == 0]
    assert all(P.gpt_memory(bf16(GPT7B, 1024, micro_batch=b), shape) > pred.memory_limit
               for b in bigger)


def test_choose_gpt_grid_for_llm_train():
    from common.plan import choose_gpt_grid
    from llm.model import tiny

    grid, plan = choose_gpt_grid(tiny(), batch_size=8, grad_accum=2, seq_len=64,
                                 world_size=8, profile="local-cpu")
    assert grid.axes == ("data", "depth", "row", "col") and grid.num_ranks == 8
    assert tuple(grid.shape.values()) == tuple(plan.best.shape.values())
    assert plan.best.extra["micro_batch"] == 8


def _trainer_bytes(ctx, cases):
    import torch

    from common.grid import AXONN_AXES, ProcessGrid
    from llm.model import GPTConfig
    from llm.parallel import make_groups
    from llm.trainer import DataConfig, GoldfishConfig, OptimConfig, TrainConfig, Trainer

    torch.set_num_threads(1)
    out = []
    for grid, sizes, batch, accum in cases:
        trainer = Trainer(GPTConfig(**sizes, max_seq_len=16),
                          DataConfig(seq_len=16, batch_size=batch, eval_batches=0),
                          OptimConfig(lr=1e-2, warmup_steps=2), GoldfishConfig(k=4, h=3),
                          TrainConfig(steps=1, grad_accum=accum),
                          make_groups(ProcessGrid.parse(grid, AXONN_AXES), ctx.rank), seed=5)
        trainer.train_step()
        out.append({axis: r.bytes for axis, r in trainer.stats.by_axis().items()})
    return out


BASE = dict(vocab_size=259, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=45)
ODD = dict(BASE, d_model=30, n_head=3, n_kv_head=1)  # d_model 30 padded on col 4
CASES = [("data=2,depth=2,row=2,col=1", BASE, 8, 2), ("depth=2,row=1,col=4", ODD, 4, 1),
         ("depth=2,row=2,col=2", BASE, 5, 1), ("data=8", BASE, 8, 1), ("depth=8", BASE, 8, 1),
         ("row=2,col=4", BASE, 6, 2), ("data=2,col=4", ODD, 6, 1)]


@pytest.mark.slow
def test_trainer_counted_bytes_equal_the_model():
    """llm.trainer.Trainer.train_step counts, per group, exactly the model's volumes (vocab,
    d_ff, d_model and batch padded; gradient accumulation; all 8-rank grids in one launch)."""
    from common.grid import AXONN_AXES, ProcessGrid
    from common.perf.model import bytes_by_axis
    from tests.distributed import run_ranks

    results = run_ranks(_trainer_bytes, 8, CASES)
    for k, (grid, sizes, batch, accum) in enumerate(CASES):
        shape = dict(ProcessGrid.parse(grid, AXONN_AXES).shape)
        work = P.GPTWorkload(**sizes, seq_len=16, global_batch=batch * accum, micro_batch=batch)
        want = bytes_by_axis(P.gpt_collectives(work, shape), shape)
        for rank, per_rank in enumerate(results):
            assert per_rank[k] == want, (grid, rank)
