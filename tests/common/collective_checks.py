"""Parallel-equals-serial checks of every collective and autograd pair along every grid axis.

Used in-process by test_collectives.py (through tests.distributed.run_ranks) and as a script
under real launchers by test_dist.py::

    mpiexec -n 4 python -m tests.common.collective_checks --grid 2x2x1

Every rank can rebuild every member's input from (seed, global rank), so the serial reference
is plain single-process torch autograd over all members' inputs.
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import autograd as ag
from common import collectives as coll
from common.comm_stats import CommStats, ring_bytes
from common.grid import AXONN_AXES, PLEXUS_AXES, ProcessGrid

# Generous: the sums over the group are gloo's or MPI's, in an order they pick by algorithm,
# message size and rank count (common.collectives does not fix it; over 3+ ranks the bits
# differ from the serial left-to-right sum), but in float64 over at most 8 members of
# randn data, two orders differ by at most 2 gamma(7) sum|x_i| ~ 1.6e-15 * 8 * 5, far below
# atol. Gathers and splits are copies, within any tolerance.
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _data(seed: int, rank: int, shape, requires_grad=False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_(requires_grad)


def _serial(kind: str, xs: list[torch.Tensor], ws: list[torch.Tensor], m: int, dim: int):
    """Reference output of member ``m`` and the gradient of member ``m``'s input."""
    g = len(xs)
    if kind in ("identity_all_reduce", "split_all_gather"):
        xs = [xs[0]] * g  # replicated input: one tensor shared by every member
    if kind == "all_reduce_identity":  # partial in -> replicated out, loss counted once
        outs = [sum(xs)] * g
        loss = (outs[0] * ws[0]).sum()
    elif kind == "identity_all_reduce":
        outs = xs
        loss = sum((o * w).sum() for o, w in zip(outs, ws))
    elif kind == "all_reduce_all_reduce":  # partial in -> replicated out, used by every member
        outs = [sum(xs)] * g
        loss = sum((o * w).sum() for o, w in zip(outs, ws))
    elif kind == "all_gather_reduce_scatter":
        outs = [torch.cat(xs, dim)] * g
        loss = sum((o * w).sum() for o, w in zip(outs, ws))
    elif kind == "reduce_scatter_all_gather":
        outs = list(sum(xs).chunk(g, dim))
        loss = sum((o * w).sum() for o, w in zip(outs, ws))
    elif kind == "split_all_gather":
        outs = list(xs[0].chunk(g, dim))
        loss = sum((o * w).sum() for o, w in zip(outs, ws))
    elif kind == "all_gather_split":  # sharded in -> replicated out, loss counted once
        outs = [torch.cat(xs, dim)] * g
        loss = (outs[0] * ws[0]).sum()
    else:
        raise AssertionError(kind)
    (grad,) = torch.autograd.grad(loss, [xs[m]])
    return outs[m].detach(), grad


# kind -> (input shape, output-weights replicated?)  chunked dims use sizes divisible by g
def _cases(g: int, dim: int):
    base = [3, 5, 2]
    full = list(base)
    full[dim] = base[dim] * g
    return {
        "all_reduce_identity": (base, True),
        "identity_all_reduce": (base, False),
        "all_reduce_all_reduce": (base, False),
        "all_gather_reduce_scatter": (base, False),
        "reduce_scatter_all_gather": (full, False),
        "split_all_gather": (full, False),
        "all_gather_split": (base, True),
    }


def check_grid(ctx, grid_text: str, seed: int = 0) -> list[str]:
    """Run every check on every axis of the grid; return a list of failures (empty = pass)."""
    axes = AXONN_AXES if "=" in grid_text or grid_text.count("x") == 3 else PLEXUS_AXES
    grid = ProcessGrid.parse(grid_text, axes)
    grid.check(ctx.world_size)
    groups = ctx.create_groups(grid, [*grid.axes, tuple(grid.axes[:2])])
    failures = []
    for name, grp in groups.items():
        members = grp.members
        tag = f"grid {grid_text} axis {name}"
        for dim in (0, 1, -1):
            for kind, (shape, shared_w) in _cases(grp.size, dim).items():
                fn = getattr(ag, kind)
                xs = [_data(seed, r, shape, True) for r in members]
                ws_src = [members[0]] * grp.size if shared_w else members
                out_shape = _output_shape(kind, shape, grp.size, dim)
                ws = [_data(seed + 7, r, out_shape) for r in ws_src]
                ref_out, ref_grad = _serial(kind, xs, ws, grp.rank, dim)
                replicated_in = kind in ("identity_all_reduce", "split_all_gather")
                x = xs[0 if replicated_in else grp.rank].detach().clone().requires_grad_(True)
                out = fn(x, grp, dim) if "gather" in kind or "scatter" in kind else fn(x, grp)
                (out * ws[grp.rank]).sum().backward()
                if not torch.allclose(out, ref_out, **TOL):
                    failures.append(f"{tag} {kind} dim={dim}: forward differs")
                if not torch.allclose(x.grad, ref_grad, **TOL):
                    failures.append(f"{tag} {kind} dim={dim}: gradient differs")
        failures += _check_plain_and_async(grp, seed, tag)
        failures += _check_wire(grp, seed, tag)
    return failures


def _output_shape(kind: str, shape: list[int], g: int, dim: int) -> list[int]:
    out = list(shape)
    if kind in ("all_gather_reduce_scatter", "all_gather_split"):
        out[dim] *= g
    elif kind in ("reduce_scatter_all_gather", "split_all_gather"):
        out[dim] //= g
    return out


def _check_plain_and_async(grp, seed, tag) -> list[str]:
    """Plain collectives (sync and async, overlapped), their byte counts, and a non-contiguous
    input, against serial results."""
    failures = []
    g, members = grp.size, grp.members
    stats = CommStats()
    xs = [_data(seed + 3, r, (4 * g, 6)) for r in members]
    mine = xs[grp.rank]
    # issue all three asynchronously, compute something in between, then wait
    h1 = coll.all_reduce(mine, grp, stats=stats, async_op=True)
    h2 = coll.all_gather(mine.t(), grp, dim=1, stats=stats, async_op=True)  # non-contiguous input
    h3 = coll.reduce_scatter(mine, grp, stats=stats, async_op=True)
    _ = mine @ mine.t()
    got = {"all_reduce": h1.wait(), "all_gather": h2.wait(), "reduce_scatter": h3.wait()}
    want = {
        "all_reduce": sum(xs),
        "all_gather": torch.cat([x.t() for x in xs], 1),
        "reduce_scatter": sum(xs).chunk(g, 0)[grp.rank],
    }
    for op in got:
        if not torch.allclose(got[op], want[op], **TOL):
            failures.append(f"{tag} async {op}: result differs")
    sync = coll.all_reduce(mine, grp, stats=stats)
    if not torch.allclose(sync, want["all_reduce"], **TOL) or not torch.equal(mine, xs[grp.rank]):
        failures.append(f"{tag} sync all_reduce differs or modified its input")
    if g > 1:  # bf16 summed in float32 buffers, whatever the default dtype
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            half = coll.reduce_scatter(mine.to(torch.bfloat16), grp)
        finally:
            torch.set_default_dtype(default)
        # within bf16's rounding of the inputs and of the sum (|sum| < 40 here)
        if half.dtype != torch.bfloat16 or not torch.allclose(
                half.double(), want["reduce_scatter"], rtol=2e-2, atol=2e-2):
            failures.append(f"{tag} bf16 reduce_scatter under a float64 default dtype differs")
        try:
            coll.reduce_scatter(mine.sum(), grp)
            failures.append(f"{tag} reduce_scatter of a 0-dim tensor raised nothing")
        except ValueError as e:
            if "0-dimensional" not in str(e):
                failures.append(f"{tag} reduce_scatter of a 0-dim tensor: {e}")
    full = mine.numel() * mine.element_size()
    expect = {
        "all_reduce": 2 * ring_bytes("all_reduce", full, g) if g > 1 else 0,
        "all_gather": ring_bytes("all_gather", g * full, g),
        "reduce_scatter": ring_bytes("reduce_scatter", full, g),
    }
    counted = {op: stats.records[(grp.name, op)].bytes if (grp.name, op) in stats.records else 0
               for op in expect}
    if counted != expect:
        failures.append(f"{tag} byte accounting {counted} != ring volumes {expect}")
    if g > 1 and counted["all_reduce"] != 2 * 2 * (g - 1) * full // g:
        failures.append(f"{tag} all_reduce bytes do not follow 2(g-1)/g * M")
    return failures


def _wire_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    """Each member's float32 rounded to bf16 once, added in float32 in group order."""
    total = xs[0].to(torch.bfloat16).float()
    for x in xs[1:]:
        total = total + x.to(torch.bfloat16).float()
    return total


def _check_wire(grp, seed, tag) -> list[str]:
    """A group whose float32 messages travel as bf16 (``grp.on_wire``): sums are bit for bit
    the float32 sum of the bf16-rounded inputs in group order (an all-reduce rounds it to bf16
    once more), on every transport; gathers are the bf16-rounded inputs; async, in place,
    along other dims and over sizes that need padding (5 x 3 over 2, 4 and 8 ranks); half
    the bytes of float32."""
    failures, g, wire = [], grp.size, grp.on_wire(torch.bfloat16)
    stats = CommStats()
    xs = [_data(seed + 5, r, (5, 3)).float() for r in grp.members]
    mine = xs[grp.rank]
    want = _wire_sum(xs) if g > 1 else mine
    got = coll.all_reduce(mine, wire, stats=stats)
    late = coll.all_reduce(mine.clone(), wire, stats=stats, async_op=True, inplace=True)
    _ = mine @ mine.t()
    whole = coll.WIRE_PIECE_BYTES
    try:  # in pieces of 3 elements (or g), the last one padded: the same sums
        coll.WIRE_PIECE_BYTES = 6
        pieces = coll.all_reduce(mine, wire, async_op=True).wait()
    finally:
        coll.WIRE_PIECE_BYTES = whole
    rounded = want.to(torch.bfloat16).float() if g > 1 else mine
    for name, t in (("sync", got), ("async in place", late.wait()), ("in pieces", pieces)):
        if t.dtype != torch.float32 or not torch.equal(t, rounded):
            failures.append(f"{tag} bf16-wire all_reduce ({name}) differs from the float32 sum "
                            "of bf16 messages")
    ys = [_data(seed + 6, r, (3, 2 * g, 4)).float() for r in grp.members]
    for dim, async_op in ((1, False), (0, True)) if g > 1 else ():
        ys_dim = [y.movedim(1, dim).contiguous() for y in ys]
        out = coll.reduce_scatter(ys_dim[grp.rank], wire, dim=dim, stats=stats,
                                  async_op=async_op)
        out = out.wait() if async_op else out
        if not torch.equal(out, _wire_sum(ys_dim).chunk(g, dim)[grp.rank]):
            failures.append(f"{tag} bf16-wire reduce_scatter dim={dim} differs")
    gathered = coll.all_gather(mine, wire, stats=stats, async_op=True).wait()
    if not torch.equal(gathered, torch.cat([x.to(torch.bfloat16).float() for x in xs])
                       if g > 1 else mine):
        failures.append(f"{tag} bf16-wire all_gather is not the bf16-rounded inputs")
    half = {"all_reduce": 2 * ring_bytes("all_reduce", mine.numel() * 2, g),
            "reduce_scatter": 2 * ring_bytes("reduce_scatter", ys[0].numel() * 2, g),
            "all_gather": ring_bytes("all_gather", g * mine.numel() * 2, g)}
    counted = {op: stats.records[(grp.name, op)].bytes if (grp.name, op) in stats.records else 0
               for op in half}
    if counted != ({op: 0 for op in half} if g == 1 else half):
        failures.append(f"{tag} bf16-wire bytes {counted} != bf16 ring volumes {half}")
    return failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", required=True)
    args = p.parse_args(argv)
    from common.dist import init_distributed
    from common.failure import fail_all_ranks

    ctx = init_distributed(device="cpu", timeout_s=60)
    try:
        failures = check_grid(ctx, args.grid)
    except ValueError as e:
        fail_all_ranks(str(e), ctx)
    print(f"rank {ctx.rank}/{ctx.world_size} launcher={ctx.launcher} "
          f"{'OK' if not failures else 'FAILED'} {len(failures)} failures", flush=True)
    for f in failures:
        print("  " + f, flush=True)
    return 1 if failures else 0  # init_distributed's exit hook closes the process group


if __name__ == "__main__":
    sys.exit(main())
