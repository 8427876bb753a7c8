"""Tokenizers of the GPT trainer: UTF-8 bytes, or a Hugging Face ``tokenizer.json``.

A tokenizer turns text into int64 token ids and back. :func:`load_tokenizer` builds one from a
spec string, the value a CLI flag or a checkpoint's config holds:

    ``"bytes"``                the UTF-8 byte tokenizer (vocabulary 256, no special tokens)
    ``PATH/tokenizer.json``    a Hugging Face tokenizer file (``tokenizers`` package)
    ``DIR``                    a model directory holding ``DIR/tokenizer.json``

Documents in a token stream (:meth:`Tokenizer.encode_document`): a tokenizer with an
end-of-text token (``eos_id``) ends every document with it; one without (the byte tokenizer)
appends :data:`DOC_SEPARATOR`, a blank line, to the text. Plain :meth:`Tokenizer.encode` never
adds special tokens.

Shapes legend:
    L: tokens of one text.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["DOC_SEPARATOR", "ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer",
           "spec_of_checkpoint"]

DOC_SEPARATOR = "\n\n"
TOKENIZER_FILE = "tokenizer.json"
# end-of-text / begin-of-text tokens looked for when no tokenizer_config.json names them
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]")
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|bos|>", "[BOS]")


class Tokenizer(ABC):
    """Text <-> int64 token ids in ``[0, vocab_size)``.

    Attributes:
        name: the spec that :func:`load_tokenizer` rebuilds it from (``"bytes"`` or a path).
        vocab_size: number of token ids (the largest id + 1), special tokens included.
        eos_id: end-of-text token ending each document in a stream, or None.
        bos_id: begin-of-text token, or None; never added by this module (a caller that
            wants it, e.g. for a Llama prompt, prepends it).
    """

    name: str
    vocab_size: int
    eos_id: int | None = None
    bos_id: int | None = None

    @abstractmethod
    def encode(self, text: str) -> Tensor:
        """Token ids of ``text``, no special tokens added.

        Shapes:
            returns: int64 [L]
        """

    @abstractmethod
    def decode(self, ids: Tensor | Sequence[int]) -> str:
        """Text of token ids (special tokens are written out, not skipped)."""

    def encode_document(self, text: str) -> Tensor:
        """One document as it appears in a token stream: its tokens, then ``eos_id`` if the
        tokenizer has one, else the tokens of ``text + DOC_SEPARATOR``.

        Shapes:
            returns: int64 [L]
        """
        if self.eos_id is None:
            return self.encode(text + DOC_SEPARATOR)
        return torch.cat((self.encode(text), torch.tensor([self.eos_id])))

    def encode_documents(self, texts: Iterable[str]) -> list[Tensor]:
        """:meth:`encode_document` of each text (a subclass may batch the work)."""
        return [self.encode_document(text) for text in texts]

    def fingerprint(self) -> str:
        """A string that changes whenever the token ids of some text would (cache keys)."""
        return self.name

    def check_vocab(self, model_vocab_size: int) -> None:
        """ValueError unless every token id fits a model's embedding of ``model_vocab_size``
        rows (a larger model vocabulary, e.g. padded to a multiple of 64, is fine)."""
        if self.vocab_size > model_vocab_size:
            raise ValueError(f"tokenizer {self.name!r} has a vocabulary of {self.vocab_size} "
                             f"token ids but the model's vocab_size is {model_vocab_size}; "
                             f"use a model with vocab_size >= {self.vocab_size} or another "
                             f"tokenizer")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes: vocabulary 256, no special tokens; documents end with a blank line."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> Tensor:
        data = bytearray(text.encode("utf-8"))
        if not data:  # frombuffer refuses an empty buffer
            return torch.zeros(0, dtype=torch.int64)
        return torch.frombuffer(data, dtype=torch.uint8).to(torch.int64)

    def decode(self, ids: Tensor | Sequence[int]) -> str:
        """Invalid UTF-8 (a cut multi-byte character) becomes U+FFFD."""
        values = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        return bytes(values).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` package.

    The end-of-text and begin-of-text tokens are, in order of preference: ``eos_token`` /
    ``bos_token`` given here, those named by a ``tokenizer_config.json`` beside the file
    (as in a model directory), or the first special token with a usual name
    (:data:`EOS_NAMES`, :data:`BOS_NAMES`). None if there is none.

    Args:
        path: a ``tokenizer.json`` file or a directory holding one.
        eos_token, bos_token: token strings overriding the lookup above.

    Raises:
        FileNotFoundError: no such file, or a directory without ``tokenizer.json``.
        ValueError: the file is not a readable tokenizer, or a named token is not in it.
        ImportError: the ``tokenizers`` package is not installed.
    """

    def __init__(self, path: str | Path, *, eos_token: str | None = None,
                 bos_token: str | None = None) -> None:
        try:
            import tokenizers
        except ImportError as e:
            raise ImportError("Hugging Face tokenizers need the 'tokenizers' package: "
                              "pip install tokenizers") from e
        file = _tokenizer_file(Path(path))
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises a bare Exception with the JSON error
            raise ValueError(f"{str(file)!r} is not a readable Hugging Face tokenizer.json: "
                             f"{e}") from e
        self.path, self.name = file, str(path)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values(), default=-1) + 1
        special = [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]
        named = _config_tokens(file.parent / "tokenizer_config.json")
        self.eos_id = self._token_id(eos_token or named.get("eos_token"), special, EOS_NAMES)
        self.bos_id = self._token_id(bos_token or named.get("bos_token"), special, BOS_NAMES)

    def _token_id(self, token: str | None, special: list[str],
                  usual: Sequence[str]) -> int | None:
        if token is not None:
            token_id = self._tok.token_to_id(token)
            if token_id is None:
                raise ValueError(f"token {token!r} is not in the vocabulary of {self.name!r}")
            return token_id
        found = [name for name in usual if name in special]
        return self._tok.token_to_id(found[0]) if found else None

    def encode(self, text: str) -> Tensor:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return torch.from_numpy(np.asarray(ids, dtype=np.int64).reshape(-1))

    def decode(self, ids: Tensor | Sequence[int]) -> str:
        values = ids.tolist() if isinstance(ids, Tensor) else [int(i) for i in ids]
        return self._tok.decode(values, skip_special_tokens=False)

    def encode_documents(self, texts: Iterable[str]) -> list[Tensor]:
        """Batched over the library's threads (``TOKENIZERS_PARALLELISM`` governs them)."""
        texts = list(texts)
        if self.eos_id is None:
            texts = [text + DOC_SEPARATOR for text in texts]
        tail = [] if self.eos_id is None else [self.eos_id]
        return [torch.tensor(enc.ids + tail, dtype=torch.int64)
                for enc in self._tok.encode_batch(texts, add_special_tokens=False)]

    def fingerprint(self) -> str:
        digest = hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]
        return f"hf:{digest}:eos={self.eos_id}"


def load_tokenizer(spec: str | Path | Tokenizer = "bytes", *,
                   vocab_size: int | None = None) -> Tokenizer:
    """The tokenizer of a spec: ``"bytes"``, a ``tokenizer.json`` path or a model directory.

    Args:
        spec: see the module docstring; a :class:`Tokenizer` is returned as it is.
        vocab_size: when given, the model's vocabulary, checked with
            :meth:`Tokenizer.check_vocab`.

    Raises:
        FileNotFoundError: the path does not exist, or the directory has no tokenizer.json.
        ValueError: unreadable tokenizer, or more token ids than ``vocab_size``.
    """
    if isinstance(spec, Tokenizer):
        tokenizer = spec
    elif str(spec) == "bytes":
        tokenizer = ByteTokenizer()
    else:
        tokenizer = HFTokenizer(spec)
    if vocab_size is not None:
        tokenizer.check_vocab(vocab_size)
    return tokenizer


def spec_of_checkpoint(meta: Mapping[str, Any]) -> str:
    """The tokenizer spec a checkpoint's meta implies (:func:`llm.checkpoint.load_model`).

    In order: the training data config's ``tokenizer``; the Hugging Face directory a
    ``python -m llm.convert import`` came from (it holds the model's tokenizer.json);
    ``"bytes"``, what every checkpoint written before tokenizers were configurable used.
    """
    data = (meta.get("configs") or {}).get("data") or {}
    if data.get("tokenizer"):
        return str(data["tokenizer"])
    hf_dir = (meta.get("source") or {}).get("hf_dir")
    return str(hf_dir) if hf_dir else "bytes"


def _tokenizer_file(path: Path) -> Path:
    if path.is_dir():
        file = path / TOKENIZER_FILE
        if not file.is_file():
            others = sorted(p.name for p in path.iterdir()
                            if p.name in ("tokenizer.model", "vocab.json", "merges.txt"))
            hint = (f" (it has {', '.join(others)}: save a tokenizer.json with transformers' "
                    f"AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))" if others else "")
            raise FileNotFoundError(f"model directory {str(path)!r} has no {TOKENIZER_FILE}"
                                    f"{hint}")
        return file
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer {str(path)!r} not found: give 'bytes', a "
                                f"{TOKENIZER_FILE} file or a model directory holding one")
    return path


def _config_tokens(path: Path) -> dict[str, str]:
    """eos_token / bos_token of a tokenizer_config.json (a string or {"content": ...})."""
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from e
    found = {}
    for key in ("eos_token", "bos_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            found[key] = value
    return found
