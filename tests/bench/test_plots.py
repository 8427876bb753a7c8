"""bench/plots.py draws every figure of docs/benchmarks.md from the committed results files,
each of which parses with its provenance; the runs copied from docs/benchmarks.md say only
what their section says; the docs link every figure and name the command that draws them."""

import json
import re

import pytest

from bench.provenance import PROVENANCE_FIELDS, read_runs
from tests.bench.scripts import load_bench
from tests.distributed import ROOT

RESULTS = ROOT / "bench" / "results"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
PNG = b"\x89PNG\r\n\x1a\n"
# row columns that describe the workload (written in words in the docs: "200K nodes"), not a
# figure the section reports
SETTINGS = {"nodes", "ranks", "layers", "hidden", "dropout", "round_ratios"}


@pytest.fixture(scope="module")
def plots():
    return load_bench("plots")


def _slug(heading: str) -> str:
    """A markdown heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _sections() -> dict[str, str]:
    """{anchor: the text from its heading to the next heading of any level}."""
    parts = re.split(r"^(#{2,4} .*)$", BENCHMARKS.read_text(), flags=re.M)
    return {_slug(head.lstrip("#")): body for head, body in zip(parts[1::2], parts[2::2])}


def test_every_figure_has_its_results_file_and_every_file_a_figure(plots):
    files = {p.name for p in RESULTS.glob("*.json")}
    assert files == set(plots.FIGURES)


@pytest.mark.parametrize("name", ["epoch_time.json", "scaling.json", "memory_per_rank.json"])
def test_a_results_file_parses_with_the_provenance_of_every_run(name):
    runs = read_runs(RESULTS / name)
    assert runs and all(run["rows"] for run in runs)
    for run in runs:
        prov = run["provenance"]
        assert all(prov[k] and prov[k] != "not recorded" for k in ("date", "commit"))
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", prov["date"])
        assert "python bench/" in prov["command"]


@pytest.mark.parametrize("name", ["epoch_time.json", "scaling.json", "memory_per_rank.json"])
def test_runs_copied_from_the_docs_report_only_what_their_section_reports(name):
    """A copied run's section exists and states its date, commit and machine; every figure
    in its rows is printed in that section."""
    sections = _sections()
    for run in read_runs(RESULTS / name):
        source = run["provenance"].get("source")
        if source is None:
            continue  # written by a bench: its own provenance
        doc, anchor = source.split("#")
        assert doc == "docs/benchmarks.md" and anchor in sections, source
        text = sections[anchor]
        prov = run["provenance"]
        assert f"date={prov['date']}; commit={prov['commit']}; machine={prov['machine']}" \
            in text, (source, prov)
        assert prov["command"] in text, (source, prov["command"])
        for row in run["rows"]:
            for key, value in row.items():
                if key in SETTINGS or not isinstance(value, (int, float)):
                    continue
                assert f"{value:g}" in text, f"{name} {source}: {key}={value} not in the section"


def test_plots_draws_every_figure_from_the_committed_results(plots, tmp_path, capsys):
    assert plots.main(["--out", str(tmp_path)]) == 0
    for _, image in plots.FIGURES.values():
        data = (tmp_path / image).read_bytes()
        assert data.startswith(PNG), image
        assert 5_000 < len(data) < 400_000, (image, len(data))
    assert "absent" not in capsys.readouterr().err


def test_the_docs_show_every_committed_figure_and_the_command(plots):
    text = BENCHMARKS.read_text()
    assert "python bench/plots.py" in text
    for _, image in plots.FIGURES.values():
        assert (ROOT / "docs" / "img" / image).is_file(), image
        assert f"](img/{image})" in text, f"docs/benchmarks.md does not link img/{image}"


def test_a_results_file_no_figure_draws_is_refused(plots, tmp_path, capsys):
    (tmp_path / "mystery.json").write_text(json.dumps({"runs": []}))
    with pytest.raises(SystemExit) as exc:
        plots.main(["--results", str(tmp_path), "--out", str(tmp_path / "img")])
    assert exc.value.code == 2
    assert "mystery.json" in capsys.readouterr().err


def test_a_figure_from_bench_written_rows(plots, tmp_path):
    """Rows as the benches write them (memory.py's three cases, scaling's split, a CPU and a
    GPU epoch) draw without the copied runs' gaps."""
    prov = {k: "x" for k in PROVENANCE_FIELDS}
    memory = [{"bench": "memory", "case": "plexus", "provenance": prov,
               "rows": [{"ranks": g, "peak_epoch_mib": 900 / g + 100, "planner_mib": 800 / g,
                         "features_and_optimizer_mib": 300 / g} for g in (1, 2, 4, 8)]},
              {"bench": "memory", "case": "ogb", "provenance": prov,
               "rows": [{"run": "1 rank, prepares", "ranks": 1, "peak_mib": 3000.0},
                        {"run": "1 rank, reuses", "ranks": 1, "peak_mib": 2500.0,
                         "planner_mib": 2400.0},
                        {"run": "8 ranks 2x2x2", "ranks": 8, "peak_mib": 1000.0,
                         "planner_mib": 900.0}]}]
    plots.memory_per_rank(memory, tmp_path / "m.png")
    rows = [{"ranks": 4, "grid": g, "measured_ms": m, "measured_comm_ms": 20.0,
             "predicted_ms": p, "pred_compute_ms": p - 30, "pred_comm_ms": 30.0}
            for g, m, p in (("1x1x4", 100.0, 90.0), ("2x2x1", 120.0, 130.0))]
    plots.scaling([{"bench": "scaling", "provenance": prov, "rows": rows}], tmp_path / "s.png")
    epoch = [{"bench": "gcn_epoch", "device": d, "provenance": prov,
              "rows": [{"variant": "fixed", "nodes": n, "ours_s": n / 1e6, "pyg_s": n / 5e5,
                        "dropout": 0.5, "norm": "batch"} for n in (10_000, 100_000)]}
             for d in ("cpu", "cuda")]
    plots.epoch_time(epoch, tmp_path / "e.png")
    assert all((tmp_path / f).read_bytes().startswith(PNG) for f in ("m.png", "s.png", "e.png"))
