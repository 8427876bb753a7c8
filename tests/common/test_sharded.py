"""common.sharded: pieces written on one layout read back on any other, checksums, fallback."""

import json

import numpy as np
import pytest
import torch

from common import sharded
from common.checkpoint import CheckpointError
from common.grid import ceil_div, round_up
from common.sharded import Slab


def local_of(full: torch.Tensor, slab: Slab) -> torch.Tensor:
    """Reference: the local tensor of ``slab``, straight from the full tensor."""
    f2 = full.reshape(1, -1) if full.dim() == 1 else full
    ids = slab.row_ids()
    n_rows = max(int(ids.max()) + 1 if ids.size else 0, f2.shape[0])
    padded = torch.zeros(n_rows, max(slab.cols[1], f2.shape[1]), dtype=full.dtype)
    padded[: f2.shape[0], : f2.shape[1]] = f2
    block = padded[torch.from_numpy(ids)][:, slab.cols[0]: slab.cols[1]]
    if slab.flat is None:
        return block if full.dim() == 2 else block.reshape(-1)
    flat = torch.zeros(max(block.numel(), slab.flat[1]), dtype=full.dtype)
    flat[: block.numel()] = block.reshape(-1)
    return flat[slab.flat[0]: slab.flat[1]]


def grid_slabs(shape, x, y, z, perm=None, pad_rows=None):
    """Slabs of a plexus-like layout: rows split over x (in ``perm`` order, padded), columns
    over y, the block flattened and split over z."""
    rows, cols = shape if len(shape) == 2 else (1, shape[0])
    n_pad = pad_rows or round_up(rows, x)
    order = np.arange(n_pad) if perm is None else perm
    c_pad = round_up(cols, y)
    out = []
    for i in range(x):
        for j in range(y):
            ids = order[i * n_pad // x:(i + 1) * n_pad // x]
            block_cols = (j * c_pad // y, (j + 1) * c_pad // y)
            numel = ids.size * (block_cols[1] - block_cols[0])
            size = ceil_div(numel, z)
            for k in range(z):
                out.append(Slab(tuple(shape), ids if perm is not None else
                                (int(ids[0]), int(ids[-1]) + 1), block_cols,
                                (k * size, (k + 1) * size) if z > 1 else None))
    return out


def write_layout(path, step, tensors, layouts):
    """Write ``tensors`` (name -> full) as each rank of ``layouts`` (name -> slabs) would,
    without torch.distributed: the files and manifest of :func:`common.sharded.save`."""
    path.mkdir(parents=True)
    world = len(next(iter(layouts.values())))
    records, descs = [], []
    for r in range(world):
        mine = {n: (local_of(tensors[n], layouts[n][r]), layouts[n][r]) for n in tensors}
        records.append(sharded._write_rank_file(path, r, sorted(mine), mine))
        descs.append({n: s.describe() | {"dtype": sharded._dtype_name(t)}
                      for n, (t, s) in mine.items()})
    manifest = sharded._manifest(step, {"k": 1}, descs, records)
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


CASES = [  # (source grid, target grid): lopsided, padded, more and fewer ranks
    ((2, 1, 2), (3, 2, 1)),
    ((1, 1, 1), (2, 2, 2)),
    ((4, 1, 2), (1, 2, 4)),
    ((2, 2, 2), (1, 1, 1)),
]


@pytest.mark.parametrize("src,dst", CASES)
@pytest.mark.parametrize("permuted", [False, True])
def test_reshard_reads_exactly_the_target_layout(tmp_path, src, dst, permuted):
    gen = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(13, 7, generator=gen), "v": torch.randn(5, generator=gen),
               "w.exp_avg": torch.randn(13, 7, generator=gen)}
    rng = np.random.default_rng(1)

    def layouts(grid, pad):
        perm = rng.permutation(pad) if permuted else None
        w = grid_slabs((13, 7), *grid, perm=perm, pad_rows=pad)
        v = grid_slabs((5,), 1, grid[1], 1)
        return {"w": w, "w.exp_avg": w, "v": [v[(r // grid[2]) % len(v)] for r in
                                              range(len(w))]}

    pad_src = round_up(13, src[0]) + (src[0] if permuted else 0)
    path = write_layout(tmp_path / "step-00000001", 1, tensors, layouts(src, pad_src))
    ck = sharded.ShardedCheckpoint(path, json.loads((path / "manifest.json").read_text()))
    pad_dst = round_up(13, dst[0])
    for name, slabs in layouts(dst, pad_dst).items():
        for slab in slabs:
            got = ck.read(name, slab)
            torch.testing.assert_close(got, local_of(tensors[name], slab), rtol=0, atol=0)


def test_save_load_round_trip_keep_and_fallback(tmp_path, capsys):
    w = torch.arange(12.0).reshape(3, 4)
    b = torch.arange(4, dtype=torch.bfloat16)
    for step in (1, 2, 3):
        sharded.save(tmp_path, step, {"w": (w * step, Slab.whole((3, 4))),
                                      "b": (b, Slab.whole((4,)))},
                     meta={"epoch": step}, files={"history.json": b"[1]"}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]
    ck = sharded.load_latest(tmp_path)
    assert ck.step == 3 and ck.meta == {"epoch": 3} and ck.files == {"history.json": b"[1]"}
    torch.testing.assert_close(ck.read("w", Slab.whole((3, 4))), w * 3)
    assert ck.read("b", Slab.whole((4,))).dtype == torch.bfloat16
    torch.testing.assert_close(ck.read("b", Slab((4,), (0, 1), (1, 3))), b[1:3])
    # damage the newest: every reader falls back to step 2, saying why
    shard = tmp_path / "step-00000003" / "shard-00000.bin"
    data = bytearray(shard.read_bytes())
    data[5] ^= 0xFF
    shard.write_bytes(bytes(data))
    ck = sharded.load_latest(tmp_path)
    assert ck.step == 2
    assert "shard-00000.bin" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="shape"):
        ck.read("w", Slab.whole((4, 3)))
    with pytest.raises(CheckpointError, match="no tensor"):
        ck.read("nope", Slab.whole((4, 3)))


def test_no_intact_checkpoint_and_old_format(tmp_path):
    with pytest.raises(CheckpointError, match="no intact checkpoint"):
        sharded.load_latest(tmp_path)
    old = tmp_path / "step-00000001"
    old.mkdir()
    (old / "manifest.json").write_text(json.dumps({"step": 1, "meta": {}, "files": {}}))
    with pytest.raises(CheckpointError, match="older version"):
        sharded.load_latest(tmp_path)


def _model_and_adamw(seed):
    """Two parameters (one bf16), one buffer and an AdamW, as entries of whole slabs."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(3, 4, generator=gen))
    b = torch.nn.Parameter(torch.randn(4, generator=gen).to(torch.bfloat16))
    stat = torch.randn(4, generator=gen)  # a statistic: saved, no optimizer state
    entries = [("w", w, Slab.whole((3, 4))), ("b", b, Slab.whole((4,))),
               ("stat", stat, Slab.whole((4,)))]
    return entries, torch.optim.AdamW([w, b], lr=0.1)


def _step(entries, opt):
    w, b = entries[0][1], entries[1][1]
    opt.zero_grad()
    ((w.sum(0) * b.float()).square().sum()).backward()
    opt.step()


def _opt_state(opt):
    return [(k, v.dtype, v.device, v) for st in opt.state_dict()["state"].values()
            for k, v in sorted(st.items())]


def test_save_state_load_state_round_trip_is_exact(tmp_path):
    entries, opt = _model_and_adamw(0)
    for _ in range(3):
        _step(entries, opt)
    sharded.save_state(tmp_path, 3, entries, opt, meta={"k": 1}, files={"x": b"y"})
    ck = sharded.load_latest(tmp_path)
    assert ck.names() == ["b", "b.exp_avg", "b.exp_avg_sq", "stat", "w", "w.exp_avg",
                          "w.exp_avg_sq"]
    assert ck.meta == {"k": 1, "adam_steps": {"w": 3.0, "b": 3.0}} and ck.files == {"x": b"y"}
    fresh, fresh_opt = _model_and_adamw(1)  # other values, no optimizer state
    sharded.load_state(ck, fresh, fresh_opt)
    for (name, t, _), (_, u, _) in zip(entries, fresh):
        assert t.dtype == u.dtype and torch.equal(t.detach(), u.detach()), name
    for a, b in zip(_opt_state(opt), _opt_state(fresh_opt), strict=True):
        assert a[:3] == b[:3] and torch.equal(a[3], b[3]), a[0]
    # and the next step is the same to the bit
    _step(entries, opt)
    _step(fresh, fresh_opt)
    for (name, t, _), (_, u, _) in zip(entries, fresh):
        assert torch.equal(t.detach(), u.detach()), name


def test_load_state_names_what_is_missing_or_damaged(tmp_path):
    entries, opt = _model_and_adamw(0)
    _step(entries, opt)
    with pytest.raises(ValueError, match="two tensors of the model are named 'w'"):
        sharded.save_state(tmp_path, 1, [*entries, entries[0]], opt, meta={})
    sharded.save_state(tmp_path, 1, entries, opt, meta={})
    fresh, fresh_opt = _model_and_adamw(1)
    extra = ("extra", torch.zeros(2), Slab.whole((2,)))
    with pytest.raises(CheckpointError, match="has no tensor 'extra'"):
        sharded.load_state(sharded.load_latest(tmp_path), [*fresh, extra], fresh_opt)
    ck = sharded.load_latest(tmp_path)
    del ck.manifest["tensors"]["w.exp_avg_sq"]  # a step count without its moment
    with pytest.raises(CheckpointError, match=r"has no tensor 'w\.exp_avg_sq'"):
        sharded.load_state(ck, fresh, fresh_opt)
    other = [("w", torch.zeros(4, 3), Slab.whole((4, 3))), *fresh[1:]]
    with pytest.raises(CheckpointError, match=r"w has shape \(3, 4\), this model \(4, 3\)"):
        sharded.load_state(sharded.load_latest(tmp_path), other, fresh_opt)
    shard = tmp_path / "step-00000001" / "shard-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-8])  # truncated
    with pytest.raises(CheckpointError, match=r"shard-00000\.bin missing, truncated or corrupt"):
        sharded.load(tmp_path / "step-00000001")


def test_a_permuted_piece_is_read_without_mapping_it(tmp_path):
    """A chunk of a ~100 MB piece whose rows are permuted (learned features) raises the peak
    resident set by about the chunk, not the piece: its rows are read where they lie."""
    from common.memory import peak_bytes, reset_peak, resident_bytes

    n, w = 25_000, 1_000  # float32: 100 MB
    ids = np.random.default_rng(0).permutation(n).astype(np.int64)
    full = torch.arange(n * w, dtype=torch.float32).reshape(n, w)
    sharded.save(tmp_path, 1, {"f": (full[torch.from_numpy(ids)], Slab((n, w), ids, (0, w)))},
                 meta={})
    ck = sharded.load_latest(tmp_path)
    chunk = Slab((n, w), (1000, 2000), (0, w))  # 4 MB
    if not reset_peak() or not resident_bytes():
        pytest.skip("no /proc/self/clear_refs or statm: the peak cannot be measured here")
    before = resident_bytes()
    got = ck.read("f", chunk)
    grew = peak_bytes() - before
    assert torch.equal(got, full[1000:2000])
    assert grew < 40 << 20, f"reading a 4 MB chunk raised the peak by {grew >> 20} MiB"


def test_permuted_rows_are_sorted_once_per_tensor_and_read_bit_for_bit(tmp_path, monkeypatch):
    """Reading in chunks (common.consolidate, ``keep_row_index``) sorts each piece's row ids
    once, shares them with the tensors of the same rows (its AdamW moments) and drops them for
    another; a plain read (a training rank's slab) keeps none once it returns."""
    n, w = 500, 6
    gen = torch.Generator().manual_seed(0)
    tensors = {"f": torch.randn(n, w, generator=gen).to(torch.bfloat16),
               "f.exp_avg": torch.randn(n, w, generator=gen), "b": torch.randn(w, generator=gen)}
    rng = np.random.default_rng(0)
    perm = rng.permutation(n + 2)
    layouts = {"f": grid_slabs((n, w), 2, 2, 2, perm=perm, pad_rows=n + 2),
               "b": [Slab.whole((w,))] * 8}
    layouts["f.exp_avg"] = layouts["f"]
    path = write_layout(tmp_path / "step-00000001", 1, tensors, layouts)
    ck = sharded.ShardedCheckpoint(path, json.loads((path / "manifest.json").read_text()))
    made, real = [], sharded.RowIndex

    def counted(ids):
        made.append(ids.size)
        return real(ids)

    monkeypatch.setattr(sharded, "RowIndex", counted)
    for name in ("f", "f.exp_avg"):
        for lo in range(0, n, 37):
            got = ck.read(name, Slab((n, w), (lo, min(n, lo + 37)), (0, w)),
                          keep_row_index=True)
            assert torch.equal(got, tensors[name][lo:lo + 37]), (name, lo)
    assert len(made) == 2  # one per row split of the source grid (x=2)
    ck.read("b", Slab.whole((w,)))
    assert not ck._row_indexes
    got = ck.read("f", Slab((n, w), (0, 250), (0, w)))  # each piece's sorted once, not kept
    assert torch.equal(got, tensors["f"][:250]) and len(made) == 4 and not ck._row_indexes
