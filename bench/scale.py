"""plexus at scale: streaming preparation, sharded loading and training on billion-edge graphs.

    python bench/scale.py prepare   # R-MAT scale 24, edge factor 64 (1,073,741,824 edges)
    python bench/scale.py epoch     # one epoch of a 3-layer GCN (16 features, hidden 16) on it
    python bench/scale.py equal     # ~100M-edge graph: prepared and in-memory losses, same run
    python bench/scale.py memory    # the ~100M-edge graph: memory per rank at G = 1, 2, 4, 8
    python bench/scale.py all       # the four in turn

Every step prints what it measured and appends it to bench/results/scale.jsonl. Preparation
and training run as child processes (``python -m plexus.prepare`` / ``plexus.train``), so peak
resident memory is the child's own (``os.wait4`` on it alone; under mpiexec the ranks
report theirs through ``--metrics``). Resident memory counts the pages of memory-mapped block
files a process has touched: the page cache holds them, and the kernel may drop them again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.child import run as _run  # noqa: E402  (a child's own peak: bench/child.py)

RESULTS = ROOT / "bench" / "results" / "scale.jsonl"
GIB = 2**30


def _record(step: str, data: dict) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "a") as f:
        f.write(json.dumps({"step": step, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                            **data}) + "\n")


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def prepare_step(args) -> None:
    out = Path(args.out)
    if out.exists() and not args.force:
        print(f"{out} exists: preparation skipped (pass --force to redo it)")
        return
    cmd = [sys.executable, "-m", "plexus.prepare", "--source", "rmat", "--scale",
           str(args.scale), "--edge-factor", str(args.edge_factor), "--features",
           str(args.features), "--blocks", str(args.blocks), "--out", str(out), "--force"]
    print("$ " + " ".join(cmd), flush=True)
    r, wall, peak = _run(cmd)
    if r.returncode:
        sys.exit(f"preparation failed (exit {r.returncode})")
    m = json.loads((out / "manifest.json").read_text())
    res = {"scale": args.scale, "edge_factor": args.edge_factor,
           "edges_generated": m["edges_read"], "nodes": m["num_nodes"],
           "stored_edges": m["num_edges"], "nnz": m["nnz"], "blocks": m["blocks"],
           "seconds": round(wall, 1), "peak_rss_gib": round(peak / GIB, 3),
           "disk_gib": round(_dir_bytes(out) / GIB, 2), "limit_gib": args.limit_gib}
    _record("prepare", res)
    ok = peak <= args.limit_gib * GIB
    print(f"\nprepared {m['edges_read']:,} generated edges -> {m['num_edges']:,} stored "
          f"(symmetrised, deduplicated; {m['nnz']:,} nonzeros with self-loops) in "
          f"{m['blocks']}x{m['blocks']} blocks: {wall:.0f} s, peak resident "
          f"{peak / GIB:.2f} GiB (limit {args.limit_gib} GiB: {'met' if ok else 'NOT met'}), "
          f"{res['disk_gib']} GiB on disk")


def _train(data: str, ranks: int, grid: str | None, epochs: int, hidden: int,
           metrics: Path, extra: list[str] | None = None) -> tuple[dict, float, int]:
    cmd = [sys.executable, "-m", "plexus.train", "--dataset", data, "--epochs", str(epochs),
           "--hidden", str(hidden), "--layers", "3", "--log-every", "1",
           "--metrics", str(metrics), *(extra or [])]
    if grid:
        cmd += ["--grid", grid]
    from common.spawn import ranks_command

    cmd = ranks_command(ranks, cmd)
    print("$ " + " ".join(cmd), flush=True)
    r, wall, peak = _run(cmd)
    if r.returncode:
        sys.exit(f"training failed (exit {r.returncode})")
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    return {"epochs": lines[:-1], "summary": lines[-1]["summary"]}, wall, peak


def epoch_step(args) -> None:
    res, wall, _ = _train(args.data, args.ranks, args.grid, 1, args.hidden,
                          Path(args.data).parent / "epoch-metrics.jsonl")
    e, s = res["epochs"][0], res["summary"]
    mem = s["memory_per_rank_max"]
    out = {"data": args.data, "ranks": args.ranks, "grid": s["grid"], "epoch_s": e["epoch_s"],
           "loss": e["loss"], "loading_s": s["setup_s"],
           "adjacency_mapped_gib": round(mem["adjacency_bytes"] / GIB, 3),
           "peak_rss_per_rank_gib": round(mem["peak_bytes"] / GIB, 3),
           "wall_s": round(wall, 1)}
    _record("epoch", out)
    print(f"\none epoch on {args.data} ({s['num_nodes']:,} nodes, {s['num_edges']:,} edges), "
          f"grid {s['grid']}: {e['epoch_s']:.1f} s (loading {s['setup_s']:.1f} s), loss "
          f"{e['loss']:.4f}; per rank: {out['adjacency_mapped_gib']} GiB of blocks mapped, "
          f"peak resident {out['peak_rss_per_rank_gib']} GiB")


def equal_step(args) -> None:
    """In-memory and prepared training in one child process each, same seed and padding."""
    out = Path(args.mid)
    if not out.exists() or args.force:
        cmd = [sys.executable, "-m", "plexus.prepare", "--source", "rmat", "--scale",
               str(args.mid_scale), "--edge-factor", str(args.mid_edge_factor), "--features",
               str(args.features), "--blocks", str(args.blocks), "--out", str(out), "--force"]
        print("$ " + " ".join(cmd), flush=True)
        if _run(cmd)[0].returncode:
            sys.exit("preparation failed")
    k = json.loads((out / "manifest.json").read_text())["blocks"]
    code = (
        "import json, sys\n"
        "from common.dist import init_distributed\n"
        "from common.grid import ProcessGrid\n"
        "from plexus.config import split_config\n"
        "from plexus.trainer import train_gcn\n"
        "init_distributed(device='cpu', launcher='single')\n"
        f"cfg = split_config(epochs={args.epochs}, hidden={args.hidden}, num_layers=3)\n"
        "if sys.argv[1] == 'memory':\n"
        "    from plexus.data import InMemorySource\n"
        "    from plexus.data.generators import rmat_graph\n"
        f"    g = InMemorySource(rmat_graph({args.mid_scale}, {args.mid_edge_factor}, 0, "
        f"num_features={args.features}), pad_multiple={k})\n"
        "else:\n"
        "    from plexus.data import PreparedGraph\n"
        "    g = PreparedGraph(sys.argv[2])\n"
        "r = train_gcn(g, ProcessGrid.parse('1x1x1'), 0, **cfg)\n"
        "print(json.dumps({'edges': g.num_edges, 'setup_s': r.info['setup_s'], "
        "'losses': [h['loss'] for h in r.history]}))\n"
    )
    got = {}
    for mode in ("memory", "prepared"):
        r, wall, _ = _run([sys.executable, "-c", code, mode, str(out)], capture_output=True)
        if r.returncode:
            sys.exit(f"{mode} training failed:\n{r.stderr[-3000:]}")
        got[mode] = {**json.loads(r.stdout.strip().splitlines()[-1]), "wall_s": wall}
        print(f"{mode:>9}: {got[mode]['edges']:,} edges, setup {got[mode]['setup_s']:.1f} s, "
              f"losses {got[mode]['losses']}", flush=True)
    a, b = got["memory"]["losses"], got["prepared"]["losses"]
    diff = max(abs(x - y) for x, y in zip(a, b))
    _record("equal", {"edges": got["memory"]["edges"], "losses_memory": a,
                      "losses_prepared": b, "max_abs_diff": diff,
                      "setup_s": {m: got[m]["setup_s"] for m in got}})
    print(f"\nlosses over {len(a)} epochs: in-memory == prepared: {a == b} "
          f"(max |difference| {diff:.3g})")


def memory_step(args) -> None:
    """Per-rank memory of loading the ~100M-edge graph at G = 1, 2, 4, 8.

    Two series. 2 layers on 1x1xG grids: layer 0 needs rows chunk z of A', layer 1 columns
    chunk z of A'', so a rank maps 2/G of the blocks: adjacency memory falls as 1/G. 3 layers
    on the most cubic grids: every axis is the inner axis I (over which A_l is replicated) of
    one layer, so a rank maps nnz * sum_l(I_l) / G before blocks shared between layers are
    counted once (docs/design/plexus-3d.md section 3): it falls more slowly, G^(-2/3) on cubic
    grids.
    """
    series = [(2, {g: f"1x1x{g}" for g in (1, 2, 4, 8)}),
              (3, {1: "1x1x1", 2: "1x2x1", 4: "2x2x1", 8: "2x2x2"})]
    out = []
    for layers, grids in series:
        rows = []
        for g in [int(x) for x in args.ranks_list.split(",")]:
            res, _wall, _ = _train(args.mid, g, grids[g], 1, args.hidden,
                                  Path(args.mid).parent / f"memory-{layers}-{g}.jsonl",
                                  ["--layers", str(layers)])
            mem = res["summary"]["memory_per_rank_max"]
            shape = [int(v) for v in grids[g].split("x")]
            inner = sum(shape["xyz".index(c)] for c in "yxz"[:layers])  # I of layers 0, 1, 2
            rows.append({"layers": layers, "ranks": g, "grid": grids[g],
                         "loading_s": res["summary"]["setup_s"],
                         "sum_inner_over_g": inner / g, **mem})
        base = rows[0]
        print(f"\n{layers} layers\n{'G':>3} {'grid':>6} {'load s':>7} {'adjacency MiB':>14} "
              f"{'x G=1':>6} {'1/G':>6} {'sum I/G':>8} {'feat+W MiB':>11} {'x G=1':>6} "
              f"{'resident MiB':>13} {'peak MiB':>9}")
        for r in rows:
            print(f"{r['ranks']:>3} {r['grid']:>6} {r['loading_s']:>7.2f} "
                  f"{r['adjacency_bytes'] / 2**20:>14.1f} "
                  f"{r['adjacency_bytes'] / base['adjacency_bytes']:>6.3f} "
                  f"{1 / r['ranks']:>6.3f} "
                  f"{r['sum_inner_over_g'] / base['sum_inner_over_g']:>8.3f} "
                  f"{r['features_weights_bytes'] / 2**20:>11.1f} "
                  f"{r['features_weights_bytes'] / base['features_weights_bytes']:>6.3f} "
                  f"{r['resident_bytes_after_setup'] / 2**20:>13.1f} "
                  f"{r['peak_bytes'] / 2**20:>9.1f}", flush=True)
        out += rows
    _record("memory", {"rows": out})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("step", choices=("prepare", "epoch", "equal", "memory", "all"))
    p.add_argument("--scale", type=int, default=24)
    p.add_argument("--edge-factor", type=int, default=64)
    p.add_argument("--features", type=int, default=16)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--out", default="data/scale/rmat-24", help="the billion-edge dataset")
    p.add_argument("--data", default=None, help="dataset for 'epoch' (default: --out)")
    p.add_argument("--ranks", type=int, default=1, help="ranks for 'epoch'")
    p.add_argument("--grid", default=None, help="grid for 'epoch'")
    p.add_argument("--limit-gib", type=float, default=8.0, help="peak memory target")
    p.add_argument("--mid", default="data/scale/rmat-21", help="the ~100M-edge dataset")
    p.add_argument("--mid-scale", type=int, default=21)
    p.add_argument("--mid-edge-factor", type=int, default=28)
    p.add_argument("--epochs", type=int, default=3, help="epochs for 'equal'")
    p.add_argument("--ranks-list", default="1,2,4,8", help="world sizes for 'memory'")
    p.add_argument("--force", action="store_true", help="prepare again even if present")
    args = p.parse_args()
    args.data = args.data or args.out
    steps = {"prepare": prepare_step, "epoch": epoch_step, "equal": equal_step,
             "memory": memory_step}
    for name in (steps if args.step == "all" else [args.step]):
        print(f"\n=== {name} ===", flush=True)
        steps[name](args)


if __name__ == "__main__":
    main()
