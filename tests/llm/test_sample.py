"""python -m llm.sample: continues a prompt from a checkpoint, seeded, with clear errors (a
temperature that is not a finite number >= 0; one below 1e-6 decodes greedily); the
checkpoint's tokenizer encodes the prompt and decodes the output (bytes for a model trained on
them, the tokenizer.json of a Hugging Face model imported with llm.convert); ``--device`` reaches
:func:`llm.checkpoint.load_model`, which builds the model on that device without a throw-away
initialisation (the CUDA runs: tests/llm/test_gpu.py)."""

import pytest
import torch

from llm import checkpoint
from llm.data.tokenizers import load_tokenizer
from llm.sample import main
from tests.llm import test_init_hf, test_memorization
from tests.llm.helpers import make_trainer, one_rank

hf_dir = test_init_hf.hf_dir  # fixtures: a random HF Llama with a BPE tokenizer.json,
imported = test_memorization.imported  # and that model through python -m llm.convert import


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    trainer = make_trainer(one_rank(), steps=1)
    trainer.train_step()
    root = tmp_path_factory.mktemp("sample")
    trainer.save(str(root), keep=1, is_main=True)
    return str(root)


def test_continues_the_prompt_and_is_seeded(ckpt_dir, capsys):
    args = ["--checkpoint", ckpt_dir, "--prompt", "The ", "--tokens", "6",
            "--temperature", "1.0", "--seed", "3", "--device", "cpu"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert first.startswith("The ")
    assert main(args) == 0 and capsys.readouterr().out == first
    assert main(["--checkpoint", ckpt_dir, "--prompt", "x", "--tokens", "0"]) == 0
    assert capsys.readouterr().out == "x\n"


@pytest.mark.parametrize("argv, message", [
    (["--prompt", ""], "--prompt is empty"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0 (0: greedy), got -1"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0 (0: greedy), got nan"),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0 (0: greedy), got inf"),
    (["--tokens", "-2"], "--tokens must be >= 0, got -2"),
])
def test_errors(ckpt_dir, capsys, argv, message):
    assert main(["--checkpoint", ckpt_dir, *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("temperature", ["5e-324", "1e-300", "1e-7"])
def test_a_vanishing_temperature_is_greedy(ckpt_dir, capsys, temperature):
    """Subnormal and tiny temperatures would overflow logits / temperature to inf (multinomial
    then fails on nan); below 1e-6 they decode greedily instead."""
    base = ["--checkpoint", ckpt_dir, "--prompt", "The ", "--tokens", "8", "--device", "cpu"]
    assert main([*base, "--temperature", "0"]) == 0
    greedy = capsys.readouterr().out
    assert main([*base, "--temperature", temperature]) == 0
    assert capsys.readouterr().out == greedy


def test_generate_checks_the_temperature():
    from llm.model import GPT
    from tests.llm.helpers import SMALL

    model = GPT(SMALL, seed=0).eval()
    prompt = torch.randint(256, (2, 5), generator=torch.Generator().manual_seed(0))
    for bad in (float("nan"), float("inf"), -1e-9):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            model.generate(prompt, 1, temperature=bad)
    greedy = model.generate(prompt, 6)
    for tiny in (5e-324, 1e-38, 9.9e-7):
        assert torch.equal(model.generate(prompt, 6, temperature=tiny), greedy)
    sampled = model.generate(prompt, 6, temperature=1e-6,
                             generator=torch.Generator().manual_seed(0))  # sampled, finite
    assert sampled.shape == greedy.shape


def test_tokenizer_flag(ckpt_dir, hf_dir, tmp_path, capsys):
    assert main(["--checkpoint", ckpt_dir, "--prompt", "x", "--tokens", "0",
                 "--tokenizer", "bytes"]) == 0
    assert capsys.readouterr().out == "x\n"
    # 320 BPE ids do not fit this model's 256-row embedding
    assert main(["--checkpoint", ckpt_dir, "--tokenizer", str(hf_dir)]) == 2
    assert "vocabulary of 320 token ids" in capsys.readouterr().err
    assert main(["--checkpoint", ckpt_dir, "--tokenizer", str(tmp_path / "none.json")]) == 2
    assert "none.json" in capsys.readouterr().err


def test_imported_checkpoint_samples_with_its_tokenizer(imported, hf_dir, capsys):
    prompt = "The assert statement"
    assert main(["--checkpoint", str(imported), "--prompt", prompt, "--tokens", "12",
                 "--temperature", "0", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    tokenizer = load_tokenizer(hf_dir)
    model, _ = checkpoint.load_model(imported)
    ids = tokenizer.encode(prompt)
    want = model.generate(ids[None], 12)[0]
    assert len(ids) < len(prompt)  # BPE tokens, not bytes
    assert out == tokenizer.decode(want) + "\n" and out.startswith(prompt)


def test_bos_goes_before_the_prompt_and_is_not_printed(imported, hf_dir, tmp_path, capsys):
    """--bos: the begin-of-text token named by tokenizer_config.json is the first token the
    model sees; the printed text is the prompt and its continuation. A tokenizer without one
    is refused by name."""
    import json
    import shutil

    import torch

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    shutil.copy(hf_dir / "tokenizer.json", tok_dir / "tokenizer.json")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>"}))
    prompt = "The assert statement"
    assert main(["--checkpoint", str(imported), "--tokenizer", str(tok_dir), "--prompt", prompt,
                 "--tokens", "8", "--temperature", "0", "--bos", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    tokenizer = load_tokenizer(tok_dir)
    assert tokenizer.bos_id is not None
    model, _ = checkpoint.load_model(imported)
    ids = torch.cat([torch.tensor([tokenizer.bos_id]), tokenizer.encode(prompt)])
    want = model.generate(ids[None], 8)[0]
    assert out == tokenizer.decode(want[1:]) + "\n" and out.startswith(prompt)
    plain = model.generate(tokenizer.encode(prompt)[None], 8)[0]
    assert not torch.equal(want[1:], plain)  # the token changed what the model saw
    assert main(["--checkpoint", str(imported), "--tokenizer", "bytes", "--bos"]) == 2
    assert "--bos: the tokenizer (bytes) has no begin-of-text token" in capsys.readouterr().err


# ----------------------------------------------------------------------------- --device
def test_device_flag_reaches_load_model(ckpt_dir, capsys, monkeypatch):
    """``--device cpu`` is what load_model is given; ``auto`` is CPU when torch sees no GPU and
    CUDA when it sees one (resolved, not loaded)."""
    seen = []
    real = checkpoint.load_model

    def recording(path, device="cpu"):
        seen.append(device)
        return real(path, device)

    monkeypatch.setattr(checkpoint, "load_model", recording)
    args = ["--checkpoint", ckpt_dir, "--prompt", "The ", "--tokens", "4", "--temperature", "0"]
    assert main([*args, "--device", "cpu"]) == 0
    pinned = capsys.readouterr().out
    assert seen == ["cpu"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(args) == 0 and capsys.readouterr().out == pinned
    assert seen == ["cpu", "auto"]
    assert checkpoint.resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert checkpoint.resolve_device("auto") == torch.device("cuda")
    assert checkpoint.resolve_device("cuda") == torch.device("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_device_cuda_without_a_gpu_is_refused_by_name(ckpt_dir, capsys):
    assert main(["--checkpoint", ckpt_dir, "--device", "cuda"]) == 2
    assert "--device cuda was asked for, but torch sees no CUDA device" in \
        capsys.readouterr().err
    with pytest.raises(ValueError, match="sees no CUDA device"):
        checkpoint.load_model(ckpt_dir, device="cuda")


@pytest.mark.filterwarnings("ignore:for .*copying from a non-meta parameter:UserWarning")
def test_load_model_allocates_on_the_device_and_skips_the_random_init(ckpt_dir, monkeypatch):
    """The parameters are allocated where asked ("meta" stands in for a GPU: no CPU copy is
    kept) and filled from the checkpoint only: the keyed random initialisation never runs."""
    plain, meta = checkpoint.load_model(ckpt_dir)
    assert plain.device == torch.device("cpu") and not plain.training
    from llm.model import GPT

    def no_init(self, seed=None):
        raise AssertionError("load_model initialised weights it then overwrote")

    monkeypatch.setattr(GPT, "reset_parameters", no_init)
    again, _ = checkpoint.load_model(ckpt_dir, device="cpu")
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), again.parameters()))
    on_meta, meta_again = checkpoint.load_model(ckpt_dir, device=torch.device("meta"))
    assert meta_again == meta and on_meta.device == torch.device("meta")
    assert all(p.is_meta for p in on_meta.parameters())
    assert [(n, p.shape) for n, p in on_meta.named_parameters()] == \
        [(n, p.shape) for n, p in plain.named_parameters()]
