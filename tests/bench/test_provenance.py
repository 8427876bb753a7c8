"""bench/provenance.py: a run's provenance is taken whole, and a results file holds only runs
that carry theirs."""

import json
import shlex

import pytest

from bench.provenance import PROVENANCE_FIELDS, append_run, command, machine, provenance, read_runs


def _run(**provenance_fields):
    prov = {"date": "2026-01-02", "commit": "abc1234", "machine": "m", "command": "c",
            **provenance_fields}
    return {"bench": "b", "provenance": {k: v for k, v in prov.items() if v is not None},
            "rows": [{"x": 1}]}


def test_a_provenance_has_every_field_and_the_command_reads_back():
    argv = ["--nodes", "500", "--note", "two words"]
    prov = provenance("gcn_epoch.py", argv)
    assert all(isinstance(prov[k], str) and prov[k] for k in PROVENANCE_FIELDS)
    assert shlex.split(prov["command"]) == ["python", "bench/gcn_epoch.py", *argv]
    assert command("x.py", []) == "python bench/x.py"
    assert "cores" in machine() and "cores" in prov["machine"]


def test_append_run_creates_the_file_and_appends(tmp_path):
    path = tmp_path / "new" / "r.json"
    append_run(path, _run())
    append_run(path, _run(commit="def5678"))
    assert [r["provenance"]["commit"] for r in read_runs(path)] == ["abc1234", "def5678"]
    assert not list(path.parent.glob("*.tmp"))


@pytest.mark.parametrize("field", PROVENANCE_FIELDS)
@pytest.mark.parametrize("value", [None, ""])
def test_a_run_without_a_provenance_field_is_refused(tmp_path, field, value):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"runs": [_run(), _run(**{field: value})]}))
    with pytest.raises(ValueError, match=rf"run 1: provenance lacks \['{field}'\]"):
        read_runs(path)
    with pytest.raises(ValueError, match="provenance lacks"):
        append_run(tmp_path / "other.json", _run(**{field: value}))
    assert not (tmp_path / "other.json").exists()


@pytest.mark.parametrize("data, message", [
    ([], "expected"),
    ({"runs": [{"provenance": {}, "rows": []}]}, "no 'bench'"),
    ({"runs": [{"bench": "b", "rows": []}]}, "no 'provenance'"),
    ({"runs": [{**_run(), "rows": {"x": 1}}]}, "'rows' is not a list"),
])
def test_a_file_that_is_not_runs_is_refused(tmp_path, data, message):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        read_runs(path)
