"""Checkpoints, sharded: each rank writes its own shards, any grid (or one process) reads them.

``DIR/step-<N>/`` is a :mod:`common.sharded` checkpoint: ``shard-RRRRR.bin`` per rank with its
slices of the weights and both AdamW moments (a slice replicated over data-parallel ranks is
written once), ``state.pt`` with the small per-run state (data iterator position, RNG), and a
manifest whose meta holds the step, the model config and the run's configs. Nothing is
gathered: saving and loading hold about one rank's shards, whatever the model size.

Loading on any grid reads only the slices that grid needs; :func:`load_model` reads the full
tensors into the plain single-process :class:`~llm.model.GPT` on one device (sampling,
evaluation: the whole model on one process, by design; the CLIs' ``--device``).
``python -m common.consolidate DIR OUT.safetensors`` writes one file with the full weights,
streaming; :func:`load_model` reads that too.

Writing is atomic and checksummed (temporary directory, fsync, rename; a SHA-256 per file),
so a crash leaves the newest complete checkpoint intact; loading verifies the checksums and
falls back to an older checkpoint if the newest is damaged. Format 3 (this one) is sharded;
formats 1 and 2 (one ``checkpoint.pt`` of full tensors) are refused with a message.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch

from common import checkpoint as ckpt
from common import sharded
from common.device import DEVICES as DEVICES  # re-exported: the one-process CLIs' --device
from llm.model import GPT, GPTConfig

FORMAT = 3  # meta["format"]; bump when the layout changes
STATE_FILE = "state.pt"
DEVICE_HELP = "where the model runs: auto (CUDA when torch sees a GPU, else CPU), cpu or cuda"


def has_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a ``step-*`` directory, a root holding one, or a consolidated file."""
    path = Path(path)
    return path.is_file() or (path / "manifest.json").is_file() or bool(ckpt.list_steps(path))


def entries(model: Any) -> list[sharded.Entry]:
    """(name, local shard, Slab) of every parameter of a :class:`~llm.parallel.gpt.ParallelGPT`."""
    return [(name, p, model.slab(name)) for name, p in model.shards().items()]


def save(directory: str | os.PathLike, *, step: int, model: Any, optimizer: torch.optim.Optimizer,
         meta: dict[str, Any], state: dict[str, Any], keep: int = 3, group: Any = None) -> Path:
    """Write checkpoint ``step`` of a :class:`~llm.parallel.gpt.ParallelGPT` and its AdamW under
    ``directory``, keeping the newest ``keep``; collective. Returns the step directory.

    Args:
        meta: JSON-serialisable run description (model_config, configs); rank 0's is kept.
        state: small torch-serialisable state (data position, RNG); rank 0's is kept.
        group: whom to coordinate with (:func:`common.sharded.save`).
    """
    buf = io.BytesIO()
    torch.save(state, buf)
    return sharded.save_state(directory, step, entries(model), optimizer, keep=keep, group=group,
                              files={STATE_FILE: buf.getvalue()},
                              meta={**meta, "engine": "llm", "format": FORMAT, "step": step})


def open_checkpoint(path: str | os.PathLike, *, group: Any = None) -> sharded.ShardedCheckpoint:
    """A checkpoint root (its newest intact ``step-*``) or one ``step-*`` directory, verified;
    collective over ``group`` when torch.distributed runs.

    Raises:
        FileNotFoundError: no checkpoint there.
        common.checkpoint.CheckpointError: damaged, written by another engine, or in another
            format.
    """
    path = Path(path)
    if (path / "manifest.json").is_file():
        ck = sharded.load(path, group=group)
    elif ckpt.list_steps(path):
        ck = sharded.load_latest(path, group=group)
    else:
        raise FileNotFoundError(f"no checkpoint at {path}")
    check(ck.meta, ck.path)
    return ck


def check(meta: dict[str, Any], where: object) -> None:
    """CheckpointError unless ``meta`` is an llm checkpoint of this :data:`FORMAT`."""
    if meta.get("engine") != "llm":
        raise ckpt.CheckpointError(f"checkpoint {where} was not written by llm.train")
    if meta.get("format") != FORMAT:
        raise ckpt.CheckpointError(
            f"checkpoint {where} has format {meta.get('format')}, but this llm reads format "
            f"{FORMAT} only (sharded); continue it with the code that wrote it, or retrain")


def load_into(ck: sharded.ShardedCheckpoint, model: Any, optimizer: torch.optim.Optimizer
              ) -> dict[str, Any]:
    """Read this rank's slices of the weights and AdamW moments into ``model`` (a
    :class:`~llm.parallel.gpt.ParallelGPT`, any grid) and ``optimizer``; returns the small state.

    Raises:
        ValueError: the checkpoint holds another model.
    """
    saved = GPTConfig(**ck.meta["model_config"])
    if saved != model.config:
        raise ValueError(f"checkpoint holds a different model: {saved} vs this run's "
                         f"{model.config}")
    sharded.load_state(ck, entries(model), optimizer)
    return torch.load(io.BytesIO(ck.files[STATE_FILE]), weights_only=True)


def resolve_device(name: str) -> torch.device:
    """The device of a single-process CLI's ``--device``: ``auto`` (CUDA when torch sees a
    GPU, else CPU), ``cpu`` or ``cuda``; any other torch device string is taken as is.

    Raises:
        ValueError: ``cuda`` was asked for and torch sees no CUDA device.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name} was asked for, but torch sees no CUDA device")
    return device


def load_model(path: str | os.PathLike, device: torch.device | str = "cpu"
               ) -> tuple[GPT, dict[str, Any]]:
    """The plain single-process GPT (eval mode) of a checkpoint directory or of a consolidated
    ``.safetensors`` file, on ``device`` (:func:`resolve_device`'s names, or a torch device),
    and the checkpoint's meta (step, model_config, configs).

    The weights are read on the CPU and copied once into parameters allocated on ``device``
    (no throw-away initialisation).
    """
    device = resolve_device(device) if isinstance(device, str) else device
    path = Path(path)
    if path.is_file():
        from common.consolidate import read_consolidated

        weights, meta = read_consolidated(path)
        check(meta, path)
        tensors = {n: t for n, t in weights.items() if not n.endswith(sharded.MOMENT_SUFFIXES)}
    else:
        ck = open_checkpoint(path, group=None)
        meta = ck.meta
        tensors = {n: ck.read(n, sharded.Slab.whole(ck.shape(n))) for n in ck.names()
                   if not n.endswith(sharded.MOMENT_SUFFIXES)}
    model = GPT(GPTConfig(**meta["model_config"]), device="meta").materialize(device, init=False)
    if model.config.tie_embeddings:  # saved once, under the embedding's name
        tensors.setdefault("lm_head.weight", tensors["tok_emb.weight"])
    model.load_state_dict(tensors)  # copies every parameter: none is left uninitialised
    return model.eval(), meta
