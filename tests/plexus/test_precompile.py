"""``python -m plexus.precompile``: the signatures it compiles are the ones calls use."""

import numpy as np
import pytest

pytest.importorskip("numba")

from plexus import kernels, precompile


def _csr(index_dtype, readonly):
    indptr = np.array([0, 2, 3, 3], index_dtype)
    indices = np.array([0, 2, 1], index_dtype)
    values = np.array([1.0, 2.0, 3.0], np.float32)
    for a in (indptr, indices, values):
        a.flags.writeable = not readonly
    return indptr, indices, values


@pytest.mark.parametrize("index_dtype, readonly, x_dtype", [
    (np.int32, False, np.float32), (np.int64, False, np.uint16), (np.int64, True, np.float32)])
def test_a_call_after_precompile_compiles_nothing_new(index_dtype, readonly, x_dtype):
    """The argument types :func:`plexus.precompile.signatures` builds are the types numba
    infers for a call (writeability included), so a call finds the compiled kernel."""
    assert precompile.precompile() == sum(len(s) for s in precompile.signatures().values())
    before = len(kernels.csr_spmm.signatures)
    indptr, indices, values = _csr(index_dtype, readonly)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    if x_dtype == np.uint16:  # bf16 bit patterns of the float32 values (exact for these)
        x = (x.view(np.uint32) >> 16).astype(np.uint16)
    out = np.empty((3, 4), np.float32)
    kernels.csr_spmm(indptr, indices, values, x, out, False)
    assert len(kernels.csr_spmm.signatures) == before
    assert out[0].tolist() == [0 + 2 * 8, 1 + 2 * 9, 2 + 2 * 10, 3 + 2 * 11]


def test_shards_split_the_signatures_and_bad_shards_are_refused(capsys):
    total = sum(len(s) for s in precompile.signatures(float64=True).values())
    assert sum(precompile.precompile(float64=True, shard=(k, 3)) for k in range(3)) == total
    assert precompile.main(["--shard", "1/2"]) == 0
    assert "kernel signatures compiled or loaded" in capsys.readouterr().out
    for bad in ("2/2", "x/2", "1"):
        with pytest.raises(SystemExit) as e:
            precompile.main(["--shard", bad])
        assert e.value.code == 2
    assert "need 0 <= K < N" in capsys.readouterr().err


@pytest.mark.parametrize("keep", ["float32", "bfloat16"])
def test_the_batch_norm_kernels_are_precompiled_for_the_calls_plexus_makes(keep):
    """plexus.norms calls its kernels with the types precompile builds (a bf16-kept block as
    its uint16 bits)."""
    import torch

    from common.grid import AxisGroup
    from plexus import norm_kernels, norms, ops

    precompile.precompile()
    names = ("column_sums", "normalize", "gradient_sums", "input_gradient")
    before = {n: len(getattr(norm_kernels, n).signatures) for n in names}
    norms.FUSED_MIN_ENTRIES = 0
    try:
        bn = norms.ShardedBatchNorm(8, torch.ones(20, dtype=torch.bool), 20,
                                    AxisGroup("z", None, 1, 0))
        q = (torch.randn(20, 8).requires_grad_() * 1.0)
        with ops.StoredIn(getattr(torch, keep)):
            bn(q, relu=True, over_grad=True).sum().backward()
    finally:
        norms.FUSED_MIN_ENTRIES = 1 << 16
    assert {n: len(getattr(norm_kernels, n).signatures) for n in names} == before
