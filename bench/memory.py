"""Peak resident memory per rank, step by step, next to the planner and the 1/G share.

    python bench/memory.py plexus      # R-MAT (~100M edges), --learn-features, G = 1, 2, 4, 8:
                                       # train 1 epoch, save, resume on another grid, 1 more
    python bench/memory.py ogb         # --dataset ogbn-papers100M on OGB-format files of a
                                       # generated graph (1M nodes, 8M edges, 128 features,
                                       # 172 classes, 1.4% labelled): 1 rank prepares,
                                       # 1 rank reuses, 8 ranks (2x2x2); --model sage
                                       # or gat, --precision bf16
    python bench/memory.py llm         # gpt1b: build on 8 ranks, save, load on 4, generate
    python bench/memory.py plexus --scale 16 --edge-factor 16 --features 32   # a quick run
    python bench/memory.py plexus --device cuda --ranks 1   # GPU peaks beside the RSS ones

Every step runs in fresh ranks under ``mpiexec`` (``python bench/memory.py --worker ...``).
Each rank resets its peak (``common.memory.reset_peak``: Linux's ``clear_refs``) before a step
and reads it after (``VmHWM``), and rank 0 prints the maximum over ranks, so a step's figure is
that step's own peak, including everything the process already held. Resident memory counts
the pages of memory-mapped block files a rank has touched. With ``--device cuda`` (plexus and
ogb; one GPU per rank) each step also reports the CUDA caching allocator's peaks, allocated and
reserved (``common.memory.gpu_peaks``), reset with the resident one; the llm case runs on the
CPU. Results are appended to bench/results/memory.jsonl; with ``--json PATH`` each case's run
(its rows in MiB, with the provenance of bench/provenance.py) is appended to PATH too,
bench/results/memory_per_rank.json being the one bench/plots.py draws.

Checks (issue "Memory per rank at scale"):
  plexus: features and optimizer state per rank fall as 1/G (within 10%); neither the save
          nor the resume's set-up + load exceeds the epoch's peak on the same grid by more
          than 10%.
  ogb:    (freed buffers handed back, as the planner counts live bytes; --retain-freed-memory
          measures the trainer's default heap retention) 1-rank peak <= 4 x the data (not
          for GAT, whose last layer keeps [N, heads, classes] blocks); the
          1-rank peak above the process's start, less a 2,000-node graph's, within 10% of the
          planner's bytes (less that graph's), and the 8 ranks' largest likewise (less the
          2,000-node graph's on 8 ranks); 8-rank peak per rank <= 0.5 x the 1-rank peak;
          features and weights per rank fall as 1/G.
  llm:    every step's peak per rank <= 1.5 x (parameter bytes / ranks) + 0.6 GiB.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.child import env as child_env  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "memory.jsonl"
MIB, GIB = 2.0**20, 2.0**30
PLEXUS_GRIDS = {1: ("1x1x1", "1x1x1"), 2: ("2x1x1", "1x2x1"), 4: ("2x2x1", "1x2x2"),
                8: ("2x2x2", "4x2x1")}  # (train and save, resume on)


# ----------------------------------------------------------------------------- workers


def _phase_peaks(device="cpu"):
    """A recorder of per-step peaks: ``mark(name)`` closes the step since the last mark and
    records ``peak_NAME`` (resident) and, on a CUDA device, ``gpu_peak_allocated_NAME`` and
    ``gpu_peak_reserved_NAME``."""
    from common.memory import peaks as read_peaks
    from common.memory import reset_peaks

    peaks: dict[str, int] = {}

    def mark(name: str | None) -> None:
        if name is not None:
            for key, value in read_peaks(device).items():
                peaks[key.replace("_bytes", "") + f"_{name}"] = value
        reset_peaks(device)

    mark(None)
    return peaks, mark


def _report(ctx, values: dict[str, Any]) -> None:
    """Rank 0 prints the maximum over ranks of every value as one JSON line."""
    from common.exchange import max_over_ranks
    from common.spawn import print_result

    keys = sorted(values)
    got = max_over_ranks([float(values[k]) for k in keys], ctx.device)
    if ctx.is_main:
        print_result(dict(zip(keys, got)))


def worker_plexus(args) -> None:
    """One plexus step series on this rank: ``train`` (setup, one epoch, save) or ``resume``
    (setup, load + one epoch)."""
    import torch

    from common.dist import init_distributed
    from common.grid import ProcessGrid
    from common.run import CheckpointConfig
    from plexus.config import split_config
    from plexus.data import PreparedGraph
    from plexus.trainer import train_gcn

    ctx = init_distributed(device=args.device)
    peaks, mark = _phase_peaks(ctx.device)
    source = PreparedGraph(args.data)
    state = {}
    resume = args.phase == "resume"

    def on_setup(_shard, model, _info):  # after set-up and, resuming, the checkpoint load
        mark("setup_and_load" if resume else "setup")
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        feats = model.features.numel() * model.features.element_size()
        state.update(features_bytes=feats, optimizer_bytes=2 * params,  # Adam: 2 moments
                     features_and_optimizer_bytes=feats + 2 * params)

    result = train_gcn(source, ProcessGrid.parse(args.grid), ctx.rank,
                       **split_config(epochs=2 if resume else 1, hidden=args.hidden,
                                      num_layers=3, learn_features=True, dropout=0.0,
                                      model=args.model),
                       checkpoint=CheckpointConfig(dir=args.checkpoint, resume=resume),
                       on_setup=on_setup, on_epoch=lambda row: mark("epoch"),
                       device=ctx.device, transport=ctx.transport)
    if not resume:
        mark("save")
    assert result.history, "no epoch ran"
    _report(ctx, {**peaks, **state, "loss": result.history[-1]["loss"]})
    del torch


def worker_llm(args) -> None:
    """gpt build + save (``build``) or build + load + generate (``load``) on this rank."""
    import torch

    from common.dist import init_distributed
    from common.grid import AXONN_AXES, ProcessGrid
    from llm import checkpoint
    from llm.model import GPT, PRESETS
    from llm.parallel.gpt import ParallelGPT, make_groups

    ctx = init_distributed(device="cpu")
    peaks, mark = _phase_peaks()
    config = PRESETS[args.preset]()
    groups = make_groups(ProcessGrid.parse(args.grid, AXONN_AXES), ctx.rank, ctx.transport)
    model = ParallelGPT(GPT(config, device="meta"), groups, seed=0)
    opt = torch.optim.AdamW(model.parameters())  # no step taken: no moments to save
    mark("build")
    values: dict[str, Any] = {"param_bytes_per_rank": sum(
        p.numel() * p.element_size() for p in model.parameters())}
    if args.phase == "build":
        checkpoint.save(args.checkpoint, step=0, model=model, optimizer=opt,
                        meta={"model_config": dataclasses.asdict(config), "configs": {}},
                        state={"step": 0}, keep=1)
        mark("save")
    else:
        checkpoint.load_into(checkpoint.open_checkpoint(args.checkpoint), model, opt)
        mark("load")
        out = model.generate_greedy(torch.tensor([[1, 2, 3, 4]]), args.tokens)
        mark("generate")
        values["tokens"] = float(out[0, -1])
    _report(ctx, {**peaks, **values})


# ----------------------------------------------------------------------------- driver


def _launch(ranks: int, worker_args: list[str]) -> dict[str, Any]:
    from common.spawn import run_worker

    return run_worker(Path(__file__).resolve(), ranks, worker_args, cwd=ROOT)


def _record(case: str, rows: list[dict[str, Any]], ok: bool, args) -> None:
    """Append the case's rows to :data:`RESULTS` and, with ``--json PATH``, its run to PATH."""
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "a") as f:
        f.write(json.dumps({"case": case, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                            "ok": ok, "rows": rows}) + "\n")
    if args.json:
        from bench.provenance import append_run, provenance

        device = "cpu" if case == "llm" else args.device
        append_run(args.json, {"bench": "memory", "case": case, "ok": ok, "device": device,
                               "provenance": provenance("memory.py", args.argv, device),
                               "rows": [mib_row(r) for r in rows]})


def _in_bytes(key: str) -> bool:
    """Whether a result column counts bytes: the ``*_bytes*`` ones, every peak, the bound."""
    return "bytes" in key or "peak" in key or key == "bound"


def mib_row(row: dict[str, Any]) -> dict[str, Any]:
    """A result row with every byte count in MiB (one decimal), named ``<name>_mib`` with
    ``_bytes`` dropped from the name: ``peak_bytes`` -> ``peak_mib``, ``peak_epoch`` ->
    ``peak_epoch_mib``, ``param_bytes_per_rank`` -> ``param_per_rank_mib``."""
    return {(k.replace("_bytes", "") + "_mib" if _in_bytes(k) else k):
            (round(v / MIB, 1) if _in_bytes(k) and isinstance(v, (int, float)) else v)
            for k, v in row.items()}


def plexus_case(args) -> bool:
    from common.perf.gcn import GCNWorkload, gcn_memory

    data = Path(args.data or f"data/memory/rmat-{args.scale}-e{args.edge_factor}"
                f"-f{args.features}")
    if not (data / "manifest.json").is_file():
        cmd = [sys.executable, "-m", "plexus.prepare", "--source", "rmat", "--scale",
               str(args.scale), "--edge-factor", str(args.edge_factor), "--features",
               str(args.features), "--blocks", "8", "--out", str(data), "--force"]
        print("$ " + " ".join(cmd), flush=True)
        if subprocess.run(cmd, cwd=ROOT, env=child_env()).returncode:
            sys.exit("preparation failed")
    m = json.loads((data / "manifest.json").read_text())
    work = GCNWorkload(name="rmat", num_nodes=m["num_nodes"], model=args.model,
                       nnz=m["mean"]["nnz"] if args.model == "sage" else m["nnz"],
                       num_features=m["num_features"], num_classes=m["num_classes"],
                       num_layers=3, hidden=args.hidden, learn_features=True,
                       cache_first_aggregation=False)  # the runs: dropout 0
    rows = []
    for g in [int(x) for x in args.ranks.split(",")]:
        train_grid, resume_grid = PLEXUS_GRIDS[g]
        ck = data.parent / f"ck-{g}"
        shutil.rmtree(ck, ignore_errors=True)
        common = ["plexus", "--data", str(data), "--hidden", str(args.hidden),
                  "--model", args.model,
                  "--checkpoint", str(ck), "--device", args.device]
        a = _launch(g, [*common, "--phase", "train", "--grid", train_grid])
        b = _launch(g, [*common, "--phase", "resume", "--grid", resume_grid])
        shape = dict(zip("xyz", (int(v) for v in train_grid.split("x"))))
        rows.append({"ranks": g, "grid": train_grid, "resume_grid": resume_grid,
                     "planner_bytes": gcn_memory(work, shape), **a,
                     **{f"resume_{k}": v for k, v in b.items()}})
        shutil.rmtree(ck, ignore_errors=True)
    base = rows[0]
    print(f"\nplexus {args.model}, {m['num_nodes']:,} nodes, {m['num_edges']:,} edges, "
          f"{m['num_features']} learned features, hidden {args.hidden}, 3 layers; MiB per rank "
          f"(max over ranks)")
    print(f"{'G':>2} {'grid':>6} {'->':>6} {'feat+Adam':>10} {'x G=1':>6} {'1/G':>6} "
          f"{'setup':>7} {'epoch':>7} {'save':>7} {'planner':>8} | {'load':>7} {'epoch':>7} "
          f"{'save/ep':>8} {'load/ep':>8}")
    ok = True
    for r in rows:
        share = r["features_and_optimizer_bytes"] / base["features_and_optimizer_bytes"]
        save = r["peak_save"] / r["peak_epoch"]  # on the training grid
        load = r["resume_peak_setup_and_load"] / r["resume_peak_epoch"]  # on the resume grid
        fine = abs(share * r["ranks"] - 1) <= 0.10 and max(save, load) <= 1.10
        ok &= fine
        print(f"{r['ranks']:>2} {r['grid']:>6} {r['resume_grid']:>6} "
              f"{r['features_and_optimizer_bytes'] / MIB:>10.1f} {share:>6.3f} "
              f"{1 / r['ranks']:>6.3f} {r['peak_setup'] / MIB:>7.0f} "
              f"{r['peak_epoch'] / MIB:>7.0f} {r['peak_save'] / MIB:>7.0f} "
              f"{r['planner_bytes'] / MIB:>8.0f} | {r['resume_peak_setup_and_load'] / MIB:>7.0f} "
              f"{r['resume_peak_epoch'] / MIB:>7.0f} {save:>8.3f} {load:>8.3f}"
              f"{'' if fine else '  NOT met'}")
    print("left of |: the training grid (set-up, one epoch, save); right: the resume grid "
          "(set-up + checkpoint load, one epoch)")
    print("checks: feat+Adam x G=1 within 10% of 1/G; save and load peaks <= 1.10 x the "
          f"epoch's on the same grid: {'met' if ok else 'NOT met'}")
    if "gpu_peak_allocated_epoch" in base:
        print(f"\nGPU peaks, MiB per rank (max), allocated/reserved\n{'G':>2} {'setup':>11} "
              f"{'epoch':>11} {'save':>11} | {'load':>11} {'epoch':>11}")
        for r in rows:
            cells = [_gpu_cell(r, step) for step in ("setup", "epoch", "save")]
            cells += [_gpu_cell(r, step, "resume_") for step in ("setup_and_load", "epoch")]
            print(f"{r['ranks']:>2} {cells[0]:>11} {cells[1]:>11} {cells[2]:>11} | "
                  f"{cells[3]:>11} {cells[4]:>11}")
    _record("plexus", rows, ok, args)
    return ok


def _gpu_cell(row: dict[str, Any], step: str, prefix: str = "") -> str:
    """``allocated/reserved`` MiB of a step's GPU peaks in a result row."""
    return (f"{row[f'{prefix}gpu_peak_allocated_{step}'] / MIB:.0f}/"
            f"{row[f'{prefix}gpu_peak_reserved_{step}'] / MIB:.0f}")


def _train_cli(ranks: int, cli: list[str], metrics: Path) -> tuple[dict[str, Any], float]:
    """``plexus.train`` on ``ranks`` ranks: (its summary, the peak RSS of that child process
    and the processes it waited for, which for one rank is that rank's own, preparation
    included; :func:`bench.child.run`). A child started from this process inherits its peak,
    so this process holds no large data (ogb_case writes the files in a child)."""
    from bench.child import run
    from common.spawn import ranks_command

    cmd = ranks_command(ranks, [sys.executable, "-m", "plexus.train", *cli, "--metrics",
                                str(metrics)])
    print("$ " + " ".join(cmd), flush=True)
    done, _, peak = run(cmd, capture_output=True)
    if done.returncode:
        sys.exit(f"training failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n"
                 f"{done.stderr[-3000:]}")
    summary = [json.loads(x) for x in metrics.read_text().splitlines()][-1]["summary"]
    return summary, peak


# the test suite's writer of OGB-format files, run as a child process (ogb_case)
WRITE_PAPERS = """
import json, sys
from tests.plexus.data.ogb_format import write_papers100m_like
p = json.loads(sys.argv[2])
write_papers100m_like(sys.argv[1], num_nodes=p["nodes"], num_features=p["features"],
                      avg_degree=2 * p["edges"] / p["nodes"], num_classes=p["classes"],
                      labeled_fraction=p["labelled"])
"""


def ogb_case(args) -> bool:
    """``--dataset ogbn-papers100M`` on OGB-format files of a generated graph: the first run
    prepares the cache, the second reuses it; then 8 ranks (2x2x2)."""
    root = Path(args.ogb_root)
    raw = root / "ogbn_papers100M" / "raw" / "data.npz"
    params = {"nodes": args.ogb_nodes, "edges": args.ogb_edges,
              "features": args.ogb_features, "classes": args.ogb_classes,
              "labelled": args.ogb_labelled}
    written = root / "ogbn_papers100M" / "bench-params.json"
    if not raw.is_file() or not written.is_file() or json.loads(written.read_text()) != params:
        print(f"writing OGB-format files of a {args.ogb_nodes:,}-node graph under {root} "
              f"({args.ogb_classes} classes, {100 * args.ogb_labelled:g}% of nodes labelled)",
              flush=True)
        shutil.rmtree(root / "ogbn_papers100M", ignore_errors=True)
        # in a process of its own: a child started from this process takes this process's
        # peak as its own, and the first run's peak is read from its child (_train_cli)
        subprocess.run([sys.executable, "-c", WRITE_PAPERS, str(root), json.dumps(params)],
                       cwd=ROOT, env=child_env(), check=True)
        written.write_text(json.dumps(params))
    shutil.rmtree(root / "prepared", ignore_errors=True)  # the first run must prepare
    from common.memory import GPU_PEAK_KEYS
    from plexus.data.sources import ogb_sizes

    nodes, edges, feats = ogb_sizes(raw.parent)
    data_bytes = nodes * feats * 4 + edges * 16
    cli = ["--dataset", "ogbn-papers100M", "--root", str(root), "--epochs", "1",
           *_model_flags(args), "--device", args.device, *_run_flags(args)]
    rows = []
    for label, ranks, extra in (("1 rank, prepares", 1, []), ("1 rank, reuses", 1, []),
                                ("8 ranks 2x2x2", 8, ["--grid", "2x2x2"])):
        t = time.perf_counter()
        summary, child_peak = _train_cli(ranks, [*cli, *extra], root / "metrics.jsonl")
        mem = summary["memory_per_rank_max"]
        rows.append({"run": label, "ranks": ranks, "wall_s": time.perf_counter() - t,
                     # the first run's child peak includes the preparation
                     "peak_bytes": child_peak if not rows else mem["peak_bytes"],
                     "start_bytes": mem["resident_bytes_at_start"],
                     "features_weights_bytes": mem["features_weights_bytes"],
                     "adjacency_bytes": mem["adjacency_bytes"],
                     "storage": mem.get("adjacency_storage"),
                     "labelled_rows_only": summary["config"]["model"].get("labelled_rows_only"),
                     **{k: mem[k] for k in GPU_PEAK_KEYS if k in mem}})
    work = _papers_workload(root, args)
    for r in rows:
        r["planner_bytes"] = gcn_memory_of(work, "2x2x2" if r["ranks"] == 8 else "1x1x1")
    one, reuse, eight = max(rows[0]["peak_bytes"], rows[1]["peak_bytes"]), rows[1], rows[2]
    split = eight["features_weights_bytes"] / reuse["features_weights_bytes"]
    # the planner counts the training's bytes: set the peak above the process's start against
    # it, less the same for a 2,000-node graph of the same format and model (the runtime's
    # own growth: numba's and torch's pools), whose planner bytes are subtracted likewise
    # (at 8 ranks likewise: each rank's MPI buffers and libraries are in the tiny run too)
    tiny, tiny8, tiny_work = _tiny_papers_run(root, args)
    train_peak = reuse["peak_bytes"] - reuse["start_bytes"] - tiny
    planner = (reuse["planner_bytes"] - gcn_memory_of(tiny_work, "1x1x1")) / train_peak
    planner8 = (eight["planner_bytes"] - gcn_memory_of(tiny_work, "2x2x2")) / (
        eight["peak_bytes"] - eight["start_bytes"] - tiny8)
    # (GAT's last layer keeps [N, K, C] blocks, heads times a GCN's logits: no 4x bound)
    bound = {} if args.model == "gat" else {
        f"1-rank peak <= 4 x data ({one / data_bytes:.2f})": one <= 4 * data_bytes}
    checks = {**bound,
              f"1-rank training peak within 10% of the planner, both less a 2,000-node "
              f"graph's (planner/measured {planner:.2f})": abs(planner - 1) <= 0.10,
              f"8-rank training peak per rank within 10% of the planner, likewise "
              f"(planner/measured {planner8:.2f})": abs(planner8 - 1) <= 0.10,
              # (against the 1-rank run that reuses the prepared files, as the 8 ranks do:
              # the first run's peak includes preparing them)
              f"8-rank peak per rank <= 0.5 x 1-rank, both reusing the prepared files "
              f"({eight['peak_bytes'] / reuse['peak_bytes']:.2f})":
              eight["peak_bytes"] <= 0.5 * reuse["peak_bytes"],
              f"features and weights per rank at 8 ranks x{split:.3f} of 1 rank (1/8 = 0.125)":
              split <= 1.1 / 8}
    ok = all(checks.values())
    labelled = work.labelled_fraction
    print(f"\nogbn-papers100M format: {nodes:,} nodes, {edges:,} edges, {feats} features, "
          f"{args.ogb_classes} classes, {100 * labelled:.2f}% of nodes in a split: "
          f"{data_bytes / MIB:,.0f} MiB of data; {args.model}, hidden {args.hidden}, 3 layers, "
          f"{args.precision}; freed buffers " + ("kept in the heap (the trainer's default)"
                                                  if args.retain_freed_memory else
                                                  "handed back (--no-retain-freed-memory)")
          + ("; H_0 kept for backward (--keep-first-aggregation)"
             if args.keep_first_aggregation else ""))
    gpu = all(k in r for r in rows for k in GPU_PEAK_KEYS)
    print(f"{'run':>18} {'peak MiB':>9} {'x data':>7} {'above start':>12} {'planner':>8} "
          f"{'feat+W MiB':>11} {'adj MiB':>8} {'storage':>14} {'wall s':>7}"
          + (f" {'GPU alloc/resv MiB':>19}" if gpu else ""))
    for r in rows:
        cell = (f" {r['gpu_peak_allocated_bytes'] / MIB:>9.0f}/"
                f"{r['gpu_peak_reserved_bytes'] / MIB:<9.0f}" if gpu else "")
        print(f"{r['run']:>18} {r['peak_bytes'] / MIB:>9.0f} {r['peak_bytes'] / data_bytes:>7.2f} "
              f"{(r['peak_bytes'] - r['start_bytes']) / MIB:>12.0f} "
              f"{r['planner_bytes'] / MIB:>8.0f} "
              f"{r['features_weights_bytes'] / MIB:>11.1f} {r['adjacency_bytes'] / MIB:>8.1f} "
              f"{r['storage']!s:>14} {r['wall_s']:>7.1f}{cell}")
    print("(the first run's peak includes the preparation; 'above start': the peak minus the "
          "rank's resident size before it loaded anything, which the planner leaves out)")
    for name, fine in checks.items():
        print(f"check: {name}: {'met' if fine else 'NOT met'}")
    _record("ogb", rows, ok, args)
    return ok


def _run_flags(args) -> list[str]:
    """plexus.train's flags for the heap and H_0. The ogb case hands freed buffers back (as
    bench/scaling.py's memory check does): the planner counts live bytes, and the trainer's
    default heap retention (common/alloc.py: buffers up to 16 MiB stay in the heap, for
    speed) keeps whatever the heap grew to, more the more ranks cut the buffers below the cap
    (docs/benchmarks.md). ``--retain-freed-memory`` measures the default;
    ``--keep-first-aggregation`` keeps H_0 for backward instead of recomputing it."""
    flags = [] if args.retain_freed_memory else ["--no-retain-freed-memory"]
    return flags + (["--keep-first-aggregation"] if args.keep_first_aggregation else [])


def _model_flags(args) -> list[str]:
    """plexus.train's flags for the model: 3 layers of ``--hidden`` (GAT: ``--heads`` heads of
    ``hidden / heads``, dropout on the coefficients too), in ``--precision``."""
    flags = ["--layers", "3", "--model", args.model, "--precision", args.precision]
    if args.model == "gat":
        return [*flags, "--hidden", str(args.hidden // args.heads), "--heads", str(args.heads),
                "--attention-dropout", str(args.attention_dropout)]
    return [*flags, "--hidden", str(args.hidden)]


def _tiny_papers_run(root: Path, args) -> tuple[int, int, Any]:
    """Peak above start of one rank, and of the 8 ranks' largest (2x2x2), on a 2,000-node
    graph of the same format, classes and model (prepared first, outside the measured
    processes), and its workload."""
    tiny_root = root / "tiny"
    if not (tiny_root / "ogbn_papers100M").is_dir():
        sys.path.insert(0, str(ROOT))  # the test suite's writer of OGB-format files
        from tests.plexus.data.ogb_format import write_papers100m_like

        write_papers100m_like(tiny_root, num_nodes=2000, num_features=args.ogb_features,
                              avg_degree=2 * args.ogb_edges / args.ogb_nodes,
                              num_classes=args.ogb_classes, labeled_fraction=0.5)
    cli = ["--dataset", "ogbn-papers100M", "--root", str(tiny_root), "--epochs", "1",
           *_model_flags(args), "--device", args.device, *_run_flags(args)]
    shutil.rmtree(tiny_root / "prepared", ignore_errors=True)  # (of an older format, maybe)
    _train_cli(1, cli, tiny_root / "metrics.jsonl")  # prepares
    above = []
    for ranks, extra in ((1, []), (8, ["--grid", "2x2x2"])):
        mem = _train_cli(ranks, [*cli, *extra], tiny_root / "metrics.jsonl")[0][
            "memory_per_rank_max"]
        above.append(mem["peak_bytes"] - mem["resident_bytes_at_start"])
    return above[0], above[1], _papers_workload(tiny_root, args)


def _papers_workload(root: Path, args) -> Any:
    """The planner's workload of the prepared cache the runs trained on, as plexus.train
    builds it (plexus.config.gcn_workload: the model's aggregation, split sizes, the CLI's
    defaults such as dropout 0.5)."""
    from plexus.config import ModelConfig, aggregation_of, gcn_workload
    from plexus.data import PreparedGraph

    (manifest,) = (root / "prepared").glob("*/manifest.json")
    gat = {"model": "gat", "hidden": args.hidden // args.heads, "heads": args.heads,
           "attention_dropout": args.attention_dropout} if args.model == "gat" else {}
    model = ModelConfig(**{"model": args.model, "num_layers": 3, "hidden": args.hidden,
                           "precision": args.precision,
                           "recompute_first": not args.keep_first_aggregation, **gat})
    return gcn_workload(model, PreparedGraph(manifest.parent,
                                             aggregation=aggregation_of(args.model)))


def gcn_memory_of(work: Any, grid: str) -> float:
    from common.perf.gat import gat_memory
    from common.perf.gcn import gcn_memory

    shape = dict(zip("xyz", (int(v) for v in grid.split("x"))))
    return gat_memory(work, shape) if work.model == "gat" else gcn_memory(work, shape)


def llm_case(args) -> bool:
    ck = Path(args.checkpoint_dir)
    shutil.rmtree(ck, ignore_errors=True)
    a = _launch(8, ["llm", "--preset", args.preset, "--grid", "data=1,depth=2,row=2,col=2",
                    "--phase", "build", "--checkpoint", str(ck)])
    b = _launch(4, ["llm", "--preset", args.preset, "--grid", "data=1,depth=1,row=2,col=2",
                    "--phase", "load", "--checkpoint", str(ck), "--tokens", str(args.tokens)])
    shutil.rmtree(ck, ignore_errors=True)
    rows, ok = [], True
    print(f"\nllm {args.preset}: MiB per rank (max over ranks)")
    print(f"{'ranks':>5} {'step':>9} {'peak':>8} {'params/rank':>12} {'bound':>8}")
    for ranks, res, steps in ((8, a, ("build", "save")), (4, b, ("build", "load", "generate"))):
        bound = 1.5 * res["param_bytes_per_rank"] + 0.6 * GIB
        for step in steps:
            peak = res[f"peak_{step}"]
            ok &= peak <= bound
            rows.append({"ranks": ranks, "step": step, "peak_bytes": peak, "bound": bound,
                         "param_bytes_per_rank": res["param_bytes_per_rank"]})
            print(f"{ranks:>5} {step:>9} {peak / MIB:>8.0f} "
                  f"{res['param_bytes_per_rank'] / MIB:>12.0f} {bound / MIB:>8.0f}"
                  f"{'' if peak <= bound else '  NOT met'}")
    print(f"check: every peak <= 1.5 x parameter bytes per rank + 0.6 GiB: "
          f"{'met' if ok else 'NOT met'}")
    _record("llm", rows, ok, args)
    return ok


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--worker"]:
        w = argparse.ArgumentParser()
        w.add_argument("kind", choices=("plexus", "llm"))
        w.add_argument("--phase", required=True)
        w.add_argument("--grid", required=True)
        w.add_argument("--checkpoint", required=True)
        w.add_argument("--data")
        w.add_argument("--hidden", type=int, default=64)
        w.add_argument("--model", choices=("gcn", "sage"), default="gcn")
        w.add_argument("--preset", default="gpt1b")
        w.add_argument("--tokens", type=int, default=4)
        w.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
        wa = w.parse_args(argv[1:])
        (worker_plexus if wa.kind == "plexus" else worker_llm)(wa)
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("case", choices=("plexus", "ogb", "llm", "all"))
    p.add_argument("--scale", type=int, default=21, help="plexus: R-MAT scale")
    p.add_argument("--edge-factor", type=int, default=28,
                   help="plexus: edges per node (21/28: about 100M stored edges)")
    p.add_argument("--features", type=int, default=64, help="plexus: learned feature width")
    p.add_argument("--hidden", type=int, default=64, help="plexus: hidden width")
    p.add_argument("--data", default=None, help="plexus: a prepared dataset to use instead")
    p.add_argument("--ranks", default="1,2,4,8", help="plexus: world sizes")
    p.add_argument("--ogb-root", default="data/memory/ogb", help="ogb: where the files go")
    p.add_argument("--ogb-nodes", type=int, default=1_000_000, help="ogb: nodes")
    p.add_argument("--ogb-edges", type=int, default=8_000_000, help="ogb: directed edges")
    p.add_argument("--ogb-features", type=int, default=128, help="ogb: feature width")
    p.add_argument("--ogb-classes", type=int, default=172, help="ogb: classes (papers100M's)")
    p.add_argument("--ogb-labelled", type=float, default=0.014,
                   help="ogb: fraction of nodes with a label, all in a split (papers100M: "
                   "1.4%%)")
    p.add_argument("--retain-freed-memory", action="store_true",
                   help="ogb: keep the trainer's default heap retention (default: freed "
                   "buffers handed back, as the planner counts live bytes)")
    p.add_argument("--keep-first-aggregation", action="store_true",
                   help="ogb: train with plexus.train --keep-first-aggregation (H_0 kept for "
                   "backward, not recomputed), for the comparison")
    p.add_argument("--model", choices=("gcn", "sage", "gat"), default="gcn",
                   help="plexus and ogb (gat: ogb only): the model trained")
    p.add_argument("--heads", type=int, default=2,
                   help="ogb, gat: heads, each of --hidden / heads (hidden layers stay "
                   "--hidden wide). The last layer holds a few [N, heads, 172] blocks: with 8 "
                   "heads 5.5 GB each on one rank, and 8 ranks' share of them does not fit "
                   "in 24 GiB")
    p.add_argument("--attention-dropout", type=float, default=0.5,
                   help="ogb, gat: dropout on the attention coefficients (its keep-masks are "
                   "kept for backward)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="ogb: what features and kept activations are stored in")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="plexus and ogb: train on this device (cuda: one GPU per rank; the "
                   "GPU peaks are reported beside the resident ones)")
    p.add_argument("--preset", default="gpt1b", help="llm: model preset")
    p.add_argument("--tokens", type=int, default=4, help="llm: tokens to generate")
    p.add_argument("--checkpoint-dir", default="data/memory/llm-ck", help="llm: checkpoint")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="append each case's run (rows in MiB, provenance) to PATH "
                   "(e.g. bench/results/memory_per_rank.json)")
    args = p.parse_args(argv)
    args.argv = list(argv)
    if args.model == "gat" and (args.case != "ogb" or args.hidden % args.heads):
        p.error("--model gat: the ogb case, with --hidden a multiple of --heads")
    ok = True
    if args.case in ("plexus", "all"):
        ok &= plexus_case(args)
    if args.case in ("ogb", "all"):
        ok &= ogb_case(args)
    if args.case in ("llm", "all"):
        ok &= llm_case(args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
