"""bench/memory.py's records with the ranks replaced by fixed peaks: byte counts become MiB
under names that say so, and ``--json`` appends each case's run with its provenance beside
the memory.jsonl line."""

import json

import pytest

from bench.provenance import read_runs
from tests.bench.scripts import load_bench

MIB = 2**20


def test_byte_counts_become_mib_and_the_rest_stays():
    module = load_bench("memory")
    row = {"ranks": 8, "grid": "2x2x2", "peak_bytes": 3 * MIB, "peak_epoch": 5 * MIB,
           "param_bytes_per_rank": MIB // 2, "bound": 10 * MIB, "start_bytes": None,
           "gpu_peak_allocated_save": 7 * MIB, "wall_s": 1.5, "storage": "memory-mapped"}
    assert module.mib_row(row) == {
        "ranks": 8, "grid": "2x2x2", "peak_mib": 3.0, "peak_epoch_mib": 5.0,
        "param_per_rank_mib": 0.5, "bound_mib": 10.0, "start_mib": None,
        "gpu_peak_allocated_save_mib": 7.0, "wall_s": 1.5, "storage": "memory-mapped"}


def test_json_appends_the_llm_case_with_its_provenance(monkeypatch, tmp_path, capsys):
    module = load_bench("memory")
    jsonl = tmp_path / "memory.jsonl"
    monkeypatch.setattr(module, "RESULTS", jsonl)
    launched = []

    def launch(ranks, worker_args):
        launched.append(ranks)
        if ranks == 8:
            return {"param_bytes_per_rank": 100 * MIB, "peak_build": 300 * MIB,
                    "peak_save": 310 * MIB}
        return {"param_bytes_per_rank": 200 * MIB, "peak_build": 500 * MIB,
                "peak_load": 600 * MIB, "peak_generate": 520 * MIB, "tokens": 7.0}

    monkeypatch.setattr(module, "_launch", launch)
    path = tmp_path / "memory_per_rank.json"
    argv = ["llm", "--checkpoint-dir", str(tmp_path / "ck"), "--json", str(path)]
    assert module.main(argv) == 0
    assert launched == [8, 4]
    (run,) = read_runs(path)
    assert (run["bench"], run["case"], run["ok"], run["device"]) == ("memory", "llm", True,
                                                                    "cpu")
    assert run["provenance"]["command"] == "python bench/memory.py " + " ".join(argv)
    assert [(r["ranks"], r["step"], r["peak_mib"], r["param_per_rank_mib"])
            for r in run["rows"]] == [(8, "build", 300.0, 100.0), (8, "save", 310.0, 100.0),
                                      (4, "build", 500.0, 200.0), (4, "load", 600.0, 200.0),
                                      (4, "generate", 520.0, 200.0)]
    assert run["rows"][0]["bound_mib"] == pytest.approx(1.5 * 100 + 0.6 * 1024, abs=0.05)
    (line,) = jsonl.read_text().splitlines()  # the bytes record, as before
    assert json.loads(line)["rows"][0]["peak_bytes"] == 300 * MIB
    plots = load_bench("plots")
    plots.memory_per_rank([run], tmp_path / "m.png")
    assert (tmp_path / "m.png").read_bytes().startswith(b"\x89PNG")
