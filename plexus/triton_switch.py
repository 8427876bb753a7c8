"""Which of plexus's Triton kernels run: the switch (``PLEXUS_TRITON``), the import, and the
fallback when a kernel fails at its first launch.

The kernels (:mod:`plexus.dropout_triton`, :mod:`plexus.relu_triton`,
:mod:`plexus.spmm_triton`) are imported only where ``triton`` is installed and
``PLEXUS_TRITON`` is not ``0``; every one has a torch path with the same results (the same
bits for the dropout masks and the ReLU, float32 rounding for the SpMM) that runs otherwise.
Triton compiles a kernel at its first launch, which can fail on a node (no C compiler for its
launcher, a GPU its backend does not know): :func:`launch` then warns once and turns Triton
off for the process, so the caller takes its torch path.
"""

from __future__ import annotations

import importlib
import os
import warnings
from typing import Any

import torch

__all__ = ["failures", "launch", "triton_function", "uses_triton"]

_ACCELERATOR_ERROR = tuple(e for e in (getattr(torch, "AcceleratorError", None),) if e)
_FAILED: list[str] = []  # why a Triton kernel failed in this process (then: none is used)
_LAUNCHED: set[str] = set()  # the functions whose kernels have run here


def triton_function(module: str, name: str) -> Any:
    """``plexus.<module>.<name>`` where ``triton`` is installed, ``PLEXUS_TRITON`` is not
    ``0`` and no Triton kernel has failed to launch in this process; else None (the caller's
    torch path)."""
    if os.environ.get("PLEXUS_TRITON", "1") == "0" or _FAILED:
        return None
    try:
        kernels = importlib.import_module(f"plexus.{module}")
    except ImportError:
        return None
    return getattr(kernels, name)


def failures() -> list[str]:
    """Why a Triton kernel failed at its first launch in this process (empty: none did; one
    failure turns them all off)."""
    return list(_FAILED)


def uses_triton(device: torch.device | str) -> bool:
    """Whether plexus's Triton kernels run on ``device`` (a CUDA device, Triton installed and
    working, ``PLEXUS_TRITON`` not ``0``)."""
    return (torch.device(device).type == "cuda"
            and triton_function("dropout_triton", "keep_mask_triton") is not None)


def launch(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` for a function of :func:`triton_function`; None, with a warning, where
    its kernel fails before it has ever run here: the caller then takes its torch path, and
    so do all later calls. Once a kernel has run, its errors are raised; so are, always, an
    exhausted GPU memory and a ValueError (the arguments' checks)."""
    owner = getattr(fn, "__self__", None)  # an autograd Function's apply: its class
    name = (owner.__qualname__ if isinstance(owner, type) else
            getattr(fn, "__qualname__", None) or str(fn))
    if name in _LAUNCHED:
        return fn(*args)
    try:
        out = fn(*args)
    except (torch.OutOfMemoryError, ValueError,  # the GPU's memory, our own checks, a CUDA
            *_ACCELERATOR_ERROR):  # error of torch's (an earlier kernel's, surfacing here):
        raise  # not Triton's failing (the torch path would meet the same)
    except Exception as exc:  # compilation and launch errors come in many types
        _FAILED.append(f"{name}: {type(exc).__name__}: {exc}")
        warnings.warn(f"plexus: a Triton kernel ({name}) failed at its first launch "
                      f"({type(exc).__name__}: {str(exc)[:200]}); plexus's torch paths run "
                      "instead (the same results, slower). Set PLEXUS_TRITON=0 to skip "
                      "Triton.", RuntimeWarning, stacklevel=3)
        return None
    _LAUNCHED.add(name)
    return out
