"""One command for a lent GPU: every GPU test and the GPU variants of the benches, one table.

    make gpu-check                      # = python bench/gpu_check.py
    python bench/gpu_check.py --list    # the commands it would run (works without a GPU)

In this order, each in its own process with its own time limit, all within ten minutes:

* ``pytest -m gpu`` over tests/ (llm and plexus): one row per test, read from its JUnit XML;
* ``bench/gcn_epoch.py --device cuda``: our 1x1x1 GCN against PyG's GCNConv on the same GPU
  (key: the ratio of median epoch times, ours / PyG), then again with dropout 0.5 on both
  sides (fixed features only);
* ``bench/llm_throughput.py --device cuda``: our GPT trainer against a plain PyTorch loop
  (key: our tokens/s and the ratio ours / plain).

The benches run small GPU settings (:data:`GCN_ARGS`, :data:`LLM_ARGS`) so the whole check
fits the budget. Printed: one table (check, status, key number, seconds), then the output
tail of anything that did not pass and the directory holding every log. A bench row with a
target (the dropout recipe at most PyG's epoch at 100K nodes; the GPT at least 0.95 of the
plain loop) prints it beside its number, and is ``missed`` where it ran but missed it. Exit
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
BUDGET_S = 600.0  # the whole check; each command also has its own limit
GRACE_S = 15.0  # after a command's limit, before it is killed (pytest writes its report)
NO_GPU = "no CUDA device: nothing to check"
JUNIT = "pytest-gpu.xml"  # pytest's report, in the log directory
# small GPU settings: a 100K-node graph (1.6M edges), the small GPT on 8 x 256 tokens
GCN_ARGS = ["--device", "cuda", "--nodes", "100000", "--epochs", "5", "--rounds", "1"]
DROPOUT_ARGS = ["--dropout", "0.5", "--variants", "fixed"]  # the GCN bench again, two processes
LLM_ARGS = ["--device", "cuda", "--preset", "small", "--batch-size", "8", "--seq-len", "256",
            "--steps", "20", "--warmup", "3", "--threads", "0"]


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


# the targets for the rows they apply to
DROPOUT_TARGET = ("ours/PyG <= 1.0 at 100K nodes", lambda key: _number("ours/PyG", key) <= 1.0)
LLM_TARGET = ("ours/plain >= 0.95", lambda key: _number("ours/plain", key) >= 0.95)


def gcn_key(out: str) -> str:
    """``ours/PyG 0.84, ours 0.012 s/epoch`` from bench/gcn_epoch.py's output, else ``?``."""
    ratio = re.search(r"^ratio ours/PyG: ([\d.]+)", out, re.M)
    ours = re.search(r"^ours \(Plexus 1x1x1\)[^\n]*?\s{2,}([\d.]+)", out, re.M)
    if ratio is None or ours is None:
        return "?"
    return f"ours/PyG {ratio[1]}, ours {ours[1]} s/epoch"


def llm_key(out: str) -> str:
    """``ours 123,456 tok/s, ours/plain 0.97`` (with ``, MFU 41.20%`` after the tokens/s where
    the bench knew the device's peak) from bench/llm_throughput.py's output, else ``?``."""
    ours = re.search(r"^ours, grid 1x1x1x1\s.*?\s([\d,]+)(?:\s+([\d.]+)%)?\s*$", out, re.M)
    ratio = re.search(r"throughput ratio ours / plain = ([\d.]+)", out)
    if ratio is None or ours is None:
        return "?"
    share = f", MFU {ours[2]}%" if ours[2] else ""
    return f"ours {ours[1]} tok/s{share}, ours/plain {ratio[1]}"


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
                                *parallel, f"--junitxml={junit}", "tests"], 290.0, "pytest"),
        # (the bench's four processes take longer on some H100 hosts than on others: room for both)
        Check("bench/gcn_epoch.py --device cuda", ["bench/gcn_epoch.py", *GCN_ARGS], 110.0,
              "bench", gcn_key),
        # with OGB's dropout: our masks are hashed on the GPU, PyG's drawn by F.dropout
        Check("bench/gcn_epoch.py --device cuda --dropout 0.5",
              ["bench/gcn_epoch.py", *GCN_ARGS, *DROPOUT_ARGS], 70.0, "bench", gcn_key,
              DROPOUT_TARGET),
        Check("bench/llm_throughput.py --device cuda", ["bench/llm_throughput.py", *LLM_ARGS],
              70.0, "bench", llm_key, LLM_TARGET),
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


def failed(rows: Sequence[Row]) -> bool:
    """Whether anything did not pass (a skip is not a failure; a missed target is)."""
    return any(r.status not in ("passed", "skipped") for r in rows)


def run_check(check: Check, seconds_left: float, log_dir: Path, junit: Path,
              python: str = sys.executable) -> tuple[list[Row], str]:
    """Run one command within its limit and what is left of the budget (less the grace an
    interrupted command gets); its rows and its output."""
    limit = min(check.timeout_s, seconds_left - GRACE_S)
    if limit < 10:
        return [Row(check.name, "not run", "the 10-minute budget is spent", 0.0)], ""
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
    key = check.key(out) if check.key is not None and status == "passed" else ""
    if key and key != "?" and check.target is not None:  # ("?": unread, no verdict)
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
