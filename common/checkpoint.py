"""Atomic, checksummed checkpoints that keep the last K (pure Python, no torch needed).

Layout::

    ROOT/step-00000012/manifest.json   {"step", "meta", "files": {name: {"sha256", "bytes"}}}
    ROOT/step-00000012/<name>          one file per entry
    ROOT/.tmp-step-00000012-<pid>/     while being written (never read)

A checkpoint is written into a temporary directory, every file and the directory are
fsync'ed, then the directory is renamed to its final name (atomic on POSIX) and the parent is
fsync'ed. A crash at any moment leaves either the complete new checkpoint or none of it, and
never touches older ones. Readers verify every checksum and fall back to the newest intact
checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_STEP_RE = re.compile(r"^step-(\d{8,})$")


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or belongs to another model."""


def fsync_dir(path: Path) -> None:
    """fsync a directory (makes renames and new entries in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root: str | os.PathLike, step: int, files: Mapping[str, bytes],
         meta: Mapping[str, Any], *, keep: int = 3) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically; keep the newest ``keep``.

    Args:
        root: checkpoint directory (created if missing).
        step: step or epoch number; names the checkpoint.
        files: file name -> contents.
        meta: JSON-serialisable description (config, model identity, progress).
        keep: how many complete checkpoints to keep (older ones are deleted after the new
            one is in place).

    Returns:
        The final checkpoint directory.
    """
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create checkpoint directory {root}: {e.strerror}") from e
    if not os.access(root, os.W_OK):
        raise CheckpointError(f"checkpoint directory {root} is not writable")
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    entries: dict[str, dict[str, Any]] = {}
    manifest = {"step": step, "meta": dict(meta), "files": entries}
    for name, data in files.items():
        if "/" in name or name.startswith(".") or name == "manifest.json":
            raise ValueError(f"bad checkpoint file name {name!r}")
        with open(tmp / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        entries[name] = {"sha256": hashlib.sha256(data).hexdigest(),
                                   "bytes": len(data)}
    with open(tmp / "manifest.json", "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    commit(tmp, final, keep=keep)
    return final


def commit(tmp: Path, final: Path, *, keep: int) -> None:
    """Rename the complete, fsync'ed checkpoint ``tmp`` to ``final`` (atomically replacing
    a checkpoint of the same step), then prune its parent: ``final`` and the ``keep - 1``
    newest checkpoints of earlier steps stay.

    Checkpoints of later steps than ``final`` are left alone and do not count: a run
    resumed past a damaged newest checkpoint, or one writing where a longer run wrote,
    must never delete what it has just written (nor, through it, every intact one)."""
    root = final.parent
    if final.exists():  # re-saving the same step: move the old one aside first
        old = root / f".old-{final.name}-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(root)
    step = int(_STEP_RE.match(final.name).group(1))  # type: ignore[union-attr]
    earlier = [s for s in list_steps(root) if s < step]
    for stale in earlier[:max(0, len(earlier) - (keep - 1))] if keep > 0 else []:
        shutil.rmtree(root / f"step-{stale:08d}", ignore_errors=True)


def list_steps(root: str | os.PathLike) -> list[int]:
    """Steps of the complete (renamed) checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for p in root.iterdir() if (m := _STEP_RE.match(p.name))]
    return sorted(steps)


def load(path: str | os.PathLike) -> tuple[dict[str, bytes], dict[str, Any]]:
    """Read and verify one checkpoint directory: (files, manifest)."""
    path = Path(path)
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: manifest.json is missing or unreadable "
                              f"({e})") from e
    files = {}
    for name, info in manifest.get("files", {}).items():
        try:
            data = (path / name).read_bytes()
        except OSError as e:
            raise CheckpointError(f"checkpoint {path}: file {name} is missing") from e
        if len(data) != info["bytes"] or hashlib.sha256(data).hexdigest() != info["sha256"]:
            raise CheckpointError(f"checkpoint {path}: file {name} is truncated or corrupt "
                                  f"(checksum mismatch)")
        files[name] = data
    return files, manifest


def load_latest(root: str | os.PathLike) -> tuple[dict[str, bytes], dict[str, Any], Path]:
    """The newest intact checkpoint under ``root`` (a corrupt newer one is skipped with a
    warning on stderr). Raises :class:`CheckpointError` if there is none."""
    import sys

    root = Path(root)
    problems = []
    for step in reversed(list_steps(root)):
        path = root / f"step-{step:08d}"
        try:
            files, manifest = load(path)
        except CheckpointError as e:
            problems.append(str(e))
            print(f"warning: {e}; trying an older checkpoint", file=sys.stderr, flush=True)
            continue
        return files, manifest, path
    detail = "; ".join(problems) if problems else "no step-* directories"
    raise CheckpointError(f"no intact checkpoint under {root} ({detail})")
