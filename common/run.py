"""Plumbing both trainers share: start-up flags, checkpoint flags, metrics, the steady-state
average of their rows, exit on errors (memory meters: :mod:`common.memory`).

A trainer's CLI (``plexus.train``, ``llm.train``) reads top to bottom with these::

    p = argparse.ArgumentParser()
    add_launch_args(p)                      # --device --dist-timeout --heartbeat-timeout
    add_checkpoint_args(p, unit="epochs")   # --checkpoint-dir --checkpoint-every ...
    args = p.parse_args()
    ctx = start(args)                       # init_distributed; a bad flag exits every rank
    checkpoint = run_or_exit(ctx, lambda: checkpoint_config(args), user_errors=(ValueError,))
    with MetricsWriter(args.metrics, enabled=ctx.is_main, resume=checkpoint.resume) as m:
        result = run_or_exit(ctx, lambda: train(..., on_step=m.write),
                             user_errors=(ValueError, CheckpointError, FloatingPointError))

Checkpoints live in ``DIR/step-N/`` (:mod:`common.checkpoint`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import IO, Any, TypeVar

from common.checkpoint import list_steps
from common.device import DEVICES
from common.dist import COMMS, ENV_DEVICE, DistContext, init_distributed
from common.failure import classify_failure, exit_on_failure, fail_all_ranks

T = TypeVar("T")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where and how often to checkpoint.

    Attributes:
        dir: checkpoint directory (``--checkpoint-dir``; None: no checkpoints). Checkpoints
            live in ``dir/step-N/``.
        every: save every N epochs or steps (``--checkpoint-every``; 0: only at the end and
            on preemption).
        keep: complete checkpoints kept (``--keep-checkpoints``).
        resume: continue from the newest intact checkpoint in ``dir``, if there is one
            (``--resume``).
    """

    dir: str | None = None
    every: int = 0
    keep: int = 3
    resume: bool = False

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"--checkpoint-every must be >= 0 (0: only at the end and on "
                             f"preemption), got {self.every}")
        if self.keep < 1:
            raise ValueError(f"--keep-checkpoints must be >= 1, got {self.keep}")
        if self.resume and not self.dir:
            raise ValueError("--resume needs --checkpoint-dir (the directory to resume from)")


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    """``--device {auto,cpu,cuda}`` (default ``$HPC_DEVICE``, else auto), ``--comm
    {auto,mpi,torch}``, ``--two-level``, ``--dist-timeout S``, ``--heartbeat-timeout S``."""
    default_device = os.environ.get(ENV_DEVICE) or "auto"  # read now, when the CLI builds
    parser.add_argument("--device", choices=DEVICES, default=default_device,
                        help="auto: a GPU per rank when the node has one for each local rank, "
                        "else CPU (saying why); cuda: a GPU per rank or an error (default: "
                        f"${ENV_DEVICE}, else auto)")
    parser.add_argument("--comm", choices=COMMS, default="auto",
                        help="transport of CPU tensors: mpi (mpi4py; the default when mpiexec "
                        "started the job) or torch (gloo; the default under torchrun/srun). "
                        "CUDA tensors always use NCCL")
    parser.add_argument("--two-level", action="store_true",
                        help="with --comm mpi: two-level (PCCL) all-gather and reduce-scatter "
                        "on groups that span nodes")
    parser.add_argument("--dist-timeout", type=float, default=None, metavar="S",
                        help="a collective that waits this long for a peer fails (default: "
                        "$HPC_DIST_TIMEOUT, else 300)")
    parser.add_argument("--heartbeat-timeout", type=float, default=None, metavar="S",
                        help="a rank silent this long is reported lost and every rank exits "
                        "(default: $HPC_HEARTBEAT_TIMEOUT, else 30)")


def start(args: argparse.Namespace) -> DistContext:
    """:func:`~common.dist.init_distributed` from the :func:`add_launch_args` flags.

    A bad flag (ValueError) is reported on every rank, which exit with status 2: among them
    ``--device cuda`` on a node with fewer GPUs than ranks, before any process group starts.
    """
    if args.device not in DEVICES:  # argparse checks the flag, not its default from the env
        fail_all_ranks(f"{ENV_DEVICE}={args.device!r}: use auto, cpu or cuda", None)
    for flag, seconds in (("--dist-timeout", args.dist_timeout),
                          ("--heartbeat-timeout", args.heartbeat_timeout)):
        if seconds is not None and not seconds > 0:
            fail_all_ranks(f"{flag} must be > 0 seconds, got {seconds:g}", None)
    try:
        return init_distributed(device=args.device, timeout_s=args.dist_timeout,
                                heartbeat_timeout_s=args.heartbeat_timeout, comm=args.comm,
                                two_level=args.two_level)
    except ValueError as e:
        fail_all_ranks(str(e), None)


def add_checkpoint_args(parser: argparse.ArgumentParser, *, unit: str) -> None:
    """``--checkpoint-dir DIR --checkpoint-every N --keep-checkpoints K --resume``.

    Args:
        parser: the trainer's parser.
        unit: what ``N`` counts in the help text (``"epochs"``, ``"steps"``).
    """
    parser.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                        help="write atomic checkpoints to DIR/step-N/ (at the end, every "
                        "--checkpoint-every N, and on SIGTERM/SIGUSR1); needs a filesystem "
                        "all ranks share")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                        help=f"also checkpoint every N {unit} (default 0: only at the end and "
                        "on preemption)")
    parser.add_argument("--keep-checkpoints", type=int, default=3, metavar="K",
                        help="complete checkpoints kept in DIR (default 3)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest intact DIR/step-N/ of --checkpoint-dir "
                        "(starts fresh when there is none)")


def checkpoint_config(args: argparse.Namespace) -> CheckpointConfig:
    """The :class:`CheckpointConfig` of the :func:`add_checkpoint_args` flags.

    Raises:
        ValueError: a bad combination, naming the flag.
    """
    return CheckpointConfig(dir=args.checkpoint_dir, every=args.checkpoint_every,
                            keep=args.keep_checkpoints, resume=args.resume)


def check_writable(path: str, *, flag: str, create_dir: bool = False) -> None:
    """Fail before training, not after it, when an output cannot be written.

    Args:
        path: a file to be written (its directory must exist and be writable), or with
            ``create_dir`` a directory (created with its parents if missing; must be writable).
        flag: the flag that named ``path``, for the message.
        create_dir: ``path`` is a directory to create.

    Raises:
        ValueError: naming ``flag``, ``path`` and the reason.
    """
    if create_dir:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise ValueError(f"{flag} {path}: cannot create the directory: {e.strerror}") from e
        if not os.access(path, os.W_OK):
            raise ValueError(f"{flag} {path}: the directory is not writable")
        return
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a directory; give a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: directory {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {path}: directory {folder} is not writable")


def check_checkpoint_dir(path: str, *, resume: bool, flag: str = "--checkpoint-dir") -> None:
    """Fail before training when checkpoints written under ``path`` would destroy or hide
    others: ``path`` must be a directory of checkpoints (created if missing, writable), not
    one checkpoint; without ``resume`` it must hold none yet, since a new run's saves would
    replace an earlier run's steps and a later ``--resume`` would take whichever is newest.
    Every rank calls it, so every rank fails alike.

    Raises:
        ValueError: naming ``flag``, ``path`` and what to do.
    """
    if os.path.isfile(os.path.join(path, "manifest.json")):
        parent = os.path.dirname(os.path.abspath(path))
        raise ValueError(f"{flag} {path} is one checkpoint (it holds manifest.json), not a "
                         f"directory of checkpoints: give its parent {parent} (--resume takes "
                         "the newest intact step there), or another directory")
    check_writable(path, flag=flag, create_dir=True)
    steps = list_steps(path)
    if steps and not resume:
        held = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
        raise ValueError(f"{flag} {path} already holds checkpoints ({held}) of an earlier "
                         "run: pass --resume to continue it, or give an empty directory; "
                         "nothing was written")


class MetricsWriter:
    """JSON lines written by the main rank only, to ``PATH.tmp``, renamed to ``PATH`` by
    :meth:`close`.

    A run that fails (:meth:`abort`, or leaving a ``with`` block by an exception) leaves
    ``PATH`` untouched, so a crash never truncates the metrics of an earlier run.
    ``resume=True`` starts the temporary file from a copy of an existing ``PATH`` (rows are
    appended to it).

    Args:
        path: the JSON-lines file (None: write nothing).
        enabled: False on every rank but the main one.
        resume: keep the rows of an existing ``path`` and append.
    """

    def __init__(self, path: str | None, *, enabled: bool, resume: bool = False) -> None:
        self.path = path if enabled else None
        self.tmp = None if self.path is None else self.path + ".tmp"
        self._file: IO[str] | None = None
        if self.path is not None and self.tmp is not None:
            if resume and os.path.exists(self.path):
                shutil.copyfile(self.path, self.tmp)
                self._file = open(self.tmp, "a")  # closed by close() or abort()
            else:
                self._file = open(self.tmp, "w")

    @property
    def active(self) -> bool:
        """Whether rows are being written (main rank, a path, not yet closed)."""
        return self._file is not None

    def write(self, row: dict[str, Any]) -> None:
        """Append one row (a JSON object per line); no-op when disabled or closed."""
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()

    def close(self) -> None:
        """Flush and rename ``PATH.tmp`` to ``PATH`` (idempotent)."""
        if self._file is None:
            return
        f, self._file = self._file, None
        f.flush()
        os.fsync(f.fileno())
        f.close()
        assert self.tmp is not None and self.path is not None
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        """Drop the rows of this run: remove ``PATH.tmp``, leave ``PATH`` as it was."""
        if self._file is None:
            return
        f, self._file = self._file, None
        f.close()
        assert self.tmp is not None
        try:
            os.remove(self.tmp)
        except FileNotFoundError:
            pass

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def run_or_exit(ctx: DistContext | None, fn: Callable[[], T], *,
                user_errors: tuple[type[BaseException], ...]) -> T:
    """Call ``fn()`` and return its result; turn the errors every rank sees into exits.

    * a lost peer: the watchdog names it and this rank exits 1; a CUDA, NCCL or memory error
      (out of memory, "Duplicate GPU detected", "invalid usage", ...): reported at once with
      its cause on this rank and every other, which exit 1
      (:func:`~common.failure.classify_failure`, :func:`~common.failure.exit_on_failure`);
    * a user error (an instance of ``user_errors``: ValueError, CheckpointError,
      FloatingPointError, ...): every rank prints it and exits 2
      (:func:`~common.failure.fail_all_ranks`);
    * anything else propagates (a bug: its traceback is wanted).

    A ``SystemExit`` raised inside ``fn`` (e.g. by a nested :func:`run_or_exit`) propagates.
    """
    try:
        return fn()
    except Exception as e:
        failure = classify_failure(e)
        if failure is not None:
            exit_on_failure(e, failure, ctx)
        if isinstance(e, user_errors):
            fail_all_ranks(str(e), ctx)
        raise


def steady_mean(rows: Sequence[Mapping[str, Any]], key: str) -> float:
    """Mean of ``row[key]`` over the steady state: every row but the first, whose time includes
    the warm-up (allocation, kernel selection, first communicators); the only row when there is
    one; 0.0 when there is none.

    Both trainers report it: ``epoch_s_mean``, ``comm_s_mean`` (plexus) and tokens per second
    (llm: ``steady_mean(rows, "tokens") / steady_mean(rows, "step_s")``).
    """
    steady = rows[1:] or rows
    return sum(r[key] for r in steady) / len(steady) if steady else 0.0
