"""Hugging Face Llama checkpoints in and out, streaming, in bounded memory.

    python -m llm.convert import HF_DIR OUT.safetensors      # HF Llama -> our consolidated file
    python -m llm.convert export CKPT OUT_DIR [--dtype bfloat16] [--max-shard-size 5GB]

``import`` reads a HF ``LlamaForCausalLM`` directory (``config.json`` and ``model.safetensors``
or the shards of ``model.safetensors.index.json``) and writes one safetensors file in the format
of ``python -m common.consolidate``: our tensor names, float32 (our master weights; bf16/fp16
widen exactly), and under ``__metadata__["meta"]`` the meta (engine "llm",
:data:`llm.checkpoint.FORMAT`, model_config, step 0, no run configs, the source config);
:func:`llm.checkpoint.load_model` reads it. ``export`` writes a checkpoint of ours (sharded
directory or consolidated file) as a HF directory that ``LlamaForCausalLM.from_pretrained``
loads (``config.json``, ``model.safetensors`` or shards plus index). Tokenizers are not
converted either way: the HF directory's tokenizer.json is used as it is (``llm.train --init``,
and ``llm.sample`` / ``llm.memorization`` on the imported file, through the source directory
its meta records). Names and configs:
:mod:`llm.hf.llama`; what GPT cannot represent is refused before any output is written.

Streaming: each tensor is copied in row chunks of about ``--chunk-mib``, read with
``safe_open(...).get_slice`` (one HF file mapped at a time), :meth:`ShardedCheckpoint.read
<common.sharded.ShardedCheckpoint.read>` or :class:`common.consolidate.SafetensorsReader` and
written by :class:`common.consolidate.SafetensorsWriter`, so peak memory is one chunk (plus the
mapped HF file on import), not the model. An output appears only complete: the file is renamed
from ``OUT.partial``, the directory from a temporary sibling.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from common.checkpoint import CheckpointError
from common.consolidate import SafetensorsReader, SafetensorsWriter
from common.sharded import ShardedCheckpoint, Slab
from llm import checkpoint
from llm.hf import llama as hf
from llm.model import GPTConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}

Reader = Callable[[str, int, int], torch.Tensor]  # (name, lo, hi) -> rows lo:hi


def _copy(w: SafetensorsWriter, out_name: str, shape: tuple[int, ...], read: Reader,
          name: str, dtype: torch.dtype, chunk_bytes: int) -> None:
    """Copy tensor ``name`` to ``out_name`` of ``w`` in row chunks, converted to ``dtype``."""
    if len(shape) != 2:  # a 1-D tensor is one row
        w.write(out_name, read(name, 0, 1).to(dtype))
        return
    step = max(1, chunk_bytes // max(shape[1] * 4, 1))  # rows of a float32 chunk
    for lo in range(0, shape[0], step):
        w.write(out_name, read(name, lo, min(shape[0], lo + step)).to(dtype), start=lo)


# ---------------------------------------------------------------------------------- import


def import_hf(hf_dir: str | os.PathLike, out: str | os.PathLike, *, force: bool = False,
              chunk_bytes: int = 64 << 20) -> Path:
    """Write the HF Llama directory ``hf_dir`` as our consolidated file ``out`` (float32).

    Raises:
        ValueError: a model GPT cannot represent (nothing is written).
        FileNotFoundError: not a HF directory with safetensors weights.
        FileExistsError: ``out`` exists and ``force`` is False.
    """
    with hf.HFCheckpoint(hf_dir) as src:
        config = src.config
        meta = {"engine": "llm", "format": checkpoint.FORMAT, "step": 0,
                "model_config": asdict(config), "configs": {},
                "source": {"hf_dir": str(Path(hf_dir).resolve()), "hf_config": src.hf_config}}
        shapes = hf.param_shapes(config)
        layout = {n: (torch.float32, s) for n, s in shapes.items()}

        def read(name: str, lo: int, hi: int) -> torch.Tensor:
            shape = src.shape(name)
            return src.read_block(name, (lo, hi), (0, shape[-1]))

        with SafetensorsWriter(out, layout, force=force,
                               metadata={"meta": json.dumps(meta), "step": "0"}) as w:
            for name, shape in shapes.items():
                _copy(w, name, shape, read, name, torch.float32, chunk_bytes)
    return Path(out)


# ---------------------------------------------------------------------------------- export


class _Ours:
    """Our checkpoint, a sharded directory (root or ``step-*``) or a consolidated
    ``.safetensors`` file: its meta, and any tensor's shape and rows."""

    def __init__(self, path: Path) -> None:
        self._ck: ShardedCheckpoint | None = None
        if not path.is_file():
            self._ck = checkpoint.open_checkpoint(path)
            self.meta = self._ck.meta
            return
        try:
            self._file = SafetensorsReader(path)
            self.meta = json.loads(self._file.metadata["meta"])
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{path} is not a consolidated checkpoint ({e})") from e
        checkpoint.check(self.meta, path)

    def shape(self, name: str) -> tuple[int, ...]:
        if self._ck is not None:
            return self._ck.shape(name)  # CheckpointError if absent
        try:
            return self._file.shape(name)
        except KeyError as e:
            raise CheckpointError(e.args[0]) from None

    def read(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows lo:hi of tensor ``name`` (a 1-D tensor: all of it), in its stored dtype."""
        shape = self.shape(name)
        if self._ck is not None:
            return self._ck.read(name, Slab.whole(shape) if len(shape) == 1 else
                                 Slab(shape, (lo, hi), (0, shape[1])))
        return self._file.rows(name, *((0, shape[0]) if len(shape) == 1 else (lo, hi)))


def parse_size(text: str) -> int:
    """Bytes of ``"5GB"`` (10**9), ``"2GiB"`` (2**30), ``"500MB"``, ``"1000"``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"cannot read the size {text!r}; write e.g. 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _plan_shards(sizes: dict[str, int], max_bytes: int | None) -> list[list[str]]:
    """Consecutive tensors grouped into files of at most ``max_bytes`` (a larger tensor goes
    alone), as ``save_pretrained`` does; one file without a limit."""
    files: list[list[str]] = [[]]
    total = 0
    for name, nbytes in sizes.items():
        if max_bytes is not None and files[-1] and total + nbytes > max_bytes:
            files.append([])
            total = 0
        files[-1].append(name)
        total += nbytes
    return files


def export_hf(path: str | os.PathLike, out_dir: str | os.PathLike, *,
              dtype: torch.dtype = torch.float32, max_shard_bytes: int | None = None,
              chunk_bytes: int = 64 << 20) -> Path:
    """Write our checkpoint ``path`` (sharded directory or consolidated file) as the HF
    Llama directory ``out_dir``, weights in ``dtype``; ``out_dir`` must not exist or be empty.

    Args:
        max_shard_bytes: split the weights into ``model-0000i-of-0000n.safetensors`` files of
            at most this size (plus ``model.safetensors.index.json``); None: one file.

    Raises:
        FileExistsError: ``out_dir`` is not empty.
        common.checkpoint.CheckpointError: not an llm checkpoint (or damaged).
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} exists and is not an empty directory; choose a new "
                              "output directory")
    src = _Ours(Path(path))
    config = GPTConfig(**src.meta["model_config"])
    shapes = hf.param_shapes(config)
    wrong = [f"{n} {src.shape(n)} (expected {s})" for n, s in shapes.items()
             if src.shape(n) != s]
    if wrong:
        raise CheckpointError(f"{path}: shapes differ from its model_config: {wrong[:3]}")
    sizes = {n: math.prod(s) * dtype.itemsize for n, s in shapes.items()}
    files = _plan_shards(sizes, max_shard_bytes)
    names = [hf.WEIGHTS_FILE] if len(files) == 1 else [
        f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    tmp = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    source_config = src.meta.get("source", {}).get("hf_config", {})
    try:
        tmp.mkdir(parents=True)
        for fname, members in zip(names, files):
            layout = {hf.to_hf_name(n): (dtype, shapes[n]) for n in members}
            with SafetensorsWriter(tmp / fname, layout, metadata={"format": "pt"}) as w:
                for n in members:
                    _copy(w, hf.to_hf_name(n), shapes[n], src.read, n, dtype, chunk_bytes)
        if len(files) > 1:
            weight_map = {hf.to_hf_name(n): f for f, ms in zip(names, files) for n in ms}
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
            (tmp / hf.INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        hf_config = hf.config_to_hf(config, dtype, token_ids=source_config)
        (tmp / hf.CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# ------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m llm.convert",
        description="Convert Hugging Face Llama checkpoints (LlamaForCausalLM, safetensors) to "
        "and from llm's checkpoints, streaming in bounded memory. A model llm.model.GPT "
        "cannot represent (rope_scaling, biases, another architecture...) is refused and "
        "nothing is written.",
        epilog="examples:\n  python -m llm.convert import ~/hf/TinyLlama-1.1B tiny.safetensors"
        "\n  python -m llm.convert export runs/gpt runs/gpt-hf --dtype bfloat16 "
        "--max-shard-size 5GB\n\nTokenizers are not converted: llm.sample and llm.memorization "
        "on an imported file use the tokenizer.json of the directory it came from.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="{import,export}")
    imp = sub.add_parser("import", help="HF Llama directory -> one consolidated .safetensors "
                         "file (float32) that llm.checkpoint.load_model reads",
                         description="HF Llama directory -> one consolidated .safetensors file "
                         "of ours (float32 weights, meta with model_config, step 0).")
    imp.add_argument("hf_dir", help="directory with config.json and model.safetensors (or "
                     "model.safetensors.index.json and its shards)")
    imp.add_argument("out", help="output .safetensors file")
    imp.add_argument("--force", action="store_true", help="replace an existing output file")
    exp = sub.add_parser("export", help="our checkpoint -> HF directory that "
                         "LlamaForCausalLM.from_pretrained loads",
                         description="Our checkpoint (llm.train --checkpoint-dir root, a step-* "
                         "directory, or a consolidated .safetensors file) -> a HF Llama "
                         "directory (config.json, model.safetensors or shards plus index).")
    exp.add_argument("checkpoint", help="checkpoint root (its newest intact step), step-* "
                     "directory or consolidated .safetensors file")
    exp.add_argument("out_dir", help="output directory (must not exist, or be empty)")
    exp.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                     help="dtype of the written weights (default float32)")
    exp.add_argument("--max-shard-size", default=None, metavar="SIZE",
                     help="split the weights into files of at most SIZE (5GB, 500MB, 2GiB) "
                     "with an index; default: one model.safetensors")
    for sp in (imp, exp):
        sp.add_argument("--chunk-mib", type=int, default=64, help="memory per copied chunk "
                        "(MiB, default 64)")
    args = p.parse_args(argv)
    try:
        if args.command == "import":
            out = import_hf(args.hf_dir, args.out, force=args.force,
                            chunk_bytes=args.chunk_mib << 20)
            print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB")
        else:
            limit = None if args.max_shard_size is None else parse_size(args.max_shard_size)
            out = export_hf(args.checkpoint, args.out_dir, dtype=DTYPES[args.dtype],
                            max_shard_bytes=limit, chunk_bytes=args.chunk_mib << 20)
            size = sum(f.stat().st_size for f in out.iterdir())
            print(f"{out}: {size / 2**20:.1f} MiB")
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
