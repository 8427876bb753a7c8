"""Long-context decoding: top-k, Loki and SiftAttention against full attention; QuantSpec.

    nice -n 19 python bench/sparse_attention.py          # tens of minutes on a 2-core CPU
    python bench/sparse_attention.py --quick              # smoke sizes, quick
    python bench/sparse_attention.py --checkpoint runs/long   # skip training, evaluate that

A GPT of the ``small`` preset's shape (6 layers, d_model 384, 6 heads of Dh 64, d_ff 1536:
14.4M parameters) with a 512-token context (``--seq-len``) is trained on the built-in
corpus (pydoc topics, stream mode, 10% of the documents held out) by ``python -m llm.train``
in a subprocess. The presets cap the context at 256 (``small``) and ``llm.train`` has no flag
for it, so the sizes go in the supported way for any other shape: a Hugging Face Llama
directory (``config.json`` with ``max_position_embeddings``, and the GPT's seeded initial
weights) passed as ``--init``.

Then, on the run's held-out documents (:mod:`llm.evaluate`, what ``python -m llm.evaluate``
prints for one method): perplexity teacher-forced through the decode path over ``--tokens``
tokens, greedy agreement of ``--prompts`` continuations of ``--new-tokens`` tokens after
prompts of ``seq_len - new_tokens`` tokens, and KV bytes read per generated token, for full
attention and for top-k, Loki (rank ``--rank-fraction``, basis calibrated on training text
and stored with the checkpoint) and Sift (``--sift-warmup`` full-attention decode steps, then
re-measured every ``--sift-refit-every``) at each of ``--budgets``; then QuantSpec's acceptance
rate, tokens per target pass and bytes per accepted token on the same prompts. Printed as a
table; quality against bytes read is plotted to ``--results``/sparse_attention.png
(matplotlib) and the rows written to sparse_attention.csv.

Checks: Loki at 25% budget and 25% rank within 5% of full attention's perplexity, and
QuantSpec's tokens equal greedy decoding. Exit status 0 iff both are met.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from common.mpi import cores_available
from llm import checkpoint
from llm import evaluate as ev
from llm.data import heldout
from llm.data.batches import encode_stream
from llm.data.tokenizers import load_tokenizer, spec_of_checkpoint
from llm.decode.loki import basis_path, calibration_batch, load_or_calibrate
from llm.decode.sparse_attention import SIFT_REFIT_EVERY, SIFT_WARMUP, make_method
from llm.hf import llama as hf
from llm.model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = {"layers": 6, "d_model": 384, "heads": 6, "d_ff": 1536, "seq_len": 512,
            "steps": 450, "batch_size": 4, "warmup": 20, "eval_batches": 4, "tokens": 2048,
            "prompts": 4, "new_tokens": 64, "fp_buffer": 128}
QUICK = {"layers": 2, "d_model": 32, "heads": 2, "d_ff": 64, "seq_len": 64, "steps": 4,
         "batch_size": 4, "warmup": 1, "eval_batches": 1, "tokens": 192, "prompts": 2,
         "new_tokens": 12, "fp_buffer": 16}
HELP = {"layers": "GPT layers", "d_model": "residual width", "heads": "attention heads",
        "d_ff": "SwiGLU hidden width", "seq_len": "context (max_seq_len) and training length",
        "steps": "training steps", "batch_size": "training sequences per step, and "
        "perplexity windows decoded together", "warmup": "learning-rate warmup steps",
        "eval_batches": "llm.train's held-out batches", "tokens": "held-out tokens for "
        "perplexity", "prompts": "agreement prompts (QuantSpec's too)", "new_tokens":
        "greedy tokens per prompt", "fp_buffer": "QuantSpec's full-precision recent tokens"}
METHODS = ("topk", "loki", "sift")
LOKI_CHECK = (0.25, 0.25, 5.0)  # budget, rank fraction, max perplexity increase (%)


def build_hf_dir(directory: Path, config: GPTConfig, seed: int) -> None:
    """``config.json`` and ``model.safetensors`` of ``GPT(config, seed=seed)``'s initial
    weights: what ``llm.train --init`` reads for sizes no preset has."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    weights = {hf.to_hf_name(n): t.contiguous() for n, t in GPT(config, seed=seed)
               .state_dict().items()}
    save_file(weights, str(directory / hf.WEIGHTS_FILE), metadata={"format": "pt"})
    (directory / hf.CONFIG_FILE).write_text(json.dumps(hf.config_to_hf(config), indent=2))


def train(args: argparse.Namespace, root: Path) -> Path:
    """``python -m llm.train --init`` in a subprocess; the checkpoint directory."""
    config = GPTConfig(vocab_size=256, num_layers=args.layers, num_heads=args.heads,
                       d_model=args.d_model, d_ff=args.d_ff, max_seq_len=args.seq_len)
    build_hf_dir(root / "init", config, args.seed)
    out = root / "checkpoint"
    cmd = [sys.executable, "-m", "llm.train", "--init", str(root / "init"),
           "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
           "--steps", str(args.steps), "--lr", str(args.lr), "--warmup", str(args.warmup),
           "--eval-every", "0", "--eval-batches", str(args.eval_batches),
           "--log-every", str(max(1, args.steps // 5)), "--seed", str(args.seed),
           "--threads", str(args.threads), "--checkpoint-dir", str(out)]
    print(f"training GPT {config.num_params():,} parameters ({args.layers} layers, d_model "
          f"{args.d_model}, {args.heads} heads of {config.head_dim}, d_ff {args.d_ff}, context "
          f"{args.seq_len}), bytes, built-in corpus: {args.steps} steps of {args.batch_size} x "
          f"{args.seq_len} tokens\n  python {' '.join(cmd[1:])}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    start = time.perf_counter()
    code = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    if code != 0:
        raise SystemExit(f"python -m llm.train failed (exit status {code}); no results")
    print(f"trained in {time.perf_counter() - start:.0f} s", flush=True)
    return out


def evaluate(args: argparse.Namespace, ckpt: Path) -> dict[str, Any]:
    """Every row of the table and QuantSpec's counts (module docstring)."""
    model, meta = checkpoint.load_model(ckpt)
    c = model.config
    tokenizer = load_tokenizer(spec_of_checkpoint(meta), vocab_size=c.vocab_size)
    held, train_docs, where = heldout.held_out_split(meta)
    stream = encode_stream(held, tokenizer)  # [S]
    tokens = stream[: args.tokens]
    prompt_len = c.max_seq_len - args.new_tokens
    prompts = heldout.prompts_from(stream, args.prompts, prompt_len)  # [K, P]
    print(f"\nheld-out text: {where}; perplexity over {tokens.numel():,} tokens teacher-forced "
          f"through the decode path; agreement: {args.prompts} prompts of {prompt_len} tokens +"
          f" {args.new_tokens} greedy tokens", flush=True)
    start = time.perf_counter()
    calib = calibration_batch(train_docs, tokenizer, c.max_seq_len, args.calibration_tokens)
    path = basis_path(ckpt, meta["step"])
    basis, fresh = load_or_calibrate(model, path, calib)
    how = f"calibrated on {calib.numel():,} training tokens, saved to" if fresh else "read from"
    print(f"Loki basis {how} {path}: explained variance at rank "
          f"{basis.rank(args.rank_fraction)}/{c.head_dim}: "
          f"{100 * basis.explained_variance(args.rank_fraction):.1f}%", flush=True)
    sift = {"warmup": args.sift_warmup, "refit_every": args.sift_refit_every or None}
    every = f"every {args.sift_refit_every} steps" if sift["refit_every"] else "never"
    print(f"Sift: {args.sift_warmup} full-attention warm-up decode steps, then the quantile "
          f"re-measured {every}\n", flush=True)
    reference = model.generate(prompts, args.new_tokens)  # exact attention's greedy tokens
    print(ev.format_table([]), flush=True)
    rows: list[dict[str, Any]] = []
    for name, budget in [("full", None)] + [(m, b) for b in args.budgets for m in METHODS]:
        method = make_method(name, budget=budget or 1.0, rank_fraction=args.rank_fraction,
                             basis=basis, **sift)
        row = ev.evaluate_method(model, method, tokens, prompts, args.new_tokens, reference,
                                 batch_size=args.batch_size)
        row.update(name=name, budget=budget, rank=args.rank_fraction if name == "loki" else None,
                   increase=100 * (row["perplexity"] / rows[0]["perplexity"] - 1) if rows
                   else 0.0)
        rows.append(row)
        print(ev.format_table([row]).splitlines()[1], flush=True)
    quantspec = ev.quantspec_run(model, prompts, args.new_tokens, reference, gamma=args.gamma,
                                 fp_buffer=args.fp_buffer)
    return {"rows": rows, "quantspec": quantspec, "held_out": where, "step": meta["step"],
            "sift": sift, "explained_variance": basis.explained_variance(args.rank_fraction),
            "eval_s": time.perf_counter() - start}


def save_results(rows: list[dict[str, Any]], directory: Path) -> str:
    """sparse_attention.csv, and sparse_attention.png if matplotlib is installed; what was
    written."""
    directory.mkdir(parents=True, exist_ok=True)
    keys = ["name", "budget", "rank", "perplexity", "increase", "token_agreement", "exact",
            "num_prompts", "kept_fraction", "kv_bytes_per_token", "full_kv_bytes_per_token",
            "bytes_ratio"]
    with open(directory / "sparse_attention.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    try:
        import matplotlib
    except ImportError:
        return f"{directory / 'sparse_attention.csv'} (matplotlib is not installed: no plot)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, marker in zip(METHODS, "osD"):
        sel = [r for r in rows if r["name"] == name]
        for ax, key, scale in ((ax1, "increase", 1), (ax2, "token_agreement", 100)):
            ax.plot([r["bytes_ratio"] for r in sel], [scale * r[key] for r in sel],
                    marker=marker, label=name)
            for r in sel:
                ax.annotate(f"{100 * r['budget']:g}%", (r["bytes_ratio"], scale * r[key]),
                            fontsize=7, textcoords="offset points", xytext=(3, 3))
    ax1.axhline(0, color="k", lw=0.8, label="full attention")
    ax2.scatter([1.0], [100 * rows[0]["token_agreement"]], color="k", label="full attention")
    ax1.set(xlabel="KV bytes read per token / full attention's",
            ylabel="perplexity increase over full attention (%)", title="held-out perplexity")
    ax2.set(xlabel="KV bytes read per token / full attention's",
            ylabel="greedy tokens equal to full attention's (%)", title="greedy agreement")
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(directory / "sparse_attention.png", dpi=120)
    plt.close(fig)
    return f"{directory / 'sparse_attention.png'} and {directory / 'sparse_attention.csv'}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke sizes: "
                   + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    for key, value in DEFAULTS.items():  # None: the default, or --quick's
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None,
                       help=f"{HELP[key]} (default {value}; --quick: {QUICK[key]})")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads, training and "
                   "evaluation (default: the cores this process may run on; 1 on a busy "
                   "machine)")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25, 0.125],
                   help="kept fractions of the context (default: %(default)s)")
    p.add_argument("--rank-fraction", type=float, default=0.25, help="Loki's d / Dh")
    p.add_argument("--calibration-tokens", type=int, default=8192,
                   help="training tokens for Loki's PCA (default: %(default)s)")
    p.add_argument("--sift-warmup", type=int, default=SIFT_WARMUP,
                   help="Sift's full-attention decode steps before the first power-law fit "
                   "(default: %(default)s)")
    p.add_argument("--sift-refit-every", type=int, default=SIFT_REFIT_EVERY,
                   help="Sift's decode steps between later measurements, 0: never "
                   "(default: %(default)s)")
    p.add_argument("--gamma", type=int, default=4, help="QuantSpec drafts per target pass")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="evaluate this checkpoint instead of training one")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="keep the initial weights and the checkpoint here (default: a "
                   "temporary directory)")
    p.add_argument("--results", default=str(ROOT / "bench" / "results"), metavar="DIR",
                   help="where the plot and CSV go (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not all(0 < b <= 1 for b in args.budgets):
        p.error(f"--budgets are fractions in (0, 1], got {args.budgets}")
    if not 2 <= args.new_tokens < args.seq_len:
        p.error(f"--new-tokens must be in [2, --seq-len={args.seq_len})")
    if args.sift_warmup < 2 or args.sift_refit_every < 0:
        p.error(f"need --sift-warmup >= 2 and --sift-refit-every >= 0, got {args.sift_warmup} "
                f"and {args.sift_refit_every}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.threads = args.threads or cores_available()
    torch.set_num_threads(args.threads)
    wall = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.checkpoint) if args.checkpoint else train(args, Path(args.out or tmp))
        result = evaluate(args, ckpt)
    rows, q = result["rows"], result["quantspec"]
    print(f"QuantSpec (gamma {q['gamma']}, fp buffer {q['fp_buffer']}, int4 weights): "
          f"acceptance {100 * q['acceptance_rate']:.1f}%, {q['tokens_per_target_pass']:.2f} "
          f"tokens per target pass, {q['bytes_per_accepted_token']:,.0f} bytes read per "
          f"accepted token, weights included (plain greedy: {q['baseline_bytes_per_token']:,.0f}"
          f"), tokens equal to greedy: {q['equal_to_greedy']}/{q['num_prompts']}; "
          f"{q['ms_per_token']:.2f} ms per token (the full row's ms/token is plain greedy's)")
    print(f"saved {save_results(rows, Path(args.results))}")
    budget, rank, limit = LOKI_CHECK
    loki = [r for r in rows if r["name"] == "loki" and r["budget"] == budget]
    checks = {f"Loki at {100 * budget:g}% budget and {100 * rank:g}% rank within {limit:g}% of "
              f"full-attention perplexity": bool(loki) and args.rank_fraction == rank
              and loki[0]["increase"] <= limit,
              "QuantSpec tokens equal greedy decoding": q["equal_to_greedy"] == q["num_prompts"]}
    print("\n" + "\n".join(f"{'met' if ok else 'NOT met':>8}  {name}"
                           for name, ok in checks.items()))
    print(f"wall time {time.perf_counter() - wall:.0f} s (evaluation {result['eval_s']:.0f} s)")
    if args.json:
        print(json.dumps({**result, "checks": checks}))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
