"""Plexus checkpoints: full (unsharded) tensors, so a checkpoint loads on any grid.

Saving is collective: every rank helps gather the full weights, Adam moments and (if trained)
input features; rank 0 writes them with :mod:`common.checkpoint` (atomic, checksummed, last K
kept). Loading: every rank reads the files and keeps its own shards, for whatever grid and
permutation the new run uses. On the same grid a resumed run continues bit for bit.
"""

from __future__ import annotations

import io
import json
from typing import Any

import torch
import torch.distributed as dist

from common import checkpoint as ckpt
from plexus.model import PlexusGCN

# what must agree between the checkpoint and the run that loads it
IDENTITY = ("dataset", "num_nodes", "widths", "learn_features", "model", "bias", "norm",
            "residual")


def identity(model: PlexusGCN, dataset: str) -> dict[str, Any]:
    """The model's identity: a checkpoint only loads into a model with the same one."""
    return {"dataset": dataset, "num_nodes": model.shard.num_nodes,
            "widths": list(model.shard.widths),
            "learn_features": isinstance(model.features, torch.nn.Parameter),
            "model": model.kind, "bias": len(model.biases) > 0, "norm": model.norm_kind,
            "residual": model.residual}


def save(root: str, model: PlexusGCN, opt: torch.optim.Optimizer, *, epoch: int,
         history: list[dict[str, Any]], meta: dict[str, Any], keep: int = 3) -> None:
    """Collective: gather full tensors, rank 0 writes checkpoint ``epoch`` under ``root``."""
    tensors: dict[str, torch.Tensor] = {}
    for name, p, kind, layer in model.sharded_state():
        tensors[name] = model.gather(kind, p.detach(), layer).cpu()
        state = opt.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                tensors[f"{name}.{key}"] = model.gather(kind, state[key], layer).cpu()
        if "step" in state:
            tensors[f"{name}.step"] = state["step"].detach().cpu().clone()
    if not dist.is_initialized() or dist.get_rank() == 0:
        buf = io.BytesIO()
        torch.save(tensors, buf)
        files = {"tensors.pt": buf.getvalue(),
                 "history.json": json.dumps(history).encode()}
        ckpt.save(root, epoch, files, {**meta, "epoch": epoch, "engine": "plexus"}, keep=keep)
    if dist.is_initialized():
        dist.barrier()  # nobody runs ahead (or exits) before the checkpoint is on disk


def load(root: str, model: PlexusGCN, opt: torch.optim.Optimizer, *, meta: dict[str, Any]
         ) -> tuple[int, list[dict[str, Any]]]:
    """Restore the newest intact checkpoint under ``root`` into this rank's shards.

    Returns:
        (epoch of the checkpoint, metrics history up to it).

    Raises:
        common.checkpoint.CheckpointError: none found, corrupt, or from a different model.
    """
    files, manifest, path = ckpt.load_latest(root)
    saved = manifest["meta"]
    if saved.get("engine") != "plexus":
        raise ckpt.CheckpointError(f"checkpoint {path} was written by "
                                   f"{saved.get('engine')!r}, not plexus")
    diff = [f"{k} {saved.get(k)!r} != {meta.get(k)!r}" for k in IDENTITY
            if saved.get(k) != meta.get(k)]
    if diff:
        raise ckpt.CheckpointError(f"checkpoint {path} is from a different model: "
                                   + ", ".join(diff))
    tensors = torch.load(io.BytesIO(files["tensors.pt"]), weights_only=True)
    device = model.weights[0].device
    with torch.no_grad():
        for name, p, kind, layer in model.sharded_state():
            p.copy_(model.shard_full(kind, tensors[name], layer).to(device))
            if f"{name}.step" in tensors:
                opt.state[p] = {
                    "step": tensors[f"{name}.step"].clone(),
                    "exp_avg": model.shard_full(kind, tensors[f"{name}.exp_avg"], layer)
                    .to(device),
                    "exp_avg_sq": model.shard_full(kind, tensors[f"{name}.exp_avg_sq"], layer)
                    .to(device),
                }
    return int(manifest["step"]), json.loads(files["history.json"])
