"""python -m llm.evaluate: perplexity teacher-forced through the decode path equals the plain
forward's (with the model's own attention and with an exact full-attention method), greedy
agreement, the held-out split, and the CLI on a tiny checkpoint (both rows, JSON, the Loki
basis stored with the checkpoint, errors, ``--device``; the CUDA runs: tests/llm/test_gpu.py)."""

import json
import math

import pytest
import torch
from torch.nn.functional import cross_entropy

from llm import checkpoint
from llm.data.batches import load_documents, split_documents
from llm.data.heldout import held_out_split, prompts_from
from llm.evaluate import agreement, decode_nll, main, parse_budget, perplexity
from llm.model import GPT
from tests.llm.helpers import SMALL, make_trainer, one_rank, perplexity_rel


class ExactFull:
    """Exact softmax attention over every cached position, GQA expanded; counts resets."""

    def __init__(self):
        self.resets = self.calls = 0

    def reset(self):
        self.resets += 1

    def __call__(self, layer, q, k, v):
        self.calls += 1
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
        return probs @ v  # [B, H, 1, Dh]


def forward_perplexity(model, tokens):
    """The reference: each window of max_seq_len + 1 tokens through one no-cache forward."""
    window, nll, count = model.config.max_seq_len, 0.0, 0
    for start in range(0, len(tokens) - 1, window):
        x = tokens[start : start + window + 1]
        with torch.no_grad():
            logits = model(x[None, :-1])[0].float()  # [L, V]
        nll += float(cross_entropy(logits, x[1:], reduction="sum"))
        count += len(x) - 1
    return math.exp(nll / count), count


@pytest.fixture(scope="module")
def model():
    return GPT(SMALL, seed=0).eval()  # GQA 4 / 2 heads, 16-token window


@pytest.mark.cross_shape
@pytest.mark.parametrize("length", [2, 17, 40, 49])  # one target; one window; ragged; 3 full
def test_decode_path_perplexity_equals_the_plain_forward(model, length):
    """One-row decode steps (and ExactFull's own products) against the full forward: to float
    rounding (perplexity_rel)."""
    tokens = torch.randint(256, (length,), generator=torch.Generator().manual_seed(length))
    want, count = forward_perplexity(model, tokens)
    assert decode_nll(model, tokens)["targets"] == count == length - 1
    rel = perplexity_rel(model, count)
    assert perplexity(model, tokens) == pytest.approx(want, rel=rel)
    exact = ExactFull()
    assert perplexity(model, tokens, exact, batch_size=2) == pytest.approx(want, rel=rel)
    lengths = [min(17, length - s) for s in range(0, length - 1, 16)]  # windows' tokens
    batches = {n: math.ceil(lengths.count(n) / 2) for n in set(lengths)}  # 2 windows a batch
    # each batch of n-token windows: a prefill, then n - 2 decode steps through every layer
    assert exact.calls == SMALL.num_layers * sum(b * (n - 2) for n, b in batches.items())
    assert exact.resets == sum(batches.values())  # a new sequence with each batch


def test_perplexity_needs_two_tokens(model):
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(model, torch.tensor([3]))


@pytest.mark.cross_shape
def test_agreement_of_exact_attention_is_total(model):
    """Greedy tokens of ExactFull's products against the built-in kernel, exactly: they would
    differ only at a near-tie, none in these 3 prompts."""
    prompts = prompts_from(torch.arange(100) % 50, 3, 8)  # [3, 8]
    assert prompts[:, 0].tolist() == [0, 46, 42]  # offsets 0, 46, 92 of 100 - 8 = 92
    full = agreement(model, prompts, 6, ExactFull())
    assert full["token_agreement"] == 1.0 and full["exact"] == 3
    assert full["decode_steps"] == 3 * 5 and full["tokens"].shape == (3, 14)
    assert agreement(model, prompts, 6, None, reference=full["tokens"])["exact"] == 3


def test_agreement_counts_positions():
    class Fixed:  # generates a stored continuation; "method" picks which
        def __init__(self, outs):
            self.outs = outs

        def generate(self, prompts, new_tokens, method=None):
            return self.outs[method is not None]

    ref = torch.tensor([[9, 1, 2, 3, 4], [9, 5, 6, 7, 8]])
    other = torch.tensor([[9, 1, 2, 0, 4], [9, 5, 6, 7, 8]])
    result = agreement(Fixed({False: ref, True: other}), ref[:, :1], 4, ExactFull())
    assert result["token_agreement"] == 7 / 8 and result["exact"] == 1


@pytest.mark.parametrize("text, want", [("0.25", 0.25), ("25%", 0.25), ("1", 1), ("64", 64),
                                        ("1.0", 1.0)])
def test_parse_budget(text, want):
    got = parse_budget(text)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("text", ["0", "1.5", "-0.1", "abc", "0%", "nan"])
def test_parse_budget_refuses(text):
    with pytest.raises(ValueError, match="--budget"):
        parse_budget(text)


def test_parse_budget_says_an_integer_is_a_count_and_a_decimal_a_fraction():
    with pytest.raises(ValueError, match=r"integer is a count of positions.*decimal"):
        parse_budget("0")
    with pytest.raises(ValueError, match=r"fraction.*\(0, 1\]"):
        parse_budget("1.5")


def test_quantspec_builds_its_draft_once_per_run(model, monkeypatch):
    """One draft for all prompts (built before the clock starts), and the same tokens and
    counts as a draft built for each prompt."""
    from llm.decode import quantspec
    from llm.evaluate import quantspec_run

    stream = torch.randint(256, (200,), generator=torch.Generator().manual_seed(0))
    prompts = prompts_from(stream, 3, 6)  # [3, 6]
    reference = model.generate(prompts, 5)
    per_prompt = [quantspec.quantspec_generate(model, p[None], 5, gamma=2, fp_buffer=4)
                  for p in prompts]
    build, built = quantspec.build_draft, []
    monkeypatch.setattr(quantspec, "build_draft",
                        lambda *a, **k: built.append(1) or build(*a, **k))
    result = quantspec_run(model, prompts, 5, reference, gamma=2, fp_buffer=4)
    assert len(built) == 1 and result["num_prompts"] == 3
    want = sum(int(torch.equal(out[0], ref)) for (out, _), ref in zip(per_prompt, reference))
    assert result["equal_to_greedy"] == want
    for name in ("drafted", "accepted", "target_passes", "draft_weight_bytes",
                 "draft_kv_bytes", "target_weight_bytes", "target_kv_bytes", "baseline_bytes"):
        assert result[name] == sum(getattr(stats, name) for _, stats in per_prompt), name


def test_held_out_split_follows_the_run(tmp_path):
    docs = load_documents()
    data = {"source": "pydoc", "paths": [], "docs": None, "val_fraction": 0.1, "seed": 3}
    held, train, where = held_out_split({"configs": {"data": data}})
    assert (train, held) == split_documents(docs, 0.1, 3) and "seed 3" in where
    held, train, _ = held_out_split({"configs": {"data": {**data, "docs": 70}}})
    assert held == docs[70:] and train == docs[:70]
    held, train, where = held_out_split({})  # no data config: llm.train's default split
    assert (train, held) == split_documents(docs, 0.1, 0) and "no text data config" in where
    (tmp_path / "a.txt").write_text("held out")
    held, train, where = held_out_split({}, [str(tmp_path / "a.txt")])
    assert held == ["held out"] and train == split_documents(docs, 0.1, 0)[0]
    with pytest.raises(ValueError, match="held out no documents"):
        held_out_split({"configs": {"data": {**data, "docs": len(docs)}}})
    # a token-cache run held out its stream's last tokens: no document split stands for them
    cached = {**data, "source": "files", "paths": [str(tmp_path / "a.txt")],
              "token_cache": str(tmp_path / "cache")}
    with pytest.raises(ValueError, match=r"trained on a token stream \(--token-cache .*\) and "
                       r"held out its last 0.1 of tokens, not whole documents; pass --text"):
        held_out_split({"configs": {"data": cached}})
    assert held_out_split({"configs": {"data": cached}}, [str(tmp_path / "a.txt")])[0] == [
        "held out"]


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    trainer = make_trainer(one_rank(), steps=1)  # SMALL on pydoc, 16-byte windows
    trainer.train_step()
    root = tmp_path_factory.mktemp("evaluate")
    trainer.save(str(root), keep=1, is_main=True)
    return root


FAST = ["--tokens", "96", "--prompts", "2", "--new-tokens", "6", "--device", "cpu"]


def test_cli_prints_both_rows_and_stores_the_loki_basis(ckpt_dir, capsys):
    args = ["--checkpoint", str(ckpt_dir), "--attention", "loki", "--budget", "0.5", *FAST]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    full, loki = result["rows"]
    assert (full["name"], loki["name"]) == ("full", "loki")
    assert full["increase"] == 0 and full["token_agreement"] == 1.0 and full["exact"] == 2
    assert full["bytes_ratio"] == 1.0 and full["kv_bytes_per_token"] > 0
    assert loki["perplexity"] > 0 and loki["increase"] == pytest.approx(
        100 * (loki["perplexity"] / full["perplexity"] - 1))
    assert 0 < loki["bytes_ratio"] < 1 and 0 <= loki["token_agreement"] <= 1
    assert loki["budget"] == 0.5 and loki["rank"] == 0.25
    assert result["tokens"] == 96 and result["prompt_len"] == 16 - 6
    assert result["device"] == "cpu"
    basis = result["loki_basis"]
    assert basis["calibrated"] and basis["rank"] == 2 and basis["head_dim"] == 8
    assert basis["path"] == str(ckpt_dir / "step-00000001" / "loki_basis.safetensors")
    assert 0 < basis["explained_variance"] <= 1
    assert main([*args, "--speculative", "quantspec", "--gamma", "2"]) == 0  # basis reused
    out = capsys.readouterr().out
    assert "Loki basis read from" in out and "held-out split (0.1 of the documents" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("attention"))
    assert lines[header + 1].startswith("full") and lines[header + 2].startswith("loki")
    assert "QuantSpec (gamma 2" in out and "tokens equal to greedy: 2/2" in out


@pytest.mark.cross_shape
def test_cli_loki_pre_rope_basis_is_stored_apart_and_exact_at_full_rank(ckpt_dir, capsys):
    """At full rank Loki's scores go through its basis (2 more sums a block): the perplexity
    to float rounding (perplexity_rel over the 96 tokens); its greedy tokens exactly (they
    would differ only at a near-tie, none here)."""
    args = ["--checkpoint", str(ckpt_dir), "--attention", "loki", "--budget", "1.0",
            "--rank-fraction", "1.0", "--loki-pre-rope", "--json", *FAST]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    full, loki = result["rows"]
    rel = perplexity_rel(checkpoint.load_model(ckpt_dir)[0], 96, per_block=2)
    assert loki["perplexity"] == pytest.approx(full["perplexity"], rel=rel)
    assert loki["token_agreement"] == 1.0
    basis = result["loki_basis"]
    assert basis["post_rope"] is False and basis["calibrated"]
    assert basis["path"] == str(ckpt_dir / "step-00000001" / "loki_basis_pre_rope.safetensors")
    # the pre-RoPE file given where a post-RoPE basis is asked for is refused by name
    bad = ["--checkpoint", str(ckpt_dir), "--attention", "loki", "--loki-basis", basis["path"],
           *FAST]
    assert main(bad) == 2
    assert "holds keys before RoPE, but keys after RoPE" in capsys.readouterr().err


def test_cli_full_and_text(ckpt_dir, tmp_path, capsys):
    (tmp_path / "t.txt").write_text("The assert statement checks a condition. " * 3)
    assert main(["--checkpoint", str(ckpt_dir), "--attention", "topk", "--budget", "3",
                 "--text", str(tmp_path / "t.txt"), "--json", *FAST]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in result["rows"]] == ["full", "topk"]
    assert result["rows"][1]["budget"] == 3 and "1 text file(s)" in result["held_out"]
    assert main(["--checkpoint", str(ckpt_dir), *FAST]) == 0  # --attention full: one row
    assert "full " in capsys.readouterr().out


@pytest.mark.cross_shape
def test_cli_passes_sift_warmup_and_refit_every(ckpt_dir, capsys):
    """A warm-up longer than every sequence's decode steps (15 per perplexity window, 5 per
    prompt) leaves Sift exactly full attention: the flags reach the method. Its own attention
    products against the built-in kernel: the perplexity to float rounding (perplexity_rel),
    the greedy tokens exactly (a near-tie could flip one; none here)."""
    args = ["--checkpoint", str(ckpt_dir), "--attention", "sift", "--budget", "0.25", *FAST]
    assert main([*args, "--sift-warmup", "16", "--sift-refit-every", "0", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["sift"] == {"warmup": 16, "refit_every": None}
    full, sift = result["rows"]
    assert sift["kept_fraction"] == 1.0 and sift["token_agreement"] == 1.0
    rel = perplexity_rel(checkpoint.load_model(ckpt_dir)[0], 96)
    assert sift["perplexity"] == pytest.approx(full["perplexity"], rel=rel)
    assert main([*args, "--sift-warmup", "2"]) == 0  # sifts from the third decode step
    out = capsys.readouterr().out
    assert "Sift: 2 full-attention warm-up decode steps, then the quantile re-measured every " \
        "16 steps" in out
    row = next(line for line in out.splitlines() if line.startswith("sift"))
    assert float(row.split()[-4].rstrip("%")) < 100  # kept


@pytest.mark.parametrize("flags, message", [
    (["--budget", "0"], "--budget"),
    (["--budget", "2.5"], "--budget"),
    (["--attention", "sift", "--budget", "8"], "fraction"),
    (["--attention", "sift", "--budget", "1"], "--budget 1 is a count of positions; Sift keeps "
     "a fraction"),
    (["--tokens", "-5"], "--tokens must be at least 2 (a token and the next one to predict), "
     "got -5"),
    (["--tokens", "0"], "--tokens must be at least 2 (a token and the next one to predict), "
     "got 0"),
    (["--attention", "sift", "--sift-warmup", "1"], "--sift-warmup >= 2"),
    (["--sift-refit-every", "-1"], "--sift-refit-every >= 0"),
    (["--rank-fraction", "0"], "--rank-fraction"),
    (["--new-tokens", "1"], "--new-tokens"),
    (["--prompt-len", "12"], "exceeds max_seq_len"),
    (["--prompt-len", "0"], "prompt length >= 1"),
    (["--prompts", "0"], "--prompts >= 1"),
    (["--tokens", "1"], "at least 2"),
    (["--text", "EMPTY"], "no text found"),
    (["--text", "MISSING"], "does not exist"),
    (["--attention", "loki", "--loki-basis", "MISSING"], "does not exist"),
    (["--attention", "loki", "--loki-basis", "EMPTY"], "is not a readable safetensors file"),
    (["--checkpoint", "MISSING"], "no checkpoint"),
])
def test_cli_errors(ckpt_dir, tmp_path, capsys, flags, message):
    (tmp_path / "EMPTY").write_text("")
    flags = [str(tmp_path / f) if f in ("EMPTY", "MISSING") else f for f in flags]
    assert main(["--checkpoint", str(ckpt_dir), *FAST, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_cli_device_cuda_without_a_gpu_is_refused_by_name(ckpt_dir, capsys):
    assert main(["--checkpoint", str(ckpt_dir), *FAST, "--device", "cuda"]) == 2
    assert "--device cuda was asked for, but torch sees no CUDA device" in \
        capsys.readouterr().err
