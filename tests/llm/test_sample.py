"""python -m llm.sample: continues a prompt from a checkpoint, seeded, with clear errors."""

import pytest

from llm.sample import main
from tests.llm.helpers import make_trainer, one_rank_groups


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    trainer = make_trainer(one_rank_groups(), steps=1)
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
