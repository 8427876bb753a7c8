"""bench/op_peaks.py: the resident peak around each autograd function of one training epoch,
beside the planner's phases, on a small graph."""

import re
import subprocess
import sys

from tests.distributed import ROOT


def test_every_function_of_the_epoch_is_read_in_order_beside_the_planner():
    run = subprocess.run([sys.executable, "-W", "ignore", "bench/op_peaks.py", "--", "--dataset",
                          "planted", "--hidden", "8", "--model", "sage"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    rows = re.findall(r"^  (\w+)\.(forward|backward) +([\d,]+) +([\d,]+) +([\d,]+)$", out, re.M)
    names = [f"{n}.{p}" for n, p, *_ in rows]
    # three layers, forward then backward: the first and last calls are layer 0's
    assert names[0] == "RecomputedMatmul.forward" and names[-1] == "RecomputedMatmul.backward"
    assert names.index("SpMM.backward") > names.index("SpMM.forward")
    for _, _, before, peak, after in rows:
        before, peak, after = (int(v.replace(",", "")) for v in (before, peak, after))
        assert peak >= max(before, after) - 1  # (MiB, rounded)
    top = max(int(r[3].replace(",", "")) for r in rows)
    assert re.search(rf"^peak: {top:,} MiB in \w+\.(forward|backward)$", out, re.M)
    assert re.search(r"^planner, 1x1x1: [\d,]+ MiB = adjacency", out, re.M)
    assert len(re.findall(r"^  phase ", out, re.M)) == 5
