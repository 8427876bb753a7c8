"""common.sharded: pieces written on one layout read back on any other, checksums, fallback."""

import json

import numpy as np
import pytest
import torch

from common import sharded
from common.checkpoint import CheckpointError
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
    n_pad = pad_rows or -(-rows // x) * x
    order = np.arange(n_pad) if perm is None else perm
    c_pad = -(-cols // y) * y
    out = []
    for i in range(x):
        for j in range(y):
            ids = order[i * n_pad // x:(i + 1) * n_pad // x]
            block_cols = (j * c_pad // y, (j + 1) * c_pad // y)
            numel = ids.size * (block_cols[1] - block_cols[0])
            size = -(-numel // z)
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

    pad_src = -(-13 // src[0]) * src[0] + (src[0] if permuted else 0)
    path = write_layout(tmp_path / "step-00000001", 1, tensors, layouts(src, pad_src))
    ck = sharded.ShardedCheckpoint(path, json.loads((path / "manifest.json").read_text()))
    pad_dst = -(-13 // dst[0]) * dst[0]
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
