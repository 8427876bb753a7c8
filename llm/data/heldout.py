"""The held-out text an evaluation reads, recomputed from a checkpoint's training run, and
the prompts cut from it (used by ``python -m llm.evaluate`` and bench/sparse_attention.py).

Held-out text: the documents of ``--text FILE...`` (each file one document), else the held-out
documents of the checkpoint's own training run, split exactly as the trainer split them: the
seeded ``--val-fraction`` of the documents (stream mode), or every document after the first
``--docs`` (memorization mode). A checkpoint without a text data config (a token file, or one
imported with ``python -m llm.convert``) falls back to the built-in corpus (pydoc topics)
split as ``python -m llm.train`` splits it by default (:data:`DEFAULT_SPLIT`). The other
documents of the run are returned too: calibration (Loki's basis) reads only those. A run
trained from a ``--token-cache`` held out the last tokens of its stream, not documents: its
held-out text must be given (``--text``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from llm.config import DataConfig
from llm.data.batches import SOURCES, load_documents, split_documents

__all__ = ["DEFAULT_SPLIT", "held_out_split", "prompts_from"]

_TRAIN_DATA = DataConfig()  # python -m llm.train's defaults: its val_fraction and seed
DEFAULT_SPLIT = (_TRAIN_DATA.val_fraction, _TRAIN_DATA.seed)


def held_out_split(meta: dict[str, Any], text: list[str] | None = None
                   ) -> tuple[list[str], list[str], str]:
    """(held-out documents, calibration documents, where they came from): the module docstring.

    The calibration documents are the training run's (never the default held-out ones).

    Raises:
        ValueError: the run held out no documents and no ``text`` was given.
    """
    data = (meta.get("configs") or {}).get("data") or {}
    if data.get("source") in SOURCES:
        docs = load_documents(data["source"], data.get("paths") or None)
        corpus = ("the built-in corpus (pydoc topics)" if data["source"] == "pydoc" else
                  f"{len(data['paths'])} text file(s) ({data['source']})")
        if data.get("docs") is not None:
            train, held = docs[: data["docs"]], docs[data["docs"] :]
            where = f"{corpus} after the run's first {data['docs']} (its --docs)"
        elif data.get("token_cache"):
            # (the trainer's make_data: a token cache is one stream, whose last tokens it held
            # out, not a set of documents; a document split would score text it trained on)
            if not text:
                raise ValueError(f"the checkpoint's run trained on a token stream "
                                 f"(--token-cache {data['token_cache']}) and held out its last "
                                 f"{data.get('val_fraction', 0):g} of tokens, not whole "
                                 "documents; pass --text FILE with text it did not train on")
            train, held, where = docs, [], corpus  # its stream's documents; held: --text's
        else:
            train, held = split_documents(docs, data["val_fraction"], data["seed"])
            where = (f"{corpus}, the run's held-out split ({data['val_fraction']:g} of the "
                     f"documents, seed {data['seed']})")
    else:
        val_fraction, seed = DEFAULT_SPLIT
        train, held = split_documents(load_documents("pydoc"), val_fraction, seed)
        where = (f"the built-in corpus (pydoc topics), python -m llm.train's default held-out "
                 f"split ({val_fraction:g}, seed {seed}): the checkpoint has no text data config")
    if text:
        held = load_documents("files", text)
        where = f"{len(text)} text file(s) (--text)"
    if not held:
        raise ValueError("the checkpoint's run held out no documents (--val-fraction 0, or "
                         "--docs covering the corpus); pass --text FILE")
    return held, train, f"{len(held)} documents of {where}"


def prompts_from(stream: Tensor, num_prompts: int, prompt_len: int) -> Tensor:
    """``num_prompts`` windows of ``prompt_len`` tokens at evenly spaced offsets of ``stream``.

    Shapes:
        stream: int64 [N] with N >= prompt_len -> int64 [K, P]
    """
    if num_prompts < 1 or prompt_len < 1:
        raise ValueError(f"need --prompts >= 1 and a prompt length >= 1, got {num_prompts} and "
                         f"{prompt_len}")
    if stream.numel() < prompt_len:
        raise ValueError(f"the held-out text has {stream.numel()} tokens, fewer than one "
                         f"{prompt_len}-token prompt; use a smaller --prompt-len")
    last = stream.numel() - prompt_len
    starts = [round(i * last / max(1, num_prompts - 1)) for i in range(num_prompts)]
    return torch.stack([stream[s : s + prompt_len] for s in starts])
