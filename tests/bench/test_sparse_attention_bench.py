"""Smoke test of bench/sparse_attention.py --quick: a toy GPT trained by python -m llm.train
--init (a 64-token context), then every method at every budget (Sift with the warm-up and
refit interval given), QuantSpec, the plot or CSV and the checks. The Loki threshold needs the
full run's model, so only its presence and the exit status's agreement with the checks are
asserted here."""

import json

import pytest

from tests.bench.scripts import load_bench


def test_quick_run_prints_every_row(tmp_path, capsys):
    code = load_bench("sparse_attention").main(
        ["--quick", "--out", str(tmp_path / "run"), "--results", str(tmp_path / "results"),
         "--json", "--sift-warmup", "3", "--sift-refit-every", "4"])
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    checks = result["checks"]
    assert code == (0 if all(checks.values()) else 1)
    assert sorted(checks) == ["Loki at 25% budget and 25% rank within 5% of full-attention "
                              "perplexity", "QuantSpec tokens equal greedy decoding"]
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("attention"))
    table = [line.split() for line in lines[header + 1 : header + 11]]
    assert [(r[0], r[1]) for r in table] == [("full", "-")] + [
        (m, b) for b in ("50%", "25%", "12.5%") for m in ("topk", "loki", "sift")]
    rows = result["rows"]
    # "full" is FullAttention's softmax(q k^T) v against the model's own attention kernel:
    # equal logits to rounding, so equal greedy tokens unless two logits nearly tie (none at
    # this seed)
    assert rows[0]["bytes_ratio"] == 1.0 and rows[0]["token_agreement"] == 1.0
    assert all(0 < r["bytes_ratio"] <= 1 for r in rows)
    assert [r["rank"] for r in rows if r["name"] == "loki"] == [0.25] * 3
    q = result["quantspec"]
    assert q["num_prompts"] == 2 and q["generated"] == 2 * 12 and 0 <= q["acceptance_rate"] <= 1
    assert "QuantSpec (gamma 4" in out and "python -m llm.train --init" in out
    assert result["sift"] == {"warmup": 3, "refit_every": 4}
    assert "Sift: 3 full-attention warm-up decode steps, then the quantile re-measured every 4 " \
        "steps" in out
    assert (tmp_path / "results" / "sparse_attention.csv").is_file()
    assert (tmp_path / "run" / "checkpoint" / "step-00000004" / "loki_basis.safetensors").is_file()


@pytest.mark.parametrize("flags", [["--sift-warmup", "1"], ["--sift-refit-every", "-2"]])
def test_bad_sift_flags_are_refused(flags, capsys):
    with pytest.raises(SystemExit):
        load_bench("sparse_attention").parse_args(flags)
    assert "--sift-warmup >= 2 and --sift-refit-every >= 0" in capsys.readouterr().err
