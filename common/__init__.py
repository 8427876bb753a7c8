"""Shared core: named process grids, distributed start-up, differentiable collectives along
grid axes with byte accounting, and a performance model.

Other HPC codes can import it on its own (the README's example is tests/common/core_snippet.py)::

    from common import ProcessGrid, init_distributed, CommStats
    from common import collectives, autograd

    ctx = init_distributed()     # closes itself at exit; or `with init_distributed() as ctx:`

:mod:`common.run` holds the plumbing both trainers share (flags, metrics, exits).

``common.grid`` and ``common.comm_stats`` are pure Python; names that need torch are loaded on
first use, so ``import common.grid`` does not import torch.

Importing ``common`` turns on PyTorch's huge pages for large CPU buffers
(:func:`common.alloc.use_huge_pages`; ``THP_MEM_ALLOC_ENABLE=0`` in the environment keeps them
off): import it before allocating large tensors.
"""

from typing import Any

from common.alloc import use_huge_pages
from common.comm_stats import CommStats, ring_bytes
from common.grid import AXONN_AXES, PLEXUS_AXES, AxisGroup, ProcessGrid, ceil_div, round_up

_LAZY = {
    "DistContext": "common.dist",
    "init_distributed": "common.dist",
    "shutdown": "common.dist",
    "fail_all_ranks": "common.failure",
}

use_huge_pages()  # before any large CPU allocation of code that imports common first

__all__ = ["AXONN_AXES", "PLEXUS_AXES", "AxisGroup", "CommStats", "ProcessGrid", "ceil_div",
           "ring_bytes", "round_up", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'common' has no attribute {name!r}")
