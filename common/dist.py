"""Distributed start-up and shutdown under mpiexec, torchrun, srun or a single process.

:func:`init_distributed` finds out how the job was launched, sets up ``torch.distributed``
(gloo on CPU, NCCL on GPU) with a timeout so a lost peer raises instead of hanging, splits
the machine's cores between the ranks of a node, and returns a :class:`DistContext`.

Launchers, detected in this order (override with ``launcher=``):

* ``torchrun``: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` in the environment.
* ``srun`` (Slurm): ``SLURM_PROCID``/``SLURM_NTASKS`` inside a job step; the address is the
  first host of ``SLURM_STEP_NODELIST`` (or ``MASTER_ADDR``), the port ``MASTER_PORT`` or one
  derived from the job id.
* ``mpiexec``: MPI environment variables (MPICH/Hydra ``PMI_*``, Open MPI ``OMPI_*``, PMIx);
  mpi4py gives rank and size, rank 0 picks a free port and broadcasts its address.
* ``single``: one process, no launcher.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = float(os.environ.get("HPC_DIST_TIMEOUT", "300"))
# a rank whose heartbeat stalls this long is declared lost (detection within ~this + 2 s)
HEARTBEAT_TIMEOUT_S = float(os.environ.get("HPC_HEARTBEAT_TIMEOUT", "30"))
_PEER_LOST = re.compile(r"closed by peer|reset by peer|[Bb]roken pipe|Socket Timeout|"
                        r"Connection refused|NCCL (error|communicator was aborted)")
_MPI_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


@dataclass(frozen=True)
class DistContext:
    """What a rank knows about the job after start-up."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    launcher: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def detect_launcher(env: dict[str, str] | None = None) -> str:
    """``"torchrun"``, ``"srun"``, ``"mpiexec"`` or ``"single"`` from the environment."""
    env = os.environ if env is None else env
    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return "torchrun"
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and int(env.get("SLURM_NTASKS", 1)) > 1:
        return "srun"
    if any(k in env for k in _MPI_VARS):
        return "mpiexec"
    return "single"


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list: ``"nid[001-004,010],gpu7"`` -> ``"nid001"``."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot parse Slurm node list {nodelist!r}; set MASTER_ADDR")
    prefix, _, ranges = m.groups()
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _cores_available() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1


def _rendezvous(launcher: str) -> tuple[int, int, int, int, str, int]:
    """(rank, world, local_rank, local_world, master_addr, master_port) for a launcher."""
    env = os.environ
    if launcher == "torchrun":
        world = int(env["WORLD_SIZE"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        return (int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)), local_world,
                env["MASTER_ADDR"], int(env["MASTER_PORT"]))
    if launcher == "srun":
        world = int(env["SLURM_NTASKS"])
        nodes = int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", 1)))
        addr = env.get("MASTER_ADDR") or first_slurm_host(
            env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "localhost"))
        )
        port = int(env.get("MASTER_PORT", 15000 + int(env.get("SLURM_JOB_ID", 0)) % 20000))
        return (int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", 0)),
                max(1, world // nodes), addr, port)
    if launcher == "mpiexec":
        try:
            from mpi4py import MPI
        except ImportError as e:  # pragma: no cover - depends on the install
            raise RuntimeError(
                "launched under mpiexec but mpi4py is not importable; `pip install mpi4py` "
                "(built against the MPI that provides this mpiexec)"
            ) from e
        comm = MPI.COMM_WORLD
        rank, world = comm.Get_rank(), comm.Get_size()
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        local_rank, local_world = local.Get_rank(), local.Get_size()
        local.Free()
        addr_port = None
        if rank == 0:
            addr = env.get("MASTER_ADDR") or socket.gethostname()
            addr_port = (addr, int(env.get("MASTER_PORT", 0)) or _free_port())
        addr, port = comm.bcast(addr_port, root=0)
        return rank, world, local_rank, local_world, addr, port
    if launcher == "single":
        return 0, 1, 0, 1, "127.0.0.1", 0
    raise ValueError(f"unknown launcher {launcher!r}; use torchrun, srun, mpiexec or single")


def init_distributed(
    *,
    device: str = "auto",
    backend: str | None = None,
    launcher: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    set_threads: bool = True,
    watchdog: bool = True,
) -> DistContext:
    """Start ``torch.distributed`` for this process and return its :class:`DistContext`.

    Args:
        device: ``"auto"`` (CUDA if available, else CPU), ``"cpu"``, ``"cuda"``.
        backend: default ``"nccl"`` on CUDA, ``"gloo"`` on CPU.
        launcher: force a launcher instead of detecting it.
        timeout_s: collective timeout: a lost or stuck peer raises after this long.
        set_threads: give each rank ``cores / ranks-on-this-node`` torch threads, so ranks
            sharing a machine do not fight over cores (``OMP_NUM_THREADS`` wins if set).
        watchdog: with several ranks, start a heartbeat thread (:class:`Watchdog`) so that a
            killed rank makes every other rank exit non-zero, naming it, instead of hanging.
    """
    launcher = launcher or detect_launcher()
    rank, world, local_rank, local_world, addr, port = _rendezvous(launcher)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    elif device == "cpu":
        dev = torch.device("cpu")
    else:
        raise ValueError(f"unknown device {device!r}; use auto, cpu or cuda")
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    if set_threads and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, _cores_available() // max(1, local_world)))

    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if world == 1:
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        else:
            # env:// also honours torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE)
            os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank),
                              WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank))
            dist.init_process_group(
                backend, init_method="env://", rank=rank, world_size=world, timeout=timeout
            )
    if watchdog and world > 1 and _WATCHDOG[0] is None:
        store = _default_store()
        if store is not None:
            _WATCHDOG[0] = Watchdog(store, rank, world)
    return DistContext(rank, world, local_rank, local_world, dev, backend, launcher)


def _default_store():
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 - private API; without it there is no watchdog
        return None


class Watchdog:
    """Heartbeats through the rendezvous store; turns a lost peer into a prompt, named exit.

    Every ``interval_s`` each rank bumps its counter ``hpc/hb/<rank>`` and watches its ring
    successor's. If the successor's counter has not moved for ``timeout_s``, the rank posts
    ``hpc/abort`` naming it; every rank polls that key and exits with status 1 and the message.
    If the store itself is gone (its host died), the rank exits naming the store's host.
    """

    def __init__(self, store, rank: int, world: int, *, interval_s: float = 2.0,
                 timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="hpc-watchdog", daemon=True)
        self.thread.start()

    def _die(self, message: str) -> None:
        if self.stopped.wait(2 * self.interval_s):  # a clean shutdown raced us: stay quiet
            return
        print(f"[rank {self.rank}] error: {message}; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    def _run(self) -> None:
        succ = (self.rank + 1) % self.world
        beat, seen, since = 0, None, time.monotonic()
        while not self.stopped.is_set():
            try:
                beat += 1
                self.store.set(f"hpc/hb/{self.rank}", str(beat))
                if self.store.check(["hpc/abort"]):
                    return self._die(self.store.get("hpc/abort").decode())
                key = f"hpc/hb/{succ}"
                value = self.store.get(key) if self.store.check([key]) else None
                done = self.store.check([f"hpc/done/{succ}"])
            except Exception as e:  # noqa: BLE001 - the store's host is gone
                return self._die(f"lost contact with the rendezvous store ({type(e).__name__}"
                                 "); rank 0 or the launcher that hosts it was probably lost")
            now = time.monotonic()
            if value != seen or done:
                seen, since = value, now
            elif now - since > self.timeout_s:
                msg = f"rank {succ} was lost (no heartbeat for {self.timeout_s:.0f} s)"
                try:
                    self.store.set("hpc/abort", msg)
                except Exception:  # noqa: BLE001
                    pass
                return self._die(msg)
            self.stopped.wait(self.interval_s)

    def stop(self) -> None:
        try:
            self.store.set(f"hpc/done/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - shutting down anyway
            pass
        self.stopped.set()
        self.thread.join(timeout=5)


_WATCHDOG: list[Watchdog | None] = [None]  # one per process, owned by init/shutdown


def preemption_flag(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)
                    ) -> Callable[[], bool]:
    """Install handlers for the scheduler's preemption signals; return ``requested()``.

    Slurm sends SIGTERM (or ``--signal=USR1@T``) before killing a job: the trainers check the
    flag once per epoch/step (agreed across ranks), write a checkpoint and exit cleanly.
    """
    hit = threading.Event()
    for sig in signals:
        signal.signal(sig, lambda *_: hit.set())
    return hit.is_set


def is_comm_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective failing because a peer is gone (not a bug of ours).

    Gloo raises a plain RuntimeError ("Connection closed by peer ..."); newer torch raises
    ``torch.distributed.DistError`` subclasses.
    """
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    return isinstance(error, (RuntimeError, ConnectionError)) and bool(
        _PEER_LOST.search(str(error)))


def exit_on_comm_failure(error: BaseException, ctx: DistContext | None) -> None:
    """A collective failed (a peer vanished): let the watchdog name the lost rank, then exit.

    Gloo and NCCL report a dead peer as a generic connection error on the survivors; the
    watchdog (if running) identifies which rank stopped heart-beating within
    ``HEARTBEAT_TIMEOUT_S`` and exits the process with that message. Without a watchdog,
    or if it finds nothing, exit 1 with the original error.
    """
    rank = f"[rank {ctx.rank}] " if ctx else ""
    print(f"{rank}error: communication failed ({type(error).__name__}: {error}); "
          "identifying the lost rank...", file=sys.stderr, flush=True)
    if _WATCHDOG[0] is not None:
        _WATCHDOG[0].stopped.wait(HEARTBEAT_TIMEOUT_S + 10)  # the watchdog exits before this
    os._exit(1)


def any_rank(flag: bool, device: torch.device | str = "cpu") -> bool:
    """True on every rank if ``flag`` is True on any rank (one tiny all-reduce; collective)."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def shutdown() -> None:
    """Tear down the process group (safe to call twice or when never initialised)."""
    if _WATCHDOG[0] is not None:
        _WATCHDOG[0].stop()
        _WATCHDOG[0] = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def fail_all_ranks(message: str, ctx: DistContext | None, code: int = 2) -> None:
    """Report a user error on this rank and exit non-zero.

    For errors every rank detects identically (a bad grid, a bad flag): each rank prints the
    message, ranks meet at a barrier so no launcher kills a peer before it has printed, then
    all exit with ``code``.
    """
    prefix = f"[rank {ctx.rank}] " if ctx and ctx.world_size > 1 else ""
    print(f"{prefix}error: {message}", file=sys.stderr, flush=True)
    if ctx is not None and dist.is_initialized() and ctx.world_size > 1:
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - we are exiting with an error anyway
            pass
    shutdown()
    sys.exit(code)
