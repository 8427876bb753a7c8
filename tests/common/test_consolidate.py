"""common.consolidate: one file from a checkpoint of permuted pieces, bit for bit, in chunks;
a truncated or foreign file refused by name, never a traceback from a reshape."""

import os
import re

import numpy as np
import pytest
import torch

from common.checkpoint import CheckpointError
from common.consolidate import SafetensorsReader, consolidate, read_consolidated, read_header
from common.slab import Slab
from tests.common.test_sharded import grid_slabs, write_layout


@pytest.fixture
def consolidated(tmp_path):
    """A checkpoint of a 2x2x2 grid (rows permuted, as learned features) consolidated in
    chunks of a few rows, and its tensors."""
    gen = torch.Generator().manual_seed(0)
    tensors = {"f": torch.randn(203, 5, generator=gen).to(torch.bfloat16),
               "f.exp_avg": torch.randn(203, 5, generator=gen), "b": torch.randn(5, generator=gen)}
    perm = np.random.default_rng(0).permutation(204)
    rows = grid_slabs((203, 5), 2, 2, 2, perm=perm, pad_rows=204)
    layouts = {"f": rows, "f.exp_avg": rows, "b": [Slab.whole((5,))] * len(rows)}
    write_layout(tmp_path / "ck" / "step-00000001", 1, tensors, layouts)
    out = consolidate(tmp_path / "ck", tmp_path / "out.safetensors", chunk_bytes=64)
    return out, tensors


def test_permuted_pieces_consolidate_bit_for_bit(consolidated):
    out, tensors = consolidated
    got, meta = read_consolidated(out)
    assert meta == {"k": 1} and sorted(got) == sorted(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_a_truncated_or_foreign_file_is_refused_naming_it(consolidated, tmp_path):
    out, _ = consolidated
    data = out.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:len(data) - 7])
    with pytest.raises(CheckpointError, match=re.escape(str(cut)) + " is truncated"):
        read_consolidated(cut)
    with pytest.raises(ValueError, match="is truncated"):
        SafetensorsReader(cut)
    with pytest.raises(ValueError, match="is truncated"):
        read_header(cut)
    noise = tmp_path / "noise.safetensors"
    for seed in range(20):  # the length read from noise: huge, or pointing past the file
        noise.write_bytes(np.random.default_rng(seed).bytes(100))
        with pytest.raises(CheckpointError, match=re.escape(str(noise))
                           + " is not a safetensors file"):
            read_consolidated(noise)
    head = tmp_path / "head.safetensors"
    head.write_bytes(data[:8 + 3])  # the header cut short
    with pytest.raises(CheckpointError, match="is not a safetensors file"):
        read_consolidated(head)
    with pytest.raises(CheckpointError, match="No such file"):
        read_consolidated(tmp_path / "absent.safetensors")
    assert os.path.getsize(out) == len(data)  # (the original is untouched)
