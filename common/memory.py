"""Memory meters of this process: resident set size now, its peak, a reset of the peak, and on a
GPU the caching allocator's peaks beside them.

Linux reads ``/proc/self`` (``statm``, ``VmHWM``, ``clear_refs``); elsewhere the peak falls back
to ``getrusage`` (never reset) and the current size to 0. On a CUDA device :func:`peaks` adds the
peak bytes allocated to tensors and reserved by the caching allocator
(``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``). Both trainers report
:func:`peaks_per_rank_max` in their summaries, worded by :func:`describe_peaks`;
``bench/memory.py`` resets the peaks (:func:`reset_peaks`) before a measured step.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["GPU_PEAK_KEYS", "describe_peaks", "gpu_peaks", "peak_bytes", "peaks",
           "peaks_per_rank_max", "release", "reset_peak", "reset_peaks", "resident_bytes"]

# the keys :func:`peaks` adds on a CUDA device (absent on the CPU)
GPU_PEAK_KEYS = ("gpu_peak_allocated_bytes", "gpu_peak_reserved_bytes")
MIB = 2.0**20


def resident_bytes() -> int:
    """Current resident set size of this process (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_bytes() -> int:
    """Peak resident set size of this process since it started or since the last
    :func:`reset_peak` (Linux ``VmHWM``; elsewhere ``ru_maxrss``, never reset)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import resource

    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def reset_peak() -> bool:
    """Start a new peak for :func:`peak_bytes` at the current resident size (Linux: writes
    5 to ``/proc/self/clear_refs``); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _cuda(device: Any) -> Any:
    """``device`` as a torch device if it is a CUDA one, else None."""
    if device is None:
        return None
    import torch

    dev = torch.device(device)
    return dev if dev.type == "cuda" else None


def gpu_peaks(device: Any) -> dict[str, int]:
    """``{"gpu_peak_allocated_bytes", "gpu_peak_reserved_bytes"}`` of a CUDA ``device`` since
    the process started or the last :func:`reset_peaks`; ``{}`` for any other device."""
    dev = _cuda(device)
    if dev is None:
        return {}
    import torch

    return {"gpu_peak_allocated_bytes": int(torch.cuda.max_memory_allocated(dev)),
            "gpu_peak_reserved_bytes": int(torch.cuda.max_memory_reserved(dev))}


def peaks(device: Any = None) -> dict[str, int]:
    """This process's peaks: ``peak_bytes`` (resident set, :func:`peak_bytes`) and, when
    ``device`` is a CUDA device, :data:`GPU_PEAK_KEYS` (:func:`gpu_peaks`)."""
    return {"peak_bytes": peak_bytes(), **gpu_peaks(device)}


def reset_peaks(device: Any = None) -> bool:
    """Start new peaks: the resident one (:func:`reset_peak`; its result is returned) and, on a
    CUDA ``device``, the caching allocator's (``torch.cuda.reset_peak_memory_stats``)."""
    dev = _cuda(device)
    if dev is not None:
        import torch

        torch.cuda.reset_peak_memory_stats(dev)
    return reset_peak()


def peaks_per_rank_max(device: Any = None, transport: Any = None) -> dict[str, int]:
    """:func:`peaks` of every rank, the maximum over ranks of each, on every rank (one tiny
    all-reduce on ``device``: collective; ``transport`` as in
    :func:`common.exchange.max_over_ranks`). Every rank passes the same kind of device, so
    every rank reduces the same keys."""
    from common.exchange import max_over_ranks

    mine = peaks(device)
    keys = sorted(mine)
    return dict(zip(keys, (int(v) for v in max_over_ranks([mine[k] for k in keys],
                                                          device or "cpu", transport))))


def describe_peaks(p: Mapping[str, Any]) -> str:
    """The summary wording of both trainers: ``"812 MiB resident per rank (max)"``, with
    ``"; GPU 301 MiB allocated, 420 MiB reserved per rank (max)"`` after it when ``p`` holds
    the GPU peaks (never on the CPU)."""
    text = f"{p['peak_bytes'] / MIB:,.0f} MiB resident per rank (max)"
    if all(k in p for k in GPU_PEAK_KEYS):
        text += (f"; GPU {p['gpu_peak_allocated_bytes'] / MIB:,.0f} MiB allocated, "
                 f"{p['gpu_peak_reserved_bytes'] / MIB:,.0f} MiB reserved per rank (max)")
    return text


def release(device: Any = None) -> None:
    """Free what nothing refers to any more: collect garbage (cycles included) and, on a CUDA
    ``device``, hand the caching allocator's unused blocks back to the driver, so that what a
    finished run held is free for the next one (``plexus.train --runs``)."""
    gc.collect()
    if _cuda(device) is not None:
        import torch

        torch.cuda.empty_cache()
