"""One consolidated file from a sharded checkpoint, streaming, in bounded memory.

    python -m common.consolidate runs/gpt/ckpt out.safetensors        # newest intact step
    python -m common.consolidate runs/gpt/ckpt/step-00000100 out.safetensors --only-weights

The output is a safetensors file (https://huggingface.co/docs/safetensors: an 8-byte
little-endian header length, a JSON header of dtype, shape and byte offsets per tensor, then
the raw little-endian data), readable by ``safetensors.safe_open`` and by
:func:`read_consolidated`. The checkpoint's meta is stored under ``__metadata__["meta"]``
(JSON). Every tensor is written in row chunks of about ``--chunk-mib`` by a
:class:`SafetensorsWriter`, each chunk read from only its rows of the pieces (positioned
reads, no memory map: :meth:`common.sharded.ShardedCheckpoint.read`), so peak memory is one
chunk, not the model, plus the sorted row ids (12 bytes a row) of a tensor whose rows are
permuted. The file is written as ``OUT.partial`` and renamed when complete. An existing OUT
is not overwritten without ``--force``.

:class:`SafetensorsWriter` and :func:`read_header` are the reusable parts (``llm.convert``
writes Hugging Face checkpoints with them).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch

from common import sharded
from common.checkpoint import CheckpointError, list_steps

_DTYPES = {"float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16",
           "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
           "bool": "BOOL"}
_FROM_ST = {v: k for k, v in _DTYPES.items()}


def st_dtype(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (``torch.bfloat16`` -> ``"BF16"``)."""
    return _DTYPES[str(dtype).removeprefix("torch.")]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (``"BF16"`` -> ``torch.bfloat16``)."""
    try:
        return getattr(torch, _FROM_ST[name])
    except KeyError:
        raise ValueError(f"unsupported safetensors dtype {name!r}") from None


class SafetensorsWriter:
    """A safetensors file written tensor by tensor, in chunks of rows, never whole in memory.

    The header (every tensor's dtype, shape and byte range, in the given order) is written
    first; :meth:`write` then puts each chunk's bytes at its place. The file is ``OUT.partial``
    until :meth:`close` checks that every byte was written, syncs it and renames it to OUT;
    leaving a ``with`` block by an exception removes it, so OUT is either complete or absent
    (or the untouched old file).

    Args:
        out: the final path.
        tensors: name -> (dtype, shape), in file order.
        metadata: strings stored under ``__metadata__``.
        force: replace an existing ``out`` (only once the new file is complete).

    Raises:
        FileExistsError: ``out`` exists and ``force`` is False.

    Example::

        with SafetensorsWriter(out, {"w": (torch.float32, (4, 3))}) as w:
            w.write("w", torch.zeros(2, 3))           # rows 0-1
            w.write("w", torch.ones(2, 3), start=2)   # rows 2-3
    """

    def __init__(self, out: str | os.PathLike, tensors: Mapping[str, tuple[torch.dtype,
                 Sequence[int]]], *, metadata: Mapping[str, str] | None = None,
                 force: bool = False) -> None:
        self.out, self.tmp = Path(out), Path(f"{out}.partial")
        if self.out.exists() and not force:
            raise FileExistsError(f"{self.out} exists; choose another output or pass --force")
        header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
        self._layout: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
        offset = 0
        for name, (dtype, shape) in tensors.items():
            shape = tuple(int(s) for s in shape)
            nbytes = int(np.prod(shape)) * dtype.itemsize
            header[name] = {"dtype": st_dtype(dtype), "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self._layout[name] = (dtype, shape, offset)
            offset += nbytes
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
        self._start, self.size = 8 + len(head), 8 + len(head) + offset
        self._written = dict.fromkeys(self._layout, 0)
        self._file = open(self.tmp, "wb")  # closed by close() or abort()
        try:
            self._file.write(struct.pack("<Q", len(head)))
            self._file.write(head)
            self._file.truncate(self.size)
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, rows: torch.Tensor, start: int = 0) -> None:
        """Write ``rows`` as rows ``start, start + 1, ...`` of tensor ``name`` (of a 1-D
        tensor: elements). Its dtype and trailing dimensions must be the declared ones.

        Shapes:
            rows: [n, *shape[1:]] (1-D tensor: [n])
        """
        dtype, shape, offset = self._layout[name]
        if rows.dtype != dtype or tuple(rows.shape[1:]) != shape[1:] or rows.dim() != len(shape):
            raise ValueError(f"{name}: got a {rows.dtype} chunk of shape {tuple(rows.shape)} "
                             f"for a {dtype} tensor of shape {shape}")
        n, total = (rows.shape[0], shape[0]) if shape else (1, 1)  # a scalar is one row
        if start < 0 or start + n > total:
            raise ValueError(f"{name}: rows {start}..{start + n} outside its {total} rows")
        data = rows.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        row_bytes = int(np.prod(shape[1:])) * dtype.itemsize
        self._file.seek(self._start + offset + start * row_bytes)
        self._file.write(data.data)  # the chunk's own buffer, no copy
        self._written[name] += data.size

    def close(self) -> Path:
        """Check that every tensor was written whole, sync, rename to ``out``; returns it."""
        if self._file.closed:
            return self.out
        try:
            for name, (dtype, shape, _) in self._layout.items():
                nbytes = int(np.prod(shape)) * dtype.itemsize
                if self._written[name] != nbytes:
                    raise ValueError(f"{name}: {self._written[name]} of its {nbytes} bytes "
                                     "were written")
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self.tmp, self.out)
        except BaseException:
            self.abort()
            raise
        return self.out

    def abort(self) -> None:
        """Close and remove the partial file (``out`` is left as it was)."""
        self._file.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


def read_header(path: str | os.PathLike) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The tensor entries (name -> dtype, shape, data_offsets) and the ``__metadata__`` of a
    safetensors file, reading only its header.

    Raises:
        ValueError: not a safetensors file, or one truncated before the end of a tensor.
    """
    header, metadata, _ = _read_header(path)
    return header, metadata


_MAX_HEADER_BYTES = 100 << 20  # larger is garbage read as a length, not a real header


def _read_header(path: str | os.PathLike
                 ) -> tuple[dict[str, dict[str, Any]], dict[str, str], int]:
    """(tensor entries, metadata, byte where the data starts), checked against the file's size
    so that a damaged file is refused here, not by a reshape or an allocation later."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > _MAX_HEADER_BYTES:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
        if not isinstance(header, dict):
            raise ValueError(f"a header that is a JSON {type(header).__name__}, not an object")
    except (ValueError, struct.error) as e:
        raise ValueError(f"{path} is not a safetensors file ({e})") from e
    metadata = header.pop("__metadata__", None) or {}
    _check_extents(path, header, 8 + size)
    return header, metadata, 8 + size


def _check_extents(path: str | os.PathLike, header: dict[str, Any], start: int) -> None:
    """ValueError unless every tensor's bytes lie in the file, as many as its shape and dtype
    need (a dtype this module does not know is checked for its place only)."""
    file_bytes = os.path.getsize(path)
    for name, info in header.items():
        try:
            lo, hi = (int(v) for v in info["data_offsets"])
            shape = [int(v) for v in info["shape"]]
            st = str(info["dtype"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path} is not a safetensors file (tensor {name!r}: "
                             f"{type(e).__name__} {e})") from e
        need = (int(np.prod(shape)) * getattr(torch, _FROM_ST[st]).itemsize
                if st in _FROM_ST else hi - lo)
        if not 0 <= lo <= hi or min(shape, default=0) < 0 or hi - lo != need:
            raise ValueError(f"{path} is not a safetensors file (tensor {name!r}: bytes "
                             f"{lo}..{hi} for a {st} tensor of shape {shape})")
        if start + hi > file_bytes:
            raise ValueError(f"{path} is truncated: tensor {name!r} ends at byte {start + hi}, "
                             f"the file has {file_bytes}; copy or write it again")


class SafetensorsReader:
    """Rows of the tensors of a safetensors file, by plain reads at their offsets: no memory
    map, so memory is the rows asked for (``safe_open`` maps the file, and the pages it
    touches stay resident while it is open).

    Attributes:
        path: the file.
        metadata: its ``__metadata__`` (strings).

    Raises:
        ValueError: not a safetensors file.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._entries, self.metadata, self._start = _read_header(self.path)

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return torch_dtype(self._entry(name)["dtype"])

    def _entry(self, name: str) -> dict[str, Any]:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"{self.path} has no tensor {name!r}") from None

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` of tensor ``name`` (of a 1-D tensor: elements).

        Shapes:
            returns: [hi - lo, *shape[1:]] (1-D tensor: [hi - lo])
        """
        shape, dtype = self.shape(name), self.dtype(name)
        row_bytes = int(np.prod(shape[1:])) * dtype.itemsize
        lo, hi = max(0, lo), min(hi, shape[0] if shape else 1)
        with open(self.path, "rb") as f:
            f.seek(self._start + self._entry(name)["data_offsets"][0] + lo * row_bytes)
            data = bytearray(max(hi - lo, 0) * row_bytes)
            if f.readinto(data) != len(data):
                raise ValueError(f"{self.path} is truncated ({name})")
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(-1, *shape[1:]) \
            if data else torch.empty(0, *shape[1:], dtype=dtype)


def consolidate(path: str | os.PathLike, out: str | os.PathLike, *, only_weights: bool = False,
                chunk_bytes: int = 64 << 20, force: bool = False) -> Path:
    """Write the full tensors of the sharded checkpoint at ``path`` (a root: its newest intact
    step; or a ``step-*`` directory) to the safetensors file ``out``; one process.

    Args:
        only_weights: leave out the optimizer moments (names ending in .exp_avg/.exp_avg_sq).
        chunk_bytes: rows per write are chosen so one chunk is about this size.
        force: replace an existing ``out`` (only once the new file is complete).
    """
    path, out = Path(path), Path(out)
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists; choose another output or pass --force")
    ck = (sharded.load(path) if (path / "manifest.json").is_file()
          else sharded.load_latest(path))
    names = [n for n in ck.names() if not (only_weights and n.endswith(sharded.MOMENT_SUFFIXES))]
    layout = {n: (getattr(torch, ck.manifest["tensors"][n]["dtype"]), ck.shape(n))
              for n in names}
    with SafetensorsWriter(out, layout, force=force,
                           metadata={"meta": json.dumps(ck.meta), "step": str(ck.step)}) as w:
        for name in names:
            _write_tensor(ck, name, w, chunk_bytes)
    return out


def _write_tensor(ck: sharded.ShardedCheckpoint, name: str, w: SafetensorsWriter,
                  chunk_bytes: int) -> None:
    shape = tuple(ck.shape(name))
    if len(shape) != 2:  # a 1-D tensor is one row
        w.write(name, ck.read(name, sharded.Slab.whole(shape)))
        return
    rows, cols = shape
    row_bytes = cols * getattr(torch, ck.manifest["tensors"][name]["dtype"]).itemsize
    step = max(1, chunk_bytes // max(row_bytes, 1))
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        w.write(name, ck.read(name, sharded.Slab(shape, (lo, hi), (0, cols)),
                              keep_row_index=True), start=lo)


def read_consolidated(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and the checkpoint meta of a file written by :func:`consolidate` (loads
    the whole file: for models that fit one process).

    Raises:
        CheckpointError: the file is missing, truncated, not a safetensors file, or one
            without a checkpoint's meta (the message names the file and which).
    """
    path = Path(path)
    try:
        header, metadata, start = _read_header(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(str(e)) from e
    try:
        meta = json.loads(metadata["meta"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path} is not a consolidated checkpoint (no checkpoint meta: "
                              f"{type(e).__name__} {e}); write one with python -m "
                              "common.consolidate") from e
    tensors = {}
    with open(path, "rb") as f:
        for name, info in header.items():
            lo, hi = info["data_offsets"]
            if info["dtype"] not in _FROM_ST:
                raise CheckpointError(f"{path} is not a consolidated checkpoint (tensor "
                                      f"{name!r} is {info['dtype']}, which none holds)")
            dtype = torch_dtype(info["dtype"])
            data = bytearray(hi - lo)
            f.seek(start + lo)
            if f.readinto(data) != len(data):  # (its size was checked: it shrank since)
                raise CheckpointError(f"{path} is truncated: tensor {name!r} ends past the "
                                      "end of the file")
            raw = torch.frombuffer(data, dtype=torch.uint8) if data else \
                torch.zeros(0, dtype=torch.uint8)
            tensors[name] = raw.view(dtype).reshape(info["shape"])
    return tensors, meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m common.consolidate",
        description="Write a sharded checkpoint (plexus.train or llm.train --checkpoint-dir) "
        "as one safetensors file of full tensors, streaming in bounded memory.")
    p.add_argument("checkpoint", help="checkpoint root (its newest intact step) or a step-* "
                   "directory")
    p.add_argument("out", help="output .safetensors file")
    p.add_argument("--only-weights", action="store_true",
                   help="leave out the optimizer moments")
    p.add_argument("--chunk-mib", type=int, default=64, help="memory per write (MiB)")
    p.add_argument("--force", action="store_true", help="replace an existing output file")
    args = p.parse_args(argv)
    try:
        if not Path(args.checkpoint).is_dir() or not (
                list_steps(args.checkpoint) or sharded.is_sharded(args.checkpoint)):
            raise CheckpointError(f"no sharded checkpoint at {args.checkpoint}")
        out = consolidate(args.checkpoint, args.out, only_weights=args.only_weights,
                          chunk_bytes=args.chunk_mib << 20, force=args.force)
    except (CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
