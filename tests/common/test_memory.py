"""common.memory: the resident-set meters the trainers and bench/memory.py log."""

import numpy as np
import pytest

from common.memory import peak_bytes, reset_peak, resident_bytes


def test_resident_and_peak_see_a_touched_block():
    before = resident_bytes()
    block = np.ones(32 << 17)  # 32 MiB, touched
    assert resident_bytes() >= before + (16 << 20) or resident_bytes() == 0  # 0: not Linux
    assert peak_bytes() >= 32 << 20
    del block


def test_peak_can_be_reset():
    block = np.ones(64 << 17)  # 64 MiB, touched
    high = peak_bytes()
    assert high >= 64 << 20
    del block
    if not reset_peak():
        pytest.skip("/proc/self/clear_refs is not writable here")
    assert peak_bytes() < high - (32 << 20)
