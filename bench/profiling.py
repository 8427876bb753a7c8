"""The benches' ``--profile``: torch.profiler over one step (an epoch, an optimizer step) after
the timed ones, so that it slows none of them, and the costliest entries of it.

Used by bench/gcn_epoch.py (one epoch of each side, through the trainer's epoch hook:
:class:`ProfileAfter`) and bench/llm_throughput.py (one step of each side:
:func:`profile_step`). On a GPU the entries are the device's kernels by device time, and
:attr:`StepProfile.busy_ms` their sum: a step whose kernels take much less than its wall time
is bound by the host's launches, not by the device; on the CPU they are the operators by
their own CPU time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


def _activities(device: torch.device) -> list:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def _self_ms(event, device: torch.device) -> float | None:
    """An averaged event's own time in ms: device time of a kernel on a GPU (None for a host
    event there), CPU time on the CPU."""
    if device.type != "cuda":
        return event.self_cpu_time_total / 1000
    if event.device_type != torch.autograd.DeviceType.CUDA:
        return None
    us = getattr(event, "self_device_time_total", None)
    return (getattr(event, "self_cuda_time_total", 0) if us is None else us) / 1000


def top_ops(prof: torch.profiler.profile, device: torch.device,
            num: int = 12) -> list[tuple[str, float, int]]:
    """The ``num`` costliest entries of a profile, (name, self ms, calls): the GPU's kernels
    by device time on a GPU, the operators by CPU time on the CPU."""
    rows = []
    for e in prof.key_averages():
        ms = _self_ms(e, device)
        if ms is not None:
            rows.append((e.key, ms, e.count))
    return sorted(rows, key=lambda r: -r[1])[:num]


def busy_ms(prof: torch.profiler.profile, device: torch.device) -> float | None:
    """The summed device time of every kernel of a profile on a GPU (None on the CPU, where
    the operators nest and their times do not add up to a busy time)."""
    if device.type != "cuda":
        return None
    return sum(ms for e in prof.key_averages() if (ms := _self_ms(e, device)) is not None)


class ProfileAfter:
    """torch.profiler over step ``after + 1``: called after each step with its number
    (1-based), it starts the profiler after step ``after`` and stops it after the next;
    :attr:`top` is then its :func:`top_ops`."""

    def __init__(self, after: int, device: torch.device) -> None:
        self.after, self.device = after, device
        self.prof: torch.profiler.profile | None = None
        self.top: list[tuple[str, float, int]] = []

    def __call__(self, step: int) -> None:
        if step == self.after:
            self.prof = torch.profiler.profile(activities=_activities(self.device))
            self.prof.start()
        elif step == self.after + 1 and self.prof is not None:
            self.prof.stop()
            self.top = top_ops(self.prof, self.device)
            self.prof = None


@dataclass(frozen=True)
class StepProfile:
    """One profiled step: its costliest entries (:func:`top_ops`), its wall time from an idle
    device to a finished one, and (on a GPU) its kernels' summed device time."""

    top: list[tuple[str, float, int]]
    wall_ms: float
    busy_ms: float | None

    def busy_share(self) -> float | None:
        """The kernels' time over the wall time (on a GPU), at most 1 (kernels on several
        streams may overlap)."""
        if self.busy_ms is None or self.wall_ms <= 0:
            return None
        return min(1.0, self.busy_ms / self.wall_ms)


def profile_step(step: Callable[[], object], device: torch.device) -> StepProfile:
    """``step()`` once under torch.profiler, timed from a device with nothing queued to one
    that has finished it."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    with torch.profiler.profile(activities=_activities(device)) as prof:
        start = time.perf_counter()
        step()
        sync()
        wall = 1000 * (time.perf_counter() - start)
    return StepProfile(top_ops(prof, device), wall, busy_ms(prof, device))


def print_top(title: str, top: list[tuple[str, float, int]]) -> None:
    """``title`` and one line per entry of a :func:`top_ops` list."""
    print(title)
    for name, ms, calls in top:
        print(f"    {ms:9.2f} ms  {calls:5d} calls  {name[:90]}")
