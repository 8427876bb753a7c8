"""One preparer per cache across jobs: an exclusive ``flock`` on ``OUT.lock`` beside the cache.

    with preparing_lock(out, token=token, verbose=True) as previous:
        if not is_prepared(out):     # another job may have finished it while this one waited
            prepare(...)

The lock belongs to the open file, so the kernel releases it when its holder exits, killed or
not: a job that finds ``OUT.partial`` once it holds the lock knows the job that wrote it is
gone, and prepares anew. While it waits, a job prints who holds the lock (host, pid and job,
which the holder writes into the lock file) every ``report_every_s``.

Where it works: ``flock`` is coherent across nodes on NFS (Linux emulates it with NFS's byte-
range locks; NFSv3 needs ``lockd``), on GPFS/Spectrum Scale, on BeeGFS with
``tuneUseGlobalFileLocks``, and on Lustre mounted with ``-o flock``. On Lustre mounted with
``-o localflock`` it holds only among the processes of one node, and with ``-o noflock`` (or
NFS without ``lockd``) it fails: the job then stops with :class:`CacheLockError`, which says
to prepare the dataset once with ``python -m plexus.prepare`` before the jobs start. The lock
file stays (removing it would let two jobs lock two different files); it is a few bytes.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

POLL_S = 2.0  # how often a waiting job tries the lock again
REPORT_EVERY_S = 30.0  # how often a waiting job says whom it waits for

T = TypeVar("T")


class CacheLockError(OSError):
    """The filesystem of the cache does not support ``flock``."""


def lock_path(out: Path) -> Path:
    return Path(f"{out}.lock")


def holder(out: Path) -> str:
    """Who holds (or last held) the lock of ``out``, as its holder wrote it."""
    try:
        rec = json.loads(lock_path(out).read_text())
        job = f", job {rec['token']}" if rec.get("token") else ""
        since = time.strftime("%H:%M:%S", time.localtime(rec["since"]))
        return f"{rec['host']} pid {rec['pid']}{job}, since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another job"  # between the holder's lock and its write, or an older plexus


@contextmanager
def preparing_lock(out: Path, *, token: str | None = None, verbose: bool = False,
                   poll_s: float = POLL_S, report_every_s: float = REPORT_EVERY_S,
                   timeout_s: float | None = None, required: bool = True) -> Iterator[str]:
    """Hold the exclusive lock of ``out`` (waiting for another holder) for the ``with`` body,
    which gets the previous holder (:func:`holder`: who wrote an ``OUT.partial`` found then).

    Args:
        out: the cache directory; the lock is ``OUT.lock``, its parent must exist.
        token: this job's id, written for the jobs that wait (:func:`holder`).
        verbose: print that this job waits, and for whom.
        poll_s, report_every_s: try again every ``poll_s`` s; say so every ``report_every_s``.
        timeout_s: give up after this long (None: wait as long as the holder works).
        required: False: where the filesystem has no ``flock``, say so and run the body
            unlocked (``python -m plexus.prepare``, the command that prepares before jobs).

    Raises:
        CacheLockError: the filesystem does not support ``flock`` (module docstring).
        TimeoutError: waited ``timeout_s``.
    """
    path = lock_path(out)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        start, last = time.monotonic(), None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    if not required:
                        print(f"note: cannot lock {path} ({e.strerror}); preparing without "
                              "it: start no job on this dataset until this is done",
                              flush=True)
                        yield "nobody"
                        return
                    raise CacheLockError(
                        f"cannot lock {path} ({e.strerror}): the filesystem of "
                        "--root does not support flock (Lustre needs -o flock, NFSv3 lockd), "
                        "so jobs cannot take turns preparing it; prepare it once before the "
                        "jobs start (python -m plexus.prepare --source NAME --out "
                        f"{out} ...), or use a --root where flock works") from e
            now = time.monotonic()
            if timeout_s is not None and now - start > timeout_s:
                raise TimeoutError(f"waited {now - start:.0f} s for {holder(out)} to prepare "
                                   f"{out}; it holds {path}")
            if verbose and (last is None or now - last >= report_every_s):
                last = now
                print(f"waiting for {holder(out)} to prepare {out} (elapsed "
                      f"{now - start:.0f} s); this job will use it when it is done", flush=True)
            time.sleep(poll_s)
        previous = holder(out)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "token": token,
                  "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        yield previous
    finally:
        os.close(fd)  # releases the lock


def parse_once(cache: Path, is_cached: Callable[[], bool], load: Callable[[], T]) -> T:
    """``load()``, where a loader (ogb's, PyG's) parses raw files into ``cache`` on first use and
    reads the cache afterwards, and several processes may load at once (the ranks of a job,
    the jobs of a sweep): the first parses and writes while holding ``CACHE.lock``; the others
    wait for the lock and read what it wrote, never a half-written file. Where the cache is
    there already, loads run in parallel. Where the filesystem has no ``flock`` this says so
    and loads unlocked (:func:`preparing_lock` with ``required=False``)."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    with preparing_lock(cache, required=False):
        if not is_cached():
            return load()
    return load()
