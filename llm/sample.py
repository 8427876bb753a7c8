"""Sample text from a checkpoint (one process reads the full weights from the shards).

    python -m llm.sample --checkpoint runs/tiny --prompt "The assert statement" --tokens 200
    python -m llm.sample --checkpoint llama.safetensors --prompt "Once" --temperature 0

The prompt is encoded and the output decoded with the checkpoint's tokenizer: the one it was
trained with (``--tokenizer`` of ``llm.train``), the ``tokenizer.json`` of the Hugging Face
directory it was imported from (``python -m llm.convert import``), else UTF-8 bytes;
``--tokenizer SPEC`` overrides it (:func:`llm.data.tokenizers.load_tokenizer`). No special token is
added to the prompt unless ``--bos`` asks for the tokenizer's begin-of-text token first (Llama
models were trained with it, and Hugging Face's tokenizers add it by default); it is not
printed. Special tokens in the generated text are written out.

Decoding keeps a KV cache (:meth:`llm.model.GPT.generate`); ``--no-cache`` reruns the whole
window at every step instead (the reference loop, same tokens, slower). ``--device`` picks
where the model runs (default: CUDA when torch sees a GPU); the sampling generator stays on
the CPU, so ``--seed`` draws the same tokens on either device (up to rounding).
"""

from __future__ import annotations

import argparse
import sys

import torch

from llm import checkpoint
from llm.data.tokenizers import load_tokenizer, spec_of_checkpoint


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llm.sample", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="checkpoint directory (its newest intact DIR/step-N/ is read), one "
                   "step-N directory, or a .safetensors file from python -m common.consolidate "
                   "or python -m llm.convert import")
    p.add_argument("--prompt", default="\n", help="text to continue")
    p.add_argument("--tokenizer", default=None, metavar="SPEC",
                   help="bytes, or a Hugging Face tokenizer.json (file or model directory); "
                   "default: the checkpoint's (see above)")
    p.add_argument("--tokens", type=int, default=200, help="new tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="a finite number >= 0; "
                   "0 (or below 1e-6, where sampling differs from greedy only at near-ties): "
                   "greedy (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cache", action="store_true", help="no KV cache: rerun the window "
                   "every step")
    p.add_argument("--bos", action="store_true", help="put the tokenizer's begin-of-text "
                   "token (e.g. <s>) before the prompt, as Llama models expect")
    p.add_argument("--device", choices=checkpoint.DEVICES, default="auto",
                   help=checkpoint.DEVICE_HELP)
    args = p.parse_args(argv)
    try:
        if args.tokens < 0:
            raise ValueError(f"--tokens must be >= 0, got {args.tokens}")
        if not 0 <= args.temperature < float("inf"):  # nan fails every comparison
            raise ValueError(f"--temperature must be a finite number >= 0 (0: greedy), got "
                             f"{args.temperature}")
        model, meta = checkpoint.load_model(args.checkpoint, args.device)
        tokenizer = load_tokenizer(args.tokenizer or spec_of_checkpoint(meta),
                                   vocab_size=model.config.vocab_size)
        prompt = tokenizer.encode(args.prompt)  # [T0]
        if prompt.numel() == 0:
            raise ValueError("--prompt is empty; give at least one character")
        bos = tokenizer.bos_id
        if args.bos and bos is None:
            raise ValueError(f"--bos: the tokenizer ({tokenizer.name}) has no begin-of-text "
                             "token; drop --bos, or give a tokenizer.json whose "
                             "tokenizer_config.json names a bos_token")
        if args.bos:
            prompt = torch.cat([prompt.new_tensor([bos]), prompt])
        out = model.generate(prompt[None].to(model.device), args.tokens,
                             temperature=args.temperature,
                             generator=torch.Generator().manual_seed(args.seed),
                             use_cache=not args.no_cache).cpu()  # [1, T0 + tokens]
    except (ValueError, OSError, ImportError) as e:  # FileNotFoundError is an OSError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(tokenizer.decode(out[0, 1:] if args.bos else out[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
