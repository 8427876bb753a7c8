"""Fixtures shared by every test directory (the plain helpers live in tests/distributed.py,
which test modules import; conftest modules are not imported directly)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from tests.distributed import require_mpiexec


def pytest_configure(config) -> None:
    """Under pytest-xdist (``make test`` runs ``TEST_WORKERS`` workers), pin each worker to its
    own share of the cores, so that what a test launches sees the cores it really has: ranks
    split that share (torch threads = cores / ranks) and MPI waits sleep at two or more ranks
    per core (tests/distributed.py), instead of two workers' ranks spinning on the same cores.
    With fewer cores than workers nothing is pinned. The controller first fills numba's cache
    (:func:`_precompile_kernels`)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get(
        "PYTEST_XDIST_WORKER_COUNT")
    if not worker and getattr(config.option, "numprocesses", None):
        _precompile_kernels(config.option.numprocesses)
    if not worker or not count or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    index, workers = int(worker.removeprefix("gw")), int(count)
    if len(cores) < workers:
        return
    share = len(cores) // workers
    os.sched_setaffinity(0, cores[index * share:(index + 1) * share])
    import torch

    torch.set_num_threads(share)


def _precompile_kernels(workers) -> None:
    """On a cold numba cache (a fresh clone), every rank of a multi-rank test compiles the
    kernels it calls at the same time, a compile per signature and rank on the same cores;
    compile each signature once, before the workers start, one process per core (``python -m
    plexus.precompile``; on a warm cache this only loads them)."""
    import subprocess
    import sys
    from pathlib import Path

    procs = max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                       else os.cpu_count() or 1, int(workers) if str(workers).isdigit() else 2))
    root = Path(__file__).resolve().parents[1]
    runs = [subprocess.Popen([sys.executable, "-m", "plexus.precompile", "--float64",
                              "--shard", f"{k}/{procs}"], cwd=root, stdout=subprocess.DEVNULL)
            for k in range(procs)]
    for run in runs:
        run.wait()  # a failure here shows again, with its test, where the kernel is called


def _shared_fixture_group(item) -> str | None:
    """The pytest-xdist group of a test that uses a session- or module-scoped fixture of ours
    (a multi-rank launch, a trained model): every test that shares one instance runs on the
    same worker, so the fixture runs once, not once per worker. Session fixtures group by
    name (and parameter), module fixtures by module."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    group = None
    for name in info.names_closure:
        defs = info.name2fixturedefs.get(name)
        if not defs or not getattr(defs[-1].func, "__module__", "").startswith("tests"):
            continue
        scope = defs[-1].scope
        if scope == "session":
            param = getattr(getattr(item, "callspec", None), "params", {}).get(name)
            # no brackets: xdist reads an id's group only after its last "]"
            return name if param is None else f"{name}-{param}"
        if scope in ("module", "package") and group is None:
            group = item.nodeid.partition("::")[0]
    return group


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the groups off the items
def pytest_collection_modifyitems(config, items) -> None:
    """Under pytest-xdist's ``--dist loadgroup`` (``make test``), keep the tests of one shared
    fixture on one worker (:func:`_shared_fixture_group`): the 8-rank llm launch alone takes
    about two minutes, once per worker that needs it."""
    if config.getoption("loadgroup", default=False):
        for item in items:
            if (group := _shared_fixture_group(item)) is not None:
                item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    """Every test leaves torch's thread count as it found it: a test that calls a CLI's
    ``main`` in process (which sets ``--threads``) would otherwise leave more threads than the
    worker's cores to every later test in the process, and on a pinned pytest-xdist worker
    two threads on one core made a later test many times slower."""
    import torch

    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


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
def pooling(monkeypatch):
    """common.dense's pool of tall buffers, fresh (no marks or buffers of other tests) and on;
    off again after the test."""
    from common import dense

    monkeypatch.setattr(dense, "_POOL", dense._Pool())
    dense.pool_freed(True)
    yield dense._POOL
    dense.pool_freed(False)


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
