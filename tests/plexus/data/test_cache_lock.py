"""Jobs that share --root take turns preparing a cache (plexus.data.lock): one prepares, the
others wait for it and reuse it, and a preparer killed mid-way is taken over.

The jobs are real ``python -m plexus.train`` processes on a tiny graph in the exact OGB format
of ogbn-papers100M, which always goes through the cache; their losses are compared with a job
that ran alone on a root of its own.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from plexus.data import PreparedGraph, cache
from plexus.data.lock import CacheLockError, holder, lock_path, parse_once, preparing_lock
from tests.distributed import ROOT, launch_env
from tests.plexus.data.ogb_format import write_papers100m_like

PAPERS = "ogbn-papers100M"
NODES = 400
TRAIN = ["--dataset", PAPERS, "--epochs", "3", "--hidden", "8", "--grid", "1x1x1"]


def _cache(root: Path) -> Path:  # grid 1x1x1: k = 8 (plexus.data.job.default_blocks)
    return cache.cache_dir(PAPERS, root, blocks=8, permutation="double", seed=0,
                           symmetrize=False)


def _start(root: Path, name: str) -> tuple[subprocess.Popen, Path]:
    """``python -m plexus.train`` on ``root`` in the background; stdout to ``root/name.out``."""
    out = root / f"{name}.out"
    with open(out, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "plexus.train", *TRAIN, "--root", str(root), "--metrics",
             str(root / f"{name}.jsonl")], cwd=ROOT, env=launch_env(), stdout=f,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return proc, out


def _losses(root: Path, name: str) -> list[float]:
    lines = [json.loads(x) for x in (root / f"{name}.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines if "epoch" in x and "loss" in x]
    assert len(losses) == 3, lines
    return losses


def _finish(proc: subprocess.Popen, out: Path) -> str:
    try:
        proc.wait(timeout=300)
    finally:
        proc.kill()
    text = out.read_text()
    assert proc.returncode == 0, text
    return text


def _wait_for(predicate, what: str, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> list[float]:
    """The losses of a job alone on its own root."""
    root = tmp_path_factory.mktemp("alone")
    write_papers100m_like(root, num_nodes=NODES)
    text = _finish(*_start(root, "alone"))
    assert f"preparing {PAPERS} into {_cache(root)}" in text
    return _losses(root, "alone")


def test_the_lock_is_exclusive_says_whom_it_waits_for_and_frees_on_exit(tmp_path, capsys):
    out = tmp_path / "data"
    with preparing_lock(out, token="job-a") as previous:
        assert previous == "another job"  # nobody held it before
        assert f"pid {os.getpid()}, job job-a, since " in holder(out)
        with pytest.raises(TimeoutError, match=rf"for \S+ pid {os.getpid()}, job job-a"):
            with preparing_lock(out, timeout_s=0.3, poll_s=0.05):
                pass  # another open file description: a second job in all but pid
        released = threading.Event()

        def second():
            with preparing_lock(out, token="job-b", verbose=True, poll_s=0.05,
                                report_every_s=0.1):
                released.set()

        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.4)
        assert not released.is_set()
    thread.join(timeout=10)
    assert released.is_set() and "job job-b" in holder(out)
    said = capsys.readouterr().out
    assert f"waiting for {os.uname().nodename} pid {os.getpid()}, job job-a" in said
    assert lock_path(out).is_file()  # stays: a removed lock file would split the jobs


def test_a_filesystem_without_flock_stops_with_what_to_do(tmp_path, monkeypatch, capsys):
    import fcntl

    def no_flock(fd, op):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with pytest.raises(CacheLockError, match=r"does not support flock.*python -m plexus\.prepare"):
        with preparing_lock(tmp_path / "data"):
            pass
    ran = []
    with preparing_lock(tmp_path / "data", required=False):  # plexus.prepare goes on
        ran.append(True)
    assert ran and "preparing without it" in capsys.readouterr().out


def test_parse_once_parses_under_the_lock_and_reads_after_it(tmp_path):
    """A loader that writes its cache on first use (ogb's, PyG's): a second process that comes
    while the first parses waits, then reads the finished cache outside the lock."""
    cache = tmp_path / "ds" / "processed"
    done = cache / "data"
    calls = []

    def load():
        calls.append(("parsed" if not done.exists() else "read", _locked(cache)))
        cache.mkdir(parents=True, exist_ok=True)
        done.write_text("x")
        return len(calls)

    result = []
    cache.parent.mkdir()
    with preparing_lock(cache):  # a first loader, parsing
        thread = threading.Thread(target=lambda: result.append(parse_once(cache, done.exists,
                                                                           load)))
        thread.start()
        time.sleep(0.4)
        assert not calls  # waits for the lock, does not read a half-written cache
        cache.mkdir()
        done.write_text("x")
    thread.join(timeout=10)
    assert result == [1] and calls == [("read", False)]  # read the finished cache, unlocked
    calls.clear()
    other = tmp_path / "other" / "processed"
    assert parse_once(other, (other / "data").exists, lambda: load_other(other, calls)) == 1
    assert calls == [True]  # nothing cached: parsed while holding the lock


def load_other(cache, calls):
    calls.append(_locked(cache))
    return 1


def _locked(cache) -> bool:
    """Whether another open file description holds the lock of ``cache`` now."""
    try:
        with preparing_lock(cache, timeout_s=0.0, poll_s=0.01):
            return False
    except TimeoutError:
        return True


@pytest.mark.slow
def test_two_jobs_at_once_prepare_once_and_both_train_as_alone(tmp_path, alone):
    write_papers100m_like(tmp_path, num_nodes=NODES)
    out = _cache(tmp_path)
    out.parent.mkdir(parents=True)
    with preparing_lock(out, token="test"):  # both start while the lock is taken
        jobs = {name: _start(tmp_path, name) for name in ("a", "b")}
        _wait_for(lambda: all("waiting for" in o.read_text() for _, o in jobs.values()),
                  "both jobs to wait for the lock")
    texts = {name: _finish(*job) for name, job in jobs.items()}
    for text in texts.values():
        assert f"waiting for {os.uname().nodename} pid {os.getpid()}, job test" in text
    both = "".join(texts.values())
    assert both.count(f"preparing {PAPERS} into {out}") == 1  # once, by one of them
    assert PreparedGraph(out).num_nodes == NODES
    assert not list(out.parent.glob("*.partial")) and not list(out.parent.glob("*.failed"))
    for name in texts:
        assert _losses(tmp_path, name) == alone  # the same cache, bit for bit


KILLED_PREPARER = """
import sys, time
from pathlib import Path
import plexus.data.writer as writer
from plexus.data.cache import prepared_cache

def hang(work, *args, **kwargs):  # blocks written, node data not yet: mid-way
    Path(sys.argv[2]).touch()
    time.sleep(600)

writer._write_node_data = hang
prepared_cache("ogbn-papers100M", sys.argv[1], blocks=8, permutation="double", seed=0,
               symmetrize=False, is_writer=True, token="killed")
"""


@pytest.mark.slow
def test_a_killed_preparer_is_taken_over_by_the_next_job(tmp_path, alone):
    write_papers100m_like(tmp_path, num_nodes=NODES)
    out = _cache(tmp_path)
    ready = tmp_path / "mid-way"
    victim = subprocess.Popen([sys.executable, "-c", KILLED_PREPARER, str(tmp_path), str(ready)],
                              cwd=ROOT, env=launch_env(), stdin=subprocess.DEVNULL)
    try:
        _wait_for(ready.exists, "the preparer to reach its node data")
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    partial = Path(f"{out}.partial")
    assert partial.is_dir() and not out.exists()  # half-written, as the kill left it
    text = _finish(*_start(tmp_path, "next"))
    assert f"{partial} was left by a job that stopped ({os.uname().nodename} pid {victim.pid}, " \
           "job killed, since" in text
    assert f"preparing {PAPERS} into {out}" in text
    assert not partial.exists() and PreparedGraph(out).num_nodes == NODES
    assert _losses(tmp_path, "next") == alone
