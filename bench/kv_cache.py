"""Greedy decoding with and without the KV cache (:meth:`llm.model.GPT.generate`).

    nice -n 19 python bench/kv_cache.py                  # small preset, 32 + 256 tokens
    python bench/kv_cache.py --preset tiny --new-tokens 64 --batch 1 2

A ``--preset`` GPT (random init, seed 0, one torch thread) continues a random ``--prompt-len``
token prompt by ``--new-tokens`` greedy tokens, for each ``--batch`` size: ``use_cache=False``
(every step reruns the window) and ``use_cache=True`` (prefill, then one token per step), timed
alternately in one process, median of ``--repeats``. Printed per batch size: both medians,
tokens per second with the cache, the speed-up and whether the two outputs are identical.

With the defaults the sequence outgrows the small preset's 256-token window after 224 new
tokens; the remaining 32 steps rerun the window without a cache in both modes (the window
slides, so no cached position stays valid), which caps the speed-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from llm.model import GPT, PRESETS, get_preset


def timed(model: GPT, prompt: torch.Tensor, new_tokens: int, use_cache: bool
          ) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = model.generate(prompt, new_tokens, use_cache=use_cache)
    return time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = get_preset(args.preset)
    model = GPT(config, seed=0).eval()
    total = args.prompt_len + args.new_tokens
    print(f"{args.preset}: {config.num_params() / 1e6:.1f}M parameters, window "
          f"{config.max_seq_len}; prompt {args.prompt_len} + {args.new_tokens} greedy tokens "
          f"({max(0, total - config.max_seq_len)} steps past the window); "
          f"{args.threads} thread(s), median of {args.repeats}")
    print(f"{'batch':>5} {'no cache s':>11} {'cache s':>9} {'cache tok/s':>12} "
          f"{'speed-up':>9} {'identical':>10}")
    for batch in args.batch:
        prompt = torch.randint(config.vocab_size, (batch, args.prompt_len),
                               generator=torch.Generator().manual_seed(batch))
        runs: dict[bool, list[float]] = {False: [], True: []}
        outs: dict[bool, torch.Tensor] = {}
        for _ in range(args.repeats):
            for use_cache in (False, True):
                seconds, outs[use_cache] = timed(model, prompt, args.new_tokens, use_cache)
                runs[use_cache].append(seconds)
        plain, cached = (statistics.median(runs[c]) for c in (False, True))
        same = torch.equal(outs[False], outs[True])
        print(f"{batch:>5} {plain:>11.2f} {cached:>9.2f} "
              f"{batch * args.new_tokens / cached:>12.1f} {plain / cached:>8.2f}x {same!s:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
