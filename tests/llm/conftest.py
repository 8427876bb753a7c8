"""Fixtures of the llm tests: one torch thread everywhere, a small GPT config, and the two
shared multi-rank launches (per-rank functions and plain helpers: tests/llm/helpers.py)."""

from __future__ import annotations

import pytest

from llm.model import GPTConfig
from tests.distributed import COMMS, run_ranks
from tests.llm.helpers import eight_rank_checks, four_rank_checks


@pytest.fixture(autouse=True)
def one_thread(threads):
    """Every llm test runs with one torch thread (tests/conftest.py's ``threads``)."""
    return threads


@pytest.fixture
def small_config(tiny_gpt_config) -> GPTConfig:
    """tests/conftest.py's ``tiny_gpt_config`` (:data:`tests.llm.helpers.SMALL`)."""
    return tiny_gpt_config


@pytest.fixture(scope="session", params=COMMS)
def four_ranks(request):
    """Per rank, the results of every 4-rank check (one launch per transport for the whole
    session: every test that uses it runs on gloo and on MPI)."""
    return run_ranks(four_rank_checks, 4, timeout=600, comm=request.param)


@pytest.fixture(scope="session")
def eight_ranks(tmp_path_factory):
    """Per rank, the results of every 8-rank check (one launch for the whole session)."""
    return run_ranks(eight_rank_checks, 8, str(tmp_path_factory.mktemp("llm8")), timeout=600)
