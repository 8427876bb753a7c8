"""One command for a lent GPU: every GPU test and the GPU variants of the benches, one table.

    make gpu-check                      # = python bench/gpu_check.py
    python bench/gpu_check.py --list    # the commands it would run (works without a GPU)

In this order, each in its own process with its own time limit, all within nine minutes:

* ``pytest -m gpu`` over tests/ (llm and plexus): one row per test, read from its JUnit XML;
* ``bench/gcn_epoch.py --device cuda --dropout 0.5`` (OGB's recipe: dropout on both sides),
  fixed and trainable features, our 1x1x1 GCN against PyG's GCNConv on the same GPU, at 100K
  nodes (target: ours/PyG <= 1.0 for both, where the epoch is short and the host's launches
  count) and at 1M nodes (float32: <= 0.8 for both, and our dropout at most 10% of our epoch;
  ours in bf16, fixed features: <= 0.5 against PyG in float32; each side's costliest kernels
  of one more epoch, ``--profile``, in its log); key: each workload's ratio of median epoch
  times;
* ``bench/llm_throughput.py --device cuda``: our GPT trainer against a plain PyTorch loop,
  the small preset in float32 (target: ours/plain >= 0.95 in each of three rounds) and the
  1.1B preset in bf16 with compiled blocks (target: MFU >= 40%); each side's costliest
  kernels of one more step, ``--profile``, in its log; key: our tokens/s, MFU, the ratio and
  the GPU's busy share of each side's profiled step.

The benches run settings sized so the whole check fits the budget (:data:`GCN_ARGS`,
:data:`LLM_ARGS`, :data:`LLM_1B_ARGS`); ``bench/gcn_epoch.py --device cuda --nodes 2000000
--dropout 0.5`` is the larger run by hand. Printed: one table (check, status, key number,
seconds), then the output tail of anything that did not pass and the directory holding every
log. A bench row prints its target beside its number, and is ``missed`` where it ran but
missed it; one cut off after printing its result keeps that result, as a ``timeout``. Exit
status 0 when everything passed or was skipped, 1 otherwise. Without a CUDA device it prints
``no CUDA device: nothing to check`` and exits 0, so it is harmless on a CPU machine or in
CI.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the whole check, a minute under the ten a lent machine's command may take, so that its
# table comes back; each command also has its own limit
BUDGET_S = 540.0
GRACE_S = 10.0  # after a command's limit, before it is killed (pytest writes its report)
NO_GPU = "no CUDA device: nothing to check"
JUNIT = "pytest-gpu.xml"  # pytest's report, in the log directory
# GPU settings: OGB's dropout on both sides, both workloads; the small GPT on 8 x 256 tokens,
# the 1.1B one in bf16 on 4 x 1024
GCN_ARGS = ["--device", "cuda", "--dropout", "0.5", "--variants", "fixed,learn", "--epochs",
            "5", "--rounds", "1"]
GCN_1M_ARGS = [*GCN_ARGS, "--nodes", "1000000", "--precision", "fp32,bf16", "--profile"]
# (both GPT runs end with one profiled step a side: its costliest kernels in the log, the
# GPU's busy share in the key)
LLM_ARGS = ["--device", "cuda", "--preset", "small", "--batch-size", "8", "--seq-len", "256",
            "--steps", "20", "--warmup", "3", "--rounds", "3", "--threads", "0", "--profile"]
LLM_1B_ARGS = ["--device", "cuda", "--preset", "gpt1b", "--precision", "bf16", "--compile",
               "--batch-size", "4", "--seq-len", "1024", "--steps", "8", "--warmup", "2",
               "--threads", "0", "--profile"]


@dataclass(frozen=True)
class Row:
    """One line of the table: a test or a bench, its status (passed, failed, error, skipped,
    timeout, not run), its key number as text, and its wall seconds."""

    name: str
    status: str
    key: str
    seconds: float


@dataclass(frozen=True)
class Check:
    """One command: its name in the table, its arguments (after the Python interpreter), its
    time limit and how its output becomes rows."""

    name: str
    args: list[str]
    timeout_s: float
    kind: str  # "pytest" (rows from the JUnit XML) or "bench" (one row, key from stdout)
    key: Callable[[str], str] | None = None
    # (what it is, whether the key meets it): a bench that runs but misses it is "missed"
    target: tuple[str, Callable[[str], bool]] | None = None


def _number(pattern: str, key: str) -> float:
    """The number after ``pattern`` in a key (``nan`` without one: no target is met)."""
    m = re.search(pattern + r" ([\d.]+)", key)
    return float(m[1]) if m else float("nan")


def _ratios(key: str) -> dict[str, float]:
    """Every workload's ours/PyG in a :func:`gcn_key`, by its name (``fixed``, ``learn``,
    ``fixed-bf16``; {} when unread)."""
    return {case: float(v) for case, v in re.findall(r"((?:fixed|learn)(?:-bf16)?) ([\d.]+)",
                                                     key.partition(", ours ")[0])}


def _shares(key: str) -> list[float]:
    """Every workload's dropout share (a fraction) in a :func:`gcn_key`."""
    return [float(v) / 100 for v in re.findall(r"(?:fixed|learn) ([\d.]+)%", key)]


def _gcn_target(what: str, at_most: float, share: float | None = None,
                bf16: float | None = None):
    """(what, test): every float32 workload's ours/PyG at most ``at_most`` (and, with
    ``share``, our dropout at most that share of our epoch in every workload; with ``bf16``,
    ours in bf16 read and at most that against PyG in float32)."""
    def met(key: str) -> bool:
        if "FALLBACK" in key:  # ours ran eagerly or on torch's paths: not what is judged
            return False
        ratios, shares = _ratios(key), _shares(key)
        fp32 = [r for case, r in ratios.items() if not case.endswith("-bf16")]
        low = [r for case, r in ratios.items() if case.endswith("-bf16")]
        return (bool(fp32) and all(r <= at_most for r in fp32)
                and (share is None or (bool(shares) and all(f <= share for f in shares)))
                and (bf16 is None or (bool(low) and all(r <= bf16 for r in low))))
    return what, met


# the targets for the rows they apply to
DROPOUT_TARGET = _gcn_target("ours/PyG <= 1.0 at 100K nodes", 1.0)
DROPOUT_1M_TARGET = _gcn_target("ours/PyG <= 0.8 (bf16: 0.5), dropout <= 10% of the epoch",
                                0.8, 0.10, bf16=0.5)
LLM_TARGET = ("ours/plain >= 0.95", lambda key: _number("ours/plain", key) >= 0.95)
MFU_TARGET = ("MFU >= 40%", lambda key: _number("MFU", key.replace("%", "")) >= 40.0)


def gcn_key(out: str) -> str:
    """``ours/PyG fixed 0.84 learn 0.91 fixed-bf16 0.45, ours 0.012 s/epoch`` (with
    ``, dropout fixed 6.1% learn 5.0%`` where the bench measured our dropout's share, and
    ``, FALLBACK in fixed`` where ours fell back to eager steps or torch's kernels, which no
    target then meets) from bench/gcn_epoch.py's output, else ``?``."""
    ratios = re.findall(r"^((?:fixed|learn)(?:-bf16)?): ours/PyG ([\d.]+) against", out, re.M)
    ours = re.search(r"^ours \(Plexus 1x1x1\)[^\n]*?\s{2,}([\d.]+)", out, re.M)
    if not ratios or ours is None:
        return "?"
    key = "ours/PyG " + " ".join(f"{v} {r}" for v, r in ratios) + f", ours {ours[1]} s/epoch"
    shares = re.findall(r"^(fixed|learn): our dropout .* share ([\d.]+)%", out, re.M)
    fell = re.findall(r"^(\S+): FALLBACK:", out, re.M)
    return key + (", dropout " + " ".join(f"{v} {f}%" for v, f in shares) if shares else "") + (
        f", FALLBACK in {' '.join(fell)}" if fell else "")


def llm_key(out: str) -> str:
    """``ours 123,456 tok/s, ours/plain 0.97`` (with ``, MFU 41.20%`` after the tokens/s where
    the bench knew the device's peak, and ``, GPU busy ours 91% plain 94%`` where it profiled
    a step of each side on a GPU) from bench/llm_throughput.py's output, else ``?``."""
    ours = re.search(r"^ours, grid 1x1x1x1\s.*?\s([\d,]+)(?:\s+([\d.]+)%)?\s*$", out, re.M)
    ratio = re.search(r"throughput ratio ours / plain = ([\d.]+)", out)
    if ratio is None or ours is None:
        return "?"
    share = f", MFU {ours[2]}%" if ours[2] else ""
    busy = re.findall(r"^(ours|plain): one profiled step [\d.]+ ms, GPU busy [\d.]+ ms: "
                      r"(\d+)% of it", out, re.M)
    busy_text = ", GPU busy " + " ".join(f"{side} {pct}%" for side, pct in busy) if busy else ""
    return f"ours {ours[1]} tok/s{share}, ours/plain {ratio[1]}{busy_text}"


def host_cpu() -> str:
    """The host CPU's model name and whether it has AVX-512 (MKL, oneDNN and ATen take other
    code paths there: docs/testing.md), from /proc/cpuinfo; ``unknown CPU`` without it."""
    sys.path.insert(0, str(ROOT))
    from bench.provenance import cpuinfo

    fields = cpuinfo()
    avx512 = "avx512f" in fields.get("flags", "").split()
    return f"{fields.get('model name', 'unknown CPU')}, {'with' if avx512 else 'no'} AVX-512"


def default_workers() -> int:
    """pytest-xdist workers for the GPU tests: a quarter of the cores, at most 4 (the tests
    share the one GPU, and several start ranks of their own), 0 without pytest-xdist."""
    import importlib.util

    if importlib.util.find_spec("xdist") is None:
        return 0
    return min(4, (os.cpu_count() or 1) // 4)


def checks(junit: Path, workers: int = 0) -> list[Check]:
    """The commands of a check, in order (run by this Python); ``junit``: where pytest writes
    its XML; ``workers``: pytest-xdist workers for the tests (0: none)."""
    parallel = ["-n", str(workers)] if workers > 0 else []
    return [
        Check("pytest -m gpu", ["-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                                *parallel, f"--junitxml={junit}", "tests"], 160.0, "pytest"),
        # OGB's recipe: our masks hashed on the GPU, PyG's drawn by F.dropout (each of the
        # bench's processes, one a side and the main one, builds the graph on the host)
        Check("bench/gcn_epoch.py --device cuda --dropout 0.5 --nodes 100000",
              ["bench/gcn_epoch.py", *GCN_ARGS, "--nodes", "100000"], 75.0, "bench", gcn_key,
              DROPOUT_TARGET),
        Check("bench/gcn_epoch.py --device cuda --dropout 0.5 --nodes 1000000 (fp32, bf16)",
              ["bench/gcn_epoch.py", *GCN_1M_ARGS], 115.0, "bench", gcn_key,
              DROPOUT_1M_TARGET),
        Check("bench/llm_throughput.py --device cuda --preset small",
              ["bench/llm_throughput.py", *LLM_ARGS], 45.0, "bench", llm_key, LLM_TARGET),
        Check("bench/llm_throughput.py --device cuda --preset gpt1b --precision bf16",
              ["bench/llm_throughput.py", *LLM_1B_ARGS], 95.0, "bench", llm_key, MFU_TARGET),
    ]


def junit_rows(xml_text: str) -> list[Row]:
    """One row per test case of a pytest JUnit XML report: ``path.py::name``, its outcome,
    the skip reason or failure message's first line as the key, and its seconds."""
    rows = []
    for case in ET.fromstring(xml_text).iter("testcase"):
        module = case.get("classname", "")
        name = module.replace(".", "/") + ".py::" + case.get("name", "?")
        status, key = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                status = {"failure": "failed"}.get(tag, tag)
                message = (child.get("message") or "").strip()
                key = message.splitlines()[0][:60] if message else ""
                break
        rows.append(Row(name, status, key, float(case.get("time", 0.0))))
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """The rows as an aligned text table with a header and a summary line."""
    width = max([len("check")] + [len(r.name) for r in rows])
    key_width = max([len("key")] + [len(r.key) for r in rows])
    lines = [f"{'check':<{width}}  {'status':<8}  {'key':<{key_width}}  {'seconds':>8}"]
    lines += [f"{r.name:<{width}}  {r.status:<8}  {r.key:<{key_width}}  {r.seconds:>8.1f}"
              for r in rows]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    lines.append(f"{len(rows)} rows: {summary or 'nothing run'}; "
                 f"{sum(r.seconds for r in rows):.0f} s in all")
    return "\n".join(lines)


def summary(rows: Sequence[Row]) -> str:
    """One command's rows in a line: a bench's status and key; the tests' counts and the
    names of those that did not pass."""
    if len(rows) == 1:
        return f"{rows[0].status} {rows[0].key}".strip()
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    bad = [r.name for r in rows if r.status not in ("passed", "skipped")]
    return (", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
            + (f"; not passed: {', '.join(bad)}" if bad else ""))


def failed(rows: Sequence[Row]) -> bool:
    """Whether anything did not pass (a skip is not a failure; a missed target is)."""
    return any(r.status not in ("passed", "skipped") for r in rows)


def run_check(check: Check, seconds_left: float, log_dir: Path, junit: Path,
              python: str = sys.executable) -> tuple[list[Row], str]:
    """Run one command within its limit and what is left of the budget (less the grace an
    interrupted command gets); its rows and its output."""
    limit = min(check.timeout_s, seconds_left - GRACE_S)
    if limit < 10:
        return [Row(check.name, "not run", "the 9-minute budget is spent", 0.0)], ""
    log = log_dir / (re.sub(r"[^\w.-]+", "_", check.name)[:60] + ".log")
    if check.kind == "pytest":
        junit.unlink(missing_ok=True)  # never read an earlier run's report
    start = time.perf_counter()
    out, code = _run([python, *check.args], limit)
    status = "timeout" if code is None else "passed" if code == 0 else "failed"
    seconds = time.perf_counter() - start
    log.write_text(out)
    if check.kind == "pytest":
        rows = junit_rows(junit.read_text()) if junit.is_file() else []
        if status == "timeout" or not rows:  # cut off, or nothing ran: a row of its own
            why = "cut off" if rows else "no test ran" if junit.is_file() else "no report"
            rows.append(Row(check.name, "error" if status == "passed" else status, why,
                            seconds))
        return rows, out
    # a bench cut off after printing its result (in its profiled step, say) still shows it,
    # though it stays a timeout and gets no verdict
    key = check.key(out) if check.key is not None and status in ("passed", "timeout") else ""
    if status == "timeout":
        key = f"{key}, then cut off" if key and key != "?" else ""
    elif key and key != "?" and check.target is not None:  # ("?": unread, no verdict)
        met = check.target[1](key)
        status = "passed" if met else "missed"
        key += f" (target {check.target[0]}: {'met' if met else 'NOT met'})"
    return [Row(check.name, status, key, seconds)], out


def _default_sigint() -> None:
    """In the child before exec: SIGINT back to its default. A shell starts background jobs
    with SIGINT ignored, and an ignored signal stays ignored across exec, so a command started
    from one (``make gpu-check &``, CI runners) would never see the SIGINT that asks it to
    write its report."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _run(argv: list[str], limit: float) -> tuple[str, int | None]:
    """Run ``argv`` in its own process group; (its stdout and stderr, its exit status, or None
    when it ran past ``limit``). Past the limit the group gets SIGINT (pytest still writes its
    report, and the ranks a test started end with it), then SIGKILL after GRACE_S."""
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True,
                            preexec_fn=_default_sigint)
    try:
        out, _ = proc.communicate(timeout=limit)
        return out, proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        return out, None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--list", action="store_true", help="print the commands and exit")
    p.add_argument("--log-dir", default=None, help="where each command's output is kept "
                   "(default: a new temporary directory)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="pytest-xdist workers for the GPU tests (default: a quarter of the "
                   "cores, at most 4; 0 without pytest-xdist)")
    args = p.parse_args(argv)
    workers = default_workers() if args.workers is None else args.workers
    if args.list:
        for check in checks(Path(args.log_dir or "LOG_DIR") / JUNIT, workers):
            print(f"{check.timeout_s:>5.0f} s  python {' '.join(check.args)}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print(NO_GPU)
        return 0
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="gpu-check-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    junit = log_dir / JUNIT
    print(f"GPU check on {torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} GPU(s)), "
          f"torch {torch.__version__}, host CPU {host_cpu()}; logs in {log_dir}", flush=True)
    start, rows, tails = time.perf_counter(), [], []
    for check in checks(junit, workers):
        print(f"running: {check.name}", flush=True)
        got, out = run_check(check, BUDGET_S - (time.perf_counter() - start), log_dir, junit)
        print(f"done: {check.name}: {summary(got)}", flush=True)  # (if the rest is cut off)
        rows += got
        if failed(got):
            tails.append(f"--- {check.name} (last lines) ---\n" +
                         "\n".join(out.splitlines()[-30:]))
    print()
    print(format_table(rows))
    for tail in tails:
        print("\n" + tail)
    print(f"\nlogs: {log_dir}")
    return 1 if failed(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
