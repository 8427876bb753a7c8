"""Shared core: named process grids, distributed start-up, differentiable collectives along
grid axes with byte accounting, and a performance model.

Other HPC codes can import it on its own (the README's example is tests/common/core_snippet.py)::

    from common import ProcessGrid, init_distributed, CommStats
    from common import collectives, autograd

    ctx = init_distributed()     # closes itself at exit; or `with init_distributed() as ctx:`

:mod:`common.run` holds the plumbing both trainers share (flags, metrics, exits).

``common.grid`` and ``common.comm_stats`` are pure Python; names that need torch are loaded on
first use, so ``import common.grid`` does not import torch.
"""

from typing import Any

from common.comm_stats import CommStats, ring_bytes
from common.grid import AXONN_AXES, PLEXUS_AXES, AxisGroup, ProcessGrid, ceil_div, round_up

_LAZY = {
    "DistContext": "common.dist",
    "init_distributed": "common.dist",
    "shutdown": "common.dist",
    "fail_all_ranks": "common.failure",
}

__all__ = ["AXONN_AXES", "PLEXUS_AXES", "AxisGroup", "CommStats", "ProcessGrid", "ceil_div",
           "ring_bytes", "round_up", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'common' has no attribute {name!r}")
