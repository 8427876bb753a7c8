"""Loki's offline step (:mod:`llm.decode.loki`): the bases are PCA bases of the right keys (after or
before RoPE) and round-trip through a file, written whole or not at all; a damaged file is
refused by name; where a checkpoint's basis lives, the calibration batch, calibrating once then
reading the stored basis, and calibration text moved to the model's device (the CUDA run:
test_gpu.py)."""

import pytest
import torch

from llm.data.batches import BYTES, encode_stream
from llm.decode import sparse_attention
from llm.decode.loki import (
    BASIS_FILE,
    LokiBasis,
    basis_path,
    calibrate_loki,
    calibration_batch,
    load_or_calibrate,
)
from llm.model import GPT, apply_rope, rope_cache
from tests.llm.helpers import DECODE_CONFIGS as CONFIGS
from tests.llm.helpers import GQA64 as GQA
from tests.llm.helpers import random_tokens as tokens


def captured_keys(model, text, post_rope):
    """Every layer's keys on ``text`` by a hook of the test's own: [L, Hkv, B * T, Dh]."""
    dh, out = model.config.head_dim, []
    handles = [block.attn.k_proj.register_forward_hook(lambda m, i, o: out.append(o))
               for block in model.blocks]
    with torch.no_grad():
        model(text)
    for handle in handles:
        handle.remove()
    keys = [o.view(*text.shape, -1, dh) for o in out]  # [B, T, Hkv, Dh]
    if post_rope:
        keys = [apply_rope(x, *rope_cache(dh, text.shape[1])) for x in keys]
    return torch.stack([x.permute(2, 0, 1, 3).flatten(1, 2) for x in keys]).double()


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("post_rope", [True, False], ids=["post-rope", "pre-rope"])
def test_the_loki_basis_is_the_keys_pca_and_round_trips(config, post_rope, tmp_path):
    model = GPT(CONFIGS[config], seed=0).eval()
    text = tokens(4, 48, seed=2)
    basis = calibrate_loki(model, text, post_rope=post_rope)
    p = basis.bases.double()  # [L, Hkv, Dh, Dh]
    eye = torch.eye(basis.head_dim, dtype=torch.float64)
    torch.testing.assert_close(p.transpose(-1, -2) @ p, eye.expand_as(p), rtol=0, atol=1e-5)
    assert (basis.explained.diff(dim=-1) <= 0).all()
    torch.testing.assert_close(basis.explained.sum(-1), torch.ones(basis.explained.shape[:2]))
    # P^T C P is diagonal, with the explained-variance ratios times the total variance
    keys = captured_keys(model, text, post_rope)
    centred = keys - keys.mean(2, keepdim=True)
    cov = centred.transpose(-1, -2) @ centred / keys.shape[2]  # [L, Hkv, Dh, Dh]
    rotated = p.transpose(-1, -2) @ cov @ p
    total = cov.diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True)
    torch.testing.assert_close(rotated / total[..., None], torch.diag_embed(
        basis.explained.double()), rtol=0, atol=1e-5)
    assert basis.explained_variance(0.25) < basis.explained_variance(0.5) < 1.0
    assert basis.explained_variance(1.0) == pytest.approx(1.0)
    basis.save(str(tmp_path / "loki.safetensors"))
    loaded = LokiBasis.load(str(tmp_path / "loki.safetensors"))
    assert torch.equal(loaded.bases, basis.bases) and torch.equal(loaded.explained,
                                                                  basis.explained)
    assert (loaded.post_rope, loaded.rope_theta) == (post_rope, model.config.rope_theta)


def test_the_basis_is_also_importable_from_sparse_attention():
    assert sparse_attention.LokiBasis is LokiBasis
    assert sparse_attention.calibrate_loki is calibrate_loki


def test_basis_path_lives_with_the_weights_read(tmp_path):
    assert basis_path(tmp_path, 7) == tmp_path / "step-00000007" / BASIS_FILE  # a root
    (tmp_path / "manifest.json").write_text("{}")
    assert basis_path(tmp_path, 7) == tmp_path / BASIS_FILE  # one step directory
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert basis_path(tmp_path / "model.safetensors", 7) == (
        tmp_path / "model.loki_basis.safetensors")


def test_calibration_batch_rows_of_the_window():
    docs = ["abcdefghij", "klmnopqrstuvwxyz"]
    stream = encode_stream(docs, BYTES)
    batch = calibration_batch(docs, BYTES, 8, 20)
    assert batch.shape == (2, 8) and torch.equal(batch.flatten(), stream[:16])
    assert calibration_batch(docs, BYTES, 64, 20).shape == (1, 20)  # one shorter row


def test_load_or_calibrate_calibrates_once_then_reads(tmp_path):
    model = GPT(GQA, seed=0).eval()
    path = tmp_path / BASIS_FILE
    with pytest.raises(ValueError, match="no Loki basis at"):
        load_or_calibrate(model, path, None)
    basis, fresh = load_or_calibrate(model, path, tokens(2, 24))
    assert fresh and path.is_file()
    again, fresh = load_or_calibrate(model, path, None)
    assert not fresh and torch.equal(again.bases, basis.bases)
    other = GPT(CONFIGS["tiny"], seed=0).eval()
    with pytest.raises(ValueError, match="is for \\[layers, kv heads, head_dim\\] = \\[2, 2, 8\\]"):
        load_or_calibrate(other, path, None)


def small_basis():
    return LokiBasis(bases=torch.eye(8).expand(2, 2, 8, 8).clone(),
                     explained=torch.full((2, 2, 8), 1 / 8))


def test_save_writes_beside_and_renames_so_a_failed_save_leaves_no_file(tmp_path, monkeypatch):
    path = tmp_path / BASIS_FILE
    small_basis().save(str(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [BASIS_FILE]  # no temporary left
    written = path.read_bytes()

    def interrupted(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise KeyboardInterrupt

    from llm.decode import loki

    monkeypatch.setattr(loki, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        small_basis().save(str(tmp_path / "new.safetensors"))
    with pytest.raises(KeyboardInterrupt):
        small_basis().save(str(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [BASIS_FILE]
    assert path.read_bytes() == written  # the basis already there is kept whole


@pytest.mark.parametrize(("damage", "message"), [
    ("truncate", "is not a readable safetensors file"),
    ("empty", "is not a readable safetensors file"),
    ("other tensors", r"lacks the tensor\(s\) \['bases', 'explained'\]"),
    ("no metadata", r"lacks the metadata \['num_layers'"),
    ("bad metadata", "has malformed metadata"),
])
def test_a_damaged_basis_is_refused_naming_the_file_and_what_to_do(tmp_path, damage, message):
    from safetensors.torch import save_file

    path = tmp_path / BASIS_FILE
    small_basis().save(str(path))
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:200])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "other tensors":
        save_file({"weight": torch.zeros(2)}, str(path))
    elif damage == "no metadata":
        save_file({"bases": torch.zeros(2, 2, 8, 8), "explained": torch.zeros(2, 2, 8)},
                  str(path))
    else:
        save_file({"bases": torch.zeros(2, 2, 8, 8), "explained": torch.zeros(2, 2, 8)},
                  str(path), metadata={"num_layers": "two", "num_kv_heads": "2",
                                       "head_dim": "8", "post_rope": "True",
                                       "rope_theta": "1e4"})
    model = GPT(GQA, seed=0).eval()
    for load in (lambda: LokiBasis.load(str(path)), lambda: load_or_calibrate(model, path, None)):
        with pytest.raises(ValueError, match=message) as info:
            load()
        assert str(path) in str(info.value) and "remove it" in str(info.value)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: calibrate_loki(GPT(GQA, seed=0), torch.zeros(2, 4)), "int64 \\[B, T\\]"),
    (lambda: calibrate_loki(GPT(GQA, seed=0), tokens(1, 1)), "at least 2 keys"),
    (lambda: LokiBasis(bases=torch.zeros(1, 2, 8, 4), explained=torch.zeros(1, 2, 8)),
     "\\[L, Hkv, Dh, Dh\\]"),
    (lambda: LokiBasis(bases=torch.zeros(1, 1, 8, 8), explained=torch.zeros(1, 1, 8)).rank(0),
     "rank_fraction must be in \\(0, 1\\], got 0"),
])
def test_bad_inputs_raise_with_the_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


class _StopError(Exception):
    pass


def test_calibration_tokens_go_to_the_models_device():
    """A model on "meta" (standing in for a GPU) is given CPU calibration text: the forward
    sees it on the model's device. The first batch is enough; the hook stops there."""
    model = GPT(GQA, device="meta")
    seen = []

    def stop(module, args):
        seen.append(args[0].device)
        raise _StopError

    model.register_forward_pre_hook(stop)
    with pytest.raises(_StopError):
        calibrate_loki(model, [tokens(2, 16), tokens(2, 16, seed=2)])
    assert seen == [torch.device("meta")]
