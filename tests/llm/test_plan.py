"""python -m llm.plan: a preset's workload, the planner's table and choice, and the same
choice as ``llm.train --grid auto``."""

from common.perf import auto_grid
from llm.model import gpt7b
from llm.plan import main, parse_args, workload
from llm.train import main as train_main

GPT7B = ["--preset", "gpt7b", "--batch", "1024", "--seq-len", "2048", "--ranks", "64",
         "--machine", "perlmutter-a100"]


def test_workload_copies_the_preset_and_the_sizes():
    work = workload(parse_args([*GPT7B, "--bf16", "--micro-batch", "256"]))
    config = gpt7b()
    for name in ("vocab_size", "num_layers", "num_heads", "num_kv_heads", "d_model", "d_ff",
                 "tie_embeddings"):
        assert getattr(work, name) == getattr(config, name), name
    assert (work.name, work.global_batch, work.micro_batch, work.seq_len) == \
        ("gpt7b", 1024, 256, 2048)
    assert work.param_bytes == work.grad_bytes == work.activation_bytes == 2
    assert work.num_params() == config.num_params()


def test_gpt7b_on_64_perlmutter_gpus(capsys):
    assert main([*GPT7B, "--bf16", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("GPT gpt7b: 6.738B parameters")
    assert "... 81 more grids" in out  # 84 grids of 64 ranks
    ranked = [line for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(ranked) == 3
    grid, plan = auto_grid(workload(parse_args([*GPT7B, "--bf16"])), 64,
                           machine="perlmutter-a100")
    assert f"grid auto: {grid}" in out and plan.describe_choice() in out


def test_errors_exit_2(capsys):
    assert main(["--preset", "tiny", "--batch", "6", "--micro-batch", "4", "--seq-len", "8",
                 "--ranks", "2"]) == 2
    assert "micro_batch must divide global_batch" in capsys.readouterr().err
    assert main(["--preset", "tiny", "--batch", "8", "--seq-len", "8", "--ranks", "2",
                 "--machine", "no-such-machine"]) == 2
    assert "no-such-machine" in capsys.readouterr().err


def test_train_grid_auto_logs_the_choice(capsys):
    assert train_main(["--grid", "auto", "--steps", "1", "--seq-len", "16", "--batch-size",
                       "2", "--eval-batches", "0"]) == 0
    out = capsys.readouterr().out
    assert "grid auto: data=1,depth=1,row=1,col=1" in out
    assert "grid data=1,depth=1,row=1,col=1 (1 ranks" in out


# ------------------------------------------------ the planner's activations vs the trainer's
SAVED_GRIDS = ("1x1x2x2", "1x2x2x1")  # row and col split; depth splits the batch
SAVED_BATCH, SAVED_SEQ = 4, 16


def saved_activation_bytes(ctx):
    """Per rank and grid: bytes autograd keeps for backward during one forward of the
    parallel GPT (tensors counted once per storage, parameters excluded)."""
    import torch

    from common.grid import AXONN_AXES, ProcessGrid
    from llm.model import GPT
    from llm.parallel.gpt import ParallelGPT, batch_shard, make_groups
    from tests.llm.parallel.test_gpt import BASE

    out = {}
    for grid in SAVED_GRIDS:
        groups = make_groups(ProcessGrid.parse(grid, AXONN_AXES), ctx.rank, ctx.transport)
        model = ParallelGPT(GPT(BASE, device="meta"), groups, seed=0)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen = {}

        def pack(t, seen=seen, params=params):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        x = torch.randint(BASE.vocab_size, (SAVED_BATCH, SAVED_SEQ))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(batch_shard(x, groups, 0))
        out[grid] = sum(seen.values())
    return out


def test_planner_activations_match_what_the_trainer_keeps(four_ranks):
    from dataclasses import replace

    from common.grid import AXONN_AXES, ProcessGrid
    from common.perf.gpt import GPTWorkload, gpt_memory_terms
    from tests.llm.parallel.test_gpt import BASE

    for grid in SAVED_GRIDS:
        shape = ProcessGrid.parse(grid, AXONN_AXES).shape
        work = GPTWorkload.from_config(BASE, global_batch=SAVED_BATCH, seq_len=SAVED_SEQ)
        planned = gpt_memory_terms(work, shape)["activations"]
        for rank, result in enumerate(four_ranks):
            measured = result["saved"][grid]
            assert abs(planned - measured) <= 0.1 * measured, (grid, rank, planned, measured)
        ckpt = gpt_memory_terms(replace(work, activation_checkpointing=True), shape)
        assert ckpt["activations"] < 0.7 * planned  # two layers: one kept, one recomputed


def test_ors_window_bounds_the_dw_blocks_in_flight_as_the_planner_counts():
    import torch
    from torch import nn

    from common.perf import gpt
    from llm.parallel import layers as tp
    from tests.llm.helpers import one_rank_groups

    assert tp.ORS_WINDOW == gpt.ORS_WINDOW
    grads = tp.DepthGrads(one_rank_groups()["depth"], defer=True, stats=None)
    params = [nn.Parameter(torch.zeros(6)) for _ in range(6)]
    for i, p in enumerate(params):
        grads.add(p, torch.full((2, 3), float(i)))
        assert len(grads._pending) <= tp.ORS_WINDOW + 1
    grads.finish()
    assert [float(p.grad[0]) for p in params] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
