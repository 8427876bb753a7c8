"""bench/spmm.py at a small size: every number it prints is recomputed from what it writes with
``--json`` (each round's time, the copy times, the byte counts) and must match; the byte count
follows the stated formula on the bench's own matrices; the verdict follows the ratio; every
blocked variant is bit-identical to the row kernel (exit 0). No time is compared with a
threshold."""

import json
import math
import re
import statistics

import numpy as np

from common.mpi import cores_available
from tests.bench.scripts import load_bench
from tests.distributed import ROOT, launch

SCRIPT = ROOT / "bench" / "spmm.py"
# two threads where the test may use two cores (one under a pinned pytest-xdist worker)
THREADS = min(2, cores_available())
ARGS = ["--nodes", "3000", "--nnz", "60000", "--rmat-scale", "11", "--rmat-edge-factor", "16",
        "--width", "32", "--reps", "3", "--threads", str(THREADS), "--sweep-slices", "1,3",
        "--feature-tiles", "16", "--cache-bytes", str(64 << 10), "--copy-mib", "16"]
# kernel, ms, GB/s, of copy, gather GB/s, identical
ROW = re.compile(r"^(rows|blocked(?: [St]=\d+)?|torch CSR)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)"
                 r"\s+([0-9.]+)\s+(yes|NO|-)\s*$")


def printed_as(text: str, value: float) -> bool:
    """Whether ``text`` is ``value`` rounded to the decimals ``text`` shows."""
    decimals = len(text.partition(".")[2])
    return abs(float(text) - value) <= 0.5 * 10.0 ** -decimals + 1e-9 * abs(value)


def printed_cases(stdout: str) -> dict[str, dict[str, list[str]]]:
    """case -> kernel -> the printed fields after the name; plus the ratio line."""
    cases, name = {}, None
    for line in stdout.splitlines():
        if m := re.match(r"^# (uniform|rmat): ", line):
            name = m.group(1)
            cases[name] = {}
        elif (m := ROW.match(line)) and name is not None:
            assert m.group(1) not in cases[name], line
            cases[name][m.group(1)] = list(m.groups()[1:])
        elif (m := re.match(r"^blocked/rows = ([0-9.]+)x", line)) and name is not None:
            cases[name]["ratio"] = [m.group(1)]
    return cases


def test_bench_spmm_prints_what_it_measured(tmp_path):
    out = tmp_path / "spmm.json"
    r = launch([str(SCRIPT), *ARGS, "--json", str(out)], launcher="single", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    saved = json.loads(out.read_text())
    assert saved["threads"] == saved["numba_threads"] == THREADS
    assert f"threads: torch {THREADS}, numba {THREADS}" in r.stdout
    copy_gbps = saved["copy_bytes"] / statistics.median(saved["copy_times_s"]) / 1e9
    assert saved["copy_gbps"] == copy_gbps and len(saved["copy_times_s"]) == 2 * 3
    assert f"copy bandwidth: {copy_gbps:.2f} GB/s" in r.stdout

    bench = load_bench("spmm")
    matrices = {"uniform": bench.uniform_matrix(3000, 60000, 0),
                "rmat": bench.rmat_matrix(11, 16, 0)}
    printed = printed_cases(r.stdout)
    assert list(printed) == [c["name"] for c in saved["cases"]] == ["uniform", "rmat"]
    for case in saved["cases"]:
        m = matrices[case["name"]]
        # the byte counts from the matrix: indptr + indices + values (int32, int32, float32),
        # distinct referenced columns' X rows once, the output; one X row per nonzero instead
        referenced = len(np.unique(m.indices))
        nbytes = 4 * (m.shape[0] + 1) + 8 * m.nnz
        assert case["nnz"] == m.nnz and case["index_dtype"] == "int32"
        assert case["bytes"] == nbytes + 4 * 32 * (referenced + m.shape[0])
        assert case["gather_bytes"] == 8 * m.nnz + 4 * 32 * (m.nnz + m.shape[0])
        # the default slicing from --cache-bytes: 64 KiB / CACHE_SHARE / 128-byte rows, but
        # no more slices than one more than the mean row length
        cols = max((64 << 10) // bench.slicing.CACHE_SHARE // 128,
                   math.ceil(m.shape[1] / (1 + m.nnz // m.shape[0])))
        assert case["slice_cols"] == cols and case["num_slices"] == math.ceil(m.shape[1] / cols)
        assert case["plan_bytes"] >= 2 * (case["num_slices"] - 1) * m.shape[0]  # uint16 cuts

        names = ["rows", "blocked", "torch CSR", "blocked S=1", "blocked S=3", "blocked t=16"]
        assert list(case["kernels"]) == names
        assert list(printed[case["name"]]) == [*names, "ratio"], r.stdout
        assert case["identical"] == {k: True for k in names if k.startswith("blocked")}
        for kname, k in case["kernels"].items():
            sec = statistics.median(k["times_s"])
            assert len(k["times_s"]) == 3
            values = (1e3 * sec, case["bytes"] / sec / 1e9,
                      case["bytes"] / sec / 1e9 / copy_gbps, case["gather_bytes"] / sec / 1e9)
            *texts, same = printed[case["name"]][kname]
            for text, value in zip(texts, values, strict=True):
                assert printed_as(text, value), (case["name"], kname, text, value)
            assert same == ("-" if kname in ("rows", "torch CSR") else "yes")
        ratio = (statistics.median(case["kernels"]["rows"]["times_s"])
                 / statistics.median(case["kernels"]["blocked"]["times_s"]))
        assert math.isclose(case["ratio"], ratio, rel_tol=1e-12)
        assert printed_as(printed[case["name"]]["ratio"][0], ratio)

    ratio = saved["cases"][0]["ratio"]
    assert saved["target"] == {"case": "uniform", "min_ratio": 1.5, "ratio": ratio,
                               "met": ratio >= 1.5}
    verdict = "met" if ratio >= 1.5 else "MISSED"
    assert f"blocked/rows >= 1.5x bytes/s: {verdict} ({ratio:.3f}x)" in r.stdout
    assert "bit-identical to the row kernel: yes" in r.stdout and saved["identical"] is True
