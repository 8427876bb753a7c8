"""Sharded checkpoints: every rank writes only what it holds, any grid reads what it needs.

A tensor of a parallel model is split over a grid; a :class:`~common.slab.Slab` says where one
rank's local tensor sits in the global (serial, unpadded) tensor (:mod:`common.slab`).

Layout of checkpoint ``step`` under ``ROOT``::

    ROOT/step-00000012/manifest.json     step, meta, per tensor its pieces, per file SHA-256
    ROOT/step-00000012/shard-00003.bin   rank 3's pieces (and explicit row ids), raw bytes
    ROOT/step-00000012/<name>            small files of rank 0 (history, iterator state)

Saving is collective over ``group``: the pieces' descriptions are gathered (a few bytes per
tensor), a piece held by several ranks (replicated) is written once, by the lowest of them,
and every rank writes its file into one temporary directory which rank 0 renames after all
have succeeded (fsync'ed, atomic: :mod:`common.checkpoint`). Loading is collective too: each
file's checksum is verified by one rank and the verdict shared, so a damaged newest
checkpoint makes every rank fall back to the same older one; then each rank reads only the
parts of the files its own slabs need (positioned reads of the rows it wants; peak memory
about its own shards, plus the sorted row ids of a tensor whose rows are permuted).

A model's state goes through :func:`save_state` and :func:`load_state`: the model lists its
tensors as entries ``(name, local tensor, Slab)`` (parameters and statistics), and the loop
writes each with its AdamW moments (``NAME.exp_avg``, ``NAME.exp_avg_sq``, on the tensor's
slab) and step count (``meta["adam_steps"][NAME]``), and reads them back into this rank's
slices. Both engines' checkpoint modules are that call plus their own meta and small files.

``python -m common.consolidate CKPT OUT.safetensors`` turns one into a single file, streaming.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.checkpoint import CheckpointError, commit, fsync_dir, list_steps
from common.exchange import all_gather_object, barrier, broadcast_object, rank_and_size
from common.slab import PieceReader, RowIndex, Slab, SlabFiller, storage_dtype

__all__ = ["ADAM_MOMENTS", "FORMAT", "MOMENT_SUFFIXES", "Entry", "ShardedCheckpoint", "Slab",
           "is_sharded", "load", "load_latest", "load_state", "save", "save_state",
           "verify_files"]

FORMAT = "sharded-1"
# AdamW's per-parameter state, saved as "<parameter name>.<moment>" beside each parameter
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
MOMENT_SUFFIXES = tuple(f".{m}" for m in ADAM_MOMENTS)  # str.endswith: is this a moment?
_ALIGN = 64  # byte alignment of every piece in a shard file
# one tensor of a model's state: (name, this rank's local tensor, where it sits in the full one)
Entry = tuple[str, torch.Tensor, Slab]


# ------------------------------------------------------------------------------------ saving


def save(root: str | os.PathLike, step: int, tensors: Mapping[str, tuple[torch.Tensor, Slab]],
         *, meta: Mapping[str, Any], files: Mapping[str, bytes] | None = None, keep: int = 3,
         group: Any = None) -> Path:
    """Write checkpoint ``step`` under ``root``: each rank its own pieces (collective).

    Args:
        root: checkpoint directory, shared by all ranks (created if missing).
        step: names the checkpoint (``step-%08d``).
        tensors: name -> (this rank's local tensor, its :class:`Slab`); the same names, in
            any order, on every rank.
        meta: JSON-serialisable description; rank 0's is stored.
        files: small extra files, rank 0's are stored (others' are ignored).
        keep: complete checkpoints to keep (older ones are deleted after the new one is in).
        group: whom to coordinate with (:mod:`common.exchange`): a torch.distributed group,
            the job's :class:`~common.mpi.MPITransport` (the whole job over MPI), or None
            (the world, or one process without torch.distributed).

    Returns:
        The final checkpoint directory.

    Raises:
        CheckpointError: on every rank, if any rank failed to write (nothing is committed).
    """
    rank, _ = rank_and_size(group)
    root = Path(root)
    names = sorted(tensors)
    mine = {n: tensors[n][1].describe() | {"dtype": _dtype_name(tensors[n][0])} for n in names}
    everyone = all_gather_object(mine, group)
    if any(sorted(d) != names for d in everyone):
        raise CheckpointError("ranks disagree on the tensors of the checkpoint (a bug)")
    # a piece held by several ranks is written by the lowest of them
    first_owner: dict[str, int] = {}
    for r, descs in enumerate(everyone):
        for n in names:
            first_owner.setdefault(json.dumps([n, descs[n]], sort_keys=True), r)
    writes = [n for n in names if first_owner[json.dumps([n, mine[n]], sort_keys=True)] == rank]
    tmp = None
    error = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp = root / f".tmp-step-{step:08d}-{os.getpid()}"
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as e:
            error = f"cannot create the checkpoint under {root}: {e}"
    tmp, error = broadcast_object((tmp, error), group)
    if error:
        raise CheckpointError(error)
    assert tmp is not None
    record: dict[str, Any] = {}
    try:
        record = _write_rank_file(Path(tmp), rank, writes, tensors)
        if rank == 0:
            for name, data in (files or {}).items():
                if "/" in name or name.startswith((".", "shard-")) or name == "manifest.json":
                    raise ValueError(f"bad checkpoint file name {name!r}")
                _write_bytes(Path(tmp) / name, data)
                record.setdefault("extra", {})[name] = _file_entry(data)
    except (OSError, ValueError) as e:
        record = {"error": f"rank {rank}: {e}"}
    records = all_gather_object(record, group)
    errors = [r["error"] for r in records if "error" in r]
    final = root / f"step-{step:08d}"
    if rank == 0:
        if errors:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            manifest = _manifest(step, meta, everyone, records)
            _write_bytes(Path(tmp) / "manifest.json",
                         json.dumps(manifest, indent=1, sort_keys=True).encode())
            fsync_dir(Path(tmp))
            commit(Path(tmp), final, keep=keep)
    if errors:
        raise CheckpointError("writing the checkpoint failed: " + "; ".join(errors))
    barrier(group)  # nobody goes on (or exits) before the checkpoint is committed
    return final


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _file_entry(data: bytes) -> dict[str, Any]:
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def _write_rank_file(tmp: Path, rank: int, names: list[str],
                     tensors: Mapping[str, tuple[torch.Tensor, Slab]]) -> dict[str, Any]:
    """This rank's pieces into ``shard-RANK.bin`` (streamed, hashed as written)."""
    if not names:
        return {"pieces": {}}
    fname = f"shard-{rank:05d}.bin"
    sha, offset = hashlib.sha256(), 0
    pieces: dict[str, dict[str, Any]] = {}
    ids_at: dict[str, int] = {}  # explicit row ids shared by several tensors: stored once

    def put(f: Any, arr: np.ndarray) -> int:
        nonlocal offset
        pad = -offset % _ALIGN
        if pad:
            f.write(b"\0" * pad)
            sha.update(b"\0" * pad)
            offset += pad
        at = offset
        data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data
        f.write(data)
        sha.update(data)
        offset += data.nbytes
        return at

    with open(tmp / fname, "wb") as f:
        for name in names:
            local, slab = tensors[name]
            if local.numel() != slab.numel():
                raise ValueError(f"{name}: local tensor has {local.numel()} elements, its slab "
                                 f"{slab.numel()}")
            piece = slab.describe()
            if isinstance(slab.rows, np.ndarray):
                key = piece["rows"]["digest"]
                if key not in ids_at:
                    ids_at[key] = put(f, slab.row_ids())
                piece["rows"]["offset"] = ids_at[key]
            arr = local.detach().to("cpu").contiguous()
            piece["offset"] = put(f, arr.view(torch.uint8).numpy() if arr.numel() else
                                  np.zeros(0, np.uint8))
            piece["numel"] = local.numel()
            piece["file"] = fname
            pieces[name] = piece
        f.flush()
        os.fsync(f.fileno())
    return {"pieces": pieces, "file": {fname: {"sha256": sha.hexdigest(), "bytes": offset}}}


def _manifest(step: int, meta: Mapping[str, Any], descs: list[dict], records: list[dict]
              ) -> dict[str, Any]:
    tensors: dict[str, dict[str, Any]] = {}
    files: dict[str, Any] = {}
    for rec in records:
        files.update(rec.get("file", {}))
        files.update(rec.get("extra", {}))
        for name, piece in rec["pieces"].items():
            entry = tensors.setdefault(name, {"shape": piece["shape"],
                                              "dtype": descs[0][name]["dtype"], "pieces": []})
            entry["pieces"].append({k: v for k, v in piece.items() if k != "shape"})
    return {"format": FORMAT, "step": step, "meta": dict(meta), "tensors": tensors,
            "files": files}


# ----------------------------------------------------------------------------------- loading


class ShardedCheckpoint:
    """A verified sharded checkpoint: its manifest, small files and slab reads.

    Attributes:
        path: the ``step-*`` directory.
        step, meta: as saved.
        files: the small files (name -> bytes).
    """

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path, self.manifest = path, manifest
        self.step: int = manifest["step"]
        self.meta: dict[str, Any] = manifest["meta"]
        self.files = {n: (path / n).read_bytes() for n in manifest["files"]
                      if not n.startswith("shard-")}
        # the sorted explicit row ids of the pieces of the tensor last read, by their digest:
        # reused by its next reads (chunks, its AdamW moments), dropped for another tensor's
        self._row_indexes: dict[str, RowIndex] = {}

    def names(self) -> list[str]:
        return sorted(self.manifest["tensors"])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)["shape"])

    def _entry(self, name: str) -> dict[str, Any]:
        try:
            return self.manifest["tensors"][name]
        except KeyError:
            raise CheckpointError(f"checkpoint {self.path} has no tensor {name!r}") from None

    def read(self, name: str, slab: Slab, *, keep_row_index: bool = False) -> torch.Tensor:
        """The local tensor of ``slab`` of tensor ``name``, read from the pieces it overlaps
        (padding zero). Its global shape must be the checkpoint's.

        Only the rows ``slab`` wants are read, by positioned reads, never a memory map: a
        map's pages stay in this process's resident memory while it is open, and rows in a
        permuted order (learned features) touch pages all over a piece. A piece with
        explicit row ids has them sorted (:class:`~common.slab.RowIndex`, 12 bytes a row):
        one row split's at a time, its replicas read one after another, or, with
        ``keep_row_index``, kept for every split while the same tensor, or one with the same
        rows, is read: a reader of a tensor in many row chunks
        (:mod:`common.consolidate`) sorts each piece once, at 12 bytes a row of the whole
        tensor, which a training rank loading its own slab never holds.
        """
        entry = self._entry(name)
        if tuple(entry["shape"]) != tuple(slab.shape):
            raise CheckpointError(f"checkpoint {self.path}: {name} has shape "
                                  f"{tuple(entry['shape'])}, this model {tuple(slab.shape)}")
        dtype = getattr(torch, entry["dtype"])
        np_dtype = storage_dtype(dtype)
        digests = {p["rows"]["digest"] for p in entry["pieces"] if isinstance(p["rows"], dict)}
        self._row_indexes = {d: i for d, i in self._row_indexes.items()
                             if d in digests and keep_row_index}
        out = SlabFiller(slab, np_dtype)
        # the pieces of one row split (replicated over the other axes) one after another,
        # so that without keep_row_index one split's sorted ids are held at a time
        for piece in sorted(entry["pieces"], key=lambda p: (
                p["rows"]["digest"] if isinstance(p["rows"], dict) else "")):
            if not out.wants(tuple(piece["cols"])):
                continue
            path = self.path / piece["file"]
            fd = os.open(path, os.O_RDONLY)
            try:
                rows = piece["rows"]
                if isinstance(rows, dict):
                    if rows["digest"] not in self._row_indexes:
                        if not keep_row_index:  # the previous split's: done with
                            self._row_indexes.clear()
                        ids = np.empty(rows["ids"], dtype=np.int64)
                        _pread(fd, path, rows["offset"], ids)
                        self._row_indexes[rows["digest"]] = RowIndex(ids)
                        del ids
                    src_rows: tuple[int, int] | RowIndex = self._row_indexes[rows["digest"]]
                else:
                    src_rows = (rows[0], rows[1])
                out.fill(src_rows, tuple(piece["cols"]),
                         None if piece["flat"] is None else tuple(piece["flat"]),
                         _piece_reader(fd, path, piece["offset"]))
                del src_rows
            finally:
                os.close(fd)
        if not keep_row_index:
            self._row_indexes.clear()
        return torch.from_numpy(out.result()).view(dtype)


def _piece_reader(fd: int, path: Path, offset: int) -> PieceReader:
    """The elements of the piece whose data starts at byte ``offset`` of open file ``fd``."""
    def read(start: int, out: np.ndarray) -> None:
        _pread(fd, path, offset + start * out.itemsize, out)
    return read


def _pread(fd: int, path: Path, offset: int, out: np.ndarray) -> None:
    """Fill ``out`` (contiguous) with the bytes of open file ``fd`` from ``offset`` on."""
    assert out.flags.c_contiguous, "a read goes straight into its buffer"
    view = out.reshape(-1).view(np.uint8).data
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if not got:
            raise CheckpointError(f"{path} ends at byte {offset + done}, before the "
                                  f"{len(view)} bytes at {offset} its manifest lists: it was "
                                  "truncated after it was verified; load the checkpoint again")
        done += got


def verify_files(path: Path, manifest: dict[str, Any], names: list[str]) -> list[str]:
    """The files among ``names`` whose size or SHA-256 differs from the manifest (streamed)."""
    bad = []
    for name in names:
        info = manifest["files"][name]
        sha, size = hashlib.sha256(), 0
        try:
            with open(path / name, "rb") as f:
                while block := f.read(1 << 24):
                    sha.update(block)
                    size += len(block)
        except OSError:
            bad.append(name)
            continue
        if size != info["bytes"] or sha.hexdigest() != info["sha256"]:
            bad.append(name)
    return bad


def is_sharded(path: str | os.PathLike) -> bool:
    """Whether ``path`` (a ``step-*`` directory) holds a sharded checkpoint."""
    try:
        return json.loads((Path(path) / "manifest.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError):
        return False


def load(path: str | os.PathLike, *, group: Any = None) -> ShardedCheckpoint:
    """Open and verify one sharded checkpoint directory (collective: each file is hashed by
    one rank). Raises CheckpointError on every rank if anything is missing or damaged."""
    path = Path(path)
    rank, world = rank_and_size(group)
    try:
        manifest = json.loads((path / "manifest.json").read_text())
        problem = None if manifest.get("format") == FORMAT else (
            f"checkpoint {path} is not a sharded checkpoint (format "
            f"{manifest.get('format')!r}); it was written by an older version: continue it "
            "with that version, or train again")
    except (OSError, ValueError) as e:
        manifest, problem = {}, f"checkpoint {path}: manifest.json is missing or unreadable ({e})"
    if problem is None:
        names = sorted(manifest["files"])
        bad = verify_files(path, manifest, names[rank::world])
        problem = (f"checkpoint {path}: {', '.join(bad)} missing, truncated or corrupt "
                   "(checksum mismatch)") if bad else None
    problems = [p for p in all_gather_object(problem, group) if p]
    if problems:
        raise CheckpointError(problems[0])
    return ShardedCheckpoint(path, manifest)


def load_latest(root: str | os.PathLike, *, group: Any = None) -> ShardedCheckpoint:
    """The newest intact sharded checkpoint under ``root``, the same on every rank (a damaged
    newer one is skipped with a warning from rank 0). Raises CheckpointError if none."""
    root = Path(root)
    rank, _ = rank_and_size(group)
    problems = []
    for step in reversed(list_steps(root)):
        try:
            return load(root / f"step-{step:08d}", group=group)
        except CheckpointError as e:
            problems.append(str(e))
            if rank == 0:
                print(f"warning: {e}; trying an older checkpoint", file=sys.stderr, flush=True)
    detail = "; ".join(problems) if problems else "no step-* directories"
    raise CheckpointError(f"no intact checkpoint under {root} ({detail})")


# ------------------------------------------------------------------ a model and its AdamW


def save_state(root: str | os.PathLike, step: int, entries: Sequence[Entry],
               optimizer: torch.optim.Optimizer, *, meta: Mapping[str, Any],
               files: Mapping[str, bytes] | None = None, keep: int = 3,
               group: Any = None) -> Path:
    """Write checkpoint ``step`` of a model's tensors and their AdamW state (collective, as
    :func:`save`).

    Each entry is written under its name; a tensor with AdamW state (``optimizer.state[t]``)
    also gets its moments (:data:`ADAM_MOMENTS`, as ``NAME.exp_avg`` ..., laid out by the
    same slab) and its step count (``meta["adam_steps"][NAME]``). Tensors without state
    (buffers, parameters not yet stepped) are written alone.

    Args:
        entries: ``(name, local tensor, Slab)`` of every tensor of the model, in the same
            names on every rank.
        optimizer: the model's Adam or AdamW.
        meta, files, keep, group: as :func:`save`; ``meta`` gains ``"adam_steps"``.

    Raises:
        ValueError: two entries share a name.
        CheckpointError: on every rank, if any rank failed to write.
    """
    tensors: dict[str, tuple[torch.Tensor, Slab]] = {}
    steps: dict[str, float] = {}
    for name, t, slab in entries:
        if name in tensors:
            raise ValueError(f"two tensors of the model are named {name!r}")
        tensors[name] = (t.detach(), slab)
        state = optimizer.state.get(t, {})
        for key in ADAM_MOMENTS:
            if key in state:
                tensors[f"{name}.{key}"] = (state[key], slab)
        if "step" in state:
            steps[name] = float(state["step"])
    return save(root, step, tensors, meta={**meta, "adam_steps": steps}, files=files,
                keep=keep, group=group)


def load_state(ck: ShardedCheckpoint, entries: Sequence[Entry],
               optimizer: torch.optim.Optimizer) -> None:
    """Read this rank's slices of a :func:`save_state` checkpoint (written on any grid) into
    the entries' tensors and their AdamW state (not collective).

    A tensor is cast to its own dtype; the AdamW moments keep the saved dtype and go to the
    tensor's device, the step count is a float32 scalar on the CPU (as AdamW makes it; on the
    tensor's device for torch's fused AdamW). The
    state of a tensor the checkpoint has no step count for is left as it is.

    Raises:
        CheckpointError: the checkpoint lacks an entry or one of its moments, or holds it in
            another global shape.
    """
    steps = ck.meta.get("adam_steps", {})
    # torch's fused Adam keeps the step count on the parameters' device, the others on the CPU
    fused = any(group.get("fused") for group in optimizer.param_groups)
    with torch.no_grad():
        for name, t, slab in entries:
            t.copy_(ck.read(name, slab).to(t.dtype))
            if name in steps:
                optimizer.state[t] = {
                    "step": torch.tensor(steps[name], dtype=torch.float32,
                                         device=t.device if fused else "cpu"),
                    **{key: ck.read(f"{name}.{key}", slab).to(t.device) for key in ADAM_MOMENTS}}
