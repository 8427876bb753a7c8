"""llm.mfu: the device's peak (a flag, or the table by the GPU's name; none on a CPU), the MFU
arithmetic, and llm.train printing MFU beside tokens/s on every logged step and in its
summary where a peak is known, and not where none is."""

import json

import pytest
import torch

from llm.config import tiny
from llm.mfu import PEAK_TFLOPS, mfu, peak_tflops
from llm.train import main as train_main


def test_the_peak_is_the_flag_else_the_tables_for_the_gpu_it_names(monkeypatch):
    assert peak_tflops("cpu", "bf16", 2.5) == 2.5
    assert peak_tflops("cpu", "bf16") is None  # no table for CPUs: no MFU
    with pytest.raises(ValueError, match="peak-tflops must be > 0"):
        peak_tflops("cpu", "fp32", 0.0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, precision, want in [("NVIDIA H100 80GB HBM3", "bf16", 989.4),
                                  ("NVIDIA H100 PCIe", "bf16", 756.0),
                                  ("NVIDIA H200", "fp32", 66.9),
                                  ("NVIDIA H200 NVL", "bf16", 835.5),
                                  ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
                                  ("Tesla T4", "bf16", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda _d=None, n=name: n)
        assert peak_tflops("cuda", precision) == want, name
    assert all(set(p) == {"bf16", "fp32"} for p in PEAK_TFLOPS.values())


def test_mfu_is_a_ranks_share_of_the_flops_over_its_peak():
    # 1e9 FLOPs a token, 3000 tokens of the step in 0.5 s over 4 ranks, 2 TFLOP/s
    assert mfu(1e9, 3000, 0.5, 4, 2.0) == pytest.approx(1e9 * 3000 / 4 / 0.5 / 2e12)


def test_train_prints_mfu_with_a_peak_and_not_without(tmp_path, capsys):
    args = ["--steps", "3", "--seq-len", "32", "--batch-size", "4", "--eval-batches", "0",
            "--log-every", "1"]
    metrics = tmp_path / "m.jsonl"
    assert train_main([*args, "--peak-tflops", "0.5", "--metrics", str(metrics)]) == 0
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in rows if "step" in r]
    assert len(steps) == 3 and out.count("MFU ") == 4  # every step, and the summary
    per_token = tiny().flops_per_token(32)
    for r in steps:
        assert r["mfu"] == pytest.approx(mfu(per_token, r["tokens"], r["step_s"], 1, 0.5))
        assert f"MFU {100 * r['mfu']:.1f}%" in out
    summary = next(r["summary"] for r in rows if "summary" in r)
    assert 0 < summary["mfu"] and "of 0.5 TFLOP/s" in out
    assert train_main(args) == 0
    assert "MFU" not in capsys.readouterr().out  # a CPU: no peak, no MFU


def data_parallel_rows(ctx):
    """Two steps of the tiny trainer on the 2x1x1x1 grid with a 0.5 TFLOP/s peak."""
    from llm.config import DataConfig, GoldfishConfig, OptimConfig, RunConfig
    from llm.trainer import Trainer
    from tests.llm.helpers import on_grid

    torch.set_num_threads(1)
    trainer = Trainer(tiny(), DataConfig(seq_len=32, batch_size=4, eval_batches=0),
                      OptimConfig(), GoldfishConfig(), RunConfig(steps=2, peak_tflops=0.5),
                      on_grid(ctx, "2x1x1x1"))
    return [trainer.train_step() for _ in range(2)]


@pytest.mark.slow
def test_mfu_on_two_ranks_counts_the_global_batch_over_both():
    from tests.distributed import run_ranks

    per_token = tiny().flops_per_token(32)
    for rank, rows in enumerate(run_ranks(data_parallel_rows, 2, timeout=120)):
        for r in rows:
            assert r["tokens"] == 4 * 32, rank  # the step's global batch, on every rank ...
            # ... of which this rank trained half: MFU over both ranks
            assert r["mfu"] == pytest.approx(mfu(per_token, 4 * 32, r["step_s"], 2, 0.5))
            assert r["mfu"] == pytest.approx(per_token * 64 / r["step_s"] / 0.5e12), rank
