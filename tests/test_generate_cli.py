"""`flashgen generate` and `flashgen bench-model` on the CPU: sampling ranges and prompt files are one
line and exit 2 before a model loads; bench-model's defaults follow the device, and a run that would not
fit in memory is refused with its estimate before anything is allocated."""
from __future__ import annotations

import io
import re

import pytest
import torch

from flashgen.cli import main
from flashgen.runtime import bench

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Llama folder whose tokenizer reads words w0..w127 as tokens 0..127 (the one the
    warm-start study times)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
    from generate_warm_start import tiny_folder
    return tiny_folder(tmp_path_factory.mktemp("tiny-llama"))


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


no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's defaults and memory")


@no_gpu
def test_bench_model_defaults_to_the_small_config_without_a_gpu(monkeypatch, capsys):
    """On the CPU the defaults are those of the committed CPU figures, not the 8B model's."""
    seen = []
    monkeypatch.setattr(bench, "run", lambda *a, **k: seen.append(a) or [])
    assert main(["bench-model"]) == 0
    assert seen[0][:4] == ("smollm2-135m", [1, 8], 64, 32)
    assert main(["bench-model", "--config", "tiny", "--batch", "3", "--prompt-len", "7", "--new-tokens", "2"]) == 0
    assert seen[1][:4] == ("tiny", [3], 7, 2)
    assert "smollm2-135m" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--prompt-len", "--new-tokens"])
def test_bench_model_lengths_must_be_positive(capsys, flag):
    assert main(["bench-model", "--config", "tiny", flag, "0"]) == 2
    assert capsys.readouterr().err == f"flashgen: error: argument {flag}: must be an integer of at least 1, got '0'\n"


@no_gpu
def test_bench_model_refuses_what_does_not_fit_before_allocating(monkeypatch, capsys):
    """The estimate (weights while they load, KV cache of batch x context, prefill) against free memory."""
    def refuse(*a, **k):
        raise AssertionError("weights were allocated")
    monkeypatch.setattr(bench, "random_weights", refuse)
    monkeypatch.setattr(bench, "available_bytes", lambda dev: 2 * 10**9)
    assert main(["bench-model", "--config", "llama3-8b", "--batch", "1,4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashgen: error: llama3-8b at batch 4 x 96 tokens needs about 64.") and err.count("\n") == 1
    assert "(weights 64.2 GB while they load in float32," in err and "and 2.0 GB is free" in err
    c = bench.CONFIGS["smollm2-135m"]
    kv = bench.kv_cache_bytes(c, 4, 512, 8192)  # k and v of 30 layers, 512 x 512 blocks (+4) of 16 x 3 x 64 floats
    assert kv == 2 * 30 * (512 * 512 + 4) * 16 * 3 * 64 * 4
    assert main(["bench-model", "--config", "smollm2-135m", "--batch", "512", "--prompt-len", "8000",
                 "--new-tokens", "192"]) == 2
    assert f"KV cache {kv / 1e9:.1f} GB" in capsys.readouterr().err


def test_bench_model_one_new_token_reports_no_decode_rate(capsys):
    assert main(["bench-model", "--config", "tiny", "--batch", "2", "--prompt-len", "5", "--new-tokens", "1"]) == 0
    row = capsys.readouterr().out.splitlines()[2].split()
    assert row[0] == "2" and float(row[1]) >= 0 and row[2] == "-" and row[4] == "-"


def _copy(folder, tmp_path):
    import shutil
    shutil.copytree(folder, tmp_path / "m")
    return tmp_path / "m"


@pytest.mark.parametrize("damage,message", [
    ("garbage", "tokenizer.json is not a tokenizer file the tokenizers library reads"),
    ("past_vocab", "token 'w200' has id 200, past the model's vocab_size of 128"),
    ("missing", "has no tokenizer.json"),
])
def test_a_tokenizer_the_model_cannot_serve_is_one_line(folder, tmp_path, capsys, damage, message):
    from tokenizers import Tokenizer, models
    m = _copy(folder, tmp_path)
    if damage == "garbage":
        (m / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 7}}')
    elif damage == "past_vocab":
        Tokenizer(models.WordLevel({"w0": 0, "w200": 200}, unk_token="w0")).save(str(m / "tokenizer.json"))
    else:
        (m / "tokenizer.json").unlink()
    assert main(["generate", "--model", str(m), "--prompt", "w1"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_cache_blocks_are_bounded_by_free_memory(folder, capsys, monkeypatch):
    from flashgen.runtime import memory
    monkeypatch.setattr(memory, "available_bytes", lambda dev: 10**8)
    assert main(["generate", "--model", str(folder), "--prompt", "w1", "--cache-blocks", "100000"]) == 2
    err = capsys.readouterr().err
    # 2 layers x 100000 blocks x 16 tokens x 2 KV heads x 16 dims x 2 (k, v) x 4 bytes = 0.8 GB, plus the weights
    assert re.search(r"KV cache of 100000 blocks needs about 0\.8 GB, and cpu has 0\.1 GB free; pass fewer "
                     r"--cache-blocks", err), err


@pytest.mark.parametrize("prompt, message", [
    ("w1 \udcff w2", "--prompt is not UTF-8 text (byte 0xff at character 3)"),
    ("\ud800", "--prompt is not UTF-8 text (character U+D800 at character 0)"),
])
def test_a_prompt_argument_not_utf8_is_one_line(folder, capsys, prompt, message):
    """Bytes of another encoding reach Python's argv as lone surrogates, which the tokenizer raised on
    (a TypeError traceback)."""
    assert main(["generate", "--model", str(folder), "--prompt", prompt]) == 2
    assert capsys.readouterr().err == f"flashgen: error: {message}\n"
