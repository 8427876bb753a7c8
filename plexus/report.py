"""What ``python -m plexus.train`` reports: the set-up (block balance, memory per rank), each
run's summary (times, communication, accuracies, the OGB Evaluator's) and, over several runs,
the mean and deviation OGB reports. Rank 0 prints; the summaries also go to ``--metrics``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from common.dist import DistContext
from common.exchange import max_over_ranks
from common.grid import ProcessGrid
from common.memory import describe_peaks, peaks, peaks_per_rank_max, resident_bytes
from common.run import steady_mean
from plexus import layout
from plexus.data import ShardSource
from plexus.trainer import Trainer, TrainResult, best_state_missing, split_predictions


def runs_summary(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and standard deviation over runs of the test accuracy at the best validation epoch
    and at the last epoch (OGB's report)."""
    out: dict[str, Any] = {"runs": len(summaries)}
    lines = [f"{len(summaries)} runs:"]
    for key, label, pick in (("best_val", "at best val", lambda s: s["best_val"]),
                             ("final", "final", lambda s: s["final"])):
        for split in ("val_acc", "test_acc"):
            vals = np.array([pick(s)[split] for s in summaries], dtype=float)
            out[f"{key}.{split}"] = {"mean": float(vals.mean()), "std": float(vals.std())}
        test = out[f"{key}.test_acc"]
        val = out[f"{key}.val_acc"]
        lines.append(f"  {label:<12} val {100 * val['mean']:.2f} +- {100 * val['std']:.2f}%  "
                     f"test {100 * test['mean']:.2f} +- {100 * test['std']:.2f}%")
    out["text"] = "\n".join(lines)
    return out


def log_setup(trainer: Trainer, ctx: DistContext, start_bytes: int = 0) -> None:
    """Block balance per adjacency layout, loading time and per-rank memory (max over ranks,
    collective; into ``trainer.info["memory_per_rank_max"]``).

    Adjacency bytes count every distinct index/value array once (layers may share a block),
    whether held in memory or memory-mapped from a prepared dataset. ``start_bytes``: this
    rank's resident size before it loaded anything (interpreter, torch, MPI), kept as
    ``resident_bytes_at_start`` so that a bench can set a peak against the planner's bytes,
    which leave the process itself out.
    """
    shard, model, source, info = trainer.shard, trainer.model, trainer.source, trainer.info
    other = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    mine = peaks(ctx.device)  # and on a GPU its allocator's peaks
    adj, feats, res, at_start, *high = max_over_ranks(
        [shard.adjacency_bytes(), other, resident_bytes(), start_bytes, *mine.values()],
        ctx.device, ctx.transport)
    after = {f"{k}_after_setup": int(v) for k, v in zip(mine, high)}
    info["memory_per_rank_max"] = {
        "adjacency_bytes": int(adj), "adjacency_storage": source.storage,
        "features_weights_bytes": int(feats), "resident_bytes_after_setup": int(res),
        "resident_bytes_at_start": int(at_start), **after}
    if not ctx.is_main:
        return
    print(f"graph {source.name}: {source.num_nodes:,} nodes, {source.num_edges:,} edges, "
          f"{source.num_features} features, {source.num_classes} classes; grid "
          f"{trainer.parallel.grid} ({ctx.world_size} ranks, {ctx.launcher}, "
          f"{ctx.comm_label})", flush=True)
    for lay, blk in sorted(shard.adj.items()):
        o, i, p = layout.roles(lay)
        print(f"  adjacency layout {lay} (O,I,P)=({o},{i},{p}): max/mean nonzeros per "
              f"block {blk.balance.max_nnz:,}/{blk.balance.mean_nnz:,.0f} = "
              f"{blk.balance.ratio:.3f}", flush=True)
    if any(model.weight_first):  # the layers that multiply first (--weight-first)
        print("  multiply first, A (F W): layer " + ", ".join(
            str(layer) for layer, first in enumerate(model.weight_first) if first)
            + ("; the others aggregate first, (A F) W" if not all(model.weight_first)
               else ""), flush=True)
    mib = 2.0**20
    gpu = ""
    if "gpu_peak_allocated_bytes_after_setup" in after:
        gpu = (f"; GPU peak {after['gpu_peak_allocated_bytes_after_setup'] / mib:.1f} MiB "
               f"allocated, {after['gpu_peak_reserved_bytes_after_setup'] / mib:.1f} MiB "
               "reserved")
    storage = source.storage if ctx.device.type == "cpu" else f"on {ctx.device}"
    print(f"  setup {info['setup_s']:.2f} s; per rank (max): adjacency {adj / mib:.1f} MiB "
          f"({storage}), features and weights {feats / mib:.1f} MiB, resident "
          f"{res / mib:.1f} MiB (peak {after['peak_bytes_after_setup'] / mib:.1f} MiB){gpu}",
          flush=True)


def run_summary(result: TrainResult, source: ShardSource, grid: ProcessGrid, ctx: DistContext
             ) -> dict[str, Any]:
    hist = result.history
    best = result.info.get("best") or {}
    epoch_s, comm_s = steady_mean(hist, "epoch_s"), steady_mean(hist, "comm_s")
    exposed_s = steady_mean(hist, "comm_exposed_s")
    cfg = result.info["config"]
    out = {
        "dataset": source.name, "num_nodes": source.num_nodes, "num_edges": source.num_edges,
        "grid": str(grid), "world_size": ctx.world_size, "launcher": ctx.launcher,
        "device": str(ctx.device), "config": cfg,
        "setup_s": result.info["setup_s"],
        "epoch_s_mean": epoch_s, "comm_s_mean": comm_s,
        "comm_share": comm_s / epoch_s if epoch_s else 0.0,
        "comm_exposed_s_mean": exposed_s,
        "comm_exposed_share": exposed_s / epoch_s if epoch_s else 0.0,
        "comm_bytes_per_epoch": hist[-1]["comm_bytes"] if hist else 0,
        "memory_per_rank_max": {**result.info.get("memory_per_rank_max", {}),
                                **peaks_per_rank_max(ctx.device, ctx.transport)},
        "final": {k: hist[-1].get(k) for k in ("loss", "train_acc", "val_acc", "test_acc")}
        if hist else {},  # accuracies None only if a resumed run's last epoch was not evaluated
        "best_val": {"epoch": best.get("epoch"), "val_acc": best.get("val_acc"),
                     "test_acc": best.get("test_acc"),  # among the evaluated epochs
                     "evaluated_epochs": sum("val_acc" in r for r in hist),
                     "eval_every": cfg["run"]["eval_every"]},
    }
    if source.name.startswith("ogbn-") and hist:
        # the same on every rank (the best epoch is chosen from all-reduced accuracies), so
        # every rank runs the same collective passes
        missing = best_state_missing(result)
        if missing is not None:  # the final weights' numbers must not pass for the best's
            out["ogb_evaluator_best_val_unavailable"] = missing
        wanted = [("ogb_evaluator", False)] + [("ogb_evaluator_best_val", True)] * (
            missing is None)
        # both forward passes before the Evaluator is imported: ogb's import (pandas and the
        # rest, a few hundred MiB resident) would add to the second pass's peak
        passes = {key: split_predictions(result, best=at_best)  # collective
                  for key, at_best in wanted}
        if ctx.is_main:
            from plexus.data.ogb import ogb_accuracy

            for key, splits in passes.items():
                out[key] = {s: ogb_accuracy(source.name, y, p)
                            for s, (y, p) in splits.items() if y.numel()}
    return out


def print_summary(s: dict[str, Any]) -> None:
    m, c = s["config"]["model"], s["config"]
    rows = [
        ("dataset", f"{s['dataset']} ({s['num_nodes']:,} nodes, {s['num_edges']:,} edges)"),
        ("grid", f"{s['grid']} on {s['world_size']} ranks ({s['launcher']}, {s['device']})"),
        ("model", f"{m['model']}, {m['num_layers']} layers, hidden {m['hidden']}"
                  + (f" x {m['heads']} heads, attention dropout {m['attention_dropout']}"
                     if m["model"] == "gat" else "") + ", dropout "
                  f"{m['dropout']}, norm {m['norm']}, bias {m['bias']}, residual "
                  f"{m['residual']}, permutation "
                  f"{c['permutation']}, learn features {m['learn_features']}, precision "
                  f"{m.get('precision', 'fp32')}"),
        ("epochs", f"{c['run']['epochs']} (setup {s['setup_s']:.2f} s)"),
        ("peak memory", describe_peaks(s["memory_per_rank_max"])),
        ("epoch time", f"{1000 * s['epoch_s_mean']:.1f} ms, communication "
                       f"{100 * s['comm_share']:.1f}% (exposed: the compute waited "
                       f"{100 * s['comm_exposed_share']:.1f}%), "
                       f"{s['comm_bytes_per_epoch'] / 2**20:.2f} MiB per rank by the ring "
                       "formula"),
    ]
    if s["final"]:
        f, b = s["final"], s["best_val"]
        acc = (f", train {100 * f['train_acc']:.2f}%, val {100 * f['val_acc']:.2f}%, test "
               f"{100 * f['test_acc']:.2f}%" if f["val_acc"] is not None else " (not evaluated)")
        rows.append(("final", f"loss {f['loss']:.4f}{acc}"))
        if b["epoch"] is not None:
            n, every = b["evaluated_epochs"], b["eval_every"]
            rows.append(("best val", f"epoch {b['epoch']}: val {100 * b['val_acc']:.2f}%, "
                                     f"test {100 * b['test_acc']:.2f}% (over the {n} evaluated "
                                     f"epoch{'s' * (n != 1)}, "
                                     f"{'every epoch' if every == 1 else f'every {every}'})"))
    for key, label in (("ogb_evaluator", "OGB Evaluator"),
                       ("ogb_evaluator_best_val", "  at best val")):
        if key in s:
            rows.append((label, ", ".join(f"{k} {100 * v:.2f}%" for k, v in s[key].items())))
    if "ogb_evaluator_best_val_unavailable" in s:
        rows.append(("  at best val", "not available: "
                     + s["ogb_evaluator_best_val_unavailable"]))
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows), flush=True)
