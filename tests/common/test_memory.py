"""common.memory: the resident-set meters and, on a GPU, the allocator's peaks beside them, as
both trainers' summaries and bench/memory.py report them (torch.cuda faked on the CPU)."""

import re

import numpy as np
import pytest

from common.memory import peak_bytes, reset_peak, resident_bytes


def test_resident_and_peak_see_a_touched_block():
    before = resident_bytes()
    block = np.ones(32 << 17)  # 32 MiB, touched
    assert resident_bytes() >= before + (16 << 20) or resident_bytes() == 0  # 0: not Linux
    assert peak_bytes() >= 32 << 20
    del block


def test_peak_can_be_reset():
    block = np.ones(64 << 17)  # 64 MiB, touched
    high = peak_bytes()
    assert high >= 64 << 20
    del block
    if not reset_peak():
        pytest.skip("/proc/self/clear_refs is not writable here")
    assert peak_bytes() < high - (32 << 20)


def _fake_cuda(monkeypatch, allocated=5 << 20, reserved=8 << 20):
    """torch.cuda's peak meters, reset and cache release, faked: what they were asked."""
    import torch

    asked = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: asked.append(
        ("allocated", d)) or allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: asked.append(
        ("reserved", d)) or reserved)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: asked.append(
        ("reset", d)))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: asked.append(("empty_cache",)))
    return asked


def test_gpu_peaks_only_on_a_cuda_device(monkeypatch):
    import torch

    from common.memory import GPU_PEAK_KEYS, gpu_peaks, peaks, release, reset_peaks

    asked = _fake_cuda(monkeypatch)
    for device in (None, "cpu", torch.device("cpu")):
        assert set(peaks(device)) == {"peak_bytes"} and gpu_peaks(device) == {}
        reset_peaks(device)
        release(device)
    assert asked == []  # torch.cuda untouched off CUDA
    got = peaks("cuda:0")
    assert set(got) == {"peak_bytes", *GPU_PEAK_KEYS}
    assert got["gpu_peak_allocated_bytes"] == 5 << 20
    assert got["gpu_peak_reserved_bytes"] == 8 << 20
    cuda0 = torch.device("cuda", 0)
    assert asked == [("allocated", cuda0), ("reserved", cuda0)]
    reset_peaks(cuda0)
    release(cuda0)
    assert asked[2:] == [("reset", cuda0), ("empty_cache",)]


def test_the_max_over_ranks_and_the_summary_wording(monkeypatch):
    """Both trainers word the peaks alike: the resident one alone on the CPU (as before), the
    GPU's allocated and reserved peaks after it on a GPU (max over ranks, one process here)."""
    import common.exchange
    from common.memory import describe_peaks, peaks_per_rank_max

    _fake_cuda(monkeypatch, allocated=300 << 20, reserved=420 << 20)
    seen = []

    def max_over_ranks(values, device="cpu", transport=None):  # no GPU to reduce on here
        seen.append(str(device))
        return list(values)

    monkeypatch.setattr(common.exchange, "max_over_ranks", max_over_ranks)
    cpu, gpu = peaks_per_rank_max("cpu"), peaks_per_rank_max("cuda:0")
    assert seen == ["cpu", "cuda:0"] and set(cpu) == {"peak_bytes"}
    cpu_text, gpu_text = describe_peaks(cpu), describe_peaks(gpu)
    assert cpu_text.endswith("MiB resident per rank (max)") and "GPU" not in cpu_text
    assert gpu_text.startswith(cpu_text[:cpu_text.index(" MiB")])
    assert gpu_text.endswith("; GPU 300 MiB allocated, 420 MiB reserved per rank (max)")

    from types import SimpleNamespace

    from llm.train import _summary as llm_summary
    from plexus.train import _print_summary

    history = [{"step": s, "loss": 1.0, "tokens": 100, "step_s": 0.1} for s in (1, 2, 3)]
    for peaks, text in ((cpu, cpu_text), (gpu, gpu_text)):
        s = llm_summary(history, 1.0, SimpleNamespace(step=3), peaks)
        assert s["text"].endswith(f"peak memory {text}")
        assert s["peak_bytes_per_rank_max"] == peaks["peak_bytes"]
        assert ("gpu_peak_allocated_bytes_per_rank_max" in s) == (peaks is gpu)
    out = []
    monkeypatch.setattr("builtins.print", lambda *a, **k: out.append(" ".join(map(str, a))))
    config = {"model": {k: 0 for k in ("model", "num_layers", "hidden", "dropout", "norm",
                                         "bias", "residual", "learn_features")},
              "permutation": "double", "run": {"epochs": 1}}
    for peaks, text in ((cpu, cpu_text), (gpu, gpu_text)):
        _print_summary({"dataset": "d", "num_nodes": 1, "num_edges": 1, "grid": "1x1x1",
                        "world_size": 1, "launcher": "single", "device": "cpu",
                        "config": config, "setup_s": 0.0, "epoch_s_mean": 0.1,
                        "comm_share": 0.0, "comm_exposed_share": 0.0, "comm_bytes_per_epoch": 0,
                        "final": {},
                        "memory_per_rank_max": {"adjacency_bytes": 1, **peaks}})
        assert re.search(rf"\npeak memory +{re.escape(text)}\n", out[-1] + "\n"), out[-1]
