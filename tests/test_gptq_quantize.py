"""GPTQ (flashgen/quant.py `quantize_gptq`, `flashgen quantize`): on inputs with correlated features
its codes keep a linear's output closer than round-to-nearest's on the same grid, and on uncorrelated
ones it is round-to-nearest (`--method rtn` writes those codes); the checkpoint it writes of a tiny random Llama loads in the decoder,
whose logits match transformers in float64 holding the weights the stored codes stand for (decoded
here from the packed tensors); bad input is one line, exit code 2, nothing written."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashgen.cli import main  # noqa: E402
from flashgen.quant import quantize_gptq, quantize_rtn  # noqa: E402
from flashgen.runtime.checkpoints.weights import ModelConfig, load_weights  # noqa: E402
from flashgen.runtime.decoder.model import Decoder  # noqa: E402
from tests.prefill import prefill_logits, write_checkpoint  # noqa: E402
from tests.test_decoder import COMMON, PROMPTS  # noqa: E402

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _correlated(t: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """t inputs of k features that mostly move together (a few directions and some noise), as a layer's
    activations do."""
    f64 = torch.float64
    return (torch.randn(t, 6, generator=gen, dtype=f64) @ torch.randn(6, k, generator=gen, dtype=f64)
            + 0.3 * torch.randn(t, k, generator=gen, dtype=f64))


@pytest.mark.parametrize("bits,group,sym", [(4, 32, True), (4, 32, False), (4, None, True), (8, None, True)])
def test_gptq_keeps_the_output_closer_than_rtn_on_the_same_grid(bits, group, sym):
    gen = torch.Generator().manual_seed(bits + (group or 0) + sym)
    n, k, t = 40, 96, 768
    x, w = _correlated(t, k, gen), torch.randn(n, k, generator=gen, dtype=torch.float64)
    gptq = quantize_gptq(w, 2 * x.T @ x / t, bits, group, sym)
    rtn = quantize_rtn(w, bits, group, sym)
    assert gptq.codes.dtype == rtn.codes.dtype and gptq.scales.shape == rtn.scales.shape
    err = {name: float((x @ (w - q.dequantize()).T).norm()) for name, q in (("gptq", gptq), ("rtn", rtn))}
    assert err["gptq"] < 0.5 * err["rtn"], err  # (here about a quarter)
    # uncorrelated inputs: no column's error can be made up by another's, and GPTQ rounds to nearest
    alone = quantize_gptq(w, torch.eye(k, dtype=torch.float64), bits, group, sym)
    assert torch.equal(alone.codes, rtn.codes) and torch.equal(alone.scales, rtn.scales)


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(COMMON["vocab_size"])}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama with a word tokenizer, and calibration text whose words follow a short cycle
    with noise (inputs that correlate)."""
    torch.manual_seed(3)
    root = tmp_path_factory.mktemp("gptq")
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).eval()
    folder = write_checkpoint(hf, root / "float")
    _tokenizer(folder)
    gen = torch.Generator().manual_seed(4)
    words = (torch.arange(3000) * 7 % 19 + torch.randint(0, 3, (3000,), generator=gen) * 40) % COMMON["vocab_size"]
    (root / "calib.txt").write_text(" ".join(f"w{i}" for i in words.tolist()))
    return hf, folder, root


def _unpack(words: torch.Tensor, bits: int, along: int) -> torch.Tensor:
    """Packed int32 words -> values, 32 / bits per word, lowest bits first, along dim 0 (rows) or 1."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    vals = torch.stack([(w >> (bits * j)) & ((1 << bits) - 1) for j in range(32 // bits)], dim=along + 1)
    return vals.reshape(-1, w.shape[1]) if along == 0 else vals.reshape(w.shape[0], -1)


@pytest.mark.parametrize("args,fmt", [(["--group", "32"], "gptq"), (["--group", "32", "--asym"], "gptq_v2"),
                                      (["--bits", "8", "--group", "-1"], "gptq")])
def test_the_checkpoint_loads_as_the_weights_its_codes_stand_for(tiny, tmp_path, args, fmt, capsys):
    from safetensors.torch import load_file
    hf, folder, root = tiny
    out = tmp_path / "q"
    assert main(["quantize", *args, "--calib", str(root / "calib.txt"), "--samples", "6", "--seq-len", "48",
                 str(folder), str(out)]) == 0
    err = capsys.readouterr().err
    assert "layer 2/2 quantized" in err
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["checkpoint_format"] == fmt and (out / "tokenizer.json").is_file()
    bits, stored = qc["bits"], load_file(str(out / "model.safetensors"))
    ref = transformers.LlamaForCausalLM(hf.config).double().eval()
    ref.load_state_dict(hf.state_dict())
    for i in range(hf.config.num_hidden_layers):
        for lin in LINEARS:
            p = f"model.layers.{i}.{lin}."
            assert p + "weight" not in stored
            codes = _unpack(stored[p + "qweight"], bits, 0).T.double()                       # [N, K]
            zeros = _unpack(stored[p + "qzeros"], bits, 1).T.double() + (fmt == "gptq")     # [N, K / G]
            g = stored[p + "g_idx"].long()
            assert torch.equal(g, torch.arange(codes.shape[1]) // (qc["group_size"] if qc["group_size"] > 0 else
                                                                   codes.shape[1]))
            dq = (codes - zeros[:, g]) * stored[p + "scales"].T.double()[:, g]
            before = ref.get_submodule(p[:-1]).weight.detach()
            assert 0 < float((dq - before).abs().max()) < float(before.abs().max()) / 4  # quantized, near the weight
            before.data.copy_(dq)
    model = Decoder(ModelConfig.from_folder(out), load_weights(out))
    assert model.quant == ("w4a16" if bits == 4 else "w8a16")
    with torch.no_grad():
        want = ref(torch.tensor([PROMPTS[1]])).logits[0]
    got = prefill_logits(model, PROMPTS[1]).double()
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4


def test_rtn_writes_round_to_nearest_codes(tiny, tmp_path):
    """--method rtn: each weight rounded to the nearest step of its group's stored (fp16) scale amax / 7
    (the control beside GPTQ), stored as GPTQ's are."""
    from safetensors.torch import load_file
    _, folder, _ = tiny
    assert main(["quantize", "--method", "rtn", "--group", "32", str(folder), str(tmp_path / "q")]) == 0
    stored, source = load_file(str(tmp_path / "q" / "model.safetensors")), load_file(str(folder / "model.safetensors"))
    for name in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"):
        w = source[name + ".weight"].double()
        s = (w.reshape(w.shape[0], -1, 32).abs().amax(-1) / 7).half()
        want = torch.round(w / s.double().repeat_interleave(32, 1)).clamp(-8, 7) + 8
        assert torch.equal(stored[name + ".scales"].T, s)
        assert torch.equal(_unpack(stored[name + ".qweight"], 4, 0).T, want.long())


@pytest.mark.parametrize("args,message", [
    (["--calib", "CALIB", "NOWHERE", "OUT"], "NOWHERE: no such folder"),
    (["--bits", "3", "--calib", "CALIB", "FLOAT", "OUT"], "argument --bits: invalid choice: 3"),
    (["--group", "48", "--seq-len", "48", "--calib", "CALIB", "FLOAT", "OUT"],
     "group 48 does not divide self_attn.q_proj's 64 inputs"),
    (["--bits", "8", "--calib", "CALIB", "FLOAT", "OUT"], "8-bit codes load per channel and symmetric only"),
    (["--calib", "NOWHERE", "FLOAT", "OUT"], "--calib NOWHERE: cannot read it"),
    (["--samples", "100", "--seq-len", "48", "--group", "32", "--calib", "CALIB", "FLOAT", "OUT"],
     "fewer than 100 samples of 48"),
    (["--calib", "CALIB", "FLOAT", "FLOAT"], "exists: give a new folder"),
    (["FLOAT", "OUT"], "--method gptq takes --calib TEXTFILE"),
    (["--method", "rtn", "--calib", "CALIB", "FLOAT", "OUT"], "--method rtn takes no --calib"),
])
def test_bad_input_is_one_line(tiny, tmp_path, capsys, args, message):
    _, folder, root = tiny
    names = {"CALIB": str(root / "calib.txt"), "FLOAT": str(folder), "OUT": str(tmp_path / "q"),
             "NOWHERE": str(tmp_path / "nowhere")}
    assert main(["quantize", *[names.get(a, a) for a in args]]) == 2
    err = capsys.readouterr().err
    assert message.replace("NOWHERE", names["NOWHERE"]) in err and err.count("\n") == 1, err
    assert not (tmp_path / "q").exists() and not (tmp_path / "q.partial").exists()
