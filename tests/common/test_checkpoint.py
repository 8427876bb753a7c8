"""Atomic checkpoints: keep-last-K, checksums, crash during a save, corruption fallback."""

import json
import os

import pytest

from common import checkpoint as ckpt


def _files(tag):
    return {"a.bin": f"alpha-{tag}".encode() * 100, "b.json": json.dumps({"tag": tag}).encode()}


def test_save_load_and_keep_last_k(tmp_path):
    for step in range(1, 6):
        ckpt.save(tmp_path, step, _files(step), {"model": "m"}, keep=2)
    assert ckpt.list_steps(tmp_path) == [4, 5]
    files, manifest, path = ckpt.load_latest(tmp_path)
    assert manifest["step"] == 5 and manifest["meta"] == {"model": "m"}
    assert files == _files(5) and path.name == "step-00000005"


def test_pruning_keeps_what_was_just_written_and_ignores_later_steps(tmp_path):
    """A save whose step is below the newest under the root (a run resumed past a damaged
    newest checkpoint, or a shorter run where a longer one wrote) keeps itself and the
    ``keep - 1`` newest earlier ones; the later ones neither go nor count."""
    for step in (2, 4, 6):
        ckpt.save(tmp_path, step, _files(step), {}, keep=5)
    ckpt.save(tmp_path, 3, _files(3), {}, keep=2)
    assert ckpt.list_steps(tmp_path) == [2, 3, 4, 6]
    ckpt.save(tmp_path, 5, _files(5), {}, keep=1)
    assert ckpt.list_steps(tmp_path) == [5, 6]
    ckpt.save(tmp_path, 1, _files(1), {}, keep=1)
    assert ckpt.list_steps(tmp_path) == [1, 5, 6]
    ckpt.save(tmp_path, 7, _files(7), {}, keep=10)  # more kept than there are: none go
    assert ckpt.list_steps(tmp_path) == [1, 5, 6, 7]


def test_crash_between_files_never_damages_the_newest(tmp_path, monkeypatch):
    ckpt.save(tmp_path, 1, _files(1), {}, keep=3)
    real_open = open
    calls = {"n": 0}

    def failing_open(path, mode="r", *a, **kw):
        if "w" in mode and ".tmp-" in str(path):
            calls["n"] += 1
            if calls["n"] == 2:  # interrupt the save between its first and second file
                raise KeyboardInterrupt("killed mid-save")
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr("builtins.open", failing_open)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(tmp_path, 2, _files(2), {}, keep=3)
    monkeypatch.undo()
    assert ckpt.list_steps(tmp_path) == [1]  # the half-written one never got its name
    files, manifest, _ = ckpt.load_latest(tmp_path)
    assert manifest["step"] == 1 and files == _files(1)
    ckpt.save(tmp_path, 2, _files(2), {}, keep=3)  # the next save still works
    assert ckpt.load_latest(tmp_path)[1]["step"] == 2


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_corrupt_newest_falls_back_to_older(tmp_path, damage, capsys):
    ckpt.save(tmp_path, 1, _files(1), {}, keep=3)
    newest = ckpt.save(tmp_path, 2, _files(2), {}, keep=3)
    target = newest / ("manifest.json" if damage == "manifest" else "a.bin")
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        target.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    elif damage == "delete":
        os.remove(target)
    else:
        target.write_text("{not json")
    with pytest.raises(ckpt.CheckpointError):
        ckpt.load(newest)
    files, manifest, _ = ckpt.load_latest(tmp_path)
    assert manifest["step"] == 1 and files == _files(1)
    assert "trying an older checkpoint" in capsys.readouterr().err


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="no intact checkpoint"):
        ckpt.load_latest(tmp_path / "nothing-here")


def test_directory_that_cannot_exist(tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ckpt.CheckpointError, match="cannot create checkpoint directory"):
        ckpt.save(tmp_path / "a-file" / "ckpt", 1, _files(1), {})


def test_unwritable_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):  # running as root: permissions are not enforced
            pytest.skip("directory permissions are not enforced for this user")
        with pytest.raises(ckpt.CheckpointError, match="not writable"):
            ckpt.save(ro, 1, _files(1), {})
    finally:
        ro.chmod(0o700)
