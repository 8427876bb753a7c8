"""ogbn-products' size on one machine: PyG's GCNConv on one process against ours on 1 and 2 ranks.

    python bench/products_scale.py                    # 2,449,029 nodes, 61,859,140 edges
    python bench/products_scale.py --scale 0.5        # half the nodes and edges
    python bench/products_scale.py --nodes 20000 --edges 500000 --epochs 1   # a quick run
    python bench/products_scale.py --skip-pyg --ranks 1,2 --json runs/products.json

The graph has ogbn-products' shape (2,449,029 nodes, 61,859,140 undirected edges stored once,
100 features, 47 classes, products' split fractions) and is generated once by plexus's
planted-partition generator (class-correlated features, so it is learnable) and written under
``--root`` in OGB's on-disk format for ogbn-products (raw/*.csv.gz, split/sales_ranking/).
Both sides then read it as they read the real dataset: PyG through the unmodified ``ogb``
loader (``plexus.data.ogb.load_ogb``; its processed cache is built once beforehand), ours
through ``plexus.train --dataset ogbn-products --root ROOT`` (the prepared block cache, also
built once beforehand). Neither measured process pays for a one-time preparation's time;
PyG's process does build its normalised adjacency (a torch CSR tensor) from the loaded edges,
which counts in its memory peak: its peak by the end of that set-up is printed beside.

The recipe is OGB's full-batch GCN for ogbn-products: 3 layers, hidden 256, dropout 0.5,
ReLU, bias, Adam lr 0.01 without weight decay, one full-graph step per epoch. PyG runs
``GCNConv(normalize=False)`` on the normalised adjacency as a torch CSR tensor (its fastest
CPU path, as in bench/gcn_epoch.py), with dropout after each hidden layer as OGB's example;
ours is ``python -m plexus.train`` (its ``main``), which also drops out the input features.
Each side runs in its own processes: PyG in one, ours alone and under ``mpiexec -n 2``
(``init_distributed`` gives each rank cores / ranks threads; PyG gets all cores, as ours on one
rank). Both train 1 warm-up epoch and ``--epochs`` timed ones, then evaluate once.

Measured per side: the median time of the timed epochs (the training step; ours' ``epoch_s``)
and every rank's peak resident memory over its whole life (``common.memory.peak_bytes``, Linux
``VmHWM``, read at exit), printed as the maximum over ranks and the sum (the sum is what the
machine must hold; the memory ratio uses it). A side that dies (the OOM killer, a
MemoryError) is reported with its exit signal or error and the peak the kernel recorded for
it, and the bench goes on. The PyG process volunteers as the OOM killer's first victim
(``oom_score_adj`` 1000).

Allocator: both sides run under the same settings. Both import ``common``, which turns on
PyTorch's huge pages for large CPU buffers (``THP_MEM_ALLOC_ENABLE=1`` unless the environment
sets it; the header prints the value both inherit), and PyG also gets our trainer's retained
heap (common.alloc: freed buffers up to 16 MiB stay in the heap; at this size the [N, 256]
activations are far larger and go back to the OS as usual); ``--no-retain-freed-memory``: on
neither side.

Check (issue "ogbn-products scale"): ours on one rank needs at most 0.6x PyG's peak memory and
at most 0.5x its epoch time, or PyG cannot run in the host's memory (then its error is
printed). Exit status 0 when the check is met, 1 when missed or not measured.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.child import env as _env  # noqa: E402
from bench.child import wait_with_peak  # noqa: E402
from common.spawn import ranks_command  # noqa: E402

GIB = 2.0**30
PRODUCTS = {"nodes": 2_449_029, "edges": 61_859_140, "features": 100, "classes": 47}
SPLIT = (196_615, 39_323, 2_213_091)  # ogbn-products' train / valid / test sizes
TIME_TARGET, MEMORY_TARGET = 0.5, 0.6  # ours / PyG, at most
BLOCKS = 8  # k of ours' prepared cache: what plexus.train uses for 1 and 2 ranks
# an exception ("RuntimeError: ...", "[rank0]: MemoryError") or a complaint about memory
MEMORY_WORDS = re.compile(r"MemoryError|out of memory|allocate memory|not enough memory|"
                          r"memory allocation", re.IGNORECASE)
MPI_RANK_KILLED = re.compile(r"KILLED BY SIGNAL: 9\b|\(signal 9\)")  # mpiexec's report
ERROR_LINE = re.compile(rf"\b[\w.]*(?:Error|Exception)\b.*|.*(?:{MEMORY_WORDS.pattern}).*",
                        re.IGNORECASE)


# ----------------------------------------------------------------------------- the graph


def csv_bytes(values: Any, decimals: int = 0) -> bytes:
    """Rows of ``values`` as CSV text: integers, or fixed-point numbers rounded to ``decimals``
    digits after the point ("-0.845116"), vectorised (numpy's savetxt formats row by row).

    Each number is laid out in a fixed-width byte cell (sign, digits, point, separator) and the
    unused bytes (sign of a positive number, leading zeros) are masked out.

    Shapes: values [n, k] -> n lines of k comma-separated numbers
    """
    import numpy as np

    v = np.asarray(values)
    scaled = (np.rint(v.astype(np.float64) * 10.0**decimals).astype(np.int64) if decimals
              else v.astype(np.int64))
    mag = np.abs(scaled)  # [n, k]
    width = max(len(str(int(mag.max(initial=0)))), decimals + 1)  # digits of the longest
    shown = np.maximum(np.searchsorted(10 ** np.arange(1, 19, dtype=np.int64), mag,
                                       side="right") + 1, decimals + 1)  # [n, k] digits shown
    point = 1 if decimals else 0
    cell = np.empty((*mag.shape, width + point + 2), dtype=np.uint8)  # [n, k, L]
    keep = np.ones(cell.shape, dtype=bool)
    cell[..., 0], keep[..., 0] = ord("-"), scaled < 0
    for j in range(width):
        power = width - 1 - j
        col = 1 + j + (point if power < decimals else 0)
        cell[..., col] = (mag // 10**power) % 10 + ord("0")
        keep[..., col] = power < shown
    if decimals:
        cell[..., 1 + width - decimals] = ord(".")
    cell[..., -1] = ord(",")
    cell[:, -1, -1] = ord("\n")
    return cell[keep].tobytes()


def write_csv_gz(path: Path, values: Any, decimals: int = 0, rows_per_chunk: int = 1 << 16,
                 workers: int = 2) -> None:
    """``values`` [n, k] as a gzip CSV file, ``rows_per_chunk`` rows at a time: each chunk is
    formatted and compressed (level 1) on a worker thread into its own gzip member (a file of
    several members is one valid gzip stream for pandas and ogb), written in order."""
    import gzip
    from concurrent.futures import ThreadPoolExecutor

    def chunk(lo: int) -> bytes:
        return gzip.compress(csv_bytes(values[lo:lo + rows_per_chunk], decimals), 1)

    with open(path, "wb") as f, ThreadPoolExecutor(workers) as pool:
        for data in pool.map(chunk, range(0, len(values), rows_per_chunk)):
            f.write(data)


def write_products_like(out: Path, *, nodes: int, edges: int, features: int, classes: int,
                        seed: int = 0) -> dict[str, Any]:
    """Write a generated graph of the given size in ogbn-products' OGB layout under
    ``out/ogbn_products`` (the layout of tests/plexus/data/ogb_format.py's
    ``write_products_like``, whose row-by-row writer is far too slow at this size).

    The graph is :func:`plexus.data.generators.planted_partition` (p_in 0.8, signal 0.6, as
    that test writer) generated 1% denser, its pairs then cut to exactly ``edges`` at random
    (fewer only when the generator's duplicates of a small dense graph leave fewer). Each
    undirected edge is stored once, as in products. Split: products' fractions at random.
    Returns what was written (the metadata the bench keeps beside it).
    """
    import numpy as np

    from plexus.data.generators import planted_partition

    t = time.perf_counter()
    g = planted_partition(num_nodes=nodes, num_classes=classes, avg_degree=2.02 * edges / nodes,
                          p_in=0.8, num_features=features, signal=0.6, seed=seed)
    src, dst = g.edge_index.numpy()  # [E] each, both directions
    once = src < dst
    pairs = np.stack([src[once], dst[once]], axis=1)  # [M, 2] each undirected edge once
    x, y = g.x.numpy(), g.y.numpy()  # [N, F] float32, [N]
    del g, src, dst, once
    rng = np.random.default_rng([seed, 47])
    if len(pairs) > edges:
        keep = np.ones(len(pairs), dtype=bool)
        keep[rng.choice(len(pairs), len(pairs) - edges, replace=False)] = False
        pairs = pairs[keep]
    print(f"generated {nodes:,} nodes, {len(pairs):,} edges in {time.perf_counter() - t:.0f} s; "
          f"writing OGB-format files under {out}", flush=True)
    d = out / "ogbn_products"
    (d / "raw").mkdir(parents=True)
    (d / "split" / "sales_ranking").mkdir(parents=True)
    (d / "RELEASE_v1.txt").write_text("generated by bench/products_scale.py\n")
    for name, values, decimals in (("edge", pairs, 0), ("node-feat", x, 6),
                                   ("node-label", y.reshape(-1, 1), 0),
                                   ("num-node-list", np.array([[nodes]]), 0),
                                   ("num-edge-list", np.array([[len(pairs)]]), 0)):
        write_csv_gz(d / "raw" / f"{name}.csv.gz", values, decimals)
        print(f"  raw/{name}.csv.gz written ({time.perf_counter() - t:.0f} s)", flush=True)
    perm = rng.permutation(nodes)
    ends = np.cumsum([round(nodes * n / sum(SPLIT)) for n in SPLIT[:2]])
    split = dict(zip(("train", "valid", "test"), np.split(perm, ends), strict=True))
    for name, idx in split.items():
        write_csv_gz(d / "split" / "sales_ranking" / f"{name}.csv.gz", np.sort(idx)[:, None])
    return {"nodes": nodes, "edges": len(pairs), "requested_edges": edges,
            "features": features, "classes": classes, "seed": seed,
            "split": {k: len(v) for k, v in split.items()},
            "seconds": time.perf_counter() - t}


def ensure_dataset(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """The generated dataset under ``root`` (written under ``root.partial``, then renamed) and
    both sides' one-time caches, each step in a process of its own, done on first use."""
    want = {"nodes": args.nodes, "requested_edges": args.edges, "features": args.features,
            "classes": args.classes, "seed": 0}
    meta_path = root / "generated.json"
    if not meta_path.is_file():
        if root.exists():
            sys.exit(f"{root} exists but holds no generated.json; delete it or pick another "
                     "--root")
        partial = Path(f"{root}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        print(f"generating the graph (once) into {root}", flush=True)
        _step(["write", "--root", str(partial), *_size_args(args)])
        partial.rename(root)
    meta = json.loads(meta_path.read_text())
    if bad := {k: (meta.get(k), v) for k, v in want.items() if meta.get(k) != v}:
        sys.exit(f"{root} holds another graph (field: (there, asked)): {bad}; delete it or "
                 "pick another --root")
    if not (root / "ogbn_products" / "processed" / "data_processed").is_file():
        print("building ogb's processed cache (PyG's side reads it; once)", flush=True)
        _step(["prepare-ogb", "--root", str(root)])
    _step(["prepare-ours", "--root", str(root)])  # says "using the prepared cache" when there
    return meta


def _size_args(args: argparse.Namespace) -> list[str]:
    return ["--nodes", str(args.nodes), "--edges", str(args.edges), "--features",
            str(args.features), "--classes", str(args.classes)]


def _step(worker_args: list[str]) -> None:
    """A preparation step in its own process, its output shown as it comes."""
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker",
                        *worker_args], cwd=ROOT, env=_env(), stdin=subprocess.DEVNULL)
    if r.returncode:
        sys.exit(f"step {worker_args[0]} failed (exit {r.returncode})")


# ----------------------------------------------------------------------------- workers


def worker_write(a: argparse.Namespace) -> None:
    meta = write_products_like(Path(a.root), nodes=a.nodes, edges=a.edges,
                               features=a.features, classes=a.classes)
    (Path(a.root) / "generated.json").write_text(json.dumps(meta, indent=1))


def worker_prepare_ogb(a: argparse.Namespace) -> None:
    from plexus.data.ogb import load_ogb

    t = time.perf_counter()
    g = load_ogb("ogbn-products", a.root)
    print(f"ogb loader: {g.num_nodes:,} nodes, {g.edge_index.shape[1]:,} directed edges in "
          f"{time.perf_counter() - t:.0f} s", flush=True)


def worker_prepare_ours(a: argparse.Namespace) -> None:
    from plexus.data.cache import prepared_cache

    prepared_cache("ogbn-products", a.root, blocks=BLOCKS, permutation="double", seed=0,
                   symmetrize=False, is_writer=True, verbose=True, quiet=False)


def worker_pyg(a: argparse.Namespace) -> None:
    """OGB's full-batch GCN recipe with PyG's GCNConv; writes its measurements to ``a.out``."""
    if a.memory_limit is not None:  # from the start, as ``ulimit -v``
        import resource

        cap = int(a.memory_limit * GIB)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    import torch
    from torch.nn.functional import dropout, nll_loss
    from torch_geometric.nn import GCNConv

    from common.alloc import retain_freed_memory
    from common.dist import split_threads
    from common.memory import peak_bytes
    from plexus.data.ogb import load_ogb
    from plexus.data.partition import normalized_adjacency
    from plexus.sparse import CSRBlock

    try:
        Path("/proc/self/oom_score_adj").write_text("1000")  # the OOM killer's first choice
    except OSError:
        pass  # not Linux
    split_threads(1)  # the torch threads ours gets on one rank: all cores
    retain_freed_memory(a.retain)
    t = time.perf_counter()
    g = load_ogb("ogbn-products", a.root)
    adj = CSRBlock.from_scipy(normalized_adjacency(g.edge_index.numpy(), g.num_nodes)).to_torch()
    x, y = g.x, g.y  # [N, F], [N]
    splits = {"train": g.train_idx, "valid": g.val_idx, "test": g.test_idx}
    num_features, num_classes = g.num_features, g.num_classes
    del g  # the edge list: PyG trains on adj
    print(f"loaded and normalised in {time.perf_counter() - t:.0f} s; {torch.get_num_threads()} "
          f"threads; peak so far {peak_bytes() / GIB:.2f} GiB", flush=True)
    setup_peak = peak_bytes()

    torch.manual_seed(0)
    dims = [num_features] + [a.hidden] * (a.layers - 1) + [num_classes]
    convs = torch.nn.ModuleList(GCNConv(i, o, normalize=False)
                                for i, o in itertools.pairwise(dims))
    opt = torch.optim.Adam(convs.parameters(), lr=a.lr, fused=True)  # as ours steps
    train = splits["train"]

    def forward() -> torch.Tensor:
        h = x
        for i, conv in enumerate(convs):
            h = conv(h, adj)
            if i < len(convs) - 1:
                h = dropout(h.relu(), p=a.dropout, training=convs.training)
        return h.log_softmax(dim=-1)

    def record(**more: Any) -> None:  # after every epoch: what a killed run got done stays
        Path(a.out).write_text(json.dumps({
            "epoch_s": times[1:], "warmup_s": times[0], "peak_bytes": [peak_bytes()],
            "setup_peak_bytes": setup_peak, "threads": torch.get_num_threads(),
            "loss": loss.item(), **more}))

    times = []
    for epoch in range(1, a.epochs + 2):
        convs.train()
        t = time.perf_counter()
        opt.zero_grad()
        loss = nll_loss(forward()[train], y[train])
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
        print(f"epoch {epoch}/{a.epochs + 1}  loss {loss.item():.4f}  {times[-1]:.2f} s"
              f"{'  (warm-up)' if epoch == 1 else ''}; peak {peak_bytes() / GIB:.2f} GiB",
              flush=True)
        record()
    convs.eval()
    with torch.no_grad():
        pred = forward().argmax(dim=-1)
    acc = {k: float((pred[i] == y[i]).float().mean()) for k, i in splits.items()}
    print("accuracy " + "  ".join(f"{k} {100 * v:.2f}%" for k, v in acc.items()), flush=True)
    record(accuracy=acc, finished=True)


def worker_ours(a: argparse.Namespace, train_argv: list[str]) -> int:
    """``python -m plexus.train TRAIN_ARGV`` on this rank, then this rank's whole-life peak
    into ``a.peak_dir`` (one file per process)."""
    from common.memory import peak_bytes
    from plexus.train import main as train_main

    code = train_main(train_argv)
    (Path(a.peak_dir) / f"peak-{os.getpid()}.json").write_text(
        json.dumps({"peak_bytes": peak_bytes()}))
    return code


def run_worker(argv: list[str]) -> int:
    train_argv = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    w = argparse.ArgumentParser()
    w.add_argument("kind", choices=("write", "prepare-ogb", "prepare-ours", "pyg", "ours"))
    w.add_argument("--root")
    for name in ("nodes", "edges", "features", "classes", "epochs", "hidden", "layers"):
        w.add_argument(f"--{name}", type=int)
    w.add_argument("--dropout", type=float)
    w.add_argument("--lr", type=float)
    w.add_argument("--no-retain-freed-memory", dest="retain", action="store_false")
    w.add_argument("--memory-limit", type=float)
    w.add_argument("--out")
    w.add_argument("--peak-dir")
    a = w.parse_args(argv)
    if a.kind == "ours":
        return worker_ours(a, train_argv)
    {"write": worker_write, "prepare-ogb": worker_prepare_ogb,
     "prepare-ours": worker_prepare_ours, "pyg": worker_pyg}[a.kind](a)
    return 0


# ----------------------------------------------------------------------------- driver


def run_side(label: str, cmd: list[str]) -> dict[str, Any]:
    """Run one side's command, its output shown prefixed as it comes; returns its exit code
    (negative: the signal), the kernel's peak RSS for it and its descendants (``wait4``), the
    wall time and its last lines of output."""
    print(f"\n[{label}] $ {' '.join(cmd)}", flush=True)
    load = os.getloadavg()[0]
    t = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: collections.deque[str] = collections.deque(maxlen=40)
    for line in p.stdout:
        tail.append(line.rstrip("\n"))
        print(f"[{label}] {tail[-1]}", flush=True)
    code, peak = wait_with_peak(p)
    return {"exit": code, "rusage_maxrss_bytes": peak,
            "wall_s": time.perf_counter() - t, "tail": list(tail),
            "loadavg_1min": [load, os.getloadavg()[0]]}


def describe_failure(exit_code: int, tail: list[str]) -> tuple[str, bool]:
    """(what happened, whether it was out of memory) for a side that exited ``exit_code``
    (negative: killed by that signal) after printing ``tail``."""
    rank_killed = any(MPI_RANK_KILLED.search(x) for x in tail)
    if exit_code < 0:
        text = f"killed by {signal.Signals(-exit_code).name} (signal {-exit_code})"
    else:
        text = f"exit status {exit_code}" + (", a rank killed by SIGKILL" if rank_killed else "")
    if exit_code == -signal.SIGKILL or rank_killed:
        text += ", as the kernel's OOM killer does"
    errors = [m.group(0).strip() for x in tail if (m := ERROR_LINE.search(x))]
    if errors:
        text += f": {errors[-1][:300]}"
    killed = exit_code == -signal.SIGKILL or rank_killed
    return text, killed or any(MEMORY_WORDS.search(x) for x in errors)


def side_result(side: str, ranks: int, run: dict[str, Any], epochs: list[float],
                peaks: list[int] | None) -> dict[str, Any]:
    """One row of the results: the measurements, or the failure. ``epochs``: the times of
    the epochs it finished, the warm-up first."""
    epoch_s = epochs[1:]
    ok = run["exit"] == 0 and bool(epoch_s) and peaks is not None and len(peaks) == ranks
    row = {"side": side, "ranks": ranks, "ok": ok, "wall_s": run["wall_s"],
           "rusage_maxrss_bytes": run["rusage_maxrss_bytes"], "exit": run["exit"],
           "loadavg_1min": run["loadavg_1min"]}
    if ok:
        row.update(epoch_s=epoch_s, median_epoch_s=statistics.median(epoch_s),
                   peak_bytes=peaks, peak_max_bytes=max(peaks), peak_sum_bytes=sum(peaks))
    elif run["exit"] == 0:
        row["failure"], row["out_of_memory"] = "exited 0 without its measurements", False
    else:
        row["failure"], row["out_of_memory"] = describe_failure(run["exit"], run["tail"])
    if not ok:
        row["finished_epochs_s"] = epochs  # before it failed, the warm-up first
    return row


def measure_pyg(args: argparse.Namespace, root: Path, tmp: Path) -> dict[str, Any]:
    out = tmp / "pyg.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "pyg", "--root",
           str(root), "--out", str(out), *_recipe_args(args)]
    if args.pyg_memory_limit is not None:
        cmd += ["--memory-limit", str(args.pyg_memory_limit)]
    run = run_side("PyG", cmd)
    got = json.loads(out.read_text()) if out.is_file() else {}  # epochs a failed run finished
    epochs = [got["warmup_s"], *got["epoch_s"]] if got else []
    done = run["exit"] == 0 and got.get("finished", False)
    row = side_result("PyG GCNConv", 1, run, epochs, got.get("peak_bytes") if done else None)
    row.update({k: got[k] for k in ("setup_peak_bytes", "threads", "accuracy") if k in got})
    return row


def measure_ours(args: argparse.Namespace, root: Path, tmp: Path, ranks: int) -> dict[str, Any]:
    peak_dir, metrics = tmp / f"ours-{ranks}", tmp / f"ours-{ranks}.jsonl"
    peak_dir.mkdir()
    train = ["--dataset", "ogbn-products", "--root", str(root), "--device", "cpu",
             "--layers", str(args.layers), "--hidden", str(args.hidden), "--dropout",
             str(args.dropout), "--optimizer", "adam", "--weight-decay", "0", "--lr",
             str(args.lr), "--epochs", str(args.epochs + 1), "--eval-every",
             str(args.epochs + 1), "--log-every", "1", "--metrics", str(metrics)]
    if not args.retain:
        train.append("--no-retain-freed-memory")
    cmd = ranks_command(ranks, [sys.executable, str(Path(__file__).resolve()), "--worker",
                                "ours", "--peak-dir", str(peak_dir), "--", *train])
    run = run_side(f"ours {ranks}", cmd)
    written = metrics if metrics.is_file() else Path(f"{metrics}.tmp")  # .tmp: it failed
    rows = [json.loads(x) for x in written.read_text().splitlines()] if written.is_file() else []
    epochs = [r["epoch_s"] for r in rows if "epoch_s" in r]
    peaks = [json.loads(p.read_text())["peak_bytes"] for p in sorted(peak_dir.glob("*.json"))]
    return side_result("ours (Plexus)", ranks, run, epochs, peaks if run["exit"] == 0 else None)


def _recipe_args(args: argparse.Namespace) -> list[str]:
    out = ["--epochs", str(args.epochs), "--hidden", str(args.hidden), "--layers",
           str(args.layers), "--dropout", str(args.dropout), "--lr", str(args.lr)]
    return out if args.retain else [*out, "--no-retain-freed-memory"]


def compare(pyg: dict[str, Any] | None, ours: dict[str, Any]) -> dict[str, Any]:
    """ours / PyG epoch time and memory (the sum over ours' ranks against PyG's one process)
    and the verdict: "met", "MISSED", or "not measured" (a side missing or failed; when PyG
    ran out of memory and ours ran, the check is met by PyG not running)."""
    out: dict[str, Any] = {"ranks": ours["ranks"]}
    if pyg is None or not ours["ok"]:
        return {**out, "verdict": "not measured"}
    if not pyg["ok"]:
        return {**out, "verdict": "met" if pyg["out_of_memory"] else "not measured"}
    time_ratio = ours["median_epoch_s"] / pyg["median_epoch_s"]
    memory_ratio = ours["peak_sum_bytes"] / pyg["peak_sum_bytes"]
    met = time_ratio <= TIME_TARGET and memory_ratio <= MEMORY_TARGET
    return {**out, "time_ratio": time_ratio, "memory_ratio": memory_ratio,
            "time_met": time_ratio <= TIME_TARGET, "memory_met": memory_ratio <= MEMORY_TARGET,
            "verdict": "met" if met else "MISSED"}


def check_reasons(pyg: dict[str, Any] | None, ours: list[dict[str, Any]]) -> str:
    """Why the check reads as it does when a side is missing or failed ("" otherwise)."""
    one = next((o for o in ours if o["ranks"] == 1), None)
    reasons = ["ours did not run on 1 rank" if one is None else
               "" if one["ok"] else f"ours on 1 rank failed: {one['failure']}",
               "PyG was skipped" if pyg is None else "" if pyg["ok"] else
               f"PyG {'ran out of memory' if pyg['out_of_memory'] else 'failed, not for memory'}"
               f": {pyg['failure']}"]
    return "".join(f" ({r})" for r in reasons if r)


def print_table(sides: list[dict[str, Any]], ratios: list[dict[str, Any]]) -> None:
    by_ranks = {r["ranks"]: r for r in ratios}
    print(f"\n{'side':<14}{'ranks':>6}{'median s/epoch':>16}{'peak GiB max':>14}"
          f"{'peak GiB sum':>14}{'time ours/PyG':>15}{'memory ours/PyG':>17}  verdict")
    for s in sides:
        head = f"{s['side']:<14}{s['ranks']:>6}"
        if not s["ok"]:
            done = ", ".join(f"{t:.1f}" for t in s["finished_epochs_s"]) or "none"
            print(f"{head}  failed after {s['wall_s']:.0f} s (epochs finished, s: {done}), "
                  f"peak {s['rusage_maxrss_bytes'] / GIB:.2f} GiB: {s['failure']}")
            continue
        line = (f"{head}{s['median_epoch_s']:>16.3f}{s['peak_max_bytes'] / GIB:>14.2f}"
                f"{s['peak_sum_bytes'] / GIB:>14.2f}")
        r = by_ranks.get(s["ranks"]) if s["side"].startswith("ours") else None
        if r and "time_ratio" in r:
            line += f"{r['time_ratio']:>15.3f}{r['memory_ratio']:>17.3f}  {r['verdict']}"
        elif r:
            line += f"{'-':>15}{'-':>17}  {r['verdict']}"
        print(line)
    print(f"targets: time ours/PyG <= {TIME_TARGET}, memory ours/PyG <= {MEMORY_TARGET} "
          "(ours: the sum over its ranks)")
    for s in sides:  # PyG's whole-life peak includes building its CSR from the edge list
        if s["ok"] and s.get("setup_peak_bytes"):
            print(f"{s['side']}: peak {s['setup_peak_bytes'] / GIB:.2f} GiB by the end of its "
                  "set-up (loading, normalising the adjacency, building the CSR), "
                  f"{s['peak_max_bytes'] / GIB:.2f} GiB over its life")
    print("1-minute load average at the start and end of each side (a shared machine shows "
          "here): " + "; ".join(f"{s['side']} {s['ranks']}: {s['loadavg_1min'][0]:.1f} -> "
                                f"{s['loadavg_1min'][1]:.1f}" for s in sides))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nodes", type=int, default=PRODUCTS["nodes"])
    p.add_argument("--edges", type=int, default=PRODUCTS["edges"],
                   help="undirected edges, stored once (the loaders add the reverse)")
    p.add_argument("--features", type=int, default=PRODUCTS["features"])
    p.add_argument("--classes", type=int, default=PRODUCTS["classes"])
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply --nodes and --edges by this (0.5: half of products)")
    p.add_argument("--root", default=None,
                   help="where the generated dataset and its caches go (default: "
                   "data/products_scale/nN-eE-fF-cC in the repository)")
    p.add_argument("--epochs", type=int, default=2, help="timed epochs, after one warm-up")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--ranks", default="1,2", help="our world sizes, comma-separated")
    p.add_argument("--skip-pyg", action="store_true", help="measure ours only")
    p.add_argument("--pyg-memory-limit", type=float, default=None, metavar="GIB",
                   help="cap PyG's address space (RLIMIT_AS, as ulimit -v: virtual memory, "
                   "more than resident) to see how it fails with less memory")
    p.add_argument("--no-retain-freed-memory", dest="retain", action="store_false",
                   help="both sides: glibc's allocator thresholds as they are")
    p.add_argument("--json", default=None, metavar="PATH", help="write the measurements")
    args = p.parse_args(argv)
    args.nodes, args.edges = round(args.nodes * args.scale), round(args.edges * args.scale)
    args.rank_list = [int(r) for r in args.ranks.split(",") if r]
    if args.epochs < 1 or not args.rank_list or min(args.rank_list) < 1:
        p.error("need --epochs >= 1 and --ranks of positive world sizes")
    if args.nodes < args.classes:
        p.error(f"--nodes {args.nodes:,} (after --scale) < --classes {args.classes}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return run_worker(argv[1:])
    args = parse_args(argv)
    root = Path(args.root) if args.root else (
        ROOT / "data" / "products_scale" /
        f"n{args.nodes}-e{args.edges}-f{args.features}-c{args.classes}")
    t = time.perf_counter()
    meta = ensure_dataset(args, root)
    graph = (f"ogbn-products format, generated: {meta['nodes']:,} nodes, {meta['edges']:,} "
             f"edges ({2 * meta['edges']:,} directed), {meta['features']} features, "
             f"{meta['classes']} classes; split {meta['split']['train']:,} / "
             f"{meta['split']['valid']:,} / {meta['split']['test']:,}")
    recipe = (f"GCN, {args.layers} layers, hidden {args.hidden}, dropout {args.dropout}, Adam "
              f"lr {args.lr}; {args.epochs} timed epoch(s) after 1 warm-up; "
              f"{os.cpu_count()} cores; allocator: "
              f"{'freed buffers up to 16 MiB retained' if args.retain else 'glibc defaults'} "
              f"on both sides; THP_MEM_ALLOC_ENABLE="
              f"{os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')} on both sides")
    print(f"{graph}\n{recipe}", flush=True)

    with tempfile.TemporaryDirectory(prefix="products_scale-") as tmp:
        pyg = None if args.skip_pyg else measure_pyg(args, root, Path(tmp))
        ours = [measure_ours(args, root, Path(tmp), r) for r in args.rank_list]
    sides = [s for s in (pyg, *ours) if s is not None]
    ratios = [compare(pyg, o) for o in ours]
    print(f"\n{graph}\n{recipe}")
    print_table(sides, ratios)
    one = next((r for r in ratios if r["ranks"] == 1), {"verdict": "not measured"})
    check = one["verdict"]
    print(f"check: ours on 1 rank <= {TIME_TARGET}x PyG's epoch time and <= {MEMORY_TARGET}x "
          f"its peak memory: {check}{check_reasons(pyg, ours)}")
    print(f"total wall time {time.perf_counter() - t:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "graph": meta, "root": str(root), "recipe": recipe, "epochs": args.epochs,
            "targets": {"time": TIME_TARGET, "memory": MEMORY_TARGET},
            "sides": sides, "ratios": ratios, "check": check}, indent=1))
    return 0 if check == "met" else 1


if __name__ == "__main__":
    sys.exit(main())
