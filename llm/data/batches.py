"""Text for the GPT trainer: tokens, offline corpus, resumable batches.

Nothing here needs the internet. The built-in corpus is the standard library's
``pydoc_data.topics`` (79 documentation topics, about 465 KB of English prose), present on
every machine with Python. Users bring UTF-8 text files or JSON lines; corpora too large for
memory go through memory-mapped token files (:mod:`llm.data.streams`), which
:class:`BatchIterator` reads window by window.

Shapes legend:
    B: batch size, T: sequence length (targets per sample), L: tokens in one document,
    S: tokens in the concatenated stream.

Document splitting of user files (``load_documents``):
    ``source="files"``: each file is one document (the natural unit for the memorization test:
    one article per file).
    ``source="paragraphs"``: each file is split at blank lines (a line holding only whitespace);
    every non-empty paragraph, stripped of surrounding whitespace, is one document.
    A ``.jsonl`` path holds one document per line, the string of its ``"text"`` field, with
    either source.

Tokens: every function that tokenizes takes a ``tokenizer`` (:mod:`llm.data.tokenizers`); the
default is UTF-8 bytes, vocabulary 256, no special tokens. In the stream mode each document is
followed by the tokenizer's end-of-text token, or without one (bytes) by :data:`DOC_SEPARATOR`
(a blank line), so that the model sees where one ends
(:meth:`~llm.data.tokenizers.Tokenizer.encode_document`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from common.grid import ceil_div
from llm.data.tokenizers import DOC_SEPARATOR, ByteTokenizer, Tokenizer

__all__ = ["DOC_SEPARATOR", "MODES", "SOURCES", "VOCAB_SIZE", "BatchIterator", "decode",
           "encode", "encode_stream", "iter_jsonl", "iter_paragraphs", "load_documents",
           "split_documents", "truncate_docs"]

VOCAB_SIZE = 256
BYTES = ByteTokenizer()  # the default tokenizer (stateless)
SOURCES = ("pydoc", "files", "paragraphs")
MODES = ("stream", "documents")


def encode(text: str, tokenizer: Tokenizer = BYTES) -> Tensor:
    """Token ids of ``text``; by default its UTF-8 bytes, ids in [0, 256).

    Shapes:
        returns: int64 [L]
    """
    return tokenizer.encode(text)


def decode(tokens: Tensor | Sequence[int], tokenizer: Tokenizer = BYTES) -> str:
    """Inverse of :func:`encode`; with bytes, invalid UTF-8 (a cut multi-byte character)
    becomes U+FFFD.

    Shapes:
        tokens: int [L] -> returns str
    """
    return tokenizer.decode(tokens)


def load_documents(source: str = "pydoc", paths: Sequence[str | Path] | None = None) -> list[str]:
    """Documents of a corpus, in a fixed order.

    Args:
        source: ``"pydoc"`` (the topics of ``pydoc_data.topics`` in sorted key order),
            ``"files"`` (one document per file) or ``"paragraphs"`` (blank-line-separated
            paragraphs of each file, file by file).
        paths: text files (UTF-8) or ``.jsonl`` files (one document per line, see
            :func:`iter_jsonl`) for ``"files"`` and ``"paragraphs"``; None for ``"pydoc"``.

    Raises:
        ValueError: unknown source, paths given or missing for the source, or no text found.
        FileNotFoundError: a path does not exist.
    """
    if source not in SOURCES:
        raise ValueError(f"unknown text source {source!r}; choose one of {SOURCES}")
    if source == "pydoc":
        if paths is not None:
            raise ValueError("source='pydoc' is built in and takes no paths; use 'files'")
        from pydoc_data.topics import topics

        return [topics[key] for key in sorted(topics)]
    if not paths:
        raise ValueError(f"source={source!r} needs paths to UTF-8 text files, got {paths!r}")
    docs: list[str] = []
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"text file {str(path)!r} does not exist (source={source!r})")
        if path.suffix == ".jsonl":
            docs.extend(iter_jsonl(path))
            continue
        text = path.read_text(encoding="utf-8")
        if source == "files":
            docs.append(text)
        else:
            docs.extend(iter_paragraphs(text.splitlines()))
    docs = [doc for doc in docs if doc]
    if not docs:
        raise ValueError(f"no text found in {len(paths)} file(s) with source={source!r}")
    return docs


def iter_paragraphs(lines: Iterable[str]) -> Iterator[str]:
    """Blank-line-separated paragraphs of ``lines`` (with or without their ``"\\n"``), each
    stripped of surrounding whitespace; one paragraph in memory at a time."""
    current: list[str] = []
    for line in lines:
        line = line.rstrip("\n")
        if line.strip():
            current.append(line)
        elif current:
            yield "\n".join(current).strip()
            current = []
    if current:
        yield "\n".join(current).strip()


def iter_jsonl(path: str | Path, field: str = "text") -> Iterator[str]:
    """The ``field`` string of each line of a JSON-lines file, read line by line (blank lines
    are skipped).

    Raises:
        ValueError: a line is not a JSON object with a string ``field`` (file and line named).
    """
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{number}: not valid JSON ({e})") from e
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise ValueError(f"{path}:{number}: expected a JSON object with a string "
                                 f"{field!r} field")
            yield record[field]


def truncate_docs(docs: Sequence[str], num_docs: int, seq_len: int,
                  tokenizer: Tokenizer = BYTES) -> list[Tensor]:
    """Token ids of the first ``num_docs`` documents, each cut to at most ``seq_len + 1`` tokens.

    ``seq_len + 1`` tokens give exactly ``seq_len`` (input, target) pairs: inputs are tokens
    ``[0, seq_len)`` and targets tokens ``[1, seq_len]``. Shorter documents are kept whole
    (L tokens give L - 1 targets; the batch iterator pads the rest with ignore_index).
    Truncation counts tokens (bytes by default), so a multi-byte character may be cut in
    half. No end-of-text token is added.

    Shapes:
        returns: num_docs tensors, int64 [min(L_i, seq_len + 1)]

    Raises:
        ValueError: ``num_docs`` outside [1, len(docs)] or ``seq_len < 1``.
    """
    if not 1 <= num_docs <= len(docs):
        raise ValueError(f"num_docs must be in [1, {len(docs)}] (corpus size), got {num_docs}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    return [tokenizer.encode(doc)[: seq_len + 1] for doc in docs[:num_docs]]


def split_documents(
    docs: Sequence[str], val_fraction: float = 0.1, seed: int = 0
) -> tuple[list[str], list[str]]:
    """Seeded train/validation split by whole documents, each part in corpus order.

    ``round(len(docs) * val_fraction)`` documents (at least 1 when ``val_fraction > 0``) go to
    validation, chosen by a permutation seeded with ``seed``.

    Raises:
        ValueError: ``val_fraction`` outside [0, 1) or fewer than 2 documents to split.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if val_fraction == 0.0:
        return list(docs), []
    if len(docs) < 2:
        raise ValueError(f"cannot split {len(docs)} document(s) into train and validation")
    num_val = min(max(1, round(len(docs) * val_fraction)), len(docs) - 1)
    val_ids = set(random.Random(seed).sample(range(len(docs)), num_val))
    train = [doc for i, doc in enumerate(docs) if i not in val_ids]
    val = [doc for i, doc in enumerate(docs) if i in val_ids]
    return train, val


def encode_stream(docs: Sequence[str], tokenizer: Tokenizer = BYTES) -> Tensor:
    """All documents as one token stream, each ended as
    :meth:`~llm.data.tokenizers.Tokenizer.encode_document` says (bytes: followed by
    :data:`DOC_SEPARATOR`).

    Shapes:
        returns: int64 [S]
    """
    if isinstance(tokenizer, ByteTokenizer):  # one encode of the joined text, same result
        return tokenizer.encode("".join(doc + DOC_SEPARATOR for doc in docs))
    pieces = tokenizer.encode_documents(docs)
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def _is_stream(data: object) -> bool:
    if isinstance(data, Tensor):
        return data.dim() == 1
    return (isinstance(data, np.ndarray) and data.ndim == 1
            and np.issubdtype(data.dtype, np.integer))


def _derive_seed(*values: int) -> int:
    """A 63-bit generator seed mixed from integers (same on every machine and Python)."""
    x = 0
    for value in values:
        x = (x * 0x9E3779B97F4A7C15 + value + 1) % 2**64
        x ^= x >> 31
    return x % 2**63


class BatchIterator:
    """Deterministic, resumable, endless iterator of (inputs, targets) batches.

    The batch drawn depends only on ``(seed, epoch, position)``, which :meth:`state_dict`
    saves and :meth:`load_state_dict` restores, so a resumed run sees exactly the batches the
    uninterrupted run would have seen. ``position`` counts samples already drawn in ``epoch``.

    Modes:
        ``"stream"`` (pretraining): ``data`` is one token stream: a tensor (see
            :func:`encode_stream`) or a 1-D integer numpy array, typically a memory-mapped
            token file (:func:`llm.data.streams.open_tokens`) of which only the drawn windows are
            read; both give the same batches for the same tokens. Each sample is a window
            of ``seq_len + 1`` tokens at a uniformly random offset drawn from a generator
            seeded by (seed, epoch, position). An epoch is
            ``(S - 1) // seq_len`` samples (as many as non-overlapping windows); every batch
            has ``batch_size`` rows.
        ``"documents"`` (memorization): ``data`` is a list of documents' tokens (see
            :func:`truncate_docs`); each document, cut to ``seq_len + 1`` tokens, is one
            sample. Every epoch visits each document once, in a permutation seeded by
            (seed, epoch); the last batch of an epoch holds the remainder and may be smaller.
            A document of L < seq_len + 1 tokens fills the first L - 1 positions; the rest of
            the row is ``pad_id`` in inputs and ``ignore_index`` in targets.

    Args:
        data: int64 [S] token stream (tensor or integer array), or a list of int64 [L_i]
            documents.
        batch_size: samples per batch (B).
        seq_len: targets per sample (T).
        mode: ``"stream"`` or ``"documents"``.
        seed: base seed of all the randomness.
        ignore_index: target value of padding (documents mode).
        pad_id: input token of padding (documents mode); any valid id, it is never a target.

    Shapes:
        yields: inputs int64 [B, T], targets int64 [B, T]; targets[:, t] follows inputs[:, t].

    Raises:
        ValueError: bad mode, sizes, or data too short for one sample.
    """

    def __init__(
        self, data: Tensor | np.ndarray | Sequence[Tensor], *, batch_size: int, seq_len: int,
        mode: str = "stream", seed: int = 0, ignore_index: int = -100, pad_id: int = 0,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown batch mode {mode!r}; choose one of {MODES}")
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        if mode == "stream":
            if not _is_stream(data):
                raise ValueError("mode='stream' needs a 1-D token tensor (see encode_stream) "
                                 "or a 1-D integer array (see llm.data.streams.open_tokens)")
            if len(data) < seq_len + 1:
                raise ValueError(f"stream of {len(data)} tokens is shorter than one sample "
                                 f"of seq_len + 1 = {seq_len + 1} tokens")
            self.num_samples = (len(data) - 1) // seq_len
        else:
            if isinstance(data, (Tensor, np.ndarray)) or len(data) == 0:
                raise ValueError("mode='documents' needs a non-empty list of 1-D token tensors")
            short = [i for i, doc in enumerate(data) if doc.dim() != 1 or doc.numel() < 2]
            if short:
                raise ValueError(f"documents {short[:5]} are not 1-D with >= 2 tokens (no target)")
            self.num_samples = len(data)
        self.data = data
        self.batch_size, self.seq_len, self.mode = batch_size, seq_len, mode
        self.ignore_index, self.pad_id = ignore_index, pad_id
        self.seed, self.epoch, self.position = seed, 0, 0

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch (the last one may be smaller in documents mode)."""
        return ceil_div(self.num_samples, self.batch_size)

    def state_dict(self) -> dict[str, int | str]:
        """Everything needed to resume: plain ints and strings (torch.save or JSON)."""
        return {"mode": self.mode, "seed": self.seed, "epoch": self.epoch,
                "position": self.position, "batch_size": self.batch_size,
                "seq_len": self.seq_len, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        """Resume from :meth:`state_dict`; the data and sizes must be the same as when saved.

        Raises:
            ValueError: mode, batch_size, seq_len or the number of samples differ.
        """
        for key in ("mode", "batch_size", "seq_len", "num_samples"):
            if state[key] != getattr(self, key):
                raise ValueError(f"cannot resume: saved {key}={state[key]!r} but this iterator "
                                 f"has {key}={getattr(self, key)!r}")
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> tuple[Tensor, Tensor]:
        if self.mode == "stream":
            batch = self._stream_batch()
            taken = self.batch_size
        else:
            batch = self._document_batch()
            taken = batch[0].shape[0]
        self.position += taken
        if self.position >= self.num_samples:
            self.epoch, self.position = self.epoch + 1, 0
        return batch

    def _stream_batch(self) -> tuple[Tensor, Tensor]:
        generator = torch.Generator().manual_seed(_derive_seed(self.seed, self.epoch,
                                                               self.position))
        num_starts = len(self.data) - self.seq_len  # last start leaves seq_len + 1 tokens
        starts = torch.randint(num_starts, (self.batch_size,), generator=generator)  # [B]
        if isinstance(self.data, Tensor):
            offsets = torch.arange(self.seq_len + 1)  # [T + 1]
            windows = self.data[starts[:, None] + offsets]  # [B, T + 1]
        else:  # one contiguous read per row: a memory map pages in only these windows
            rows = [self.data[s : s + self.seq_len + 1] for s in starts.tolist()]
            windows = torch.from_numpy(np.stack(rows).astype(np.int64))  # [B, T + 1]
        return windows[:, :-1].clone(), windows[:, 1:].clone()

    def _document_batch(self) -> tuple[Tensor, Tensor]:
        generator = torch.Generator().manual_seed(_derive_seed(self.seed, self.epoch))
        order = torch.randperm(self.num_samples, generator=generator)  # [N]
        chosen = order[self.position : self.position + self.batch_size].tolist()
        inputs = torch.full((len(chosen), self.seq_len), self.pad_id, dtype=torch.int64)
        targets = torch.full((len(chosen), self.seq_len), self.ignore_index, dtype=torch.int64)
        for row, doc_id in enumerate(chosen):
            doc = self.data[doc_id][: self.seq_len + 1]  # [L]
            inputs[row, : doc.numel() - 1] = doc[:-1]
            targets[row, : doc.numel() - 1] = doc[1:]
        return inputs, targets
