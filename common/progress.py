"""The communication thread of the MPI transport (:mod:`common.mpi`): one per process, it runs
queued calls in issue order while the issuing thread computes.

MPICH advances a non-blocking collective only inside MPI calls, so an asynchronous collective
is run by this thread instead (MPI's blocking call with the GIL released, or a polite
test-and-sleep loop); a synchronous one runs on the caller's thread when nothing is queued.
:class:`Work` is a queued call's handle, :data:`DONE` the handle of one that already ran.
Nothing here knows MPI: the calls are plain closures.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

__all__ = ["DONE", "Done", "ProgressThread", "Work"]


class Work:
    """A collective in flight on the :class:`ProgressThread`."""

    __slots__ = ("_done", "_error")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def is_completed(self) -> bool:
        """True once the collective finished (without waiting; no MPI call)."""
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


class Done:
    """A collective that ran on the caller's thread and is complete (no Event to pay for)."""

    __slots__ = ()

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        return None


DONE = Done()


class ProgressThread:
    """One communication thread per process: runs queued collectives in issue order.

    The thread blocks inside MPI with the GIL released, so a collective progresses while the
    issuing thread computes. ``pending`` counts queued and running jobs; only the issuing
    thread adds jobs, so ``pending == 0`` means the thread is idle and stays so.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], Work] | None] = (
            queue.SimpleQueue())
        self._lock = threading.Lock()
        self.pending = 0
        self._thread = threading.Thread(target=self._run, name="hpc-mpi-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, work = job
            try:
                fn()
            except BaseException as e:  # handed to the waiter
                work._error = e
            with self._lock:
                self.pending -= 1
            work._done.set()

    def submit(self, fn: Callable[[], None]) -> Work:
        work = Work()
        with self._lock:
            self.pending += 1
        self._jobs.put((fn, work))
        return work

    def run(self, fn: Callable[[], None], async_op: bool) -> Work | Done:
        """Run ``fn`` (an MPI call) now on this thread if nothing is queued and the call is
        synchronous; else queue it behind the others."""
        if not async_op and self.pending == 0:
            fn()
            return DONE
        work = self.submit(fn)
        if not async_op:
            work.wait()
        return work

    def stop(self) -> bool:
        """End the thread after the queued jobs (idempotent); True if it is idle and ended.
        With jobs still pending (a failing rank exits) it does not wait for them."""
        if self._thread.is_alive():
            self._jobs.put(None)
            if self.pending:
                return False
            self._thread.join(timeout=10)
        return not self._thread.is_alive()
