"""common.flat: flat shards (pure), the gather before use and the gradient's reduce-scatter.

The collectives run on every axis of a few grids (group sizes 1, 2, 3 and 4) with blocks whose
element counts need padding on some of them (15 over 2 and 4, 6 over 4, 1 over 3 and 4: whole
shards of padding). Every rank rebuilds every member's data from (seed, global rank), so the
reference is single-process torch autograd.
"""

from __future__ import annotations

import pytest
import torch

from common import flat
from common.grid import ProcessGrid
from tests.distributed import run_ranks
from tests.rounding import gamma

BLOCKS = [(5, 3), (2, 3), (1, 1)]


def _sums_agree(got: torch.Tensor, want: torch.Tensor, terms: list[torch.Tensor]) -> bool:
    """``got`` and ``want`` are the elementwise sum of ``terms`` (one per member) in two orders:
    the reduce-scatter's is gloo's or MPI's (by algorithm, message size and rank count; not
    fixed by common.collectives), the reference's left to right. Each is within
    ``gamma(g - 1) sum |x_i|`` of the exact sum, so they differ by at most twice that; two
    terms (and one) add the same in any order: bits."""
    g = len(terms)
    room = 2 * gamma(g - 1, want.dtype) * sum(t.abs() for t in terms) if g > 2 else 0
    return bool(((got - want).abs() <= room).all())


def test_flat_shard_chunks_and_pads():
    block = torch.arange(10.0).reshape(2, 5)
    parts = [flat.flat_shard(block, 3, p) for p in range(3)]
    assert all(p.numel() == 4 == flat.shard_size(10, 3) for p in parts)  # ceil(10 / 3)
    assert torch.equal(torch.cat(parts)[:10], block.reshape(-1))
    assert torch.equal(parts[2][2:], torch.zeros(2))
    assert [flat.shard_range(10, 3, p) for p in range(3)] == [(0, 4), (4, 8), (8, 12)]
    assert torch.equal(flat.unflatten(torch.cat(parts), (2, 5)), block)


def test_flat_shard_is_a_copy_in_the_blocks_dtype():
    block = torch.ones(2, 2, dtype=torch.float64)
    shard = flat.flat_shard(block, 1, 0)
    assert shard.dtype == torch.float64 and shard.shape == (4,)
    shard.zero_()
    assert torch.equal(block, torch.ones(2, 2, dtype=torch.float64))
    tiny = [flat.flat_shard(torch.tensor([[7.0]]), 4, p) for p in range(4)]
    assert [t.tolist() for t in tiny] == [[7.0], [0.0], [0.0], [0.0]]  # three of padding


def _data(seed: int, rank: int, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _check_group(grp, tag: str) -> list[str]:
    failures = []
    g, members, me = grp.size, grp.members, grp.rank
    for shape in BLOCKS:
        where = f"{tag} block {shape}"
        # gather before use, plain and async: every member gets the block
        block = _data(1, 0, shape)
        shard = flat.flat_shard(block, g, me)
        if not torch.equal(flat.gather(shard, grp, shape), block):
            failures.append(f"{where}: gather differs")
        if not torch.equal(flat.gather(shard, grp, shape, async_op=True).wait(), block):
            failures.append(f"{where}: async gather differs")
        # the autograd pair against serial autograd: W is used by every member differently
        w = block.clone().requires_grad_(True)
        outs = [_data(2, r, shape) for r in members]
        sum((w * o).sum() for o in outs).backward()
        want = flat.flat_shard(w.grad, g, me)
        mine = shard.clone().requires_grad_(True)
        got = flat.all_gather_reduce_scatter(mine, grp, shape)
        (got * outs[me]).sum().backward()
        if not torch.equal(got.detach(), block):
            failures.append(f"{where}: all_gather_reduce_scatter forward differs")
        terms = [flat.flat_shard(o, g, me) for o in outs]  # the members' gradients of W
        if not _sums_agree(mine.grad, want, terms):
            failures.append(f"{where}: all_gather_reduce_scatter gradient differs")
        # reduce-scatter of every member's gradient block into this member's flat shard
        grads = [_data(3, r, shape) for r in members]
        want = flat.flat_shard(sum(grads), g, me)
        terms = [flat.flat_shard(x, g, me) for x in grads]
        if not _sums_agree(flat.reduce_scatter(grads[me], grp), want, terms):
            failures.append(f"{where}: reduce_scatter differs")
        handle = flat.reduce_scatter(grads[me], grp, async_op=True)
        if not _sums_agree(handle.wait(), want, terms):
            failures.append(f"{where}: async reduce_scatter differs")
    return failures


def _check_grids(ctx, grids):
    failures = []
    for text in grids:
        grid = ProcessGrid.parse(text)
        grid.check(ctx.world_size)
        for name, grp in ctx.create_groups(grid).items():
            failures += _check_group(grp, f"grid {text} axis {name} (size {grp.size})")
    return failures


@pytest.mark.cross_shape  # gloo's order of the sums over 3 and 4 ranks (_sums_agree)
@pytest.mark.parametrize("world, grids", [
    (4, ["4x1x1", "2x2x1"]),
    pytest.param(3, ["1x3x1"], marks=pytest.mark.slow),
])
def test_flat_collectives_match_serial(world, grids):
    results = run_ranks(_check_grids, world, grids)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)
