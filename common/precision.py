"""The training precisions of both engines (``--precision``): their names, the torch dtype of
each and the bytes of an element stored in it. One table, so that the trainers, their configs
and the performance model agree on what a name means."""

from __future__ import annotations

from typing import Any

__all__ = ["ELEMENT_BYTES", "PRECISIONS", "torch_dtype"]

PRECISIONS: tuple[str, ...] = ("fp32", "bf16")
ELEMENT_BYTES = {"fp32": 4, "bf16": 2}


def torch_dtype(precision: str) -> Any:
    """The torch dtype of ``precision`` (``torch.float32`` or ``torch.bfloat16``).

    Raises:
        ValueError: an unknown name (the message lists the choices).
    """
    import torch  # the performance model, which shares the names, runs without torch

    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
