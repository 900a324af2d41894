"""`flashgen generate` and `flashgen bench-model` on the CPU: sampling ranges and prompt files are one
line and exit 2 before a model loads; the folder's generation_config.json gives the sampling defaults
and its tokenizer_config.json the BOS and EOS of a prompt, each checked; bench-model's defaults follow
the device, and a run that would not fit in memory is refused with its estimate before anything is
allocated."""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import torch

from flashgen.cli import main
from flashgen.runtime.decoder import bench

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
    ("--min-p", "1.5", r"a number in \[0, 1\]"), ("--min-p", "-0.1", r"a number in \[0, 1\]"),
    ("--repetition-penalty", "0", "a finite number above 0"), ("--repetition-penalty", "inf", "a finite number above 0"),
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


def test_no_prefix_cache_reaches_the_engine(folder, capsys, monkeypatch):
    """Prefix caching is on unless --no-prefix-cache turns it off; the text is the same both ways."""
    from flashgen.runtime.decoder import engine, loading

    made = []

    class Recorded(engine.Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self.prefix_cache)

    monkeypatch.setattr(loading, "Engine", Recorded)
    texts = []
    for flags in ([], ["--no-prefix-cache"]):
        assert main(["generate", "--model", str(folder), "--prompt", "w5 w9 w2", "--max-new-tokens", "3"] + flags) == 0
        texts.append(capsys.readouterr().out)
    assert made == [True, False] and texts[0] == texts[1] and len(texts[0].split()) == 3



def test_quant_reaches_the_engine(folder, capsys, monkeypatch):
    """`generate --quant MODE` computes the linears in MODE (the CPU names the mode that computed)."""
    from flashgen.runtime.decoder import engine, loading

    made = []

    class Recorded(engine.Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(loading, "Engine", Recorded)
    assert main(["generate", "--model", str(folder), "--prompt", "w5 w9 w2", "--max-new-tokens", "3",
                 "--quant", "w8a8"]) == 0
    assert len(capsys.readouterr().out.split()) == 3
    assert made[0].model.quant == "w8a8" and any(f.startswith("w8a8 linear") for f in made[0].model.fallbacks)
    assert main(["generate", "--model", str(folder), "--prompt", "w5", "--quant", "w3a3"]) == 2
    assert "invalid choice: 'w3a3'" in capsys.readouterr().err


def test_prompt_file_and_stdin_give_the_prompt(folder, tmp_path, capsys, monkeypatch):
    """A prompt read from a file or standard input (its final newline kept, which this tokenizer reads as
    no token: test_chat.py shows it kept) decodes as the same prompt given as an argument; a file that is
    not UTF-8, or none, is one line and exit 2."""
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
    """(Its status lines, on stderr, come as each phase starts: the results alone are on stdout.)"""
    assert main(["bench-model", "--config", "tiny", "--batch", "2", "--prompt-len", "5", "--new-tokens", "1"]) == 0
    out, err = capsys.readouterr()
    row = out.splitlines()[2].split()
    assert row[0] == "2" and float(row[1]) >= 0 and row[2] == "-" and row[4] == "-"
    weights = "bfloat16 weights on the cuda" if torch.cuda.is_available() else "float32 weights on the cpu"
    assert err.splitlines() == [f"tiny: making random {weights}...", "batch 2: warming up (its kernels built or "
                                "loaded), then timing 5-token prefills and 1 new tokens..."]


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
    from flashgen.runtime.decoder import memory
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


def _with_json(folder: Path, tmp_path: Path, name: str, content: object) -> Path:
    """A copy of `folder` whose file `name` holds `content` (an object: merged into the file there)."""
    m = _copy(folder, tmp_path)
    if isinstance(content, dict) and (m / name).exists():
        content = {**json.loads((m / name).read_text()), **content}
    (m / name).write_text(json.dumps(content))
    return m


@pytest.fixture
def added(monkeypatch):
    """The (prompt, params) of every request `flashgen generate` adds to its engine."""
    from flashgen.runtime.decoder.engine import Engine
    seen, add = [], Engine.add

    def recorded(self, prompt, params):
        seen.append((prompt, params))
        return add(self, prompt, params)
    monkeypatch.setattr(Engine, "add", recorded)
    return seen


SAMPLES = {"do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9}
FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


@pytest.mark.parametrize("file, flags, want", [
    (SAMPLES, [], (0.7, 5, 0.9, 0.0, 1.0)),
    (SAMPLES, ["--temperature", "0"], (0.0, 5, 0.9, 0.0, 1.0)),          # a flag wins: greedy
    (SAMPLES, ["--top-k", "3", "--top-p", "1"], (0.7, 3, 1.0, 0.0, 1.0)),
    ({**SAMPLES, "do_sample": False}, [], (0.0, 5, 0.9, 0.0, 1.0)),       # not sampling: greedy
    ({**SAMPLES, "do_sample": False}, ["--temperature", "0.5"], (0.5, 5, 0.9, 0.0, 1.0)),  # the file's top-k/p then
    ({"temperature": 0.7}, [], (0.0, 50, 1.0, 0.0, 1.0)),                 # do_sample absent: greedy
    ({"temperature": 0.7}, ["--temperature", "0.5"], (0.5, 50, 1.0, 0.0, 1.0)),
    ({"do_sample": True}, [], (1.0, 50, 1.0, 0.0, 1.0)),                  # transformers' temperature and top-k
    ({"do_sample": True, "temperature": None, "top_k": None}, [], (1.0, 50, 1.0, 0.0, 1.0)),  # null: not set
    ({"do_sample": True, "top_k": 0}, [], (1.0, 0, 1.0, 0.0, 1.0)),       # 0: every token, as transformers
    ({"do_sample": True, "min_p": 0.1, "repetition_penalty": 1.05}, [], (1.0, 50, 1.0, 0.1, 1.05)),
    ({"repetition_penalty": 1.2}, [], (0.0, 50, 1.0, 0.0, 1.2)),          # penalized greedy
    ({"repetition_penalty": 1.2, "min_p": 0.1}, ["--repetition-penalty", "1", "--min-p", "0"], (0.0, 50, 1.0, 0.0, 1.0)),
    ({}, [], (0.0, 50, 1.0, 0.0, 1.0)),
])
def test_generation_config_gives_the_sampling_defaults(folder, tmp_path, capsys, added, file, flags, want):
    """The folder's settings as transformers' generate reads them, unless a flag says otherwise; they were
    ignored (a folder meant to sample decoded greedily), then its repetition penalty and min_p were."""
    m = _with_json(folder, tmp_path, "generation_config.json", file)
    assert main(["generate", "--model", str(m), "--prompt", "w1 w2", "--max-new-tokens", "2", *flags]) == 0
    (_, p), = added
    assert tuple(getattr(p, f) for f in FIELDS) == want
    assert len(capsys.readouterr().out.split()) == 2


@pytest.mark.parametrize("file, flags, want", [
    ({"max_new_tokens": 3}, [], 3),
    ({"max_new_tokens": 3}, ["--max-new-tokens", "5"], 5),
    ({"max_length": 6}, [], 4),                                  # a prompt of 2 tokens: 4 more
    ({"max_length": 200}, [], 64),                               # the default, within it
    ({"max_length": 6, "max_new_tokens": 7}, [], 7),             # max_new_tokens overrides it, as in transformers
    ({"max_length": 6}, ["--max-new-tokens", "9"], 9),
])
def test_generation_config_gives_the_length(folder, tmp_path, capsys, added, file, flags, want):
    m = _with_json(folder, tmp_path, "generation_config.json", file)
    assert main(["generate", "--model", str(m), "--prompt", "w1 w2", *flags]) == 0
    (_, p), = added
    assert p.max_new_tokens == want and len(capsys.readouterr().out.split()) == want


def test_a_prompt_at_max_length_is_one_line(folder, tmp_path, capsys, added):
    m = _with_json(folder, tmp_path, "generation_config.json", {"max_length": 3})
    assert main(["generate", "--model", str(m), "--prompt", "w1 w2 w3"]) == 2
    assert capsys.readouterr().err == (f"flashgen: error: the prompt's 3 tokens reach {m / 'generation_config.json'}'s "
                                       "max_length of 3; pass --max-new-tokens to generate past it\n")
    assert not added


@pytest.mark.parametrize("file, message", [
    ({"temperature": -1}, ": temperature must be a finite number >= 0, got -1"),
    ({"temperature": float("nan")}, ": temperature must be a finite number >= 0, got nan"),
    ({"temperature": float("inf")}, ": temperature must be a finite number >= 0, got inf"),
    ({"temperature": "0.7"}, ": temperature must be a finite number >= 0, got '0.7'"),
    ({"top_p": 0}, ": top_p must be a number in (0, 1], got 0"),
    ({"top_p": 1.5}, ": top_p must be a number in (0, 1], got 1.5"),
    ({"top_k": 2.5}, ": top_k must be an integer >= 0, got 2.5"),
    ({"top_k": -1}, ": top_k must be an integer >= 0, got -1"),
    ({"top_k": True}, ": top_k must be an integer >= 0, got True"),
    ({"min_p": 2}, ": min_p must be a number in [0, 1], got 2"),
    ({"repetition_penalty": 0}, ": repetition_penalty must be a finite number > 0, got 0"),
    ({"repetition_penalty": -1.1}, ": repetition_penalty must be a finite number > 0, got -1.1"),
    ({"max_new_tokens": 0}, ": max_new_tokens must be an integer >= 1, got 0"),
    ({"max_length": 2.5}, ": max_length must be an integer >= 1, got 2.5"),
    ({"do_sample": "true"}, ": do_sample must be true or false, got 'true'"),
    ({"do_sample": 1}, ": do_sample must be true or false, got 1"),
    ({"num_beams": 4}, ": num_beams is 4, which asks for beam search; flashgen decodes greedily or by sampling only "
                       "(remove the key to decode without it)"),
    ({"no_repeat_ngram_size": 3}, ": no_repeat_ngram_size is 3, which asks for an n-gram ban; flashgen decodes "
                                  "greedily or by sampling only (remove the key to decode without it)"),
    ({"suppress_tokens": [5]}, ": suppress_tokens is [5], which asks for suppressed tokens; flashgen decodes "
                               "greedily or by sampling only (remove the key to decode without it)"),
    ({"min_new_tokens": 4}, ": min_new_tokens is 4, which asks for a minimum length; flashgen decodes greedily or "
                            "by sampling only (remove the key to decode without it)"),
    ([1, 2], " is not a JSON object"),
])
def test_bad_generation_config_sampling_is_one_line(folder, tmp_path, capsys, added, file, message):
    """Refused naming the file and key before the model loads, even where flags override every value; a
    setting that asks for a decoding flashgen does not do is refused rather than left out."""
    m = _with_json(folder, tmp_path, "generation_config.json", file)
    assert main(["generate", "--model", str(m), "--prompt", "w1", "--temperature", "0.5", "--top-k", "1",
                 "--top-p", "1", "--max-new-tokens", "1"]) == 2
    assert capsys.readouterr().err == f"flashgen: error: {m / 'generation_config.json'}{message}\n"
    assert not added


def test_settings_that_change_nothing_are_taken(folder, tmp_path, capsys, added):
    """Neutral values of the refused keys, and keys that leave the tokens alone, decode as without them."""
    m = _with_json(folder, tmp_path, "generation_config.json", {
        "num_beams": 1, "no_repeat_ngram_size": 0, "suppress_tokens": None, "bad_words_ids": [], "typical_p": 1.0,
        "repetition_penalty": 1.0, "pad_token_id": 0, "use_cache": True, "cache_implementation": "hybrid"})
    assert main(["generate", "--model", str(m), "--prompt", "w1 w2", "--max-new-tokens", "2"]) == 0
    (_, p), = added
    assert (p.temperature, p.repetition_penalty) == (0.0, 1.0) and len(capsys.readouterr().out.split()) == 2


def _bos_template(m: Path) -> None:
    """Make `m`'s tokenizer.json add w1 as a BOS in front of every prompt, as Llama's do with <s>."""
    from tokenizers import Tokenizer, processors
    tok = Tokenizer.from_file(str(m / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="w1 $A", special_tokens=[("w1", 1)])
    tok.save(str(m / "tokenizer.json"))


@pytest.mark.parametrize("template, config, want", [
    (False, {"add_bos_token": True, "bos_token": "w1"}, [1, 5, 6]),
    (True, {"add_bos_token": True, "bos_token": {"content": "w1", "special": True}}, [1, 5, 6]),  # one, not two
    (True, {"add_bos_token": False}, [5, 6]),
    (True, {"add_eos_token": True, "eos_token": "w2"}, [5, 6, 2]),  # (add_bos_token absent: false)
    (False, {"add_bos_token": True, "add_eos_token": True, "bos_token": "w1", "eos_token": "w2"}, [1, 5, 6, 2]),
    (True, {"add_bos_token": None, "bos_token": "w3"}, [1, 5, 6]),  # neither flag set: tokenizer.json's own
    (True, None, [1, 5, 6]),
    (False, None, [5, 6]),
])
def test_tokenizer_config_decides_bos_and_eos(folder, tmp_path, added, template, config, want):
    """tokenizer_config.json's add_bos_token / add_eos_token replace what tokenizer.json's post-processor
    adds, as transformers reads them; they were ignored, so a prompt could lack the BOS the model was
    trained with (or hold one it was not)."""
    m = _with_json(folder, tmp_path, "tokenizer_config.json", config) if config is not None else _copy(folder, tmp_path)
    if template:
        _bos_template(m)
    assert main(["generate", "--model", str(m), "--prompt", "w5 w6", "--max-new-tokens", "1"]) == 0
    assert added[0][0] == want


@pytest.mark.parametrize("config, message", [
    ({"add_bos_token": "true", "bos_token": "w1"}, "add_bos_token must be true or false, got 'true'"),
    ({"add_eos_token": 1, "eos_token": "w2"}, "add_eos_token must be true or false, got 1"),
    ({"add_bos_token": True}, "add_bos_token is true, but bos_token names no token (got None)"),
    ({"add_bos_token": True, "bos_token": {"special": True}}, "add_bos_token is true, but bos_token names no token"),
    ({"add_bos_token": True, "bos_token": "<s>"}, "bos_token '<s>' is not a token of tokenizer.json"),
])
def test_bad_tokenizer_config_is_one_line(folder, tmp_path, capsys, config, message):
    m = _with_json(folder, tmp_path, "tokenizer_config.json", config)
    assert main(["generate", "--model", str(m), "--prompt", "w1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flashgen: error: {m / 'tokenizer_config.json'}: {message}") and err.count("\n") == 1, err


@pytest.fixture
def no_loading(monkeypatch):
    """Loading the weights fails the test: a refusal must come before it."""
    from flashgen.runtime.checkpoints import weights

    def loaded(*args, **kwargs):
        raise AssertionError("the weights were loaded")
    monkeypatch.setattr(weights, "load_weights", loaded)


@pytest.mark.parametrize("how, message", [
    (["--prompt", ""], "--prompt: the prompt is empty; give the text to continue from"),
    (["--prompt", "   "], "--prompt: the prompt '   ' encodes to no tokens; give the text to continue from"),
    (["--prompt-file", "{empty}"], "--prompt-file {empty}: the prompt is empty; give the text to continue from"),
    (["--prompt-file", "{newline}"], "--prompt-file {newline}: the prompt '\\n' encodes to no tokens; give the text to "
                                     "continue from"),
])
def test_an_empty_prompt_is_refused_before_the_model_loads(folder, tmp_path, capsys, no_loading, how, message):
    """It was refused by the engine's API check ("prompt must be a non-empty list of token ids"), after
    the weights loaded. (This tokenizer adds no BOS token: the empty text gives no token at all.)"""
    paths = {"{empty}": tmp_path / "empty.txt", "{newline}": tmp_path / "newline.txt"}
    paths["{empty}"].write_text("")
    paths["{newline}"].write_text("\n")  # (kept: the file is the prompt byte for byte)
    for name, path in paths.items():
        how, message = [a.replace(name, str(path)) for a in how], message.replace(name, str(path))
    assert main(["generate", "--model", str(folder), *how]) == 2
    assert capsys.readouterr().err == f"flashgen: error: {message}\n"


def test_too_few_cache_blocks_say_how_many_the_request_needs(folder, capsys, no_loading):
    """It said only "needs more KV cache blocks than the cache has", after the weights loaded."""
    argv = ["generate", "--model", str(folder), "--prompt", "w1 w2 w3", "--max-new-tokens", "30", "--cache-blocks", "2"]
    assert main(argv) == 2
    assert capsys.readouterr().err == ("flashgen: error: --cache-blocks 2 is too few: the prompt's 3 tokens and 30 new "
                                       "ones need 3 blocks of 16 tokens; pass --cache-blocks 3 or more\n")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_cuda_graphs_padding_block_comes_beside_the_cache_blocks_on_a_gpu(folder, capsys):
    """On a GPU the engine runs the generated attention in CUDA graphs and keeps a block for their padding
    rows beside the --cache-blocks: 2 blocks serve the request's 32 tokens (the engine once took that
    block out of them and said only "needs more KV cache blocks than the cache has")."""
    argv = ["generate", "--model", str(folder), "--prompt", "w1 w2", "--max-new-tokens", "30", "--cache-blocks", "2"]
    assert main(argv) == 0
    assert len(capsys.readouterr().out.split()) == 30
