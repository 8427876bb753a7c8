"""Distributed start-up and shutdown under mpiexec, torchrun, srun or a single process.

:func:`init_distributed` finds out how the job was launched, sets up ``torch.distributed``
(gloo on CPU; on GPU NCCL for CUDA tensors and gloo for CPU ones) with a timeout so a lost peer
raises instead of hanging, splits the machine's cores between the ranks of a node, picks the
transport of CPU tensors (MPI through mpi4py when an MPI launcher started the job:
:mod:`common.mpi`; else gloo), and returns a :class:`DistContext`. The
context owns the heartbeat :class:`Watchdog` and closes itself: an exit hook stops the
watchdog and destroys the process group when the interpreter exits (a process that exits with
a live gloo group can die with "terminate called without an active exception"); use
``with init_distributed() as ctx:`` or ``ctx.close()`` to close it earlier. Nothing here is
module state, and the timeouts' environment variables are read by the call, not at import.
Axis groups come from :meth:`DistContext.create_groups` (``ctx.create_groups(grid)``: with the
job's MPI transport when there is one). What ranks do together when something fails lives in
:mod:`common.failure`; the small agreements and object exchanges (``any_rank``,
``broadcast_object``, ...) in :mod:`common.exchange`.

Launchers, detected in this order (override with ``launcher=``):

* ``torchrun``: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` in the environment.
* ``srun`` (Slurm): ``SLURM_PROCID``/``SLURM_NTASKS`` inside a job step, unless the MPI
  variables show that mpiexec started the processes inside the step; the address is the first
  host of ``SLURM_STEP_NODELIST`` (or ``MASTER_ADDR``), the port ``MASTER_PORT`` or one derived
  from the job and step ids (:func:`_slurm_port`); the ranks on a node from
  ``SLURM_STEP_TASKS_PER_NODE`` (:func:`_slurm_local_world`).
* ``mpiexec``: MPI environment variables (MPICH/Hydra ``PMI_*``, Open MPI ``OMPI_*``, PMIx);
  mpi4py gives rank and size, rank 0 picks a free port and broadcasts its address.
* ``single``: one process, no launcher.

Under mpiexec and srun rank 0's process hosts the rendezvous store: its watchdog keeps the store
up until the other ranks have finished too (:class:`~common.watchdog.Watchdog`).
"""

from __future__ import annotations

import atexit
import datetime
import os
import re
import socket
import sys
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from common.device import DEVICES, choose_device, gpus_bound_to_rank
from common.grid import AxisGroup, ProcessGrid
from common.mpi import MPITransport, cores_available, mpi_world_size
from common.watchdog import DEFAULT_HEARTBEAT_TIMEOUT_S, Watchdog

__all__ = ["COMMS", "DEFAULT_TIMEOUT_S", "DEVICES", "ENV_DEVICE", "ENV_HEARTBEAT_TIMEOUT",
           "ENV_MPI_POLITE", "ENV_TIMEOUT", "DistContext", "default_backend",
           "detect_launcher", "first_slurm_host", "init_distributed",
           "resolve_timeouts", "shutdown", "split_threads"]

# Defaults of the two timeouts when neither the argument nor the environment sets them. The
# environment variables are read by init_distributed when it runs, never at import.
ENV_TIMEOUT, DEFAULT_TIMEOUT_S = "HPC_DIST_TIMEOUT", 300.0
ENV_HEARTBEAT_TIMEOUT = "HPC_HEARTBEAT_TIMEOUT"  # default: watchdog.DEFAULT_HEARTBEAT_TIMEOUT_S
ENV_MPI_POLITE = "HPC_MPI_POLITE"  # none / async / all: mpi_polite when the caller gives None
ENV_DEVICE = "HPC_DEVICE"  # the default of the CLIs' --device (common.run.add_launch_args)
COMMS = ("auto", "mpi", "torch")
_MPI_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
_MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
_MPI_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
# set by an MPI launcher's process manager (Hydra of MPICH and Intel MPI, Open MPI's mpirun) and
# never by srun, whose tasks get PMI_RANK or PMIX_RANK alone: rank 0 of an mpiexec inside a Slurm
# step has the same rank and size as the step's task 0, and only these tell it apart
_MPIEXEC_ONLY_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_RANK")
# the largest timeout datetime.timedelta (which torch.distributed takes) can hold
_MAX_TIMEOUT_S = datetime.timedelta.max.total_seconds()


@dataclass(frozen=True)
class DistContext:
    """What a rank knows about the job after start-up; owns the watchdog.

    Use it as a context manager (``with init_distributed() as ctx:``) or call :meth:`close`;
    without either, the exit hook that :func:`init_distributed` registers closes it when the
    interpreter exits. Closing twice is harmless. One context per process: closing it
    destroys the default process group.

    Attributes:
        rank, world_size: this process's global rank and the number of ranks.
        local_rank, local_world_size: the same among the ranks of this node.
        device: the torch device this rank computes on.
        device_reason: why (:func:`choose_device`): ``"--device cpu"``, ``"local rank 2 of 4
            on GPU 2 of 4"``, or the reason ``auto`` fell back to the CPU.
        backend: the ``torch.distributed`` backend: ``"gloo"``, or ``"cpu:gloo,cuda:nccl"``
            on GPUs.
        launcher: ``"torchrun"``, ``"srun"``, ``"mpiexec"`` or ``"single"``.
        heartbeat_timeout_s: how long the watchdog waits for a silent peer.
        watchdog: the heartbeat thread (None with one rank or ``watchdog=False``).
        transport: the :class:`~common.mpi.MPITransport` that CPU tensors use, or None
            (``torch.distributed`` only); :meth:`create_groups` gives it to every axis group.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    launcher: str
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    device_reason: str = field(default="", compare=False)
    watchdog: Watchdog | None = field(default=None, compare=False, repr=False)
    transport: MPITransport | None = field(default=None, compare=False, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def comm(self) -> str:
        """The transport of CPU tensors: ``"mpi"`` or ``"torch"``."""
        return "torch" if self.transport is None else "mpi"

    @property
    def comm_label(self) -> str:
        """For logs: ``"mpi"`` (plus ``"+nccl"`` on GPUs), else the torch backend."""
        if self.transport is None:
            return self.backend
        return "mpi+nccl" if self.device.type == "cuda" else "mpi"

    def create_groups(self, grid: ProcessGrid, axis_sets: Iterable[str | Iterable[str]] | None
                      = None, **pg_kwargs: Any) -> dict[str, AxisGroup]:
        """This rank's axis groups of ``grid``, over the job's transport; collective.

        The way to make axis groups: every rank calls it with the same arguments and creates
        every group, in the same order; each group gets an MPI communicator when the job has
        the MPI transport (mpiexec), so CPU tensors take MPI, not gloo. ``axis_sets`` and
        ``pg_kwargs`` as in :meth:`common.grid.ProcessGrid.create_groups`.

        Raises:
            ValueError: the grid does not have ``world_size`` ranks (``grid x=1 * y=2 * z=1 = 2
                ranks, but 3 processes were launched``), on every rank before any group is
                created: a rank outside a smaller grid would fail alone and leave the ranks
                inside waiting for it in the group creation.
        """
        grid.check(self.world_size)
        return grid.create_groups(self.rank, axis_sets, transport=self.transport, **pg_kwargs)

    def close(self) -> None:
        """Stop the watchdog and destroy the process group (:func:`shutdown`; idempotent).

        On the rank whose process hosts the rendezvous store (rank 0 under mpiexec and srun)
        this first waits for the other ranks to close too, at most the heartbeat timeout and two
        heartbeats, so that a rank finishing later does not lose the store and exit 1."""
        atexit.unregister(self._at_exit)
        shutdown(self)

    def __enter__(self) -> DistContext:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None or issubclass(exc_type, SystemExit):
            self.close()
        else:
            self._close_failed()

    def _at_exit(self) -> None:
        # An uncaught exception ended the script (the interpreter stored it in sys.last_value
        # before running exit hooks): leave the heartbeat silent so the peers name this rank
        # as lost instead of waiting for it.
        if getattr(sys, "last_value", None) is not None:
            self._close_failed()
        else:
            shutdown(self)

    def _close_failed(self) -> None:
        atexit.unregister(self._at_exit)
        if self.watchdog is not None:
            self.watchdog.stop(clean=False)
        shutdown(self)


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number of seconds") from None
    if not 0 < seconds <= _MAX_TIMEOUT_S:
        raise ValueError(f"{name}={value!r}: the timeout must be > 0 seconds and finite (at "
                         f"most {_MAX_TIMEOUT_S:.3g})")
    return seconds


def resolve_timeouts(timeout_s: float | None = None, heartbeat_timeout_s: float | None = None
                     ) -> tuple[float, float]:
    """(collective timeout, heartbeat timeout) in seconds: an argument wins, then
    ``$HPC_DIST_TIMEOUT`` / ``$HPC_HEARTBEAT_TIMEOUT`` (read now), then 300 / 30.

    Raises:
        ValueError: a timeout that is not > 0, or not finite: ``inf`` (``--dist-timeout inf``)
            would pass a plain ``> 0`` and end in an OverflowError of timedelta on every rank.
    """
    out = []
    for value, env, default, flag in (
            (timeout_s, ENV_TIMEOUT, DEFAULT_TIMEOUT_S, "timeout_s (--dist-timeout)"),
            (heartbeat_timeout_s, ENV_HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT_S,
             "heartbeat_timeout_s (--heartbeat-timeout)")):
        if value is None:
            value = _env_seconds(env, default)
        elif not 0 < value <= _MAX_TIMEOUT_S:
            raise ValueError(f"{flag} must be > 0 seconds and finite (at most "
                             f"{_MAX_TIMEOUT_S:.3g}), got {value}")
        out.append(float(value))
    return out[0], out[1]


def detect_launcher(env: Mapping[str, str] | None = None) -> str:
    """``"torchrun"``, ``"srun"``, ``"mpiexec"`` or ``"single"`` from the environment.

    Processes that mpiexec starts inside a Slurm step (an ``srun --pty bash`` shell, or
    mpiexec's proxies started by srun) inherit the step's ``SLURM_PROCID``, ``SLURM_STEP_ID``
    and ``SLURM_NTASKS``: read as srun, every rank of a proxy would take the same rank. They are
    mpiexec's when a variable only an MPI launcher sets is there (Hydra's ``MPI_LOCALRANKID``,
    Open MPI's ``OMPI_COMM_WORLD_RANK``), or when the MPI rank or size disagrees with Slurm's;
    the first test is the one rank 0 needs, whose rank and size agree with the step's task 0.
    """
    env = os.environ if env is None else env
    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return "torchrun"
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and int(env.get("SLURM_NTASKS", 1)) > 1:
        return "mpiexec" if _mpiexec_in_slurm_step(env) else "srun"
    if any(k in env for k in _MPI_VARS):
        return "mpiexec"
    return "single"


def _mpiexec_in_slurm_step(env: Mapping[str, str]) -> bool:
    """Whether mpiexec, not srun, started this process of a Slurm step (see detect_launcher)."""
    if any(k in env for k in _MPIEXEC_ONLY_VARS):
        return True
    ranks = [env[k] for k in _MPI_RANK_VARS if k in env]
    sizes = [env[k] for k in _MPI_SIZE_VARS if k in env]
    return (any(r != env["SLURM_PROCID"] for r in ranks)
            or any(n != env.get("SLURM_NTASKS") for n in sizes))


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list: ``"nid[001-004,010],gpu7"`` -> ``"nid001"``."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot parse Slurm node list {nodelist!r}; set MASTER_ADDR")
    prefix, _, ranges = m.groups()
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _slurm_tasks_per_node(spec: str, name: str = "SLURM_STEP_TASKS_PER_NODE") -> list[int]:
    """Slurm's tasks per node (the variable ``name``), one count per node of the step:
    ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"cannot parse {name}={spec!r}: Slurm writes the tasks per node as "
                             "counts such as '2(x3),1'; unset it or give it in that form")
        counts += [int(m[1])] * int(m[2] or 1)
    return counts


def _slurm_local_world(env: Mapping[str, str]) -> int:
    """How many tasks of this srun step run on this node.

    ``-n3 -N2`` puts 2 tasks on one node and 1 on the other, so the count is this node's
    (``SLURM_NODEID``) entry of ``SLURM_STEP_TASKS_PER_NODE`` (else of the job's
    ``SLURM_TASKS_PER_NODE``). Without them, the tasks are taken to spread as evenly as they
    can: ``ceil(SLURM_NTASKS / nodes)``, and at least ``SLURM_LOCALID + 1`` (a count too high
    costs threads per rank; one too low would put two ranks on a GPU).
    """
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(name):
            counts = _slurm_tasks_per_node(env[name], name)
            node = env.get("SLURM_NODEID", "")
            if len(counts) == 1:
                return counts[0]
            if node.isdigit() and int(node) < len(counts):
                return counts[int(node)]
            break
    world = int(env["SLURM_NTASKS"])
    nodes = max(1, int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", 1))))
    return max(-(-world // nodes), int(env.get("SLURM_LOCALID", 0)) + 1)


def _slurm_port(env: Mapping[str, str]) -> int:
    """The rendezvous port of an srun step: ``MASTER_PORT`` if set, else
    ``15000 + (job_id * 16 + step_id % 16) % 20000``.

    The step id keeps concurrent steps of one allocation (``srun ... &`` twice) off each other's
    store: with the job id alone they took the same port, and the second step failed to bind it
    or joined the first one's store. Steps 0-15 of a job, and jobs fewer than 1250 apart, never
    share a port.
    """
    if env.get("MASTER_PORT"):
        return int(env["MASTER_PORT"])
    job, step = int(env.get("SLURM_JOB_ID", 0)), int(env.get("SLURM_STEP_ID", 0))
    return 15000 + (job * 16 + step % 16) % 20000


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _rendezvous(launcher: str) -> tuple[int, int, int, int, str, int]:
    """(rank, world, local_rank, local_world, master_addr, master_port) for a launcher."""
    env = os.environ
    if launcher == "torchrun":
        world = int(env["WORLD_SIZE"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        return (int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)), local_world,
                env["MASTER_ADDR"], int(env["MASTER_PORT"]))
    if launcher == "srun":
        addr = env.get("MASTER_ADDR") or first_slurm_host(
            env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "localhost"))
        )
        return (int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                int(env.get("SLURM_LOCALID", 0)), _slurm_local_world(env), addr, _slurm_port(env))
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
    timeout_s: float | None = None,
    heartbeat_timeout_s: float | None = None,
    set_threads: bool = True,
    watchdog: bool = True,
    comm: str = "auto",
    two_level: bool = False,
    ranks_per_node: int | None = None,
    mpi_polite: str | None = None,
) -> DistContext:
    """Start ``torch.distributed`` for this process and return its :class:`DistContext`.

    Registers an exit hook that closes the context (watchdog, then process group) when the
    interpreter exits, so a script needs no explicit shutdown under any launcher.

    Args:
        device: ``"auto"``: a GPU per rank of the node when there are enough, else the CPU
            (saying why on the node's first rank); ``"cuda"``: a GPU per rank or an error;
            ``"cpu"``. See :func:`choose_device`.
        backend: default ``"nccl"`` on CUDA, ``"gloo"`` on CPU.
        launcher: force a launcher instead of detecting it.
        timeout_s: collective timeout: a lost or stuck peer raises after this long. None:
            ``$HPC_DIST_TIMEOUT``, else 300.
        heartbeat_timeout_s: the watchdog declares a silent peer lost after this long. None:
            ``$HPC_HEARTBEAT_TIMEOUT``, else 30.
        set_threads: give each rank ``cores / ranks-on-this-node`` torch threads, so ranks
            sharing a machine do not fight over cores (``OMP_NUM_THREADS`` wins if set).
        watchdog: with several ranks, start a heartbeat thread (:class:`Watchdog`) so that a
            killed rank makes every other rank exit non-zero, naming it, instead of hanging.
        comm: transport of CPU tensors. ``"auto"``: MPI when mpiexec started the job (and
            it has several ranks), else ``torch.distributed``; ``"mpi"``: MPI or an error
            (also under srun with an MPI-enabled Slurm); ``"torch"``: gloo/NCCL only.
        two_level: with MPI, two-level (PCCL) all-gather and reduce-scatter on groups that
            span nodes.
        ranks_per_node: with MPI, treat every ``ranks_per_node`` consecutive ranks as one
            node (simulates a multi-node layout); None: the real nodes.
        mpi_polite: with MPI, which collectives wait by testing and sleeping instead of
            spinning: ``"none"``, ``"async"``, ``"all"``; None: ``HPC_MPI_POLITE`` if set,
            else by ranks per core (:class:`common.mpi.MPITransport`).

    Raises:
        ValueError: an unknown device, launcher, comm, or a bad timeout; ``comm="mpi"`` in
            a job MPI did not start; ``device="cuda"`` with fewer GPUs than ranks on the node
            (before any process group starts).
    """
    timeout_s, heartbeat_timeout_s = resolve_timeouts(timeout_s, heartbeat_timeout_s)
    if mpi_polite is None and os.environ.get(ENV_MPI_POLITE):
        mpi_polite = os.environ[ENV_MPI_POLITE]
        if mpi_polite not in ("none", "async", "all"):
            raise ValueError(f"{ENV_MPI_POLITE}={mpi_polite!r}: use none, async or all")
    launcher = launcher or detect_launcher()
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; use auto, cpu or cuda")
    num_gpus = torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 0
    if device == "cuda" and num_gpus == 0:
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    if comm not in COMMS:
        raise ValueError(f"unknown comm {comm!r}; use one of {', '.join(COMMS)}")
    rank, world, local_rank, local_world, addr, port = _rendezvous(launcher)
    # before any process group: a node with too few GPUs is refused (cuda) or runs on the
    # CPU (auto) here, not with "Duplicate GPU detected" at NCCL's first collective
    dev, reason = choose_device(device, local_rank=local_rank, local_world_size=local_world,
                                num_gpus=num_gpus, bound=gpus_bound_to_rank(num_gpus))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    elif device == "auto" and num_gpus and local_rank == 0:  # once per node
        print(f"[rank {rank}] note: {reason}", file=sys.stderr, flush=True)
    use_mpi = _use_mpi(comm, launcher, world)
    backend = backend or default_backend(dev.type)
    if set_threads:
        split_threads(local_world)

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
    dog = None
    if watchdog and world > 1:
        default_store = _default_store()
        if default_store is not None:
            dog = Watchdog(_own_connection(addr, port, default_store), rank, world,
                           timeout_s=heartbeat_timeout_s, store_host=_store_host(os.environ))
    transport = (MPITransport(two_level=two_level, ranks_per_node=ranks_per_node,
                              polite=mpi_polite) if use_mpi else None)
    ctx = DistContext(rank, world, local_rank, local_world, dev, backend, launcher,
                      heartbeat_timeout_s=heartbeat_timeout_s, device_reason=reason,
                      watchdog=dog, transport=transport)
    atexit.register(ctx._at_exit)
    return ctx


def default_backend(device_type: str) -> str:
    """The ``torch.distributed`` backend for a device type: ``"gloo"`` on CPU; on CUDA NCCL
    for CUDA tensors plus gloo for the collectives that run on CPU tensors even in a GPU job
    (set-up checks, metrics, predictions): ``"cpu:gloo,cuda:nccl"``."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def split_threads(local_world: int, env: MutableMapping[str, str] | None = None) -> int:
    """Give this rank ``cores / ranks-on-this-node`` threads (``OMP_NUM_THREADS`` wins if set)
    in torch and in numba's kernel pool; return the count.

    numba sizes its OpenMP pool from ``NUMBA_NUM_THREADS`` when it is first imported (so set it
    here, before plexus loads its kernels; a setting the user made wins): idle pool threads
    spin-wait, so a pool of every core in each of several ranks on the same cores burns the
    CPU time the other ranks compute with, and slows every epoch of an oversubscribed job.
    """
    env = os.environ if env is None else env
    threads = (int(env["OMP_NUM_THREADS"]) if env.get("OMP_NUM_THREADS", "").isdigit()
               else max(1, cores_available() // max(1, local_world)))
    if "OMP_NUM_THREADS" not in env:
        torch.set_num_threads(threads)
    env.setdefault("NUMBA_NUM_THREADS", str(threads))
    return threads


def _use_mpi(comm: str, launcher: str, world: int) -> bool:
    """Whether CPU tensors go through MPI (see ``comm`` in :func:`init_distributed`)."""
    if comm == "torch" or world == 1:
        return False
    if comm == "auto" and launcher != "mpiexec":
        return False  # torchrun / srun: never start MPI behind the launcher's back
    mpi_world = mpi_world_size(start=comm == "mpi")
    if mpi_world == world:
        return True
    if comm == "mpi":
        raise ValueError(
            f"--comm mpi: MPI sees {mpi_world} rank(s) but the job has {world}; start it with "
            "mpiexec (or srun with Slurm's MPI support) and mpi4py built for that MPI, or use "
            "--comm torch")
    return False


def _default_store() -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # private API; without it there is no watchdog
        return None


def _store_host(env: Mapping[str, str]) -> int | None:
    """The rank whose process hosts the rendezvous store: rank 0 under env:// rendezvous
    (mpiexec, srun), none where torchrun's agent hosts it (``TORCHELASTIC_USE_AGENT_STORE``)."""
    return None if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0


def _own_connection(addr: str, port: int, default_store: Any) -> Any:
    """A connection of the watchdog's own to the rendezvous store (the default store where
    none can be made). A connection serves one request at a time, and torch.distributed's
    waits on it last until every member has come (a new group waits for each member's
    address): heartbeats and aborts through the default store would stall behind them, and a
    rank waiting there for a peer that failed would never hear of it."""
    try:
        return dist.TCPStore(addr, port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=60))
    except Exception:  # (a store this process cannot reach again: the heartbeat shares it)
        return default_store


def shutdown(ctx: DistContext | None = None) -> None:
    """Stop ``ctx``'s watchdog (if given) and tear down the process group.

    Safe to call twice or when never initialised. :meth:`DistContext.close` and the exit hook
    of :func:`init_distributed` call it; scripts need not.
    """
    if ctx is not None and ctx.watchdog is not None:
        ctx.watchdog.stop()
    if ctx is not None and ctx.transport is not None:
        ctx.transport.close()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
