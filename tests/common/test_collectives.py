"""Every collective and autograd pair against its serial equivalent on 2, 4 and 8 ranks, over
several grids per launch (lopsided ones included), on both transports (gloo, MPI); how
collectives are timed (wall clock on CPU, CUDA events on the stream on GPU: the logic with a
fake stream here, the real thing with ``-m gpu``)."""

import pytest
import torch

from common import collectives as coll
from common.comm_stats import CommStats, ring_bytes
from common.grid import AxisGroup
from tests.common.collective_checks import check_grid
from tests.distributed import COMMS, launch, run_ranks


def _check_grids(ctx, grids):
    return {g: check_grid(ctx, g) for g in grids}


@pytest.mark.cross_shape  # gloo's and MPI's order of the sums (collective_checks.TOL)
@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("world, grids", [
    (2, ["2x1x1", "1x2x1", "1x1x2", "data=2", "col=2"]),
    (4, ["2x2x1", "1x1x4", "4x1x1", "data=1,depth=2,row=1,col=2"]),
    (8, ["1x2x4", "4x1x2", "2x2x2", "data=2,depth=1,row=2,col=2"]),
])
def test_collectives_match_serial(world, grids, comm):
    results = run_ranks(_check_grids, world, grids, comm=comm)
    failures = [f"rank {r}: {f}"
                for r, res in enumerate(results) for fs in res.values() for f in fs]
    assert not failures, "\n".join(failures)
    assert all(set(res) == set(grids) for res in results)


# ------------------------------------------------ timing: wall clock on CPU, CUDA events on GPU
class _Stream:
    """A fake GPU stream: events marked on it, in order, each at a time in milliseconds."""

    def __init__(self):
        self.log, self.now_ms = [], 0.0

    def mark(self):
        self.log.append("mark")
        return _Event(self, self.now_ms)

    def launch(self):
        self.log.append("launch")
        self.now_ms += 7.0  # the collective takes 7 ms of GPU time
        return _Work(self)


class _Event:
    def __init__(self, stream, ms):
        self.stream, self.ms = stream, ms

    def synchronize(self):
        self.stream.log.append("sync")

    def elapsed_time(self, end):
        return end.ms - self.ms


class _Work:
    def __init__(self, stream):
        self.stream = stream

    def wait(self):  # NCCL: makes the stream wait, returns at once
        self.stream.log.append("wait")


GROUP = AxisGroup("row", None, 4, 1, (0, 1, 2, 3))


@pytest.mark.parametrize("async_op", [False, True])
def test_a_collective_on_a_gpu_is_timed_by_events_read_lazily(async_op):
    """Events before the launch and after ``work.wait()`` on the stream; the stats count the
    call and its bytes at once and resolve the seconds (synchronizing) only when read."""
    stream, stats, x = _Stream(), CommStats(), torch.ones(8)
    out = coll._run(GROUP, "all_reduce", 4096, stats, stream.launch, x, async_op, stream.mark)
    if async_op:
        assert stream.log == ["mark", "launch"] and not stats.total_bytes
        stream.now_ms += 5.0  # compute overlapped between issue and wait: counted, as on CPU
        out = out.wait()
    assert out is x
    assert stream.log == ["mark", "launch", "wait", "mark"]  # nothing synchronized yet
    assert stats.total_bytes == ring_bytes("all_reduce", 4096, 4)  # known without waiting
    assert stream.log[-1] == "mark"
    expected = (12.0 if async_op else 7.0) / 1e3
    assert stats.total_seconds == pytest.approx(expected)
    assert stream.log[-1] == "sync"
    assert stats.records[("row", "all_reduce")].seconds == pytest.approx(expected)
    assert stream.log.count("sync") == 1  # resolved once
    assert ("0.0120" if async_op else "0.0070") in stats.table()


def test_the_cpu_path_keeps_the_wall_clock():
    """No mark (CPU tensors) or no stats: the wall clock around launch and wait, recorded as a
    number at once (the same path and numbers as before CUDA events)."""
    stream, stats = _Stream(), CommStats()
    assert coll._stream_mark(torch.ones(2)) is None  # CPU tensors: wall clock
    coll._run(GROUP, "all_gather", 64, stats, stream.launch, torch.ones(2), False, None)
    assert stream.log == ["launch", "wait"] and not stats._pending
    assert stats.records[("row", "all_gather")].seconds > 0
    h = coll._run(GROUP, "all_gather", 64, stats, stream.launch, torch.ones(2), True, None)
    h.wait()
    assert stats.records[("row", "all_gather")].calls == 2 and not stats._pending
    coll._run(GROUP, "all_gather", 64, None, stream.launch, torch.ones(2), False, stream.mark)
    assert "mark" not in stream.log  # nothing to time: no events


def test_cuda_tensors_get_events_on_their_current_stream(monkeypatch):
    """:func:`_stream_mark` of a CUDA tensor (faked: no GPU here) records timing events on the
    tensor's device's current stream."""
    recorded = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.stream = None

        def record(self, stream=None):
            self.stream = stream
            recorded.append(self)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream of {device}")

    class CudaTensor:
        is_cuda, device = True, torch.device("cuda", 1)

    mark = coll._stream_mark(CudaTensor())
    first, second = mark(), mark()
    assert recorded == [first, second] and first.stream == "stream of cuda:1"


def test_reset_drops_pending_times_without_waiting():
    stats, called = CommStats(), []
    stats.record("z", "all_reduce", 100, lambda: called.append(1) or 0.5)
    stats.record("z", "all_reduce", 100, 0.25)
    stats.reset()
    assert stats.total_seconds == 0.0 and stats.as_dict() == {} and not called
    stats.record("z", "all_reduce", 100, lambda: 0.5)
    stats.record("y", "all_gather", 10, 0.25)
    assert stats.by_axis()["z"].seconds == 0.5
    assert stats.as_dict()["y/all_gather"]["seconds"] == 0.25


GPU_TIMING = """
import time
import torch, torch.distributed as dist
from common import collectives as coll
from common.comm_stats import CommStats
from common.dist import init_distributed
from common.grid import AxisGroup

def gpu_seconds(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record(); fn(); end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3

with init_distributed(device="cuda", launcher="single") as ctx:
    # a one-rank NCCL group, used past the size-1 fast path so that NCCL really runs
    world = AxisGroup("world", dist.group.WORLD, 1, 0, (0,))
    # (1) async: the GPU is busy 50 ms between issue and wait; the CPU is not held up
    sleep_s = gpu_seconds(lambda: torch.cuda._sleep(50_000_000))
    stats, buf = CommStats(), torch.ones(1 << 20, device="cuda")
    cpu = time.perf_counter()
    handle = coll._run(world, "all_reduce", buf.nbytes, stats, lambda: dist.all_reduce(
        buf, group=world.group, async_op=True), buf, True, coll._stream_mark(buf))
    torch.cuda._sleep(50_000_000)
    handle.wait()
    cpu_s = time.perf_counter() - cpu
    print(f"async comm_s {stats.total_seconds:.6f} sleep_s {sleep_s:.6f} cpu_s {cpu_s:.6f}")
    assert stats.total_seconds >= 0.9 * sleep_s, (stats.total_seconds, sleep_s)
    # (2) sync: a large out-of-place all-gather (one rank: NCCL copies 256 MiB)
    src = torch.ones(64 << 20, device="cuda")
    out = torch.empty_like(src)
    copy_s = gpu_seconds(lambda: out.copy_(src))
    stats = CommStats()
    coll._run(world, "all_gather", out.nbytes, stats, lambda: coll._all_gather_single(
        out, src, group=world.group, async_op=True), out, False, coll._stream_mark(out))
    print(f"sync comm_s {stats.total_seconds:.6f} copy_s {copy_s:.6f}")
    assert stats.total_seconds >= 0.25 * copy_s, (stats.total_seconds, copy_s)
print("OK")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_comm_seconds_on_cuda_cover_the_gpu_time():
    """On one GPU: comm seconds are GPU time, not launch time. (1) 50 ms of GPU work issued
    between an async all-reduce and its wait is counted (the wall clock of issue + wait sees
    microseconds: NCCL's wait does not block the CPU); (2) a synchronous 256 MiB all-gather
    takes at least a quarter of the time of copying 256 MiB on the device."""
    r = launch(["-c", GPU_TIMING], launcher="single", timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
