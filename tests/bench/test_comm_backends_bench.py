"""bench/comm_backends.py on make train's job (the planted graph), 3 epochs, on 2 ranks
(``--ranks 2``; the bench's default is 4) over both transports and on 1 rank: every number it
prints (median time, comm share, iterations, torch / mpi, 2 ranks / 1 rank and its verdict) is
recomputed from the per-epoch measurements it writes with ``--json``, and must match. Also: the
same job computes the same losses on either transport and on 1 rank, and sends the same bytes
every epoch on either transport (none on 1 rank). No time is compared with a threshold: the
target decides only the verdict, which must follow from the measured times."""

import json
import re
import statistics

import pytest

from tests.distributed import ROOT, launch, needs_mpi

SCRIPT = ROOT / "bench" / "comm_backends.py"
EPOCHS = 3  # the first is warm-up: medians over 2
RUNS = ("torch", "mpi", "one rank")
SCALING_TARGET = 5.0  # issue 12: N-rank / 1-rank epoch time at most 5
ROW = re.compile(r"^planted\s+(torch|mpi|one rank)\s+(\S+)\s+(\S+)%\s+(\d+)$", re.M)
TORCH_OVER_MPI = re.compile(r"^planted\s+torch / mpi time = (\S+)$", re.M)
SCALING = re.compile(r"^planted\s+2 ranks \(mpi\) / 1 rank epoch time = (\S+) "
                     r"\(target <= 5: (met|MISSED)\)$", re.M)


def printed_as(text: str, value: float) -> bool:
    """Whether ``text`` is ``value`` rounded to the decimals ``text`` shows."""
    decimals = len(text.partition(".")[2])
    return abs(float(text) - value) <= 0.5 * 10.0 ** -decimals + 1e-9 * abs(value)


@needs_mpi
@pytest.mark.slow
@pytest.mark.cross_shape  # 1 rank against 2: dense products of other heights (losses below)
def test_bench_comm_backends_prints_what_it_measured(tmp_path):
    out = tmp_path / "comm.json"
    r = launch([str(SCRIPT), "--jobs", "planted", "--epochs", str(EPOCHS), "--ranks", "2",
                "--json", str(out)],
               launcher="single", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    saved = json.loads(out.read_text())
    assert saved["failures"] == [] and list(saved["jobs"]) == ["planted"]
    job = saved["jobs"]["planted"]
    runs = job["runs"]
    assert list(runs) == list(RUNS)

    printed = {m.group(1): m.groups()[1:] for m in ROW.finditer(r.stdout)}
    assert list(printed) == list(RUNS), r.stdout
    seconds = {}
    for name, run in runs.items():
        assert [len(run[k]) for k in ("times_s", "comm_s", "comm_bytes", "losses")] \
            == [EPOCHS] * 4, (name, run)
        timed = list(zip(run["times_s"], run["comm_s"], strict=True))[1:]  # after warm-up
        seconds[name] = statistics.median(t for t, _ in timed)
        share = statistics.median(c / t for t, c in timed)
        assert run["seconds"] == pytest.approx(seconds[name], rel=1e-12), name
        assert run["comm_share"] == pytest.approx(share, rel=1e-12), name
        assert run["iterations"] == EPOCHS - 1
        median_s, share_pct, iters = printed[name]
        assert printed_as(median_s, seconds[name]), (name, median_s, seconds[name])
        assert printed_as(share_pct, 100 * share), (name, share_pct, share)
        assert int(iters) == EPOCHS - 1

    torch_over_mpi = seconds["torch"] / seconds["mpi"]
    assert job["torch_over_mpi"] == pytest.approx(torch_over_mpi, rel=1e-12)
    (text,) = TORCH_OVER_MPI.findall(r.stdout)
    assert printed_as(text, torch_over_mpi), (text, torch_over_mpi)
    scaling = seconds["mpi"] / seconds["one rank"]
    met = scaling <= SCALING_TARGET
    assert job["ranks_over_one"] == pytest.approx(scaling, rel=1e-12)
    assert job["target_met"] is met
    ((text, verdict),) = SCALING.findall(r.stdout)
    assert printed_as(text, scaling) and verdict == ("met" if met else "MISSED"), r.stdout

    # the same numbers on every run: same losses (2 ranks on either transport, and 1 rank), to
    # rounding: 2 ranks multiply dense blocks of half the height of 1 rank's (MKL/oneDNN sum
    # in other orders; the SpMM kernels and a 2-rank sum fix theirs), and 3 epochs of updates
    # carry such differences on, so no first-order bound applies; rel 1e-4 (the bench's own
    # transport check) is generous against float32's 6e-8 per operation at this toy size
    losses = runs["one rank"]["losses"]
    for name in ("torch", "mpi"):
        assert runs[name]["losses"] == pytest.approx(losses, rel=1e-4), name
    # the same bytes every epoch on either transport; nothing to send on 1 rank
    sent = runs["torch"]["comm_bytes"]
    assert sent == runs["mpi"]["comm_bytes"] and sent == [sent[0]] * EPOCHS and sent[0] > 0
    assert runs["one rank"]["comm_bytes"] == [0] * EPOCHS
