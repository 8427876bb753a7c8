"""Corpora larger than memory: documents read one at a time, memory-mapped token files.

A token file is a flat array of token ids, every document followed by its end (see
:meth:`llm.data.tokenizers.Tokenizer.encode_document`), exactly the stream
:func:`llm.data.batches.encode_stream` builds in memory:

    ``.bin``  raw little-endian uint16, as nanoGPT's ``prepare.py`` writes (vocabulary <= 65536)
    ``.npy``  a 1-D numpy array of any integer dtype (written as uint16, or uint32 for larger
              vocabularies)

:func:`open_tokens` memory-maps one (nothing is read until a batch needs it) and
:class:`llm.data.batches.BatchIterator` draws windows from it with the same batches, and the same
resumable state, as from the tokens in memory. :func:`write_tokens` streams documents into one
(``python -m llm.tokenize`` is its CLI); :func:`open_stream` turns text and ``.jsonl`` files
into a cached token file once and memory-maps it.

Shapes legend:
    S: tokens in the stream.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from pathlib import Path

import numpy as np

from llm.data.batches import BYTES, iter_jsonl, iter_paragraphs
from llm.data.tokenizers import Tokenizer

__all__ = ["TOKEN_SUFFIXES", "iter_documents", "open_stream", "open_tokens", "split_tokens",
           "write_tokens"]

TOKEN_SUFFIXES = (".bin", ".npy")
SPLITS = ("files", "paragraphs")
BIN_DTYPE = np.dtype("<u2")
NPY_HEADER_BYTES = 128  # magic, version, length and the padded header dict (NEP 1, v1.0)
SCAN_CHUNK = 1 << 24  # tokens per read when scanning a token file for its largest id
CACHE_VERSION = 1  # bump when the cached token file's layout changes


def iter_documents(paths: Sequence[str | Path], split: str = "files",
                   field: str = "text") -> Iterator[str]:
    """The non-empty documents of text and JSON-lines files, in order, one at a time.

    A ``.jsonl`` file gives the ``field`` string of each line. A text file is one document
    (``split="files"``, read whole) or streamed paragraph by paragraph (``"paragraphs"``),
    as :func:`llm.data.batches.load_documents` splits them.

    Raises:
        ValueError: unknown split, or a bad ``.jsonl`` line.
        FileNotFoundError: a path does not exist.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown text split {split!r}; choose one of {SPLITS}")
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"text file {str(path)!r} does not exist")
        if path.suffix in TOKEN_SUFFIXES:
            raise ValueError(f"{str(path)!r} is a token file, not text; read it with "
                             f"open_tokens (or pass it alone to open_stream)")
        if path.suffix == ".jsonl":
            docs: Iterable[str] = iter_jsonl(path, field)
        elif split == "files":
            docs = [path.read_text(encoding="utf-8")]
        else:
            with open(path, encoding="utf-8") as f:
                yield from iter_paragraphs(f)
            continue
        yield from (doc for doc in docs if doc)


def write_tokens(documents: Iterable[str], out: str | Path, tokenizer: Tokenizer = BYTES, *,
                 docs_per_batch: int = 256) -> tuple[int, int]:
    """Tokenize documents into a token file, streaming; returns (tokens, documents) written.

    ``docs_per_batch`` documents are tokenized together (in parallel for Hugging Face
    tokenizers) and appended; nothing else stays in memory. The file appears complete or not
    at all (written beside ``out``, then renamed).

    Raises:
        ValueError: ``out`` is neither ``.bin`` nor ``.npy``, or the vocabulary does not fit
            a ``.bin`` file's uint16.
    """
    out = Path(out)
    dtype = _file_dtype(out, tokenizer)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    num_tokens = num_docs = 0
    docs = iter(documents)
    try:
        with open(tmp, "wb") as f:
            if out.suffix == ".npy":
                f.write(b"\0" * NPY_HEADER_BYTES)  # the header, once the length is known
            while batch := list(islice(docs, docs_per_batch)):
                for tokens in tokenizer.encode_documents(batch):
                    f.write(tokens.numpy().astype(dtype).tobytes())
                    num_tokens += tokens.numel()
                num_docs += len(batch)
            if out.suffix == ".npy":
                f.seek(0)
                f.write(_npy_header(dtype, num_tokens))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return num_tokens, num_docs


def open_tokens(path: str | Path, *, vocab_size: int | None = None) -> np.ndarray:
    """Memory-map a token file (``.bin`` uint16 or ``.npy``); nothing is read yet.

    Args:
        path: the token file.
        vocab_size: when given, the file is scanned (in chunks) and every id must be below it.

    Shapes:
        returns: integer [S], a read-only ``numpy.memmap``

    Raises:
        FileNotFoundError: no such file.
        ValueError: another suffix, an empty or malformed file, or an id >= ``vocab_size``.
    """
    path = Path(path)
    if path.suffix not in TOKEN_SUFFIXES:
        raise ValueError(f"token file {str(path)!r} must end in .bin (uint16, as nanoGPT "
                         f"writes) or .npy (1-D integer array)")
    if not path.is_file():
        raise FileNotFoundError(f"token file {str(path)!r} does not exist")
    if path.suffix == ".bin":
        size = path.stat().st_size
        if size == 0 or size % BIN_DTYPE.itemsize:
            raise ValueError(f"token file {str(path)!r} has {size} bytes, not a positive "
                             f"whole number of uint16 tokens")
        tokens = np.memmap(path, dtype=BIN_DTYPE, mode="r")
    else:
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as e:
            raise ValueError(f"{str(path)!r} is not a readable .npy token file: {e}") from e
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer) or not tokens.size:
            raise ValueError(f"token file {str(path)!r} holds a {tokens.dtype} array of shape "
                             f"{tokens.shape}; expected a non-empty 1-D integer array")
    info = np.iinfo(tokens.dtype)
    if vocab_size is not None and (info.min < 0 or info.max >= vocab_size):
        low, high = _id_range(tokens)
        if low < 0 or high >= vocab_size:
            raise ValueError(f"token file {str(path)!r} holds token ids in [{low}, {high}] but "
                             f"the model's vocab_size is {vocab_size}; it was written with "
                             f"another tokenizer")
    return tokens


def split_tokens(tokens: np.ndarray, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) views of a token stream: the last ``round(S * val_fraction)``
    tokens are held out (no copy; a memory map stays one).

    Raises:
        ValueError: ``val_fraction`` outside [0, 1).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    cut = len(tokens) - round(len(tokens) * val_fraction)
    return tokens[:cut], tokens[cut:]


def open_stream(paths: Sequence[str | Path], tokenizer: Tokenizer = BYTES, *,
                cache_dir: str | Path | None = None, split: str = "files", field: str = "text",
                vocab_size: int | None = None) -> np.ndarray:
    """The token stream of ``paths`` as a memory-mapped array, for :class:`BatchIterator`.

    One ``.bin`` / ``.npy`` path is opened as it is (``tokenizer`` is not consulted; the
    file must have been written with the model's). Text and ``.jsonl`` files are tokenized
    once, document by document, into ``cache_dir/<key>.npy``; the key covers the files'
    paths, sizes and modification times, the tokenizer, ``split`` and ``field``, so a later
    call reuses the file and an edited input gets a new one. Ranks of one job may call it
    together (each file is renamed into place whole), but letting one rank write it first
    saves the others the work.

    Args:
        paths: one token file, or text / ``.jsonl`` files.
        tokenizer: for text inputs.
        cache_dir: where tokenized text goes (created); required for text inputs.
        split, field: as in :func:`iter_documents`.
        vocab_size: when given, checked against the tokens (see :func:`open_tokens`).

    Shapes:
        returns: integer [S]

    Raises:
        ValueError: no paths, a token file among other inputs, no cache_dir for text, or
            what :func:`iter_documents` and :func:`open_tokens` raise.
    """
    paths = [Path(p) for p in paths]
    if not paths:
        raise ValueError("open_stream needs at least one path")
    if any(p.suffix in TOKEN_SUFFIXES for p in paths):
        if len(paths) > 1:
            raise ValueError(f"a token file must be the only input, got {len(paths)} paths")
        return open_tokens(paths[0], vocab_size=vocab_size)
    if vocab_size is not None:
        tokenizer.check_vocab(vocab_size)
    if cache_dir is None:
        raise ValueError("text inputs are tokenized into a cache; give cache_dir")
    out = Path(cache_dir) / f"{_cache_key(paths, tokenizer, split, field)}.npy"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        num_tokens, _ = write_tokens(iter_documents(paths, split, field), out, tokenizer)
        if num_tokens == 0:
            out.unlink()
            raise ValueError(f"no text found in {len(paths)} file(s) with split={split!r}")
    return open_tokens(out)


def _file_dtype(out: Path, tokenizer: Tokenizer) -> np.dtype:
    if out.suffix not in TOKEN_SUFFIXES:
        raise ValueError(f"token file {str(out)!r} must end in .bin or .npy")
    small = tokenizer.vocab_size <= 1 << 16
    if out.suffix == ".bin" and not small:
        raise ValueError(f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} token ids, "
                         f"more than the uint16 of a .bin file holds (65536); write a .npy")
    return BIN_DTYPE if small else np.dtype("<u4")


def _npy_header(dtype: np.dtype, length: int) -> bytes:
    """A fixed-size .npy v1.0 header for a 1-D array (the dict padded with spaces)."""
    descr = np.lib.format.dtype_to_descr(dtype)
    text = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': ({length},), }}"
    prefix = b"\x93NUMPY\x01\x00" + struct.pack("<H", NPY_HEADER_BYTES - 10)
    header = prefix + text.ljust(NPY_HEADER_BYTES - len(prefix) - 1).encode("latin1") + b"\n"
    assert len(header) == NPY_HEADER_BYTES, "the header outgrew its reserved bytes"
    return header


def _id_range(tokens: np.ndarray) -> tuple[int, int]:
    """(smallest, largest) id, reading SCAN_CHUNK tokens at a time."""
    chunks = (np.asarray(tokens[i : i + SCAN_CHUNK]) for i in range(0, len(tokens), SCAN_CHUNK))
    bounds = [(int(chunk.min()), int(chunk.max())) for chunk in chunks]
    return min(low for low, _ in bounds), max(high for _, high in bounds)


def _cache_key(paths: Sequence[Path], tokenizer: Tokenizer, split: str, field: str) -> str:
    files = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) if p.is_file()
             else (str(p), -1, -1) for p in paths]
    described = json.dumps([CACHE_VERSION, tokenizer.fingerprint(), split, field, files])
    return hashlib.sha256(described.encode()).hexdigest()[:20]
