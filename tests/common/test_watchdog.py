"""common.watchdog: a rank that finishes is never reported lost, even when it finishes after the
rank whose process hosts the rendezvous store (rank 0 under mpiexec and srun); a rank lost
meanwhile still is. The in-process cases run every rank's watchdog in one process over a real
TCPStore, with short heartbeats; the last one is the same job under mpiexec."""

import subprocess
import sys

import pytest

from tests.distributed import launch, launch_env, needs_mpi

SCENARIOS = """
import datetime, sys, threading, time
import torch.distributed as dist
from common.watchdog import Watchdog

def stores():
    host = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    port = host.port  # not host itself: deleting it must take the store down
    return host, lambda: dist.TCPStore("127.0.0.1", port, is_master=False,
                                       wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=10))

def dog(connect, rank, world=2, store_host=0):
    return Watchdog(connect(), rank, world, interval_s=0.1, timeout_s=1.0,
                    store_host=store_host)

how = sys.argv[1]
host_store, connect = stores()
if how == "late":  # rank 1 finishes 0.6 s after rank 0: rank 0 keeps the store up for it
    host, peer = dog(connect, 0), dog(connect, 1)
    threading.Timer(0.6, peer.stop).start()
    start = time.monotonic()
    host.stop()
    print(f"host waited {time.monotonic() - start:.1f}", flush=True)
elif how == "later":  # rank 1 outlasts the wait: told, it runs on unwatched
    host, peer = dog(connect, 0), dog(connect, 1)
    start = time.monotonic()
    host.stop()
    waited = time.monotonic() - start
    assert 1.1 < waited < 4, waited
    assert peer.stopped.is_set() and host_store.check(["hpc/left/1"])
    del host, host_store
    time.sleep(0.5)
    peer.stop()
    print("peer ran on", flush=True)
elif how in ("vanished", "crashed"):  # the store goes with rank 0, after it finished or not
    peer = dog(connect, 1)
    if how == "vanished":
        host_store.set("hpc/done/0", "1")
    time.sleep(0.5)
    del host_store
    time.sleep(1.5)
    print("peer ran on", flush=True)
elif how == "lost_while_waiting":  # rank 1 is killed as rank 0 waits for it: rank 0 names it
    host, peer = dog(connect, 0), dog(connect, 1)
    peer.stopped.set()  # as when its process dies: the heartbeat ends, nothing is posted
    time.sleep(0.3)
    host.stop()
    print("host stopped", flush=True)
elif how == "failed":  # rank 1 failed and said so (stop(clean=False)): rank 0 need not wait
    host, peer = dog(connect, 0), dog(connect, 1)
    peer.stop(clean=False)
    start = time.monotonic()
    host.stop()
    print(f"host waited {time.monotonic() - start:.1f}", flush=True)
elif how == "ring":  # rank 1 finished, then rank 2 fails: rank 0 watches 2 in 1's place
    dogs = [dog(connect, r, world=3, store_host=None) for r in range(3)]
    time.sleep(0.3)
    dogs[1].stop()
    dogs[2].stop(clean=False)
    time.sleep(3)
    print("nobody noticed", flush=True)
"""


def _scenario(how):
    return subprocess.run([sys.executable, "-c", SCENARIOS, how], capture_output=True, text=True,
                          env=launch_env(), timeout=60)


def test_the_store_host_waits_for_a_rank_that_finishes_later():
    r = _scenario("late")
    assert r.returncode == 0, r.stdout + r.stderr
    waited = float(r.stdout.split("host waited ")[1])
    assert 0.4 < waited < 1.1, r.stdout  # until rank 1 finished, not the whole 1.2 s


def test_a_rank_outlasting_the_wait_runs_on_unwatched_without_an_error():
    r = _scenario("later")
    assert r.returncode == 0 and "peer ran on" in r.stdout, r.stdout + r.stderr
    assert "error" not in r.stderr, r.stderr


@pytest.mark.parametrize("how", ["vanished", "crashed"])
def test_losing_the_store_is_an_error_only_when_its_host_had_not_finished(how):
    r = _scenario(how)
    if how == "vanished":
        assert r.returncode == 0 and "peer ran on" in r.stdout, r.stdout + r.stderr
        assert "error" not in r.stderr, r.stderr
    else:
        assert r.returncode == 1 and "peer ran on" not in r.stdout, r.stdout + r.stderr
        assert "[rank 1] error: lost contact with the rendezvous store" in r.stderr, r.stderr


def test_the_store_host_does_not_wait_for_a_rank_that_failed():
    """A rank that failed printed why and exits 1; waiting for it would only turn that into
    "rank 1 was lost" a heartbeat timeout later."""
    r = _scenario("failed")
    assert r.returncode == 0, r.stdout + r.stderr
    assert float(r.stdout.split("host waited ")[1]) < 0.5, r.stdout


def test_a_rank_lost_while_the_host_waits_for_it_is_named():
    r = _scenario("lost_while_waiting")
    assert r.returncode == 1 and "host stopped" not in r.stdout, r.stdout + r.stderr
    assert "[rank 0] error: rank 1 was lost (no heartbeat for 1 s)" in r.stderr, r.stderr


def test_the_ring_closes_over_finished_ranks():
    """Rank 2's watcher (rank 1) finished first: rank 0 watches rank 2 instead."""
    r = _scenario("ring")
    assert r.returncode == 1 and "nobody noticed" not in r.stdout, r.stdout + r.stderr
    assert "[rank 0] error: rank 2 was lost (no heartbeat for 1 s)" in r.stderr, r.stderr


LATE_RANK = """
import time
from common.dist import init_distributed
ctx = init_distributed(device="cpu")
if ctx.rank == 1:
    time.sleep(7)
start = time.monotonic()
ctx.close()
print(f"rank {ctx.rank} closed after {time.monotonic() - start:.1f}", flush=True)
"""


@pytest.mark.slow
@needs_mpi
def test_a_rank_finishing_after_rank_0_under_mpiexec_exits_cleanly():
    """Under mpiexec rank 0's process hosts the store. Rank 1 finishes 7 s after rank 0: longer
    than a heartbeat interval (2 s) and the grace that spares a rank closing meanwhile (two
    intervals), after which it used to exit 1, "lost contact with the rendezvous store". Now
    rank 0 waits for it."""
    r = launch(["-c", LATE_RANK], ranks=2, launcher="mpiexec", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "error" not in r.stderr, r.stderr
    assert "rank 1 closed" in r.stdout, r.stdout
    assert float(r.stdout.split("rank 0 closed after ")[1].split()[0]) > 5, r.stdout
