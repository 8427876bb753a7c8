"""Fixtures shared by every test directory (the plain helpers live in tests/distributed.py,
which test modules import; conftest modules are not imported directly)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.distributed import require_mpiexec


@pytest.fixture(autouse=True)
def _cpu_unless_gpu_test(request, monkeypatch) -> None:
    """Tests mean the CPU unless marked ``gpu``: ``--device`` defaults to ``$HPC_DEVICE``
    (common.run), so on a GPU host an in-process ``train_main([...])`` would otherwise pick
    ``auto`` and a GPU."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("HPC_DEVICE", "cpu")


@pytest.fixture
def mpiexec() -> str:
    """Path of ``mpiexec`` (beside sys.executable first, then PATH); skips without one."""
    return require_mpiexec()


@pytest.fixture
def threads() -> Iterator[Callable[[int], None]]:
    """One torch thread for an in-process test (tiny GEMMs gain nothing from threads, and two
    threads on two busy cores slow them tenfold); call ``threads(n)`` for another count. The
    previous count is restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture
def tiny_graph():
    """A 203-node planted-partition graph (a prime node count: every grid but 1x1x1 pads),
    5 classes, 7 features, a few nodes in no split (tests/plexus/data/shards.py)."""
    from tests.plexus.data.shards import small_graph

    return small_graph()


@pytest.fixture
def tiny_gpt_config():
    """A 2-layer GPT config, d_model 32, 4 query / 2 key-value heads (tests/llm/helpers.py)."""
    from tests.llm.helpers import SMALL

    return SMALL
