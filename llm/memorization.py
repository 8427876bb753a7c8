"""Memorization test: can the model recite a document's end? (docs/design/llm-4d-goldfish.md
section 5)

For each of the first N training documents, tokenised and cut to ``--seq-len`` + 1 tokens (the
checkpoint's tokenizer, no end-of-text token: :func:`llm.data.batches.truncate_docs`):
prefix = all but the last S tokens, suffix = the last S. The model decodes S tokens greedily
after the prefix (with the KV cache of :meth:`llm.model.GPT.generate`). Exact match = all S
tokens identical; ROUGE-L (:mod:`llm.rouge`) is computed between the generated and the true
suffix tokens.

    python -m llm.memorization --checkpoint runs/std --docs 32 --suffix-len 32 [--json]
    python -m llm.memorization --checkpoint llama.safetensors --text a.txt b.txt --docs 2 \\
        --seq-len 256

Which documents, and what training saw of them:

* a run trained with ``--docs N`` (the memorization setting): its first N documents, cut
  exactly as :func:`llm.trainer.make_data` cut them, each one training sample;
* a run trained on a stream (no ``--docs``): ``--docs N`` picks the first N documents of its
  training split (:func:`llm.data.batches.split_documents` with the run's ``--val-fraction``
  and seed, so no held-out document is scored). Training saw them only inside random windows
  of the stream, which rarely start at a document's start, so the output says so; a run that
  streamed from a ``--token-cache`` held out the stream's last tokens instead of documents and
  needs ``--text``;
* ``--text FILE...``: the first N documents of those files, taken as given.

The checkpoint's full weights are loaded into a single-process GPT (any training grid) on
``--device`` (default: CUDA when torch sees a GPU, else CPU); the
documents default to the checkpoint's corpus, ``--docs`` and ``--seq-len``, the tokenizer to
the checkpoint's (:func:`llm.data.tokenizers.spec_of_checkpoint`; ``--tokenizer`` overrides it). A
checkpoint without training configs (``python -m llm.convert import`` of a Hugging Face model)
needs ``--text``, ``--docs`` and ``--seq-len``; its tokenizer is the ``tokenizer.json`` of the
directory it was imported from.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from llm import checkpoint
from llm.data.batches import load_documents, split_documents, truncate_docs
from llm.data.tokenizers import Tokenizer, load_tokenizer, spec_of_checkpoint
from llm.rouge import rouge_l

# what training saw of the documents scored, by the run's data mode (the "trained_on" result)
SEEN = {"documents": "each document, cut to seq_len + 1 tokens, as one training sample",
        "windows": "random windows of a token stream, not whole documents: a document's "
                   "start was rarely a window's start"}


def split_document(tokens: Tensor, suffix_len: int) -> tuple[Tensor, Tensor]:
    """(prefix, suffix) = (all but the last ``suffix_len`` tokens, the last ``suffix_len``).

    Raises:
        ValueError: the document has no token left for the prefix.
    """
    if suffix_len < 1:
        raise ValueError(f"--suffix-len must be >= 1, got {suffix_len}")
    if tokens.numel() <= suffix_len:
        raise ValueError(f"a document of {tokens.numel()} tokens has no prefix before a "
                         f"{suffix_len}-token suffix; use a smaller --suffix-len")
    return tokens[:-suffix_len], tokens[-suffix_len:]


@torch.no_grad()
def memorization(model: Any, docs: Sequence[Tensor], suffix_len: int,
                 batch_size: int = 64) -> dict[str, Any]:
    """Exact-match rate and mean ROUGE-L of greedy suffixes.

    Args:
        model: anything with ``generate(idx [B, T0], max_new_tokens) -> [B, T0 + S]``
            (a :class:`llm.model.GPT`).
        docs: int64 token tensors, each cut as in training, on the model's device.
        suffix_len: S.
        batch_size: documents decoded together (documents of equal length are batched).

    Returns:
        ``exact_match`` (fraction), ``rouge_l`` (mean), ``num_docs``, ``suffix_len``,
        ``exact`` (list of bool per document) and ``rouge`` (list of float per document).
    """
    pieces = [split_document(doc, suffix_len) for doc in docs]
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, (prefix, _) in enumerate(pieces):
        by_length[prefix.numel()].append(i)
    generated: dict[int, Tensor] = {}
    for ids in by_length.values():
        for start in range(0, len(ids), batch_size):
            chunk = ids[start : start + batch_size]
            prefixes = torch.stack([pieces[i][0] for i in chunk])  # [b, T0]
            out = model.generate(prefixes, max_new_tokens=suffix_len)[:, -suffix_len:]
            generated.update(zip(chunk, out))
    exact = [bool(torch.equal(generated[i], pieces[i][1])) for i in range(len(docs))]
    rouge = [rouge_l(generated[i].tolist(), pieces[i][1].tolist()) for i in range(len(docs))]
    return {"exact_match": sum(exact) / len(docs), "rouge_l": sum(rouge) / len(docs),
            "num_docs": len(docs), "suffix_len": suffix_len, "exact": exact, "rouge": rouge}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m llm.memorization", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="checkpoint directory (its newest intact DIR/step-N/ is read), one "
                   "step-N directory, or a .safetensors file from python -m common.consolidate "
                   "or python -m llm.convert import")
    p.add_argument("--docs", type=int, default=None, help="first N documents (default: the "
                   "checkpoint's --docs; a checkpoint trained on a stream needs it, and the "
                   "documents are then the first N of its training split)")
    p.add_argument("--suffix-len", type=int, default=50, help="S tokens to recite")
    p.add_argument("--seq-len", type=int, default=None, help="truncation (default: the "
                   "checkpoint's)")
    p.add_argument("--text", nargs="+", default=None, metavar="FILE",
                   help="text files (default: the checkpoint's corpus)")
    p.add_argument("--text-split", choices=("files", "paragraphs"), default="files")
    p.add_argument("--tokenizer", default=None, metavar="SPEC",
                   help="bytes, or a Hugging Face tokenizer.json (file or model directory); "
                   "default: the checkpoint's")
    p.add_argument("--device", choices=checkpoint.DEVICES, default="auto",
                   help=checkpoint.DEVICE_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def documents(args: argparse.Namespace, meta: dict[str, Any], tokenizer: Tokenizer
              ) -> tuple[list[Tensor], int, str | None]:
    """The documents to recite, tokenised and cut to seq_len + 1 tokens; the seq_len; and what
    training saw of them (a key of :data:`SEEN`, None for a checkpoint without configs).

    Flags win over the checkpoint's data config; a checkpoint without one needs them all. A
    stream run's documents come from its training split, so that no document it held out is
    scored as if it had been trained on (module docstring).

    Raises:
        ValueError: a needed flag is missing (each one named), the run's text has no
            documents to take (a token file or a token cache), or ``--docs`` exceeds them.
    """
    data = (meta.get("configs") or {}).get("data")
    if data is None:
        missing = [flag for flag, value in (("--text", args.text), ("--docs", args.docs),
                                            ("--seq-len", args.seq_len)) if value is None]
        if missing:
            raise ValueError(f"checkpoint {args.checkpoint} has no training configs (imported "
                             f"with python -m llm.convert?), so give the documents: missing "
                             f"{', '.join(missing)} (--text FILE... --docs N --seq-len T)")
        data = {}
    stream = bool(data) and data["docs"] is None
    num_docs = args.docs if args.docs is not None else data["docs"]
    if num_docs is None:
        raise ValueError("the checkpoint was trained on a stream, not on a fixed set of "
                         "documents; pass --docs N to score the first N documents of its "
                         "training split")
    seq_len = args.seq_len if args.seq_len is not None else data["seq_len"]
    seen = None if not data else "windows" if stream else "documents"
    if args.text:
        return (truncate_docs(load_documents(args.text_split, args.text), num_docs, seq_len,
                              tokenizer), seq_len, seen)
    if data["source"] == "tokens":
        raise ValueError("the checkpoint was trained on a token file, which has no documents; "
                         "pass --text FILE...")
    if stream and data.get("token_cache"):
        raise ValueError("the checkpoint was trained from a token cache (--token-cache), which "
                         "holds out the stream's last tokens rather than whole documents, so "
                         "its training documents are not known here; pass --text FILE... with "
                         "documents it trained on")
    docs = load_documents(data["source"], data["paths"] or None)
    if stream:
        docs, _ = split_documents(docs, data["val_fraction"], data["seed"])
        if num_docs > len(docs):
            raise ValueError(f"--docs {num_docs}: the run's training split holds {len(docs)} "
                             f"documents (val_fraction {data['val_fraction']:g} held out); "
                             f"pass --docs {len(docs)} or fewer")
    return truncate_docs(docs, num_docs, seq_len, tokenizer), seq_len, seen


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        model, state = checkpoint.load_model(args.checkpoint, args.device)
        spec = args.tokenizer or spec_of_checkpoint(state)
        tokenizer = load_tokenizer(spec, vocab_size=model.config.vocab_size)
        docs, seq_len, seen = documents(args, state, tokenizer)
        result = memorization(model, [doc.to(model.device) for doc in docs], args.suffix_len)
    except (ValueError, OSError, ImportError) as e:  # FileNotFoundError is an OSError
        print(f"error: {e}", file=sys.stderr)
        return 2
    result.update(checkpoint=str(args.checkpoint), step=state["step"], seq_len=seq_len,
                  tokenizer=spec, goldfish=(state.get("configs") or {}).get("goldfish"),
                  trained_on=seen)
    if args.json:
        print(json.dumps(result))
    else:
        hits = sum(result["exact"])
        print(f"{result['num_docs']} documents, {args.suffix_len}-token suffixes "
              f"(checkpoint step {state['step']}, tokenizer {spec}): exact match "
              f"{hits}/{result['num_docs']} = {100 * result['exact_match']:.1f}%, "
              f"ROUGE-L {result['rouge_l']:.3f}")
        if seen == "windows":
            which = "" if args.text else (f"; scored: the first {result['num_docs']} documents "
                                          f"of its training split")
            print(f"note: the run trained on {SEEN[seen]}{which}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
