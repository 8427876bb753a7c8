"""common.mpi: the MPI transport against gloo on the same data (dtypes without an MPI reduction
included), asynchronous progress without wait(), two-level (PCCL) collectives on simulated
2x2 node layouts, and the choice of transport at start-up."""

import re
import threading
import time

import pytest
import torch

from common import collectives as coll
from common.comm_stats import CommStats
from common.grid import AXONN_AXES, PLEXUS_AXES, ProcessGrid
from common.mpi import MPITransport, ProgressThread
from tests.distributed import launch, needs_mpi, run_ranks

DTYPES = (torch.float32, torch.float64, torch.int64, torch.bfloat16, torch.float16)


def _data(rank: int, shape, dtype) -> torch.Tensor:
    """Small integers: sums are exact in every dtype and order, so results compare bitwise
    (gloo and MPI sum floats over 3+ ranks in other orders: other bits)."""
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(shape, generator=g) * 4).round().to(dtype)


def _results(groups, dtype) -> dict[str, torch.Tensor]:
    """Every collective of the transport on this rank's data, sync and async, in one order."""
    out = {}
    for name, grp in groups.items():
        if grp.size == 1:
            continue
        x = _data(grp.members[grp.rank], (grp.size * 3, 5), dtype)
        out[f"{name}/all_reduce"] = coll.all_reduce(x, grp)
        y = x.clone()
        if coll.all_reduce(y, grp, inplace=True) is not y:
            raise AssertionError("an in-place all-reduce returned a new tensor")
        out[f"{name}/all_reduce_inplace"] = y
        if dtype in (torch.float32, torch.int64):
            out[f"{name}/max"] = coll.all_reduce(x, grp, op=coll.ReduceOp.MAX)
        h = coll.all_gather(x, grp, dim=1, async_op=True)  # queued: the sync call waits its turn
        out[f"{name}/reduce_scatter"] = coll.reduce_scatter(x, grp, dim=0)
        out[f"{name}/all_gather"] = h.wait()
        out[f"{name}/all_gather_t"] = coll.all_gather(x.t(), grp, dim=0)  # non-contiguous
        if dtype is torch.float32:  # dtypes MPI gathers as bytes; a 0-dim and an empty tensor
            out[f"{name}/all_gather_bool"] = coll.all_gather(x > 0, grp)
            out[f"{name}/all_gather_complex"] = coll.all_gather(torch.complex(x, -x), grp, dim=1)
            out[f"{name}/all_gather_0d"] = coll.all_gather(x[0, 0], grp)
            out[f"{name}/all_gather_empty"] = coll.all_gather(x[:0], grp)
    return out


def _compare(ctx):
    """(failures, two-level groups used) of the MPI transport against gloo on this rank."""
    failures, used = [], []
    grids = ["2x2x1", "1x4x1", "data=1,depth=2,row=1,col=2"]
    for rpn in (None, 2):  # real node (one), then two simulated nodes of 2 ranks
        t = MPITransport(two_level=rpn is not None, ranks_per_node=rpn)
        try:
            for text in grids:
                grid = ProcessGrid.parse(text, AXONN_AXES if "=" in text else PLEXUS_AXES)
                axis_sets = [*grid.axes, tuple(grid.axes)]
                mpi = grid.create_groups(ctx.rank, axis_sets, transport=t)
                torch_groups = grid.create_groups(ctx.rank, axis_sets, transport=None)  # gloo
                used += [f"{text}/{n}" for n, g in mpi.items() if g.mpi and g.mpi.two_level]
                assert all(g.mpi is not None for g in mpi.values() if g.size > 1)
                for dtype in DTYPES:
                    want, got = _results(torch_groups, dtype), _results(mpi, dtype)
                    for key, w in want.items():
                        if got[key].dtype != w.dtype or not torch.equal(got[key], w):
                            failures.append(f"rpn={rpn} {text} {dtype} {key} differs")
        finally:
            t.close()
    return failures, used


def _progress(ctx):
    """An async all-reduce completes while this rank only sleeps (no MPI call, no wait), and
    its result and byte count are right."""
    grid = ProcessGrid.parse(f"data={ctx.world_size},depth=1,row=1,col=1", AXONN_AXES)
    grp = ctx.create_groups(grid)["data"]
    stats = CommStats()
    x = torch.full((1 << 20,), float(ctx.rank))  # 4 MiB: far above any eager limit
    h = coll.all_reduce(x, grp, async_op=True, stats=stats)
    deadline = time.monotonic() + 20
    while not h._work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    progressed = h._work.is_completed()
    total = float(sum(range(ctx.world_size)))
    m = grp.mpi  # what the transport takes, and what it leaves to torch.distributed
    declines = [m.supports(torch.zeros(2, device="meta")),
                not m.supports(torch.zeros(2, dtype=torch.bfloat16), coll.ReduceOp.SUM),
                not m.supports(torch.zeros(2, dtype=torch.bool)),  # gathers move any bytes
                m.supports(torch.zeros(2, dtype=torch.bool), coll.ReduceOp.SUM),
                m.supports(torch.zeros(2), coll.ReduceOp.AVG)]
    return (progressed, bool((h.wait() == total).all()), stats.total_bytes, declines,
            ctx.transport is not None)


@needs_mpi
@pytest.mark.slow
def test_mpi_transport_equals_gloo_and_two_level_equals_flat():
    results = run_ranks(_compare, 4, comm="mpi")
    failures = [f for fs, _ in results for f in fs]
    assert not failures, "\n".join(failures[:20])
    # two simulated nodes {0,1},{2,3}: the groups that span both run two-level
    assert set(results[0][1]) == {"2x2x1/x+y+z", "1x4x1/y", "1x4x1/x+y+z",
                                  "data=1,depth=2,row=1,col=2/data+depth+row+col"}


@needs_mpi
@pytest.mark.slow
def test_async_collectives_progress_without_wait():
    for progressed, correct, nbytes, declines, transport in run_ranks(_progress, 2, comm="mpi"):
        assert progressed and correct
        assert nbytes == 4 << 20  # ring all-reduce over 2 ranks: 2 (g-1)/g * 4 MiB
        assert not any(declines), declines
        assert transport  # under mpiexec the context holds the MPI transport



class _CountingComm:
    """A communicator that counts its all-reduce calls (blocking and not) and passes every
    call on."""

    def __init__(self, comm):
        self.comm, self.calls = comm, 0

    def Allreduce(self, *args, **kwargs):  # noqa: N802 (mpi4py's name)
        self.calls += 1
        return self.comm.Allreduce(*args, **kwargs)

    def Iallreduce(self, *args, **kwargs):  # noqa: N802 (mpi4py's name)
        self.calls += 1
        return self.comm.Iallreduce(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.comm, name)


def _pieces(ctx):
    """All-reduces in pieces of 64 bytes (rank 1 asks for 128: the ranks agree on the
    smaller) against gloo's whole ones, every dtype, sync, queued and polite; and the number
    of MPI calls one all-reduce makes."""
    import os

    from common.mpi import ENV_ALLREDUCE_PIECE

    os.environ[ENV_ALLREDUCE_PIECE] = str(64 * (1 + ctx.rank))
    failures, calls, pieces = [], [], []
    for polite in ("none", "all"):
        t = MPITransport(polite=polite)
        try:
            pieces.append(t.piece)
            grid = ProcessGrid.parse("1x2x1", PLEXUS_AXES)
            mpi = grid.create_groups(ctx.rank, [("y",)], transport=t)
            gloo = grid.create_groups(ctx.rank, [("y",)], transport=None)
            for dtype in DTYPES:
                want, got = _results(gloo, dtype), _results(mpi, dtype)
                failures += [f"polite={polite} {dtype} {key} differs"
                             for key, w in want.items() if not torch.equal(got[key], w)]
            m = mpi["y"].mpi
            m.comm = counting = _CountingComm(m.comm)
            x = _data(ctx.rank, (100,), torch.float32)  # 400 bytes: 6 pieces of 64, then 16
            got = coll.all_reduce(x, mpi["y"])
            calls.append(counting.calls)
            want = coll.all_reduce(x, gloo["y"])
            if not torch.equal(got, want):
                failures.append(f"polite={polite} the 400-byte all-reduce differs")
        finally:
            t.close()
    return failures, calls, pieces


@needs_mpi
@pytest.mark.slow
def test_large_all_reduces_run_in_pieces_with_the_same_result():
    for failures, calls, pieces in run_ranks(_pieces, 2, comm="mpi"):
        assert not failures, "\n".join(failures[:20])
        assert pieces == [64, 64]
        assert calls == [7, 7]


def _bad_piece(ctx):
    """Rank 1 alone gives a piece size that is not one: every rank refuses, none waits."""
    import os

    from common.mpi import ENV_ALLREDUCE_PIECE

    if ctx.rank == 1:
        os.environ[ENV_ALLREDUCE_PIECE] = "4MiB"
    try:
        MPITransport().close()
    except ValueError as e:
        return str(e)
    return None


@needs_mpi
@pytest.mark.slow
def test_a_bad_piece_size_on_one_rank_is_refused_on_every_rank():
    first, second = run_ranks(_bad_piece, 2, comm="mpi")
    assert first == "HPC_MPI_ALLREDUCE_PIECE on another rank of the job is not a size in bytes"
    assert second == ("HPC_MPI_ALLREDUCE_PIECE='4MiB': give a size in bytes (0: all-reduce "
                      "whole messages)")


def test_the_piece_size_comes_from_the_environment(monkeypatch):
    from common.mpi import ALLREDUCE_PIECE_BYTES, ENV_ALLREDUCE_PIECE, _piece_from_env

    monkeypatch.delenv(ENV_ALLREDUCE_PIECE, raising=False)
    assert _piece_from_env() == ALLREDUCE_PIECE_BYTES
    monkeypatch.setenv(ENV_ALLREDUCE_PIECE, "0")
    assert _piece_from_env() == 0
    for bad in ("-1", "4MiB"):
        monkeypatch.setenv(ENV_ALLREDUCE_PIECE, bad)
        with pytest.raises(ValueError, match=r"HPC_MPI_ALLREDUCE_PIECE=.*size in bytes"):
            _piece_from_env()


def test_progress_thread_runs_jobs_in_order_and_hands_back_errors():
    p = ProgressThread()
    try:
        seen = []
        def job(i):
            return lambda: seen.append((i, threading.current_thread().name))

        works = [p.submit(job(i)) for i in range(50)]
        direct = p.run(job("sync"), async_op=False)  # waits behind the queue, on the thread
        thread = "hpc-mpi-progress"
        assert direct.is_completed() and seen == [(i, thread) for i in [*range(50), "sync"]]
        p.run(job("idle"), async_op=False)  # nothing queued: on the caller's thread
        assert seen[-1] == ("idle", threading.current_thread().name)
        assert all(w.is_completed() for w in works) and p.pending == 0

        def boom():
            raise RuntimeError("peer gone")
        with pytest.raises(RuntimeError, match="peer gone"):
            p.run(boom, async_op=True).wait()
        assert p.pending == 0
    finally:
        assert p.stop()


CHOICE = """
from common.dist import init_distributed
from common.exchange import barrier
try:
    ctx = init_distributed(device="cpu", comm="{comm}")
    print(f"rank {{ctx.rank}} comm {{ctx.comm}}", flush=True)  # one write: lines never interleave
    # no rank may exit while another is still connecting (gloo: "Connection closed by peer")
    barrier(ctx.transport)
except ValueError as e:
    print(f"error: {{e}}", flush=True)
    raise SystemExit(2)
"""


@needs_mpi
@pytest.mark.slow
@pytest.mark.parametrize("launcher, comm, expect", [
    ("mpiexec", "auto", "comm mpi"), ("mpiexec", "torch", "comm torch"),
    ("torchrun", "auto", "comm torch"),
    ("torchrun", "mpi", "--comm mpi: MPI sees 1 rank(s) but the job has 2"),
])
def test_transport_choice(tmp_path, launcher, comm, expect):
    script = tmp_path / "choice.py"
    script.write_text(CHOICE.format(comm=comm))
    r = launch([str(script)], ranks=2, launcher=launcher, timeout=120)
    refused = "MPI sees" in expect
    # torchrun stops the other rank (SIGTERM, exit code -15) once the first has exited: a rank
    # still starting then is reported stopped instead of printing its refusal, and one that
    # printed it but had not exited yet is reported stopped too (both seen in fresh clones)
    printed = r.stdout.count(expect)
    stopped = re.findall(r"exitcode\s+:\s*-15", r.stderr) if refused else []
    if refused:
        assert 1 <= printed <= 2 and printed + len(stopped) >= 2, r.stdout + r.stderr
    else:
        assert printed == 2, r.stdout + r.stderr
    assert (r.returncode != 0) == refused


LOOP = """
import os, sys, time, torch
from common import collectives as coll
from common.dist import init_distributed
from common.grid import ProcessGrid
ctx = init_distributed(device="cpu")
grp = ctx.create_groups(ProcessGrid.plexus(ctx.world_size, 1, 1))["x"]
assert ctx.transport is not None
with open(os.path.join(sys.argv[1], f"{ctx.rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
while True:
    coll.all_reduce(torch.ones(1024), grp)
    time.sleep(0.01)
"""


@needs_mpi
@pytest.mark.slow
def test_a_killed_rank_ends_the_mpi_job_on_every_rank(tmp_path):
    """Under mpiexec a SIGKILLed rank ends every other rank within the heartbeat timeout (the
    launcher and MPI abort the job; no survivor hangs in a collective)."""
    import os
    import signal
    import subprocess

    from tests.distributed import launch_command, launch_env

    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    proc = subprocess.Popen(launch_command([str(script), str(tmp_path)], ranks=4),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=launch_env({"HPC_HEARTBEAT_TIMEOUT": "8"}))
    pids: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 4 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            pids = {int(f.stem): int(f.read_text() or 0) for f in tmp_path.glob("*.pid")}
        assert len(pids) == 4 and all(pids.values()), f"ranks did not start: {pids}"
        time.sleep(1)  # all in the collective loop
        os.kill(pids[2], signal.SIGKILL)
        start = time.monotonic()
        proc.wait(timeout=8 + 10)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and elapsed < 18, (proc.returncode, elapsed)
    alive = []
    for rank, pid in pids.items():
        try:
            os.kill(pid, 0)
            alive.append(rank)
        except ProcessLookupError:
            pass
    assert not alive, f"ranks {alive} outlived the job"
