"""Long-context decoding methods against full attention, on held-out text of a checkpoint.

    python -m llm.evaluate --checkpoint runs/long --attention loki --budget 0.25
    python -m llm.evaluate --checkpoint runs/long --attention sift --budget 0.125 --json
    python -m llm.evaluate --checkpoint runs/long --attention sift --sift-warmup 16 \\
        --sift-refit-every 8
    python -m llm.evaluate --checkpoint runs/long --attention topk --budget 64 \\
        --speculative quantspec --gamma 4 --text notes.txt

Each decode-time method (:mod:`llm.decode.sparse_attention`; design:
docs/design/llm-inference.md) is measured with full attention in the same run:

* perplexity: teacher forcing through the decode path. The held-out tokens are cut into
  windows of max_seq_len + 1 tokens overlapping by one (so every token but the first is a
  target once); in each window the first token is prefilled, then every further token is fed
  alone into a KV cache carrying the method, and the cross-entropy of the next token is summed
  at every position. The method is reset before each batch of windows (Sift keeps
  per-sequence state; its decode steps count from 1 after each window's prefill).
* agreement: K prompts of P held-out tokens (evenly spaced over the held-out stream; P
  defaults to max_seq_len - M, the longest context without a sliding window) are continued by
  M greedy tokens with the model's own attention and with the method; printed: the fraction of
  generated tokens equal position by position, and of exactly equal continuations.
* bytes: KV bytes read per generated token (all layers and heads, summed by the method's
  counters over the agreement run's decode steps), the method's and full attention's, and
  their ratio.

The model runs on ``--device`` (default: CUDA when torch sees a GPU, else CPU).

Held-out text (:mod:`llm.data.heldout`): ``--text FILE...``, else the held-out documents of the
checkpoint's own training run, split exactly as the trainer split them; the documents are
joined into one token stream as in training.

Loki needs a PCA basis of the keys (:mod:`llm.decode.loki`): ``--loki-basis FILE``, else
``loki_basis.safetensors`` stored with the checkpoint's weights (in the step directory read, or
next to a ``.safetensors`` file as ``NAME.loki_basis.safetensors``), else it is calibrated
(:func:`llm.decode.loki.calibrate_loki`, keys after RoPE) on ``--calibration-tokens`` tokens of the
training documents, which never overlap the default held-out text, and stored there. Sift's
power law is measured over ``--sift-warmup`` full-attention decode steps and re-measured every
``--sift-refit-every`` steps (:class:`llm.decode.sparse_attention.Sift`). ``--speculative
quantspec``
also decodes the prompts with QuantSpec (:mod:`llm.decode.quantspec`, one prompt at a time) and
checks its tokens equal plain greedy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn.functional import cross_entropy

from llm import checkpoint
from llm.data.batches import encode_stream
from llm.data.heldout import held_out_split, prompts_from
from llm.data.tokenizers import load_tokenizer, spec_of_checkpoint
from llm.decode.kv_cache import DecodeAttention, KVCache
from llm.decode.loki import basis_path, calibration_batch, load_or_calibrate
from llm.decode.sparse_attention import METHODS, SIFT_REFIT_EVERY, SIFT_WARMUP, make_method
from llm.model import GPT

__all__ = ["agreement", "decode_nll", "evaluate_method", "format_table", "parse_budget",
           "perplexity", "quantspec_run"]


# the --budget forms, for the help and the errors (%% is argparse's escaped %)
BUDGET_HELP = ("an integer is a count of positions (64; 1 keeps one position), a decimal or a "
               "percentage is a fraction of the current context in (0, 1] (0.25, 25%%, 1.0 or "
               "100%% for all)")


def parse_budget(text: str) -> float | int:
    """``--budget``: an integer is a count of positions >= 1 (``64``, and ``1`` keeps one), a
    decimal or a percentage a fraction in (0, 1] (``0.25``, ``25%``; ``1.0`` keeps all).

    Raises:
        ValueError: neither, naming both forms.
    """
    forms = BUDGET_HELP.replace("%%", "%")
    try:
        if text.endswith("%"):
            budget: float | int = float(text[:-1]) / 100
        elif re.fullmatch(r"\s*[+-]?\d+\s*", text):
            budget = int(text)
        else:
            budget = float(text)
    except ValueError:
        raise ValueError(f"--budget {text!r} is not a number: {forms}") from None
    if isinstance(budget, int) and budget < 1:
        raise ValueError(f"--budget {text!r} keeps no position: {forms}")
    if isinstance(budget, float) and not 0 < budget <= 1:
        raise ValueError(f"--budget {text!r} is a fraction outside (0, 1]: {forms}")
    return budget


def _reset(method: DecodeAttention | None) -> None:
    """Start a new sequence: zero the method's counters and per-sequence state."""
    if method is not None and hasattr(method, "reset"):
        method.reset()


@torch.no_grad()
def decode_nll(model: GPT, tokens: Tensor, method: DecodeAttention | None = None, *,
               batch_size: int = 8) -> dict[str, Any]:
    """Summed next-token cross-entropy of ``tokens``, teacher-forced through the decode path.

    Windows of ``max_seq_len + 1`` tokens start every ``max_seq_len`` tokens (the last one
    shorter); in each, token 0 is prefilled and tokens 1.. are decoded one at a time into a
    :class:`~llm.decode.kv_cache.KVCache` carrying ``method`` (None: the model's exact attention).
    Windows of equal length run ``batch_size`` at a time; the method is reset before each
    batch (its counters then hold the last batch's).

    Shapes:
        tokens: int64 [N] (N >= 2) -> N - 1 targets

    Returns:
        ``nll`` (sum, nats) and ``targets`` (N - 1).
    """
    if tokens.dim() != 1 or tokens.numel() < 2:
        raise ValueError(f"need a 1-D stream of at least 2 tokens, got {list(tokens.shape)}")
    window = model.config.max_seq_len
    starts = range(0, tokens.numel() - 1, window)
    windows = [tokens[s : s + window + 1] for s in starts]  # each [<= window + 1]
    nll, targets = 0.0, 0
    for length in sorted({len(w) for w in windows}, reverse=True):
        same = [w for w in windows if len(w) == length]
        for i in range(0, len(same), batch_size):
            x = torch.stack(same[i : i + batch_size])  # [b, L + 1]
            _reset(method)
            cache = KVCache(model.config.num_layers, length - 1, method)
            for t in range(length - 1):  # position t predicts token t + 1
                logits = model(x[:, t : t + 1], cache)[:, -1].float()  # [b, V]
                nll += float(cross_entropy(logits, x[:, t + 1], reduction="sum"))
            targets += x.shape[0] * (length - 1)
    return {"nll": nll, "targets": targets}


def perplexity(model: GPT, tokens: Tensor, method: DecodeAttention | None = None, *,
               batch_size: int = 8) -> float:
    """``exp(mean next-token cross-entropy)`` of ``tokens`` through the decode path
    (:func:`decode_nll`). Shapes: tokens int64 [N], N >= 2."""
    result = decode_nll(model, tokens, method, batch_size=batch_size)
    return math.exp(result["nll"] / result["targets"])


@torch.no_grad()
def agreement(model: GPT, prompts: Tensor, new_tokens: int, method: DecodeAttention | None,
              reference: Tensor | None = None) -> dict[str, Any]:
    """Greedy continuations with ``method`` against those of the model's exact attention.

    Args:
        prompts: K prompts of P tokens; P + new_tokens - 1 <= max_seq_len keeps every step on
            the cache (past it :meth:`GPT.generate` reruns the window without the method).
        new_tokens: M >= 2 (the first comes from the prefill, the method decodes M - 1).
        reference: ``model.generate(prompts, new_tokens)`` if already computed.

    Shapes:
        prompts: int64 [K, P] -> ``tokens`` int64 [K, P + M]

    Returns:
        ``token_agreement`` (fraction of the K * M generated tokens equal position by
        position), ``exact`` (continuations equal throughout), ``num_prompts``,
        ``bytes_read``, ``bytes_full`` and ``kept_fraction`` from the method's counters (reset
        first), ``decode_steps`` (K * (M - 1)) and ``tokens``.
    """
    if new_tokens < 2:
        raise ValueError(f"--new-tokens must be >= 2 (the method decodes all but the first), "
                         f"got {new_tokens}")
    if reference is None:
        reference = model.generate(prompts, new_tokens)
    _reset(method)
    out = model.generate(prompts, new_tokens, method=method)  # [K, P + M]
    same = out[:, prompts.shape[1] :] == reference[:, prompts.shape[1] :]  # [K, M]
    return {"token_agreement": same.float().mean().item(), "exact": int(same.all(1).sum()),
            "num_prompts": prompts.shape[0], "bytes_read": getattr(method, "bytes_read", 0),
            "bytes_full": getattr(method, "bytes_full", 0),
            "kept_fraction": getattr(method, "kept_fraction", 1.0),
            "decode_steps": prompts.shape[0] * (new_tokens - 1), "tokens": out}


def evaluate_method(model: GPT, method: DecodeAttention, tokens: Tensor, prompts: Tensor,
                    new_tokens: int, reference: Tensor, *, batch_size: int = 8
                    ) -> dict[str, Any]:
    """One row of the table: perplexity (:func:`perplexity`), agreement and bytes
    (:func:`agreement`) of ``method``. Shapes: tokens [N], prompts [K, P]."""
    ppl = perplexity(model, tokens, method, batch_size=batch_size)
    start = time.perf_counter()
    agree = agreement(model, prompts, new_tokens, method, reference)
    seconds = time.perf_counter() - start
    steps = agree["decode_steps"]
    return {"perplexity": ppl, "token_agreement": agree["token_agreement"],
            "exact": agree["exact"], "num_prompts": agree["num_prompts"],
            "kept_fraction": agree["kept_fraction"],
            "kv_bytes_per_token": agree["bytes_read"] / steps,
            "full_kv_bytes_per_token": agree["bytes_full"] / steps,
            "bytes_ratio": agree["bytes_read"] / max(1, agree["bytes_full"]),
            # wall time of the greedy continuations on this device, per generated token (the
            # counters' .item() waits for a GPU); the methods select densely (a mask, not a
            # gather), so this shows their overhead, not the speed-up of a sparse kernel
            "ms_per_token": 1e3 * seconds / (agree["num_prompts"] * new_tokens)}


def quantspec_run(model: GPT, prompts: Tensor, new_tokens: int, reference: Tensor, *,
                  gamma: int = 4, fp_buffer: int = 128) -> dict[str, Any]:
    """:func:`llm.decode.quantspec.quantspec_generate` on each prompt (one row at a time), its
    counts summed; ``equal_to_greedy`` counts the prompts whose tokens equal ``reference``'s.

    The int4 draft is built once, before the clock starts, and shared by the prompts:
    ``ms_per_token`` times decoding only, as the methods' rows do.

    Shapes:
        prompts: int64 [K, P], reference: int64 [K, P + new_tokens]
    """
    from llm.decode.quantspec import QuantSpecStats, build_draft, quantspec_generate

    total = QuantSpecStats(gamma=gamma)
    equal = 0
    draft = build_draft(model)
    start = time.perf_counter()
    for prompt, want in zip(prompts, reference):
        out, stats = quantspec_generate(model, prompt[None], new_tokens, gamma=gamma,
                                        fp_buffer=fp_buffer, draft=draft)
        equal += int(torch.equal(out[0], want))
        for f in dataclasses.fields(stats):
            if f.name != "gamma":
                setattr(total, f.name, getattr(total, f.name) + getattr(stats, f.name))
    seconds = time.perf_counter() - start
    return {**total.summary(), "equal_to_greedy": equal, "num_prompts": len(prompts),
            "fp_buffer": fp_buffer, "ms_per_token": 1e3 * seconds / (len(prompts) * new_tokens)}


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows (``name``, ``budget``, ``rank``, and :func:`evaluate_method`'s keys, with
    ``increase`` over full attention's perplexity) as a text table."""
    lines = [f"{'attention':<10}{'budget':>7}{'rank':>6}{'perplexity':>12}{'increase':>10}"
             f"{'agreement':>11}{'exact':>7}{'kept':>8}{'KV bytes/token':>16}{'vs full':>9}"
             f"{'ms/token':>10}"]
    for r in rows:
        budget = r["budget"]
        budget = "-" if budget is None else f"{budget}" if isinstance(budget, int) else \
            f"{100 * budget:g}%"
        rank = "-" if r["rank"] is None else f"{100 * r['rank']:g}%"
        lines.append(
            f"{r['name']:<10}{budget:>7}{rank:>6}{r['perplexity']:>12.4f}"
            f"{r['increase']:>+9.2f}%{100 * r['token_agreement']:>10.1f}%"
            f"{r['exact']:>4}/{r['num_prompts']:<2}{100 * r['kept_fraction']:>7.1f}%"
            f"{r['kv_bytes_per_token']:>16,.0f}{r['bytes_ratio']:>9.3f}"
            f"{r['ms_per_token']:>10.2f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m llm.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="checkpoint directory (its newest intact DIR/step-N/ is read), one "
                   "step-N directory, or a .safetensors file")
    p.add_argument("--attention", choices=METHODS, default="full",
                   help="decode-time method compared with full attention (default: %(default)s)")
    p.add_argument("--budget", default="0.25", help=f"kept positions: {BUDGET_HELP}; sift "
                   "takes a fraction only (default: %(default)s)")
    p.add_argument("--rank-fraction", type=float, default=0.25, metavar="R",
                   help="Loki: d / head_dim of the approximate scores (default: %(default)s)")
    p.add_argument("--loki-basis", default=None, metavar="FILE",
                   help="Loki: a basis saved by LokiBasis.save (default: the checkpoint's, "
                   "calibrated and stored if missing)")
    p.add_argument("--loki-pre-rope", action="store_true",
                   help="Loki: a PCA basis of the keys before the rotary rotation (the query "
                   "is rotated back per position; default: after it)")
    p.add_argument("--calibration-tokens", type=int, default=8192, metavar="N",
                   help="Loki: training tokens for a new basis (default: %(default)s)")
    p.add_argument("--sift-warmup", type=int, default=SIFT_WARMUP, metavar="W",
                   help="Sift: full-attention decode steps before the first power-law fit "
                   "(default: %(default)s)")
    p.add_argument("--sift-refit-every", type=int, default=SIFT_REFIT_EVERY, metavar="R",
                   help="Sift: decode steps between later measurements, 0: never "
                   "(default: %(default)s)")
    p.add_argument("--speculative", choices=("quantspec",), default=None,
                   help="also decode the prompts with QuantSpec self-speculation")
    p.add_argument("--gamma", type=int, default=4, help="QuantSpec: drafts per target pass")
    p.add_argument("--fp-buffer", type=int, default=128, metavar="R",
                   help="QuantSpec: full-precision recent tokens (default: %(default)s)")
    p.add_argument("--text", nargs="+", default=None, metavar="FILE",
                   help="held-out text files (default: the run's held-out documents)")
    p.add_argument("--tokenizer", default=None, metavar="SPEC",
                   help="bytes, or a Hugging Face tokenizer.json (default: the checkpoint's)")
    p.add_argument("--tokens", type=int, default=2048, metavar="N",
                   help="held-out tokens for perplexity (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=4, metavar="K", help="agreement prompts")
    p.add_argument("--new-tokens", type=int, default=32, metavar="M",
                   help="greedy tokens per prompt (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=None, metavar="P",
                   help="default: max_seq_len - M, capped by the held-out text")
    p.add_argument("--batch-size", type=int, default=8, help="perplexity windows decoded "
                   "together (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    p.add_argument("--device", choices=checkpoint.DEVICES, default="auto",
                   help=checkpoint.DEVICE_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Everything :func:`main` prints, as one JSON-serialisable dict."""
    budget = parse_budget(args.budget)
    if args.attention == "sift" and isinstance(budget, int):
        raise ValueError(f"--budget {args.budget} is a count of positions; Sift keeps a "
                         f"fraction of the context (its threshold is a quantile), so give a "
                         f"decimal or a percentage: 0.25, 25%, or 1.0 for all")
    if args.tokens < 2:
        raise ValueError(f"--tokens must be at least 2 (a token and the next one to predict), "
                         f"got {args.tokens}")
    if not 0 < args.rank_fraction <= 1:
        raise ValueError(f"--rank-fraction must be in (0, 1], got {args.rank_fraction}")
    if args.gamma < 1 or args.batch_size < 1 or args.calibration_tokens < 2:
        raise ValueError("need --gamma >= 1, --batch-size >= 1 and --calibration-tokens >= 2")
    if args.sift_warmup < 2 or args.sift_refit_every < 0:
        raise ValueError(f"need --sift-warmup >= 2 (a power law needs two points) and "
                         f"--sift-refit-every >= 0, got {args.sift_warmup} and "
                         f"{args.sift_refit_every}")
    sift = {"warmup": args.sift_warmup, "refit_every": args.sift_refit_every or None}
    model, meta = checkpoint.load_model(args.checkpoint, args.device)
    c = model.config
    spec = args.tokenizer or spec_of_checkpoint(meta)
    tokenizer = load_tokenizer(spec, vocab_size=c.vocab_size)
    held, train, where = held_out_split(meta, args.text)
    stream = encode_stream(held, tokenizer)  # [S]
    tokens = stream[: args.tokens].to(model.device)  # [N]
    if tokens.numel() < 2:
        raise ValueError(f"the held-out text has {tokens.numel()} token(s) (--tokens "
                         f"{args.tokens}); perplexity needs at least 2")
    if not 2 <= args.new_tokens < c.max_seq_len:
        raise ValueError(f"--new-tokens must be in [2, max_seq_len={c.max_seq_len}), got "
                         f"{args.new_tokens}")
    prompt_len = (min(c.max_seq_len - args.new_tokens, stream.numel())
                  if args.prompt_len is None else args.prompt_len)
    if prompt_len + args.new_tokens - 1 > c.max_seq_len:
        raise ValueError(f"--prompt-len {prompt_len} + --new-tokens {args.new_tokens} - 1 "
                         f"exceeds max_seq_len={c.max_seq_len}")
    prompts = prompts_from(stream, args.prompts, prompt_len).to(model.device)  # [K, P]
    result: dict[str, Any] = {
        "checkpoint": str(args.checkpoint), "step": meta.get("step"), "tokenizer": spec,
        "device": str(model.device),
        "max_seq_len": c.max_seq_len, "held_out": where, "tokens": tokens.numel(),
        "prompts": args.prompts, "prompt_len": prompt_len, "new_tokens": args.new_tokens}
    if args.attention == "sift":
        result["sift"] = sift
    basis = None
    if args.attention == "loki":
        post_rope = not args.loki_pre_rope
        path = Path(args.loki_basis) if args.loki_basis else basis_path(
            args.checkpoint, meta["step"], post_rope=post_rope)
        if args.loki_basis and not path.is_file():
            raise FileNotFoundError(f"--loki-basis {path} does not exist")
        calib = calibration_batch(train, tokenizer, c.max_seq_len, args.calibration_tokens)
        basis, fresh = load_or_calibrate(model, path, calib, post_rope=post_rope)
        result["loki_basis"] = {"path": str(path), "calibrated": fresh, "post_rope": post_rope,
                                "calibration_tokens": calib.numel() if fresh else None,
                                "explained_variance": basis.explained_variance(
                                    args.rank_fraction), "rank": basis.rank(args.rank_fraction),
                                "head_dim": c.head_dim}
    reference = model.generate(prompts, args.new_tokens)  # [K, P + M], exact attention
    names = ["full"] if args.attention == "full" else ["full", args.attention]
    result["rows"] = []
    for name in names:
        method = make_method(name, budget=budget, rank_fraction=args.rank_fraction,
                             basis=basis, **sift)
        row = evaluate_method(model, method, tokens, prompts, args.new_tokens, reference,
                              batch_size=args.batch_size)
        row.update(name=name, budget=None if name == "full" else budget,
                   rank=args.rank_fraction if name == "loki" else None)
        row["increase"] = 100 * (row["perplexity"] / result["rows"][0]["perplexity"] - 1) \
            if result["rows"] else 0.0
        result["rows"].append(row)
    if args.speculative == "quantspec":
        result["quantspec"] = quantspec_run(model, prompts, args.new_tokens, reference,
                                            gamma=args.gamma, fp_buffer=args.fp_buffer)
    return result


def _print_text(r: dict[str, Any]) -> None:
    print(f"checkpoint {r['checkpoint']} (step {r['step']}, window {r['max_seq_len']}, "
          f"tokenizer {r['tokenizer']}, on {r['device']})\nheld-out text: {r['held_out']}\n"
          f"perplexity over {r['tokens']:,} tokens teacher-forced through the decode path; "
          f"agreement: {r['prompts']} prompts of {r['prompt_len']} tokens + {r['new_tokens']} "
          f"greedy tokens")
    if "loki_basis" in r:
        b = r["loki_basis"]
        how = (f"calibrated on {b['calibration_tokens']:,} training tokens and saved to"
               if b["calibrated"] else "read from")
        print(f"Loki basis {how} {b['path']}: explained variance at rank {b['rank']}/"
              f"{b['head_dim']}: {100 * b['explained_variance']:.1f}%")
    if "sift" in r:
        every = r["sift"]["refit_every"]
        print(f"Sift: {r['sift']['warmup']} full-attention warm-up decode steps, then the "
              f"quantile re-measured {f'every {every} steps' if every else 'never'}")
    print(format_table(r["rows"]))
    q = r.get("quantspec")
    if q:
        print(f"QuantSpec (gamma {q['gamma']}, fp buffer {q['fp_buffer']}): acceptance "
              f"{100 * q['acceptance_rate']:.1f}%, {q['tokens_per_target_pass']:.2f} tokens per "
              f"target pass, {q['bytes_per_accepted_token']:,.0f} bytes per accepted token "
              f"(plain greedy {q['baseline_bytes_per_token']:,.0f}, weights included); tokens "
              f"equal to greedy: {q['equal_to_greedy']}/{q['num_prompts']}; "
              f"{q['ms_per_token']:.2f} ms per token")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        result = run(args)
    except (ValueError, OSError, ImportError) as e:  # FileNotFoundError is an OSError
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        _print_text(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
