"""Model FLOPs utilisation (MFU), as torchtitan logs it: the model's training FLOPs a second
(:meth:`llm.config.GPTConfig.flops_per_token`, PaLM's count) over the device's dense peak.

A step trains the global batch's ``tokens`` on every rank of the 4D grid together (its rows
split over data and depth, the model over row x col), so a rank's share of the step's FLOPs
is ``flops_per_token * tokens / ranks``; MFU is that share a second over the peak of one
device. The peak comes from ``--peak-tflops`` where given, else from
:data:`PEAK_TFLOPS` by the CUDA device's name and the run's precision; on a CPU, or a device
the table does not know, there is none and no MFU is logged.
"""

from __future__ import annotations

import torch

__all__ = ["PEAK_TFLOPS", "mfu", "peak_tflops"]

# dense (no structured sparsity) peak TFLOP/s by a part of torch.cuda.get_device_name(), the
# first match winning (so the PCIe and NVL parts before the SXM ones), from the vendors' data
# sheets (half the bf16 figure they give with structured sparsity): bf16 on the tensor cores,
# fp32 on the CUDA cores
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "fp32": 51.2},
    "H100 NVL": {"bf16": 835.5, "fp32": 60.0},
    "H100": {"bf16": 989.4, "fp32": 66.9},
    "H200 NVL": {"bf16": 835.5, "fp32": 60.0},
    "H200": {"bf16": 989.4, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "fp32": 91.6},
}


def peak_tflops(device: torch.device | str, precision: str,
                given: float | None = None) -> float | None:
    """One device's dense peak in TFLOP/s for ``precision`` (``fp32`` or ``bf16``): ``given``
    (``--peak-tflops``) where set, else the table's for a CUDA device it names, else None."""
    if given is not None:
        if not given > 0:
            raise ValueError(f"--peak-tflops must be > 0, got {given}")
        return float(given)
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((peaks[precision] for part, peaks in PEAK_TFLOPS.items() if part in name), None)


def mfu(flops_per_token: float, tokens: int, seconds: float, ranks: int,
        peak: float) -> float:
    """The share of ``peak`` TFLOP/s one rank reached: the step's global ``tokens`` (of
    ``flops_per_token`` each) over all ``ranks`` of the grid, in ``seconds``."""
    return flops_per_token * tokens / ranks / seconds / (peak * 1e12)
