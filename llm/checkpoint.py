"""Checkpoints: full (grid-independent) tensors, atomic and checksummed, last K kept.

``DIR/step-<N>/checkpoint.pt`` holds what :meth:`llm.trainer.Trainer.state_dict` returns: the
serial GPT's weights, the AdamW moments in the same full shapes, the data iterator's position,
the RNG states, the step and the configs. Any grid can load it (each rank slices its shards),
and a single process can rebuild the plain :class:`~llm.model.GPT` for sampling and evaluation.

Writing goes through :mod:`common.checkpoint` (temporary directory, fsync, rename, a manifest
with a SHA-256 per file), so a crash leaves the newest complete checkpoint intact; loading
verifies the checksums and falls back to an older checkpoint if the newest is damaged.

Format 2 (this one) names the model's sizes ``num_layers``, ``num_heads``, ``num_kv_heads``;
format 1 (``n_layer``, ``n_head``, ``n_kv_head``) is refused with a message saying so.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch

from common import checkpoint as ckpt
from llm.model import GPT, GPTConfig

FILENAME = "checkpoint.pt"
FORMAT = 2  # the "format" entry of Trainer.state_dict(); bump when its layout changes


def check_format(state: dict[str, Any], where: object) -> None:
    """CheckpointError unless ``state`` has this code's :data:`FORMAT`."""
    found = state.get("format")
    if found != FORMAT:
        raise ckpt.CheckpointError(
            f"{where} has checkpoint format {found}, but this llm reads format {FORMAT} only "
            f"(format 2 renamed the model's n_layer, n_head, n_kv_head to num_layers, "
            f"num_heads, num_kv_heads); continue it with the code that wrote it, or retrain")


def has_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a checkpoint file, a ``step-*`` directory or a root holding one."""
    path = Path(path)
    return path.is_file() or (path / "manifest.json").is_file() or bool(ckpt.list_steps(path))


def save(state: dict[str, Any], out_dir: str | os.PathLike, *, keep: int = 3) -> Path:
    """Write ``state`` as checkpoint ``state["step"]`` under ``out_dir``; returns its file.

    Call on one rank only (the trainer's rank 0) after every rank has gathered ``state``.
    """
    buf = io.BytesIO()
    torch.save(state, buf)
    meta = {"engine": "llm", "step": int(state.get("step", 0))}
    final = ckpt.save(out_dir, meta["step"], {FILENAME: buf.getvalue()}, meta, keep=keep)
    return final / FILENAME


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint onto the CPU: a checkpoint root (newest intact ``step-*``), one
    ``step-*`` directory, or a ``checkpoint.pt`` file.

    Raises:
        FileNotFoundError: no checkpoint there.
        common.checkpoint.CheckpointError: damaged, written by another engine, or in another
            :data:`FORMAT`.
    """
    path = Path(path)
    if path.is_file():
        state = torch.load(path, map_location="cpu", weights_only=True)
        check_format(state, path)
        return state
    if (path / "manifest.json").is_file():
        files, manifest = ckpt.load(path)
    elif ckpt.list_steps(path):
        files, manifest, path = ckpt.load_latest(path)
    else:
        raise FileNotFoundError(f"no checkpoint at {path}")
    if manifest["meta"].get("engine") != "llm" or FILENAME not in files:
        raise ckpt.CheckpointError(f"checkpoint {path} was not written by llm.train")
    state = torch.load(io.BytesIO(files[FILENAME]), map_location="cpu", weights_only=True)
    check_format(state, f"checkpoint {path}")
    return state


def load_model(path: str | os.PathLike) -> tuple[GPT, dict[str, Any]]:
    """The plain single-process GPT of a checkpoint (eval mode) and the checkpoint itself."""
    state = load(path)
    model = GPT(GPTConfig(**state["model_config"]))
    weights = dict(state["model"])
    if model.config.tie_embeddings:  # saved once, under the embedding's name
        weights.setdefault("lm_head.weight", weights["tok_emb.weight"])
    model.load_state_dict(weights)
    return model.eval(), state
