"""The goldfish paper's memorization test, small: standard loss against goldfish, one run.

    python bench/memorization.py                     # tiny preset, 32 documents, minutes
    python bench/memorization.py --epochs 400 --goldfish-k 4 --goldfish-h 13 --json

Both models train on the first ``--docs`` documents of the built-in corpus (pydoc topics),
each truncated to ``--seq-len`` + 1 tokens, for ``--epochs`` epochs, from the same seed with
the same settings; the only difference is the goldfish mask. Each is saved to a checkpoint and
reloaded as a plain GPT, then asked to recite the last ``--suffix-len`` tokens of every
document from the rest (greedy). Validation loss is on held-out documents (all tokens).
Printed side by side: exact-match rate, ROUGE-L, final training loss, validation loss, and the
checks: standard exact match >= 80%, goldfish <= 5%, goldfish validation loss within 10% of the
standard run's. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from common.grid import ProcessGrid
from common.parallel import ParallelState
from common.run import CheckpointConfig
from llm import checkpoint
from llm.config import STRATEGIES, DataConfig, GoldfishConfig, OptimConfig, RunConfig
from llm.data.batches import decode, load_documents, truncate_docs
from llm.memorization import memorization
from llm.model import PRESETS, get_preset
from llm.parallel.gpt import AXIS_SETS
from llm.trainer import Trainer, run


def train_and_test(args: argparse.Namespace, goldfish: GoldfishConfig, out: Path) -> dict:
    data = DataConfig(docs=args.docs, seq_len=args.seq_len, batch_size=args.batch_size,
                      eval_batches=args.eval_batches, seed=args.seed)
    optim = OptimConfig(lr=args.lr, warmup_steps=args.warmup, weight_decay=args.weight_decay)
    parallel = ParallelState.single(ProcessGrid.axonn(1, 1, 1, 1), AXIS_SETS)  # one process
    trainer = Trainer(get_preset(args.preset), data, optim, goldfish,
                      RunConfig(epochs=args.epochs), parallel, seed=args.seed)
    name = f"goldfish k={goldfish.k}" if goldfish.k else "standard"

    def progress(row: dict) -> None:
        if row["step"] % max(1, trainer.total_steps // 5) == 0:
            print(f"  [{name}] step {row['step']}/{trainer.total_steps} loss {row['loss']:.4f}"
                  f" (all tokens {row['loss_all']:.4f})", flush=True)

    start = time.perf_counter()
    history = run(trainer, checkpoint=CheckpointConfig(dir=str(out)), on_row=progress)
    seconds = time.perf_counter() - start
    model, _ = checkpoint.load_model(out)
    docs = truncate_docs(load_documents(), args.docs, args.seq_len)
    result = memorization(model, docs, args.suffix_len)
    recited = [decode(docs[i][-args.suffix_len :]) for i, hit in enumerate(result["exact"])
               if hit]
    return {"name": name, "exact_match": result["exact_match"], "exact": sum(result["exact"]),
            "recited": recited,
            "rouge_l": result["rouge_l"], "train_loss": history[-1]["loss_all"],
            "val_loss": history[-1]["val_loss"], "steps": trainer.step, "train_s": seconds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--docs", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--epochs", type=float, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--goldfish-k", type=int, default=4)
    p.add_argument("--goldfish-h", type=int, default=13)
    p.add_argument("--goldfish-strategy", choices=STRATEGIES, default="hash")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--out", default=None, help="keep the two checkpoints under this directory")
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = get_preset(args.preset)
    print(f"memorization: GPT {args.preset} ({config.num_params():,} parameters), first "
          f"{args.docs} pydoc documents x {args.seq_len + 1} tokens, {args.epochs:g} epochs of "
          f"batch {args.batch_size}, {args.suffix_len}-token suffixes", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        rows = [train_and_test(args, GoldfishConfig(), root / "standard"),
                train_and_test(args, GoldfishConfig(k=args.goldfish_k, h=args.goldfish_h,
                                                    strategy=args.goldfish_strategy),
                               root / "goldfish")]
    std, gf = rows
    gf["name"] += f" h={args.goldfish_h} {args.goldfish_strategy}"
    print(f"\n{'':22}{std['name']:>16}{gf['name']:>28}")
    for label, fmt in (("exact match", lambda r: f"{r['exact']}/{args.docs} = "
                                                 f"{100 * r['exact_match']:.1f}%"),
                       ("ROUGE-L", lambda r: f"{r['rouge_l']:.3f}"),
                       ("train loss (all)", lambda r: f"{r['train_loss']:.4f}"),
                       ("validation loss", lambda r: f"{r['val_loss']:.4f}"),
                       ("val loss / standard", lambda r: f"{r['val_loss'] / std['val_loss']:.3f}"),
                       ("steps, train time", lambda r: f"{r['steps']}, {r['train_s']:.0f} s")):
        print(f"{label:22}{fmt(std):>16}{fmt(gf):>28}")
    checks = {"standard exact match >= 80%": std["exact_match"] >= 0.8,
              "goldfish exact match <= 5%": gf["exact_match"] <= 0.05,
              "goldfish validation loss within 10% of standard":
                  abs(gf["val_loss"] / std["val_loss"] - 1) <= 0.10}
    print(f"(validation loss of a uniform guess: ln {config.vocab_size} = "
          f"{math.log(config.vocab_size):.3f})")
    if gf["recited"]:
        print(f"suffixes the goldfish model recites: {gf['recited'][:5]}")
    print("\n" + "\n".join(f"{'PASS' if ok else 'FAIL'}  {name}" for name, ok in checks.items()))
    if args.json:
        print(json.dumps({"rows": rows, "checks": checks}))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
