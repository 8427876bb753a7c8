"""Keyword-only configs of a plexus run, one per component (STYLE.md rule 9).

    ModelConfig   depth, width, trainable features      -> plexus.model.PlexusGCN
    OptimConfig   AdamW                                  -> torch.optim.AdamW
    RunConfig     epochs, seed, CPU kernel and allocator -> plexus.trainer.train_gcn

How the graph is partitioned (permutation, padding) belongs to the data source
(plexus.data.open_source / InMemorySource); checkpoints to common.run.CheckpointConfig.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from plexus.sparse import SPMM_KERNELS


@dataclass(kw_only=True)
class ModelConfig:
    """The GCN.

    Attributes:
        num_layers: GCN layers L (>= 1).
        hidden: hidden width.
        learn_features: make the input features trainable parameters (as the paper does).
    """

    num_layers: int = 3
    hidden: int = 128
    learn_features: bool = False

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.hidden < 1:
            raise ValueError(f"need num_layers >= 1 and hidden >= 1; got num_layers="
                             f"{self.num_layers}, hidden={self.hidden}")


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW (decoupled weight decay)."""

    lr: float = 0.01
    weight_decay: float = 5e-4

    def __post_init__(self) -> None:
        if not self.lr > 0 or self.weight_decay < 0:
            raise ValueError(f"need lr > 0 and weight_decay >= 0; got lr={self.lr}, "
                             f"weight_decay={self.weight_decay}")


@dataclass(kw_only=True)
class RunConfig:
    """Length of the run and process-level switches.

    Attributes:
        epochs: full-graph epochs (>= 0).
        seed: weight seed (same seed, same numbers on any grid).
        spmm: CPU SpMM kernel: ``auto`` (numba if installed), ``numba`` or ``torch``.
        retain_freed_memory: keep large freed buffers in the heap on CPU (common.alloc), so
            every epoch reuses its activation pages.
    """

    epochs: int = 100
    seed: int = 0
    spmm: str = "auto"
    retain_freed_memory: bool = True

    def __post_init__(self) -> None:
        if self.epochs < 0:
            raise ValueError(f"need epochs >= 0, got {self.epochs}")
        if self.spmm not in SPMM_KERNELS:
            raise ValueError(f"unknown SpMM kernel {self.spmm!r}; choose from {SPMM_KERNELS}")


CONFIGS = {"model": ModelConfig, "optim": OptimConfig, "run": RunConfig}


def split_config(**fields: Any) -> dict[str, Any]:
    """``{"model": ModelConfig, "optim": OptimConfig, "run": RunConfig}`` from flat keyword
    fields (``split_config(num_layers=2, lr=0.05, epochs=10)``), for ``train_gcn(**...)``.

    Raises:
        TypeError: a field no config has.
    """
    names = {f.name: key for key, cls in CONFIGS.items() for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - set(names))
    if unknown:
        raise TypeError(f"unknown config field(s) {unknown}; known: {sorted(names)}")
    return {key: cls(**{k: v for k, v in fields.items() if names[k] == key})
            for key, cls in CONFIGS.items()}
