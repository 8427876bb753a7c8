"""The check against the Plexus paper (SC'25) on the shipped GPU profiles."""

import re

import pytest

from common.perf import paper
from common.perf.gcn import plan_gcn
from common.perf.machine import load_profile

# The one number the model misses: ogbn-papers100M on 2048 A100s, predicted at 0.55x the paper
# (the modelled epoch is the training step alone, as the paper's code times it). The paper's
# 1024 -> 2048 step speeds up only 1.19x where its other doublings give 1.39-1.47x; the model,
# communication-bound there, keeps scaling (1.57x). test_known_gap_is_the_last_doubling checks
# these numbers; the range is pinned so that a regression elsewhere shows.
KNOWN_GAPS = {("ogbn-papers100M", "perlmutter-a100", 2048): (0.5, 0.6)}


def printed_as(text: str, value: float) -> bool:
    """Whether ``text`` is ``value`` rounded to the decimals ``text`` shows."""
    decimals = len(text.partition(".")[2])
    return abs(float(text) - value) <= 0.5 * 10.0 ** -decimals + 1e-9 * abs(value)


@pytest.fixture(scope="module")
def rows():
    return paper.compare()


def test_every_paper_number_is_compared(rows):
    assert [r.number for r in rows] == list(paper.PAPER_NUMBERS)
    assert all(r.prediction.runnable for r in rows)
    assert all(paper.paper_workload(n.dataset).learn_features for n in paper.PAPER_NUMBERS)


def test_products_ranks_3d_above_2d_above_1d_on_64_gpus(rows):
    """Paper: best 3D 69, best 2D 82, best 1D 180 ms."""
    best = paper.products_by_dims(rows)
    assert {d: c.prediction.dims for d, c in best.items()} == {3: 3, 2: 2, 1: 1}
    assert best[3].predicted_ms < best[2].predicted_ms < best[1].predicted_ms
    assert not [p for p in paper.problems(rows) if "3D < 2D < 1D" in p]


def test_bounded_numbers_within_1_5x(rows):
    for r in rows:
        if not r.number.bounded:
            continue
        key = (r.number.dataset, r.number.machine, r.number.gpus)
        low, high = KNOWN_GAPS.get(key, (1 / paper.BOUND, paper.BOUND))
        assert low <= r.ratio <= high, (r.number.label(), r.prediction.label(), r.ratio)
    assert len(paper.problems(rows)) == len(KNOWN_GAPS)


def test_known_gap_is_the_last_doubling(rows):
    """The numbers of the KNOWN_GAPS comment: on ogbn-papers100M over 64 .. 2048 A100s only the
    paper's last doubling stalls, while the model, dominated by communication there, does not."""
    papers = {r.number.gpus: r for r in rows
              if r.number.dataset == "ogbn-papers100M" and r.number.machine == paper.PERLMUTTER}
    steps = [(g, papers[g // 2], papers[g]) for g in sorted(papers)[1:]]
    paper_steps = {g: a.number.paper_ms / b.number.paper_ms for g, a, b in steps}
    model_steps = {g: a.predicted_ms / b.predicted_ms for g, a, b in steps}
    assert round(paper_steps.pop(2048), 2) == 1.19
    assert (round(min(paper_steps.values()), 2), round(max(paper_steps.values()), 2)) \
        == (1.39, 1.47)
    assert round(model_steps[2048], 2) == 1.57
    assert round(papers[2048].ratio, 2) == 0.55
    last = papers[2048].prediction
    assert last.comm_s > last.compute_s


def test_table_prints_each_numbers_best_prediction(rows):
    """Every row: the fastest grid that fits, as the model predicts it on the shipped profile
    (recomputed here from plan_gcn), with its split, memory, the paper's number and the ratio."""
    lines = paper.table(rows).splitlines()
    assert lines[0].split() == ["paper", "number", "grid", "pred", "ms", "compute", "comm", "GiB",
                                "paper", "ms", "pred/paper", "bounded"]
    body = lines[1:1 + len(paper.PAPER_NUMBERS)]
    assert len(lines) == len(body) + 2
    best_ms = {}
    for line, num in zip(body, paper.PAPER_NUMBERS, strict=True):
        label = num.label()
        assert line[:40].rstrip() == label, (line, label)
        grid, pred, compute, comm, gib, paper_ms, ratio, bounded = line[40:].split()
        plan = plan_gcn(paper.paper_workload(num.dataset), num.gpus, load_profile(num.machine))
        fits = [p for p in plan.runnable if num.dims in (None, p.dims)]
        (shown,) = [p for p in fits if p.label() == grid]
        assert shown.total_s == min(p.total_s for p in fits), (label, grid)
        expected = [(pred, 1e3 * shown.total_s), (compute, 1e3 * shown.compute_s),
                    (comm, 1e3 * shown.comm_s), (gib, shown.memory / 2**30),
                    (paper_ms, num.paper_ms), (ratio, 1e3 * shown.total_s / num.paper_ms)]
        for text, value in expected:
            assert printed_as(text, value), (label, text, value)
        assert bounded == ("yes" if num.bounded else "no"), label
        best_ms[num] = 1e3 * shown.total_s
    products = {n.dims: best_ms[n] for n in paper.PAPER_NUMBERS
                if n.dataset == "ogbn-products" and n.gpus == 64 and n.dims}
    m = re.fullmatch(r"ogbn-products, 64 GPUs: 2D/3D (\S+) \(paper 1\.19\), "
                     r"1D/3D (\S+) \(paper 2\.61\)", lines[-1])  # 82 / 69, 180 / 69
    assert m, lines[-1]
    assert printed_as(m.group(1), products[2] / products[3]), lines[-1]
    assert printed_as(m.group(2), products[1] / products[3]), lines[-1]
