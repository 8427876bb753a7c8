"""GPU smoke tests (``pytest -m gpu``; skipped without CUDA): the tiny trainer on one CUDA
rank follows the CPU run to floating-point tolerance, its checkpoint continues on the CPU, the
CLI picks NCCL, and with two GPUs a 2-rank NCCL run (row = 2) follows one CPU rank."""

import json

import pytest
import torch

from llm.trainer import run
from tests.distributed import launch
from tests.llm.helpers import make_trainer, one_rank

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
KEYS = ("loss", "loss_all", "loss_dropped", "grad_norm")
STEPS = 4


def close(a, b, rel):
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-8)


def test_one_cuda_rank_follows_the_cpu_run(tmp_path):
    cpu = run(make_trainer(one_rank(), steps=STEPS))
    trainer = make_trainer(one_rank("cuda"), steps=STEPS)
    assert all(p.is_cuda for p in trainer.model.shards().values())
    gpu = run(trainer)
    assert [r["step"] for r in gpu] == list(range(1, STEPS + 1))
    for a, b in zip(cpu, gpu, strict=True):
        # the kernels differ (cuBLAS, fused attention), so equal up to rounding, growing a
        # little with every AdamW step
        for key in KEYS:
            assert close(a[key], b[key], 1e-3), (a["step"], key, a[key], b[key])
        assert (a["num_kept"], a["num_dropped"]) == (b["num_kept"], b["num_dropped"])
    assert close(cpu[-1]["val_loss"], gpu[-1]["val_loss"], 1e-3)
    # a GPU checkpoint (raw bytes per shard) continues on the CPU
    trainer.save(str(tmp_path), keep=1, is_main=True)
    resumed = make_trainer(one_rank(), steps=STEPS + 1)
    assert resumed.resume(str(tmp_path)) == STEPS
    assert run(resumed)[-1]["step"] == STEPS + 1


ARGS = ["-m", "llm.train", "--preset", "tiny", "--steps", "3", "--seq-len", "32",
        "--batch-size", "4", "--eval-batches", "1", "--log-every", "1"]


def _losses(path):
    return [json.loads(line) for line in path.read_text().splitlines()
            if '"step"' in line]


def test_cli_on_one_gpu_uses_nccl(tmp_path):
    r = launch([*ARGS, "--device", "cuda", "--metrics", str(tmp_path / "gpu.jsonl")],
               launcher="single", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "(1 ranks, single, cpu:gloo,cuda:nccl)" in r.stdout
    cpu = launch([*ARGS, "--device", "cpu", "--metrics", str(tmp_path / "cpu.jsonl")],
                 launcher="single", timeout=300)
    assert cpu.returncode == 0, cpu.stdout + cpu.stderr
    for a, b in zip(_losses(tmp_path / "cpu.jsonl"), _losses(tmp_path / "gpu.jsonl"),
                    strict=True):
        assert close(a["loss"], b["loss"], 1e-3), (a, b)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_two_nccl_ranks_follow_one_cpu_rank(tmp_path):
    gpu = launch([*ARGS, "--device", "cuda", "--grid", "data=1,depth=1,row=2,col=1",
                  "--metrics", str(tmp_path / "gpu.jsonl")], ranks=2, launcher="torchrun",
                 timeout=300)
    assert gpu.returncode == 0, gpu.stdout + gpu.stderr
    assert "(2 ranks, torchrun, cpu:gloo,cuda:nccl)" in gpu.stdout
    cpu = launch([*ARGS, "--device", "cpu", "--metrics", str(tmp_path / "cpu.jsonl")],
                 launcher="single", timeout=300)
    assert cpu.returncode == 0, cpu.stdout + cpu.stderr
    for a, b in zip(_losses(tmp_path / "cpu.jsonl"), _losses(tmp_path / "gpu.jsonl"),
                    strict=True):
        assert close(a["loss"], b["loss"], 1e-3), (a, b)
        assert b["comm_bytes"] > 0
