"""Where a bench result came from, and the JSON files of record that hold the results.

A bench given ``--json PATH`` (bench/gcn_epoch.py, bench/scaling.py, bench/memory.py) appends
one *run* to PATH, which holds ``{"runs": [run, ...]}``; bench/plots.py draws the figures of
docs/benchmarks.md from the files under bench/results/. A run is a JSON object::

    {"bench": "gcn_epoch",                  # the bench script that produced it
     "provenance": {"date": "2026-11-26",   # the fields of a docs/benchmarks.md provenance line
                    "commit": "7aeba2c",
                    "machine": "AMD EPYC, 2 cores, AVX2, no AVX-512, 23.5 GiB",
                    "command": "python bench/gcn_epoch.py --nodes 20000",
                    ...},                   # optional: time, dirty, torch, source
     "rows": [{...}, ...],                  # the bench's result rows (its own columns)
     ...}                                   # bench-specific fields (device, case, summary)

A run copied from docs/benchmarks.md (measured before the benches wrote JSON) carries
``provenance["source"]``, the section it was copied from, and the provenance line's date,
commit, machine and command as that section states them.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# the fields every run's provenance has, each a non-empty string
PROVENANCE_FIELDS = ("date", "commit", "machine", "command")
NOT_RECORDED = "not recorded"


def git_commit(root: Path = ROOT) -> tuple[str, bool]:
    """(short hash of HEAD, whether tracked files differ from it); ``not recorded`` outside a
    git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=root,
                               capture_output=True).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return NOT_RECORDED, False
    return head or NOT_RECORDED, dirty


def cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    first = text.split("\n\n", 1)[0]
    return {k.strip(): v.strip() for k, v in
            (line.split(":", 1) for line in first.splitlines() if ":" in line)}


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine(device: str = "cpu") -> str:
    """The machine in words: CPU model, the cores this process may use, the vector extensions
    the kernels' speed depends on, memory; with ``device="cuda"`` the GPU's name after it."""
    info = cpuinfo()
    flags = set(info.get("flags", "").split())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parts = [info.get("model name") or platform.processor() or platform.machine(),
             f"{cores} cores"]
    if flags:
        parts.append(("AVX-512" if "avx512f" in flags else
                      "AVX2, no AVX-512" if "avx2" in flags else "no AVX2")
                     + (", bf16" if "avx512_bf16" in flags else ""))
    if (gib := _memory_gib()) is not None:
        parts.append(f"{gib:.1f} GiB")
    out = ", ".join(parts)
    if device == "cuda":
        import torch

        if torch.cuda.is_available():
            out += f"; GPU {torch.cuda.get_device_name()}"
    return out


def command(script: str, argv: Sequence[str]) -> str:
    """``python bench/<script> ARGS`` as a shell would take it back."""
    return " ".join(["python", f"bench/{script}", *(shlex.quote(a) for a in argv)])


def provenance(script: str, argv: Sequence[str], device: str = "cpu") -> dict[str, Any]:
    """The provenance of a run of ``bench/<script>`` with ``argv``, taken now."""
    commit, dirty = git_commit()
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "time": time.strftime("%H:%M:%S"),
                           "commit": commit, "dirty": dirty, "machine": machine(device),
                           "command": command(script, argv)}
    if (torch := sys.modules.get("torch")) is not None:
        out["torch"] = torch.__version__
    return out


def check_run(run: Any, where: str = "run") -> None:
    """Raise ValueError unless ``run`` is a run: ``bench``, ``provenance`` with every field of
    :data:`PROVENANCE_FIELDS` a non-empty string, and a list of row objects."""
    if not isinstance(run, dict):
        raise ValueError(f"{where}: not a JSON object")
    if not isinstance(run.get("bench"), str) or not run["bench"]:
        raise ValueError(f"{where}: no 'bench' naming the script")
    prov = run.get("provenance")
    if not isinstance(prov, dict):
        raise ValueError(f"{where}: no 'provenance' object")
    missing = [k for k in PROVENANCE_FIELDS if not isinstance(prov.get(k), str) or not prov[k]]
    if missing:
        raise ValueError(f"{where}: provenance lacks {missing} (each a non-empty string; "
                         f"'{NOT_RECORDED}' where the records say nothing)")
    rows = run.get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{where}: 'rows' is not a list of objects")


def read_runs(path: str | Path) -> list[dict[str, Any]]:
    """The runs of a results file, each checked by :func:`check_run`."""
    path = Path(path)
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise ValueError(f"{path}: expected {{\"runs\": [...]}}")
    for i, run in enumerate(data["runs"]):
        check_run(run, f"{path} run {i}")
    return data["runs"]


def append_run(path: str | Path, run: dict[str, Any]) -> None:
    """Add ``run`` to the runs of ``path`` (created with its folder if absent), the file
    replaced whole so that an interrupted write leaves the old one."""
    check_run(run)
    path = Path(path)
    runs = read_runs(path) if path.exists() else []
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"runs": [*runs, run]}, indent=1) + "\n")
    tmp.replace(path)
    print(f"appended the run to {path}", flush=True)
