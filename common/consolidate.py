"""One consolidated file from a sharded checkpoint, streaming, in bounded memory.

    python -m common.consolidate runs/gpt/ckpt out.safetensors        # newest intact step
    python -m common.consolidate runs/gpt/ckpt/step-00000100 out.safetensors --only-weights

The output is a safetensors file (https://huggingface.co/docs/safetensors: an 8-byte
little-endian header length, a JSON header of dtype, shape and byte offsets per tensor, then
the raw little-endian data), readable by ``safetensors.safe_open`` and by
:func:`read_consolidated`. The checkpoint's meta is stored under ``__metadata__["meta"]``
(JSON). Every tensor is written in row chunks of about ``--chunk-mib`` through a memory map of
the output file, so peak memory is one chunk plus the index of one piece, not the model; the
file is written as ``OUT.partial`` and renamed when complete. An existing OUT is not
overwritten without ``--force``.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common import sharded
from common.checkpoint import CheckpointError, list_steps

_DTYPES = {"float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16",
           "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
           "bool": "BOOL"}
_FROM_ST = {v: k for k, v in _DTYPES.items()}
MOMENT_SUFFIXES = (".exp_avg", ".exp_avg_sq")


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
    names = [n for n in ck.names() if not (only_weights and n.endswith(MOMENT_SUFFIXES))]
    header: dict[str, Any] = {"__metadata__": {"meta": json.dumps(ck.meta), "step": str(ck.step)}}
    offset = 0
    for name in names:
        entry = ck.manifest["tensors"][name]
        dtype = getattr(torch, entry["dtype"])
        nbytes = int(np.prod(entry["shape"])) * dtype.itemsize
        header[name] = {"dtype": _DTYPES[entry["dtype"]], "shape": entry["shape"],
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    tmp = Path(f"{out}.partial")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            f.truncate(8 + len(head) + offset)
        start = 8 + len(head)
        for name in names:
            _write_tensor(ck, name, tmp, start + header[name]["data_offsets"][0], chunk_bytes)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def _write_tensor(ck: sharded.ShardedCheckpoint, name: str, file: Path, at: int,
                  chunk_bytes: int) -> None:
    shape = tuple(ck.shape(name))
    rows, cols = (1, shape[0]) if len(shape) == 1 else shape
    dtype = getattr(torch, ck.manifest["tensors"][name]["dtype"])
    if rows * cols == 0:
        return
    out = np.memmap(file, dtype=np.uint8, mode="r+", offset=at,
                    shape=(rows * cols * dtype.itemsize,))
    row_bytes = cols * dtype.itemsize
    step = max(1, chunk_bytes // max(row_bytes, 1))
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        slab = sharded.Slab(shape, (lo, hi), (0, cols)) if len(shape) == 2 else \
            sharded.Slab.whole(shape)
        part = ck.read(name, slab).contiguous()
        out[lo * row_bytes:hi * row_bytes] = part.view(torch.uint8).numpy().reshape(-1)
    out.flush()
    del out


def read_consolidated(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and the checkpoint meta of a file written by :func:`consolidate` (loads
    the whole file: for models that fit one process)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
            data = f.read()
        meta = json.loads(header.pop("__metadata__")["meta"])
    except (OSError, ValueError, KeyError, struct.error) as e:
        raise CheckpointError(f"{path} is not a consolidated checkpoint ({e})") from e
    tensors = {}
    for name, info in header.items():
        lo, hi = info["data_offsets"]
        dtype = getattr(torch, _FROM_ST[info["dtype"]])
        raw = torch.frombuffer(bytearray(data[lo:hi]), dtype=torch.uint8) if hi > lo else \
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
