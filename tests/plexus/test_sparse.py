"""plexus.sparse: BlockSparse SpMM (numba and torch kernels) against scipy."""

import itertools

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from plexus.sparse import BlockSparse, CSRBlock


def test_block_sparse_matmul_matches_scipy():
    rng = np.random.default_rng(0)
    row_sizes, col_sizes = [5, 0, 7], [4, 6]
    blocks = [[None, CSRBlock.from_scipy(sp.random(5, 6, 0.4, format="csr", random_state=1))],
              [None, None],
              [CSRBlock.from_scipy(sp.random(7, 4, 0.3, format="csr", random_state=2)), None]]
    m = BlockSparse(blocks, row_sizes, col_sizes)
    full = m.to_scipy().toarray()
    for dtype in (torch.float32, torch.float64):
        x = torch.from_numpy(rng.standard_normal((10, 3))).to(dtype)
        want = full @ x.double().numpy()
        for kernel in ("numba", "torch"):
            got = m.to("cpu", kernel=kernel).matmul(x)
            assert got.dtype == dtype
            np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-6)
    wide = sp.random(3, 5, 0.5, format="csr", random_state=3)
    one = CSRBlock(wide.indptr.astype(np.int64), wide.indices.astype(np.int64),
                   wide.data.astype(np.float32), (3, 5))
    np.testing.assert_allclose(BlockSparse([[one]], [3], [5]).matmul(torch.ones(5, 2)).numpy(),
                               wide @ np.ones((5, 2)), rtol=1e-6)
    with pytest.raises(ValueError, match="has shape"):
        BlockSparse([[one]], [4], [5])


def _uploads(monkeypatch, device=None):
    """Record the blocks copied off the CPU (CSRBlock.to_torch); with ``device``, the copy
    lands there instead (a fake device move: "cpu" keeps the data readable)."""
    calls = []
    to_torch = CSRBlock.to_torch

    def counted(self, target="cpu"):
        if torch.device(target).type != "cpu":
            calls.append(id(self))
        return to_torch(self, target if device is None else device)

    monkeypatch.setattr(CSRBlock, "to_torch", counted)
    return calls


def test_a_block_shared_by_two_matrices_is_copied_once(monkeypatch):
    """issue 29, finding 5: one device copy per distinct block, shared, host arrays let go."""
    import gc
    import weakref

    shared = CSRBlock.from_scipy(sp.random(4, 4, 0.5, format="csr", random_state=1))
    own = CSRBlock.from_scipy(sp.random(4, 4, 0.5, format="csr", random_state=2))
    a = BlockSparse([[shared, own]], [4], [4, 4])
    b = BlockSparse([[None], [shared]], [4, 4], [4])
    refs = [weakref.ref(shared), weakref.ref(own)]
    del shared, own
    calls = _uploads(monkeypatch)
    uploaded: dict = {}
    a.to("meta", uploaded=uploaded)
    b.to("meta", uploaded=uploaded)
    assert len(calls) == 2  # shared once, own once
    assert b._torch[1, 0] is a._torch[0, 0] and b.blocks[1][0] is a.blocks[0][0]
    assert a.blocks[0][0].indptr.device.type == "meta" and a.device.type == "meta"
    a.to("meta", uploaded=uploaded)  # already there: nothing more to copy
    assert len(calls) == 2
    del uploaded
    gc.collect()
    assert [r() for r in refs] == [None, None]  # the host blocks are gone
    without = BlockSparse([[CSRBlock.from_scipy(sp.identity(3, format="csr"))]], [3], [3])
    without.to("meta")  # no shared dict: each call copies its own blocks
    assert len(calls) == 3


def test_a_block_file_mapped_twice_is_copied_once(tmp_path, monkeypatch):
    m = sp.random(5, 5, 0.4, format="csr", random_state=3)
    blk = CSRBlock.from_scipy(m)
    for name in ("indptr", "indices", "values"):
        np.save(tmp_path / f"{name}.npy", getattr(blk, name))

    def mapped():
        return CSRBlock(*(np.load(tmp_path / f"{n}.npy", mmap_mode="r")
                          for n in ("indptr", "indices", "values")), (5, 5))

    calls = _uploads(monkeypatch)
    uploaded: dict = {}
    one, two = BlockSparse([[mapped()]], [5], [5]), BlockSparse([[mapped()]], [5], [5])
    one.to("meta", uploaded=uploaded)
    two.to("meta", uploaded=uploaded)
    assert len(calls) == 1 and two._torch[0, 0] is one._torch[0, 0]
    views = CSRBlock(*(np.load(tmp_path / f"{n}.npy", mmap_mode="r")[:] for n in (
        "indptr", "indices", "values")), (5, 5))  # views of maps: not known to be the file
    BlockSparse([[views]], [5], [5]).to("meta", uploaded=uploaded)
    assert len(calls) == 2


def test_to_a_device_and_back_keeps_the_matrix(monkeypatch):
    """Off the CPU the blocks hold the device tensors (here a fake device whose copies land on
    the CPU); back on the CPU they are host arrays again, the same matrix, and the numba and
    torch kernels run on them; on the CPU nothing is copied."""
    m = BlockSparse.single(sp.random(6, 4, 0.5, format="csr", random_state=4, dtype=np.float32))
    full = m.to_scipy().toarray()
    host = m.blocks[0][0]
    calls = _uploads(monkeypatch, device="cpu")
    assert m.to("cpu").blocks[0][0] is host and calls == []
    m.to("meta")
    assert len(calls) == 1 and isinstance(m.blocks[0][0].indptr, torch.Tensor)
    assert m.nnz == host.nnz and m.nbytes == host.nbytes
    m.to("cpu")
    assert isinstance(m.blocks[0][0].indptr, np.ndarray) and m.blocks[0][0] is not host
    np.testing.assert_array_equal(m.to_scipy().toarray(), full)
    x = torch.ones(4, 2)
    for kernel in ("numba", "torch"):
        np.testing.assert_allclose(m.to("cpu", kernel=kernel).matmul(x).numpy(),
                                   full @ np.ones((4, 2)), rtol=1e-6)


def test_unknown_kernel_is_refused():
    m = BlockSparse.single(sp.identity(3, format="csr", dtype=np.float32))
    with pytest.raises(ValueError, match="unknown SpMM kernel"):
        m.to("cpu", kernel="cusparse")


# --- the cache-blocked kernel (plexus.slicing): bit-identical to the row kernel -------------------


def _random_csr(rows: int, cols: int, density: float, seed: int, *, empty_rows: int = 0,
                index_dtype=np.int32) -> CSRBlock:
    """A random CSR block with ``empty_rows`` rows emptied (sorted columns in every row)."""
    m = sp.random(rows, cols, density, format="csr", random_state=seed, dtype=np.float32)
    m = m.tolil()
    for i in np.random.default_rng(seed).choice(rows, empty_rows, replace=False):
        m.rows[i], m.data[i] = [], []
    m = m.tocsr()
    m.sort_indices()
    return CSRBlock(m.indptr.astype(index_dtype), m.indices.astype(index_dtype),
                    m.data.astype(np.float32), (rows, cols))


def _both(m: BlockSparse, x: torch.Tensor, **blocked) -> tuple[torch.Tensor, torch.Tensor]:
    """(row kernel, blocked kernel) results of ``m @ x``."""
    rows = m.to("cpu", kernel="numba-rows").matmul(x)
    return rows, m.to("cpu", kernel="numba").matmul(x, **blocked)


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_blocked_spmm_is_bit_identical_for_every_slice_width(index_dtype):
    block = _random_csr(300, 257, 0.05, seed=5, empty_rows=40, index_dtype=index_dtype)
    m = BlockSparse([[block]], [300], [257])
    rng = np.random.default_rng(0)
    for d, dtype in ((128, torch.float32), (17, torch.float32), (3, torch.float64)):
        x = torch.from_numpy(rng.standard_normal((257, d))).to(dtype)
        for width in (1, 3, 64, 128, 256, 257, 10_000):  # 257 slices .. a single slice
            rows, blocked = _both(m, x, slice_cols=width)
            assert torch.equal(blocked, rows), (d, dtype, width)
        np.testing.assert_allclose(rows.double().numpy(),
                                   block.to_scipy().toarray() @ x.double().numpy(),
                                   rtol=1e-5, atol=1e-5)
    assert {w: p.num_slices for (w, _), p in block.slicings.items()} == {
        1: 257, 3: 86, 64: 5, 128: 3, 256: 2, 257: 1}  # 10_000 columns: the same as 257
    assert block.slicings[64, ()].cuts.dtype == np.uint16  # offsets from each row's start


def test_blocked_spmm_feature_tiles_are_bit_identical():
    m = BlockSparse([[_random_csr(90, 70, 0.1, seed=6, empty_rows=9)]], [90], [70])
    x = torch.randn(70, 64, generator=torch.Generator().manual_seed(1))
    for tile in (1, 8, 32, 64):
        for width in (5, 70):
            rows, blocked = _both(m, x, slice_cols=width, feature_tile=tile)
            assert torch.equal(blocked, rows), (tile, width)
    with pytest.raises(ValueError, match="must divide the width"):
        m.matmul(x, feature_tile=48)


def test_blocked_spmm_accumulates_across_the_blocks_of_a_block_row():
    """A 3 x 3 grid with missing blocks and an empty block row: each block row's blocks add
    into the same output rows, slice after slice, block after block, bit-identically."""
    row_sizes, col_sizes = [40, 0, 33], [25, 31, 19]
    present = {(0, 0), (0, 2), (2, 0), (2, 1), (2, 2)}
    blocks = [[_random_csr(row_sizes[r], col_sizes[c], 0.2, seed=10 * r + c, empty_rows=3)
               if (r, c) in present else None for c in range(3)] for r in range(3)]
    m = BlockSparse(blocks, row_sizes, col_sizes)
    x = torch.randn(75, 24, generator=torch.Generator().manual_seed(2))
    full = m.to_scipy().toarray() @ x.double().numpy()
    for width in (2, 7, 19, None):
        rows, blocked = _both(m, x, slice_cols=width)
        assert torch.equal(blocked, rows), width
        np.testing.assert_allclose(blocked.double().numpy(), full, rtol=1e-5, atol=1e-5)
    alone = BlockSparse([[blocks[2][1]]], [33], [31]).matmul(torch.zeros(31, 24))
    assert torch.equal(alone, torch.zeros(33, 24))  # overwrites: the output starts from 0


def test_blocked_spmm_reads_prepared_memory_mapped_blocks(tmp_path):
    """Read-only int64 maps, as plexus.data.mapped opens them: same result, no copy of A."""
    blk = _random_csr(120, 120, 0.08, seed=7, empty_rows=12, index_dtype=np.int64)
    for name in ("indptr", "indices", "values"):
        np.save(tmp_path / f"{name}.npy", getattr(blk, name))
    mapped = CSRBlock(*(np.load(tmp_path / f"{n}.npy", mmap_mode="r")
                        for n in ("indptr", "indices", "values")), (120, 120))
    assert not mapped.indptr.flags.writeable
    m = BlockSparse([[mapped, None], [None, mapped]], [120, 120], [120, 120])
    x = torch.randn(240, 32, generator=torch.Generator().manual_seed(3))
    for width in (9, 60, 120):
        rows, blocked = _both(m, x, slice_cols=width)
        assert torch.equal(blocked, rows), width
    plan = mapped.slicings[9, ()]
    assert plan.cuts.shape == (13, 120) and plan.nbytes == plan.cuts.nbytes + plan.chunks.nbytes


def test_column_slicing_cuts_each_row_where_its_columns_cross_a_slice():
    from plexus.slicing import block_slicing

    blk = _random_csr(50, 40, 0.3, seed=8, empty_rows=5)
    plan = block_slicing(blk, 7)
    assert block_slicing(blk, 7) is plan  # built once, kept on the block
    for i in range(50):
        cols = blk.indices[blk.indptr[i]:blk.indptr[i + 1]]
        for s in range(1, plan.num_slices):
            assert plan.cuts[s - 1, i] == np.searchsorted(cols, 7 * s)  # from the row's start
    assert plan.cuts.nbytes == (plan.num_slices - 1) * 50 * 2  # uint16 offsets
    assert plan.chunks[0] == 0 and plan.chunks[-1] == 50 and np.all(np.diff(plan.chunks) >= 0)


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_a_row_too_long_for_uint16_cuts_keeps_them_in_indptr_dtype(index_dtype):
    """A row of 65,536 nonzeros or more: its block's cuts take indptr's dtype, and both kinds
    of plan multiply bit for bit as the row kernel."""
    from plexus.slicing import CUT_ROW_LIMIT, block_slicing

    cols = 70_000
    rng = np.random.default_rng(11)
    for long_row in (CUT_ROW_LIMIT - 1, CUT_ROW_LIMIT):
        dense_row = np.sort(rng.choice(cols, long_row, replace=False))
        short = np.sort(rng.choice(cols, 9, replace=False))
        indices = np.concatenate([short, dense_row, short]).astype(index_dtype)
        indptr = np.array([0, 9, 9 + long_row, 18 + long_row], dtype=index_dtype)
        values = rng.standard_normal(indices.size).astype(np.float32)
        blk = CSRBlock(indptr, indices, values, (3, cols))
        m = BlockSparse([[blk]], [3], [cols])
        x = torch.randn(cols, 8, generator=torch.Generator().manual_seed(4))
        rows, blocked = _both(m, x, slice_cols=4_000)
        assert torch.equal(blocked, rows), long_row
        want = np.uint16 if long_row < CUT_ROW_LIMIT else index_dtype
        assert block_slicing(blk, 4_000).cuts.dtype == want


def test_slice_width_follows_the_cache(tmp_path, monkeypatch):
    from plexus import slicing

    for level, kind, size in ((1, "Data", "48K"), (1, "Instruction", "64K"),
                              (2, "Unified", "2048K"), (3, "Unified", "32M")):
        d = tmp_path / f"index{level}{kind[0]}"
        d.mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (d / name).write_text(f"{value}\n")
    assert slicing.last_level_cache_bytes(tmp_path) == 32 << 20
    assert slicing.last_level_cache_bytes(tmp_path / "missing") is None
    assert slicing.parse_size("491520K") == 480 << 20 and slicing.parse_size("2097152") == 2 << 20
    monkeypatch.setenv(slicing.CACHE_ENV, "1M")
    assert slicing.cache_bytes() == 1 << 20 and slicing.cache_bytes(4096) == 4096
    monkeypatch.setenv(slicing.CACHE_ENV, "lots")
    with pytest.raises(ValueError, match="cannot read a cache size"):
        slicing.cache_bytes()
    budget_rows = (32 << 20) // slicing.CACHE_SHARE // 512  # X rows of 128 float32
    assert slicing.slice_cols((10, 200_000), 6_400_000, 512, 32 << 20) == budget_rows
    assert slicing.slice_cols((10, budget_rows), 10**6, 512, 32 << 20) == budget_rows  # X fits
    assert slicing.slice_cols((10, 200_000), 100, 512, 32 << 20) == 200_000  # few rows referenced
    # short rows: at most one more slice than the mean row length (a 125K-row file block of
    # 265K nonzeros, about 2 per row: 3 slices, not 16, and plans of 2 cuts per row, not 15)
    assert slicing.slice_cols((125_000, 125_000), 265_000, 512, 32 << 20) == -(-125_000 // 3)
    assert slicing.slice_cols((200_000, 200_000), 6_400_000, 512, 32 << 20) == budget_rows


def test_default_cpu_kernel_is_blocked_where_x_exceeds_the_cache(monkeypatch):
    from plexus import slicing

    blk = _random_csr(64, 64, 0.2, seed=9)
    m = BlockSparse([[blk]], [64], [64])
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(4))
    rows = m.to("cpu", kernel="numba-rows").matmul(x)
    monkeypatch.setenv(slicing.CACHE_ENV, str(1 << 20))  # X (4 KiB) fits: one slice
    assert torch.equal(m.to("cpu", kernel="auto").matmul(x), rows)
    assert [p.num_slices for p in blk.slicings.values()] == [1]
    budget = 1024 * slicing.CACHE_SHARE  # 16 X rows of 64 bytes: 4 slices
    monkeypatch.setenv(slicing.CACHE_ENV, str(budget))
    assert torch.equal(m.matmul(x), rows)
    assert blk.slicings[16, ()].num_slices == 4


def test_take_rows_and_transpose_give_bit_identical_rows():
    """The last layer's labelled rows (plexus.data.shard.restrict_last_layer): the rows of a
    banded matrix with empty blocks, stacked into one row band, multiply to exactly the full
    product's rows; the transpose of those rows times dH gives exactly the full transpose
    times dH with zeros in the other rows (those terms add nothing)."""
    rng = np.random.default_rng(4)
    row_sizes, col_sizes = [9, 0, 13, 6], [7, 11]
    blocks = [[_random_csr(9, 7, 0.4, 1), None], [None, None],
              [_random_csr(13, 7, 0.3, 2, empty_rows=3), _random_csr(13, 11, 0.5, 3)],
              [None, _random_csr(6, 11, 0.4, 4)]]
    m = BlockSparse(blocks, row_sizes, col_sizes)
    m_t = BlockSparse([[None if b is None else b.transpose() for b in col]
                       for col in zip(*blocks)], col_sizes, row_sizes)
    rows = np.array([0, 4, 8, 9, 12, 15, 21, 23, 27])
    sub = m.take_rows(rows)
    assert sub.shape == (9, 18) and len(sub.blocks) == 1
    assert sub.to_scipy().toarray().tolist() == m.to_scipy()[rows].toarray().tolist()
    x = torch.from_numpy(rng.standard_normal((18, 5)).astype(np.float32))
    dh = torch.from_numpy(rng.standard_normal((9, 5)).astype(np.float32))
    scattered = torch.zeros(28, 5).index_copy_(0, torch.from_numpy(rows), dh)
    for kernel in ("numba", "numba-rows"):
        for a in (m, m_t, sub):
            a.to("cpu", kernel=kernel)
        assert torch.equal(sub.matmul(x), m.matmul(x)[rows]), kernel
        assert torch.equal(sub.transpose().to("cpu", kernel=kernel).matmul(dh),
                           m_t.matmul(scattered)), kernel
    assert m.take_rows(np.array([], dtype=np.int64)).matmul(x).shape == (0, 5)
    with pytest.raises(ValueError, match="ascend"):
        m.take_rows(np.array([3, 2]))


def _banded(m, row_sizes, col_sizes):
    """``m`` cut into a grid of CSR blocks (the layout of a prepared dataset's shard)."""
    ro, co = np.cumsum([0, *row_sizes]), np.cumsum([0, *col_sizes])
    blocks = [[CSRBlock.from_scipy(m[ro[i]:ro[i + 1], co[j]:co[j + 1]].tocsr())
               for j in range(len(col_sizes))] for i in range(len(row_sizes))]
    return BlockSparse(blocks, list(row_sizes), list(col_sizes))


@pytest.mark.parametrize("bands", [False, True])
def test_row_blocks_and_column_ranges_give_the_unblocked_bits(bands):
    """The overlapped aggregation's pieces: row blocks (views) multiply to the rows of one
    matmul, and column ranges of the transpose, added in increasing order, give one matmul's
    bits on both numba kernels (each element's terms in column order); torch's kernel sums
    the ranges' products (float rounding)."""
    m = sp.random(3000, 2500, density=0.01, format="csr", random_state=1, dtype=np.float32)
    a = _banded(m, [1000, 2000], [1200, 1300]) if bands else BlockSparse.single(m)
    mt = m.T.tocsr()
    a_t = _banded(mt, [1200, 1300], [1000, 2000]) if bands else BlockSparse.single(mt)
    x, dh = torch.randn(2500, 32), torch.randn(3000, 32)
    bounds, parts = a.row_blocks(5)
    assert bounds == [0, 600, 1200, 1800, 2400, 3000] and a.row_blocks(5)[1] is parts
    out = torch.empty(3000, 32)
    for (lo, hi), part in zip(itertools.pairwise(bounds), parts):
        assert part.shape == (hi - lo, 2500)
        part.matmul(x, out=out[lo:hi])
    assert torch.equal(out, a.matmul(x))
    for kernel in ("auto", "numba-rows", "torch"):
        a_t.to("cpu", kernel=kernel)
        want, got = a_t.matmul(dh), torch.zeros(2500, 32)
        for lo, hi in itertools.pairwise(bounds):
            a_t.matmul(dh, out=got, cols=(lo, hi, tuple(bounds)))
        if kernel == "torch":
            assert torch.allclose(got, want, atol=1e-5)
        else:
            assert torch.equal(got, want), kernel
    with pytest.raises(ValueError, match="not slice boundaries"):
        a_t.to("cpu", kernel="auto")
        a_t.matmul(dh, out=got, cols=(0, 7, tuple(bounds)))


def test_a_row_range_view_copies_nothing_and_multiplies_as_its_rows():
    """A row range on the host is a view of all three arrays (its indptr counts from the
    block's first nonzero): nothing copied, its own share in ``nbytes``; scipy, torch, the
    transpose, stacking and every kernel read it as the block's rows."""
    blk = CSRBlock.from_scipy(sp.random(50, 40, density=0.2, format="csr", random_state=2,
                                        dtype=np.float32))
    view = blk.row_range(10, 30)
    for mine, whole in zip((view.indptr, view.indices, view.values),
                           (blk.indptr, blk.indices, blk.values), strict=True):
        assert np.shares_memory(mine, whole)
    assert view.indptr[0] == blk.indptr[10] > 0
    assert view.nnz == int(blk.indptr[30] - blk.indptr[10])
    assert view.nbytes == 21 * 4 + view.nnz * 8
    rows = blk.to_scipy()[10:30]
    assert (view.to_scipy() != rows).nnz == 0
    assert (view.transpose().to_scipy() != rows.T.tocsr()).nnz == 0
    assert (CSRBlock.vstack([view, blk.row_range(30, 50)]).to_scipy()
            != blk.to_scipy()[10:50]).nnz == 0
    assert torch.equal(view.to_torch().to_dense(), torch.from_numpy(rows.toarray()))
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(5))
    whole = BlockSparse([[blk]], [50], [40]).to("cpu", kernel="numba-rows").matmul(x)
    part = BlockSparse([[view]], [20], [40])
    for kernel, kw in (("numba-rows", {}), ("numba", {"slice_cols": 7}), ("torch", {})):
        got = part.to("cpu", kernel=kernel).matmul(x, **kw)
        assert torch.allclose(got, whole[10:30], atol=1e-6) if kernel == "torch" else \
            torch.equal(got, whole[10:30]), kernel


@pytest.mark.parametrize("damage, code", [(None, 0), ("first", 1), ("decrease", 2),
                                          ("column", 3), ("nan", 4)])
def test_csr_check_finds_each_damage_on_both_paths(damage, code):
    """CSRBlock.problem: numpy below 2**20 nonzeros, the numba kernel above; the same verdicts
    (the kernel called directly here on the small block)."""
    from plexus import kernels

    blk = CSRBlock.from_scipy(sp.random(40, 30, density=0.3, format="csr", random_state=3,
                                        dtype=np.float32))
    indptr, indices, values = blk.indptr.copy(), blk.indices.copy(), blk.values.copy()
    if damage == "first":
        indptr[0] = 1
    elif damage == "decrease":
        indptr[5] = indptr[6] + 1
    elif damage == "column":
        indices[7] = 2**30
    elif damage == "nan":
        values[2] = np.nan
    assert kernels.csr_check(indptr, indices, values, 30) == code
    problem = CSRBlock(indptr, indices, values, (40, 30)).problem()
    assert (problem is None) == (code == 0)


@pytest.mark.parametrize("writes_out", [True, False])
def test_torchs_product_is_written_into_the_output_rows(writes_out, monkeypatch):
    """torch's kernel (a GPU's, or --spmm torch) writes each block row's product into the
    output's rows where torch's CSR mm takes an ``out`` (probed once per device), else through
    a new tensor: the same values either way, the other rows untouched."""
    from plexus import sparse

    assert sparse._mm_writes_out(torch.device("cpu"))
    monkeypatch.setattr(sparse, "_mm_writes_out", lambda device: writes_out)
    rng = np.random.default_rng(2)
    parts = [[sp.random(r, c, density=0.2, format="csr", dtype=np.float32, random_state=rng)
              for c in (7, 5)] for r in (6, 4)]
    a = BlockSparse([[CSRBlock.from_scipy(m) for m in row] for row in parts], [6, 4],
                    [7, 5]).to("cpu", kernel="torch")
    x = torch.randn(12, 3, generator=torch.Generator().manual_seed(0))
    out = torch.full((10, 3), float("nan"))
    got = a.matmul(x, out=out)
    want = torch.from_numpy(sp.bmat(parts).toarray()) @ x
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
