"""common.slab: SlabFiller against the plain gather of every row, on random layouts; the reads
it makes of a piece are the rows it wants."""

import numpy as np
import pytest

from common.grid import ceil_div
from common.slab import RowIndex, Slab, SlabFiller
from tests.common.test_sharded import grid_slabs


def local_of(full: np.ndarray, slab: Slab) -> np.ndarray:
    """Reference: the local tensor of ``slab``, gathered row by row from the full tensor."""
    f2 = full.reshape(1, -1) if full.ndim == 1 else full
    block = np.zeros((slab.row_ids().size, slab.width), full.dtype)
    for k, i in enumerate(slab.row_ids()):
        if i < f2.shape[0]:
            hi = min(slab.cols[1], f2.shape[1])
            block[k, :max(hi - slab.cols[0], 0)] = f2[i, slab.cols[0]:hi]
    if slab.flat is None:
        return block if full.ndim == 2 else block.reshape(-1)
    out = np.zeros(slab.flat[1] - slab.flat[0], full.dtype)
    got = block.reshape(-1)[slab.flat[0]:slab.flat[1]]
    out[:got.size] = got
    return out


def _random_layout(rng, shape, permuted):
    rows = shape[0] if len(shape) == 2 else 1
    x, y, z = (int(v) for v in rng.integers(1, 4, size=3))
    x = x if len(shape) == 2 else 1
    pad = ceil_div(rows, x) * x + (x if permuted else 0)
    perm = rng.permutation(pad) if permuted and len(shape) == 2 else None
    return grid_slabs(shape, x, y, z, perm=perm, pad_rows=pad)


@pytest.mark.parametrize("seed", range(4))
def test_filler_equals_the_plain_gather_on_random_layouts(seed):
    """Range and explicit-id pieces, split columns and flat ranges that cut rows, narrow
    and wide rows (runs read whole, lone rows read alone), targets in chunks of rows (as
    common.consolidate reads) that reuse one RowIndex per piece."""
    rng = np.random.default_rng(seed)
    for _ in range(40):
        shape = ((int(rng.integers(1, 60)), int(rng.integers(1, 40))) if rng.random() < 0.8
                 else (int(rng.integers(1, 50)),))
        full = rng.standard_normal(shape).astype(np.float32)
        src = _random_layout(rng, shape, rng.random() < 0.5)
        pieces = [(RowIndex(s.rows) if isinstance(s.rows, np.ndarray) else s.rows, s,
                   local_of(full, s).reshape(-1)) for s in src]
        targets = _random_layout(rng, shape, rng.random() < 0.5)
        rows = shape[0] if len(shape) == 2 else 1
        step = int(rng.integers(1, rows + 1))
        targets += [Slab(shape, (lo, min(rows, lo + step)), (0, shape[-1]))
                    for lo in range(0, rows, step)]
        for target in targets:
            filler = SlabFiller(target, np.dtype(np.float32))
            for rows_of, s, data in pieces:
                filler.fill(rows_of, s.cols, s.flat, data)
            np.testing.assert_array_equal(filler.result(), local_of(full, target))


def test_a_chunk_of_a_permuted_piece_reads_only_its_rows():
    """The reads of a chunk cover its rows, plus under a page between two rows read at once:
    never the piece around them."""
    n, w = 20_000, 64
    rng = np.random.default_rng(0)
    full = rng.standard_normal((n, w)).astype(np.float32)
    ids = rng.permutation(n)
    data = full[ids].reshape(-1)
    index = RowIndex(ids)
    read_elements = []

    def read(start, out):
        read_elements.append(out.size)
        out[...] = data[start:start + out.size].reshape(out.shape)

    for lo, hi in [(0, 50), (5000, 7000), (n - 1, n)]:
        read_elements.clear()
        filler = SlabFiller(Slab((n, w), (lo, hi), (0, w)), np.dtype(np.float32))
        filler.fill(index, (0, w), None, read)
        np.testing.assert_array_equal(filler.result(), full[lo:hi])
        assert sum(read_elements) <= (hi - lo) * (w + 4096 // 4), (lo, hi)
        if hi - lo <= 50:  # (a tenth of the rows hits nearly every page of the piece)
            assert sum(read_elements) < n * w // 100, (lo, hi)
