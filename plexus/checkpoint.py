"""Plexus checkpoints, sharded: each rank writes only its own shards, any grid loads them.

Saving is collective (:mod:`common.sharded`): every rank writes its slices of the weights,
biases, norm parameters and statistics, the Adam moments and (if trained) the input features
into its own file; a slice replicated over ranks is written once. Nothing is gathered, so no
rank ever holds more than its own shards. Loading reads, straight from the files, the slices
the new run's grid and permutation need; on the same grid a resumed run continues bit for
bit. ``python -m common.consolidate`` writes one full file from it, streaming.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from common import checkpoint as ckpt
from common import sharded
from plexus.model import PlexusGCN

# what must agree between the checkpoint and the run that loads it
IDENTITY = ("dataset", "num_nodes", "widths", "learn_features", "model", "bias", "norm",
            "residual", "heads")
# what makes the graph the model trains on, with the flag that sets each: weights trained on
# one graph would otherwise continue on another of the same name and size. A checkpoint
# written before these were recorded is compared on the others only
GRAPH_IDENTITY = {"num_edges": "--dataset", "dataset_seed": "--seed",
                  "symmetrize": "--symmetrize", "normalize_features": "--normalize-features"}


def identity(model: PlexusGCN, dataset: str, *, num_edges: int | None = None,
             storage: str | None = None, settings: dict[str, Any] | None = None,
             normalize_features: bool = False) -> dict[str, Any]:
    """The model's and its graph's identity: a checkpoint only loads into a model with the
    same one. ``num_edges`` and ``storage``: the source's (a prepared dataset counts distinct
    edges without self-loops, an in-memory graph every stored one, so the counts are compared
    within one storage only: a run may resume from the other's checkpoint of one graph).
    ``settings``: the source's (:attr:`plexus.data.shard.ShardSource.settings`): ``seed``
    where it generated or randomly split the graph, ``symmetrize``."""
    settings = settings or {}
    return {"dataset": dataset, "num_nodes": model.shard.num_nodes,
            "widths": list(model.shard.widths),
            "learn_features": isinstance(model.features, torch.nn.Parameter),
            "model": model.kind, "bias": len(model.biases) > 0, "norm": model.norm_kind,
            "residual": model.residual,
            "heads": model.heads if model.kind == "gat" else None,
            "num_edges": num_edges, "storage": storage, "dataset_seed": settings.get("seed"),
            "symmetrize": settings.get("symmetrize"), "normalize_features": normalize_features}


def entries(model: PlexusGCN) -> list[sharded.Entry]:
    """(name, local tensor, Slab) of every parameter and statistic of ``model``."""
    return [(name, t, model.slab(kind, layer)) for name, t, kind, layer in model.sharded_state()]


def save(root: str, model: PlexusGCN, opt: torch.optim.Optimizer, *, epoch: int,
         history: list[dict[str, Any]], meta: dict[str, Any], keep: int = 3,
         group: Any = None) -> None:
    """Collective: every rank writes its shards as checkpoint ``epoch`` under ``root``
    (``group``: whom to coordinate with, :func:`common.sharded.save`)."""
    sharded.save_state(root, epoch, entries(model), opt, keep=keep, group=group,
                       meta={**meta, "epoch": epoch, "engine": "plexus"},
                       files={"history.json": json.dumps(history).encode()})


def load(root: str, model: PlexusGCN, opt: torch.optim.Optimizer, *, meta: dict[str, Any],
         group: Any = None) -> tuple[int, list[dict[str, Any]]]:
    """Restore the newest intact checkpoint under ``root`` into this rank's shards
    (collective over ``group``, as :func:`save`), reading only this rank's slices.

    Returns:
        (epoch of the checkpoint, metrics history up to it).

    Raises:
        common.checkpoint.CheckpointError: none found, corrupt, or from a different model.
    """
    ck = sharded.load_latest(root, group=group)
    saved = ck.meta
    if saved.get("engine") != "plexus":
        raise ckpt.CheckpointError(f"checkpoint {ck.path} was written by "
                                   f"{saved.get('engine')!r}, not plexus")
    diff = [f"{k} {saved.get(k)!r} != {meta.get(k)!r}" for k in IDENTITY
            if saved.get(k) != meta.get(k)]
    # None: not known on that side (a prepared directory's files are the graph: no setting
    # of the run made it), so a run on it may resume an in-memory run's checkpoint
    counted_alike = saved.get("storage") == meta.get("storage")
    graph = [f"{flag} ({k}) {saved[k]!r} != {meta.get(k)!r}"
             for k, flag in GRAPH_IDENTITY.items()
             if saved.get(k) is not None and meta.get(k) is not None and saved[k] != meta[k]
             and (k != "num_edges" or counted_alike)]
    if diff or graph:
        raise ckpt.CheckpointError(
            f"checkpoint {ck.path} is from a different "
            + "; ".join([*(["model: " + ", ".join(diff)] if diff else []),
                         *([f"graph: {', '.join(graph)} (checkpoint != this run); resume with "
                            "the checkpoint's settings, or train afresh in another "
                            "--checkpoint-dir"] if graph else [])]))
    sharded.load_state(ck, entries(model), opt)
    return ck.step, json.loads(ck.files["history.json"])
