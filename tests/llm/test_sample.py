"""python -m llm.sample: continues a prompt from a checkpoint, seeded, with clear errors; the
checkpoint's tokenizer encodes the prompt and decodes the output (bytes for a model trained on
them, the tokenizer.json of a Hugging Face model imported with llm.convert)."""

import pytest

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
            "--temperature", "1.0", "--seed", "3"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert first.startswith("The ")
    assert main(args) == 0 and capsys.readouterr().out == first
    assert main(["--checkpoint", ckpt_dir, "--prompt", "x", "--tokens", "0"]) == 0
    assert capsys.readouterr().out == "x\n"


@pytest.mark.parametrize("argv, message", [
    (["--prompt", ""], "--prompt is empty"),
    (["--temperature", "-1"], "must be >= 0"),
    (["--tokens", "-2"], "must be >= 0"),
])
def test_errors(ckpt_dir, capsys, argv, message):
    assert main(["--checkpoint", ckpt_dir, *argv]) == 2
    assert message in capsys.readouterr().err


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
                 "--temperature", "0"]) == 0
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
                 "--tokens", "8", "--temperature", "0", "--bos"]) == 0
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
