"""Write a token file from text and JSON-lines files, streaming (nanoGPT's prepare.py role).

    python -m llm.tokenize corpus.jsonl more.txt --tokenizer models/llama --out train.bin
    python -m llm.tokenize book.txt --text-split paragraphs --out book.npy  # byte tokens

Documents are read one at a time (a ``.jsonl`` line's ``--field``, a whole text file, or a
text file's paragraphs), each followed by the tokenizer's end-of-text token (or, without one,
a blank line), and appended to ``--out``: ``.bin`` is raw uint16 as nanoGPT writes it,
``.npy`` a 1-D array (uint16, or uint32 for vocabularies over 65536). Train on it with the
memory-mapped stream of :func:`llm.data.streams.open_tokens`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from llm.data.streams import SPLITS, iter_documents, write_tokens
from llm.data.tokenizers import load_tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m llm.tokenize", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="UTF-8 text files and .jsonl files (one JSON object per line)")
    p.add_argument("--out", required=True, metavar="FILE",
                   help="token file to write, FILE.bin or FILE.npy (replaced whole at the end)")
    p.add_argument("--tokenizer", default="bytes", metavar="SPEC",
                   help="'bytes', a tokenizer.json or a model directory holding one "
                   "(default: %(default)s)")
    p.add_argument("--text-split", choices=SPLITS, default="files",
                   help="a text file is one document, or one per blank-line-separated "
                   "paragraph (default: %(default)s); .jsonl files: one per line")
    p.add_argument("--field", default="text", help="the .jsonl field holding the text "
                   "(default: %(default)s)")
    p.add_argument("--vocab-size", type=int, default=None, metavar="V",
                   help="refuse a tokenizer with more token ids than the model's V")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    try:
        tokenizer = load_tokenizer(args.tokenizer, vocab_size=args.vocab_size)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        docs = iter_documents(args.inputs, args.text_split, args.field)
        num_tokens, num_docs = write_tokens(docs, out, tokenizer)
        if num_tokens == 0:
            out.unlink()
            raise ValueError(f"no text found in {len(args.inputs)} input(s)")
    except (ValueError, OSError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    print(f"wrote {num_tokens} tokens of {num_docs} documents to {out} (tokenizer "
          f"{tokenizer.name}, vocabulary {tokenizer.vocab_size}) in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
