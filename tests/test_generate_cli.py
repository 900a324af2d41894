"""`flashgen generate` on the CPU: sampling ranges and prompt files are one line and exit 2 before a
model loads."""
from __future__ import annotations

import io
import re

import pytest
import torch

from flashgen.cli import main

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Llama folder whose tokenizer reads words w0..w127 as tokens 0..127."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.mark.parametrize("flag, value, must", [
    ("--max-new-tokens", "-5", "an integer of at least 1"), ("--max-new-tokens", "0", "an integer of at least 1"),
    ("--top-p", "1.5", r"a number in \(0, 1\]"), ("--top-p", "0", r"a number in \(0, 1\]"),
    ("--top-p", "nan", r"a number in \(0, 1\]"), ("--temperature", "-1", "a finite number of at least 0"),
    ("--temperature", "inf", "a finite number of at least 0"), ("--temperature", "nan", "a finite number of at least 0"),
    ("--top-k", "-3", "an integer of at least 0"), ("--top-k", "2.5", "an integer of at least 0"),
    ("--seed", "-1", r"an integer in 0..2\*\*63-1"), ("--seed", str(2**63), r"an integer in 0..2\*\*63-1"),
    ("--cache-blocks", "-1", "an integer of at least 1"),
])
def test_sampling_ranges_are_one_line_before_the_model_loads(capsys, tmp_path, flag, value, must):
    """The folder does not exist: the range error comes first, so nothing was loaded."""
    assert main(["generate", "--model", str(tmp_path / "none"), "--prompt", "w1", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert re.fullmatch(rf"flashgen: error: argument {flag}: must be {must}, got '{value}'\n", err), err


def test_edge_values_are_accepted(folder, capsys):
    assert main(["generate", "--model", str(folder), "--prompt", "w1 w2", "--max-new-tokens", "1", "--top-p", "1",
                 "--temperature", "0.7", "--top-k", "0", "--seed", str(2**63 - 1), "--cache-blocks", "1"]) == 0
    assert len(capsys.readouterr().out.split()) == 1


def test_prompt_file_and_stdin_give_the_prompt(folder, tmp_path, capsys, monkeypatch):
    """A prompt read from a file or standard input (its final newline dropped) decodes as the same
    prompt given as an argument; a file that is not UTF-8, or none, is one line and exit 2."""
    words = " ".join(f"w{i % 128}" for i in range(1, 120))
    assert main(["generate", "--model", str(folder), "--prompt", words, "--max-new-tokens", "6"]) == 0
    expected = capsys.readouterr().out
    assert len(expected.split()) == 6
    path = tmp_path / "prompt.txt"
    path.write_text(words + "\n", encoding="utf-8")
    assert main(["generate", "--model", str(folder), "--prompt-file", str(path), "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == expected
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO((words + "\r\n").encode())))
    assert main(["generate", "--model", str(folder), "--prompt-file", "-", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == expected

    path.write_bytes("w1 w2 caf\u00e9".encode("latin-1"))
    assert main(["generate", "--model", str(folder), "--prompt-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"flashgen: error: --prompt-file: {path} is not UTF-8 text (byte 0xe9 at offset 9)\n"
    assert main(["generate", "--model", str(folder), "--prompt-file", str(tmp_path / "missing.txt")]) == 2
    assert "--prompt-file: cannot read" in capsys.readouterr().err
    assert main(["generate", "--model", str(folder), "--prompt", "w1", "--prompt-file", str(path)]) == 2
    assert capsys.readouterr().err == "flashgen: error: argument --prompt-file: not allowed with argument --prompt\n"
    assert main(["generate", "--model", str(folder)]) == 2
    assert "one of the arguments --prompt --prompt-file is required" in capsys.readouterr().err
