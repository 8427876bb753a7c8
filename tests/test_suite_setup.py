"""The test suite's own set-up: under ``make test`` (pytest-xdist, ``--dist loadgroup``) the
tests of one shared fixture really run on one worker (tests/conftest.py), so a multi-rank
launch shared by several tests runs once, not once per worker."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def shared() -> int:
    """A module-scoped fixture of ours: its tests form one xdist group (the module); its value
    is not used."""
    return os.getpid()


@pytest.fixture(scope="session", params=["one"])
def shared_per_param(request) -> str:
    """A parametrized session fixture of ours: its tests form one group per parameter."""
    return request.param


def test_tests_of_one_shared_fixture_form_one_xdist_group(request, shared):
    if not request.config.getoption("loadgroup", default=False):
        pytest.skip("runs only under pytest-xdist's --dist loadgroup (make test)")
    # xdist's worker appends "@group" to a grouped test's id and schedules by it; when a
    # pytest release changes how node ids are stored, the suffix (and the grouping) silently
    # disappears (pytest-dev/pytest-xdist#1386 on pytest 9.2)
    assert request.node.nodeid.endswith("@tests/test_suite_setup.py"), request.node.nodeid


def test_the_tests_of_a_parametrized_session_fixture_form_one_group(request, shared_per_param):
    if not request.config.getoption("loadgroup", default=False):
        pytest.skip("runs only under pytest-xdist's --dist loadgroup (make test)")
    # xdist takes the group from after the id's last "@" only when no "]" follows it, so a
    # group named "fixture[param]" would silently group nothing (the 4-rank llm launches ran
    # twice per transport that way)
    nodeid = request.node.nodeid
    assert nodeid.endswith("[one]@shared_per_param-one"), nodeid
    assert nodeid.rfind("@") > nodeid.rfind("]"), nodeid
