"""bench/llm_throughput.py on the CPU: both sides in bf16 with compiled blocks, the MFU column
for the given peak, and the ratio against the target; with rounds, the lowest round's ratio
and each round's."""

import re

from bench import llm_throughput


def test_bf16_compiled_run_prints_both_sides_mfu_and_the_ratio(capsys):
    assert llm_throughput.main(["--steps", "2", "--warmup", "2", "--batch-size", "2",
                                "--seq-len", "32", "--precision", "bf16", "--compile",
                                "--peak-tflops", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "bf16, compiled blocks" in out
    for side in ("plain PyTorch loop", "ours, grid 1x1x1x1"):
        row = re.search(rf"^{re.escape(side)}\s.*\s([\d,]+)\s+([\d.]+)%$", out, re.M)
        assert row is not None, side
        assert 0 < float(row[2]) < 100, row[0]
    assert re.search(r"throughput ratio ours / plain = [\d.]+ \(target >= 0.95: ", out)


def test_rounds_print_the_lowest_rounds_ratio_and_each(capsys):
    assert llm_throughput.main(["--steps", "2", "--warmup", "1", "--batch-size", "2",
                                "--seq-len", "32", "--rounds", "3"]) == 0
    out = capsys.readouterr().out
    line = re.search(r"ratio ours / plain = ([\d.]+) \(the lowest of 3 rounds: "
                     r"([\d.]+), ([\d.]+), ([\d.]+)\) \(target >= 0.95 in every round: ", out)
    assert line is not None, out
    assert float(line[1]) == min(float(line[i]) for i in (2, 3, 4))
