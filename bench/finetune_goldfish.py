"""Fine-tuning a Hugging Face Llama with and without the goldfish loss, and KV-cache decoding.

    python bench/finetune_goldfish.py                # 3.7M parameters: minutes on 2 cores
    python bench/finetune_goldfish.py --out runs/finetune --json  # keep the files; JSON too

A random ``LlamaForCausalLM`` (transformers; ``--layers`` x ``--hidden``, vocabulary = the
tokenizer's) is saved with ``save_pretrained`` into a temporary directory, together with a
byte-level BPE ``tokenizer.json`` (``--vocab`` ids, ``<|endoftext|>``) trained there with the
``tokenizers`` package on the built-in corpus (pydoc topics). It is then fine-tuned twice by
``python -m llm.train --init HF_DIR`` (run in this process, one rank; the tokenizer is the
directory's tokenizer.json, as for any HF model) on the first ``--docs`` documents, each
tokenised and cut to ``--seq-len`` + 1 tokens, for ``--epochs`` epochs from the same seed:
standard loss, and ``--goldfish-k 4`` (the paper's hash, h = 13). Each checkpoint is reloaded
as a plain GPT and asked to recite the last ``--suffix-len`` tokens of every document
greedily, the documents tokenised as training saw them (what ``python -m llm.memorization
--checkpoint DIR`` does).

Printed: exact match, ROUGE-L, final training loss (all tokens) and validation loss (held-out
documents) of both runs; the checks standard exact match >= 80% and goldfish <= 5%; then the
KV cache: the fine-tuned standard model continues the first ``--prompt-len`` tokens of
``--kv-docs`` documents by ``--new-tokens`` (256) greedy tokens with ``use_cache=True`` and
``use_cache=False`` (:meth:`llm.model.GPT.generate`), timed alternately, median of
``--repeats``; the speed-up and whether the tokens are identical (also a check). The model's
context (``max_position_embeddings``) covers prompt + new tokens and ``--seq-len``, so no
decoding step slides the window. Exit status 0 iff every check is met.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from common.mpi import cores_available
from llm import checkpoint
from llm import memorization as mem
from llm.data.batches import load_documents
from llm.data.tokenizers import load_tokenizer, spec_of_checkpoint
from llm.train import main as train_main


def build_hf_dir(directory: Path, args: argparse.Namespace) -> int:
    """A BPE tokenizer.json and a random LlamaForCausalLM of its vocabulary in ``directory``;
    returns the number of parameters."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(load_documents("pydoc"), trainers.BpeTrainer(
        vocab_size=args.vocab, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(str(directory / "tokenizer.json"))
    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(
        vocab_size=bpe.get_vocab_size(), hidden_size=args.hidden,
        intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=max(args.seq_len, args.prompt_len + args.new_tokens),
        tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def fine_tune(hf_dir: Path, out: Path, args: argparse.Namespace, goldfish_k: int) -> dict:
    """``python -m llm.train --init hf_dir`` in this process; the memorization of the result."""
    name = f"goldfish k={goldfish_k}" if goldfish_k else "standard"
    metrics = out.with_suffix(".jsonl")
    steps = math.ceil(args.epochs * math.ceil(args.docs / args.batch_size))
    argv = ["--init", str(hf_dir), "--docs", str(args.docs), "--seq-len", str(args.seq_len),
            "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
            "--lr", str(args.lr), "--warmup", str(args.warmup),
            "--weight-decay", str(args.weight_decay), "--goldfish-k", str(goldfish_k),
            "--eval-batches", str(args.eval_batches), "--seed", str(args.seed),
            "--threads", str(args.threads), "--log-every", str(max(1, steps // 4)),
            "--checkpoint-dir", str(out), "--metrics", str(metrics)]
    print(f"\n[{name}] python -m llm.train {' '.join(argv)}", flush=True)
    start = time.perf_counter()
    preemption = (signal.SIGTERM, signal.SIGUSR1)
    handlers = {sig: signal.getsignal(sig) for sig in preemption}
    try:
        code = train_main(argv)
    finally:  # llm.train turns these into "checkpoint and stop"; the bench stops on them
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    seconds = time.perf_counter() - start
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    last = [r for r in rows if "step" in r][-1]
    if code != 0 or last.get("preempted"):
        raise SystemExit(f"the {name} run did not finish (exit status {code}, step "
                         f"{last['step']}); no results")
    # what python -m llm.memorization --checkpoint OUT does: the run's documents and tokenizer
    model, meta = checkpoint.load_model(out)
    tokenizer = load_tokenizer(spec_of_checkpoint(meta), vocab_size=model.config.vocab_size)
    docs, _, _ = mem.documents(mem.parse_args(["--checkpoint", str(out)]), meta, tokenizer)
    result = mem.memorization(model, docs, args.suffix_len)
    return {"name": name, "model": model, "exact_match": result["exact_match"],
            "exact": sum(result["exact"]), "rouge_l": result["rouge_l"],
            "train_loss": last["loss_all"], "val_loss": last.get("val_loss"),
            "steps": last["step"], "train_s": seconds,
            "tokenizer": tokenizer.name}


def kv_speedup(model: torch.nn.Module, hf_dir: Path, args: argparse.Namespace) -> dict:
    """Greedy ``--new-tokens`` after ``--prompt-len`` tokens of the first ``--kv-docs``
    documents, with and without the KV cache (alternately, median of ``--repeats``)."""
    tokenizer = load_tokenizer(hf_dir)
    docs = [tokenizer.encode(doc) for doc in load_documents()[: args.kv_docs]]
    if min(len(d) for d in docs) < args.prompt_len:
        raise ValueError(f"a document is shorter than --prompt-len {args.prompt_len}")
    prompt = torch.stack([d[: args.prompt_len] for d in docs])  # [B, P]
    times: dict[bool, list[float]] = {True: [], False: []}
    outs: dict[bool, torch.Tensor] = {}
    for _ in range(args.repeats):
        for use_cache in (False, True):
            start = time.perf_counter()
            outs[use_cache] = model.generate(prompt, args.new_tokens, use_cache=use_cache)
            times[use_cache].append(time.perf_counter() - start)
    no_cache, cache = statistics.median(times[False]), statistics.median(times[True])
    return {"batch": len(docs), "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "no_cache_s": no_cache, "cache_s": cache, "speedup": no_cache / cache,
            "identical": bool(torch.equal(outs[True], outs[False]))}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary (model's too)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=688, help="intermediate_size")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--docs", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--suffix-len", type=int, default=50, help="S (the paper's 50)")
    p.add_argument("--epochs", type=float, default=50)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--goldfish-k", type=int, default=4, help="the goldfish run's k (h = 13, "
                   "hash)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64, help="KV cache: prompt tokens")
    p.add_argument("--new-tokens", type=int, default=256, help="KV cache: greedy tokens")
    p.add_argument("--kv-docs", type=int, default=1, help="KV cache: batch of documents")
    p.add_argument("--repeats", type=int, default=3, help="KV cache: timings per mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: the cores this process may run on)")
    p.add_argument("--out", default=None, help="keep the HF directory and both checkpoints "
                   "under this directory")
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = p.parse_args(argv)
    if args.goldfish_k < 1:
        p.error(f"--goldfish-k must be >= 1 (the standard run is the other one), got "
                f"{args.goldfish_k}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.threads = args.threads or cores_available()
    torch.set_num_threads(args.threads)
    wall = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        hf_dir = root / "llama"
        hf_dir.mkdir(parents=True, exist_ok=True)
        num_params = build_hf_dir(hf_dir, args)
        print(f"fine-tune goldfish: random LlamaForCausalLM ({num_params:,} parameters, "
              f"{args.layers} layers, hidden {args.hidden}) + BPE tokenizer.json "
              f"({args.vocab} ids) in {hf_dir}; first {args.docs} pydoc documents x "
              f"{args.seq_len + 1} tokens, {args.epochs:g} epochs of batch {args.batch_size}, "
              f"{args.suffix_len}-token suffixes; {args.threads} thread(s)", flush=True)
        rows = [fine_tune(hf_dir, root / "standard", args, 0),
                fine_tune(hf_dir, root / "goldfish", args, args.goldfish_k)]
        kv = kv_speedup(rows[0]["model"], hf_dir, args)
    std, gf = rows
    print(f"\n{'':22}{std['name']:>16}{gf['name'] + ' h=13 hash':>26}")
    for label, fmt in (("exact match", lambda r: f"{r['exact']}/{args.docs} = "
                                                 f"{100 * r['exact_match']:.1f}%"),
                       ("ROUGE-L", lambda r: f"{r['rouge_l']:.3f}"),
                       ("train loss (all)", lambda r: f"{r['train_loss']:.4f}"),
                       ("validation loss", lambda r: f"{r['val_loss']:.4f}"),
                       ("steps, train time", lambda r: f"{r['steps']}, {r['train_s']:.0f} s")):
        print(f"{label:22}{fmt(std):>16}{fmt(gf):>26}")
    print(f"(uniform guess: ln {args.vocab} = {math.log(args.vocab):.3f})")
    print(f"\nKV cache, batch {kv['batch']}, {kv['prompt_len']}-token prompt + "
          f"{kv['new_tokens']} greedy tokens: no cache {kv['no_cache_s']:.2f} s, cache "
          f"{kv['cache_s']:.2f} s, speed-up {kv['speedup']:.1f}x, identical tokens: "
          f"{kv['identical']}")
    checks = {"standard exact match >= 80%": std["exact_match"] >= 0.8,
              "goldfish exact match <= 5%": gf["exact_match"] <= 0.05,
              "KV cache gives the no-cache tokens": kv["identical"]}
    print("\n" + "\n".join(f"{'met' if ok else 'NOT met':>8}  {name}"
                           for name, ok in checks.items()))
    print(f"wall time {time.perf_counter() - wall:.0f} s")
    if args.json:
        print(json.dumps({"params": num_params, "rows": [{k: v for k, v in r.items()
                                                          if k != "model"} for r in rows],
                          "kv_cache": kv, "checks": checks}))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
