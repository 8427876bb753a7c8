"""GPU smoke tests (``pytest -m gpu``; skipped without CUDA): plexus.train on one CUDA rank
follows the CPU run to floating-point tolerance (torch.sparse CSR SpMM and cuBLAS instead of the
numba kernel), and with two GPUs a 2-rank NCCL run follows it too."""

import json

import pytest
import torch

from tests.distributed import launch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ARGS = ["-m", "plexus.train", "--epochs", "5", "--hidden", "32", "--learn-features"]


def _losses(tmp_path, tag, *, device, ranks=1, grid="1x1x1"):
    path = tmp_path / f"{tag}.jsonl"
    r = launch([*ARGS, "--device", device, "--grid", grid, "--metrics", str(path)],
               ranks=ranks, launcher="single" if ranks == 1 else "torchrun", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    summary = rows[-1]["summary"]
    assert summary["device"].startswith(device), summary["device"]
    return [row["loss"] for row in rows[:-1]]


def _close(a, b, rel=1e-4):
    return all(abs(x - y) <= rel * max(abs(x), 1e-8) for x, y in zip(a, b, strict=True))


def test_one_cuda_rank_follows_the_cpu_run(tmp_path):
    cpu = _losses(tmp_path, "cpu", device="cpu")
    gpu = _losses(tmp_path, "gpu", device="cuda")
    assert len(gpu) == 5 and _close(cpu, gpu), (cpu, gpu)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_nccl_ranks_follow_one_cpu_rank(tmp_path):
    cpu = _losses(tmp_path, "cpu", device="cpu")
    gpu = _losses(tmp_path, "gpu2", device="cuda", ranks=2, grid="1x1x2")
    assert _close(cpu, gpu), (cpu, gpu)
