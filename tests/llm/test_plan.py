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
