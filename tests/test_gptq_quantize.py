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
    (["--method", "awq", "FLOAT", "OUT"], "--method awq takes --calib TEXTFILE"),
    (["--method", "awq", "--bits", "8", "--group", "-1", "--calib", "CALIB", "FLOAT", "OUT"],
     "AWQ checkpoints hold 4-bit codes"),
])
def test_bad_input_is_one_line(tiny, tmp_path, capsys, args, message):
    _, folder, root = tiny
    names = {"CALIB": str(root / "calib.txt"), "FLOAT": str(folder), "OUT": str(tmp_path / "q"),
             "NOWHERE": str(tmp_path / "nowhere")}
    assert main(["quantize", *[names.get(a, a) for a in args]]) == 2
    err = capsys.readouterr().err
    assert message.replace("NOWHERE", names["NOWHERE"]) in err and err.count("\n") == 1, err
    assert not (tmp_path / "q").exists() and not (tmp_path / "q.partial").exists()


def test_awq_scales_keep_salient_channels_closer_and_never_lose_on_their_inputs():
    """awq_scales.best_scale: on inputs where a few channels carry most of the magnitude, scaling those
    columns up before rounding keeps the output closer than rounding alone; where every channel is alike
    the search may pick no scale, and it never returns more error than rounding alone (alpha 0 is tried)."""
    from flashgen.runtime.checkpoints.awq_scales import best_scale, output_error

    gen = torch.Generator().manual_seed(11)
    n, k, t = 48, 128, 1024
    w = torch.randn(n, k, generator=gen, dtype=torch.float64)
    for salient in (True, False):
        x = torch.randn(t, k, generator=gen, dtype=torch.float64)
        if salient:
            x[:, :6] *= 30.0
        h = 2 * x.T @ x / t
        s, err, plain = best_scale(w, x.abs().mean(0), h, 4, 32, True)
        rtn = quantize_rtn(w, 4, 32, True).dequantize()
        assert plain == pytest.approx(output_error(w, rtn, h)) and err <= plain
        dq = quantize_rtn(w * s, 4, 32, True).dequantize() / s
        assert err == pytest.approx(float((x @ (w - dq).T).pow(2).sum()) * 2 / t)
        if salient:
            assert err < 0.8 * plain and float(s[:6].min()) > float(s[6:].max()), (err, plain)


def test_awq_folding_keeps_the_float_layer_output():
    """awq_scales.fold: each stack's columns times s and 1 / s in its producer (norms; up's rows; v's rows
    and bias where every query head has its own value head) leave a layer's output as it was; with
    grouped heads o is left alone."""
    from flashgen.runtime.checkpoints.awq_scales import fold
    from flashgen.runtime.checkpoints.gptq_quantize import STACKS

    for heads, kv in ((4, 4), (4, 2)):
        torch.manual_seed(heads + kv)
        cfg = transformers.Qwen2Config(**{**COMMON, "num_key_value_heads": kv}, use_sliding_window=False)
        hf = transformers.Qwen2ForCausalLM(cfg).double().eval()
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(0.1 * torch.randn_like(p))  # (norm weights and biases away from 1 and 0)
            tokens = torch.tensor([PROMPTS[1]])
            want = hf(tokens).logits
            layer = hf.model.layers[0]
            o_before = layer.self_attn.o_proj.weight.clone()
            folded = [fold(layer, stack, torch.rand(layer.get_submodule(stack[0]).weight.shape[1],
                                                    dtype=torch.float64) * 3 + 0.2) for stack in STACKS]
            got = hf(tokens).logits
        assert folded == [True, kv == heads, True, True]
        assert float((got - want).abs().max()) < 1e-9 * float(want.abs().max())
        assert torch.equal(layer.self_attn.o_proj.weight, o_before) == (kv != heads)


def test_awq_checkpoint_loads_as_the_weights_its_codes_and_norms_stand_for(tiny, tmp_path, capsys):
    """--method awq writes AWQ's GEMM format (codes, zero points 8 where symmetric, fp16 scales) and the
    norms and up rows that absorbed the scales; the decoder loads it as w4a16 and matches transformers in
    float64 holding what the stored tensors stand for."""
    from safetensors.torch import load_file

    from flashgen.runtime.checkpoints.prequant import AWQ_ORDER
    hf, folder, root = tiny
    out = tmp_path / "q"
    assert main(["quantize", "--method", "awq", "--group", "32", "--calib", str(root / "calib.txt"), "--samples", "6",
                 "--seq-len", "48", str(folder), str(out)]) == 0
    err = capsys.readouterr().err
    assert "layer 2/2: output error against rounding alone: q " in err and "o unscaled" in err, err
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True}
    stored = load_file(str(out / "model.safetensors"))
    ref = transformers.LlamaForCausalLM(hf.config).double().eval()
    ref.load_state_dict({k: v for k, v in stored.items() if k.endswith("weight")}, strict=False)
    order = torch.tensor(AWQ_ORDER).argsort()
    changed = 0
    for i in range(hf.config.num_hidden_layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            p = f"model.layers.{i}.{norm}.weight"
            changed += not torch.equal(stored[p], hf.state_dict()[p])
        for lin in LINEARS:
            p = f"model.layers.{i}.{lin}."
            codes = _unpack(stored[p + "qweight"], 4, 1)                      # [K, N], nibble order
            codes = codes.reshape(codes.shape[0], -1, 8)[:, :, order].reshape(codes.shape[0], -1).T.double()
            zeros = _unpack(stored[p + "qzeros"], 4, 1)
            zeros = zeros.reshape(zeros.shape[0], -1, 8)[:, :, order].reshape(zeros.shape[0], -1).T.double()
            assert torch.all(zeros == 8)
            g = torch.arange(codes.shape[1]) // 32
            ref.get_submodule(p[:-1]).weight.data.copy_((codes - zeros[:, g]) * stored[p + "scales"].T.double()[:, g])
    assert changed == 2 * hf.config.num_hidden_layers  # every norm took its stack's scales
    model = Decoder(ModelConfig.from_folder(out), load_weights(out))
    assert model.quant == "w4a16"
    with torch.no_grad():
        want = ref(torch.tensor([PROMPTS[1]])).logits[0]
    got = prefill_logits(model, PROMPTS[1]).double()
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4


def test_awq_clipping_keeps_each_group_output_at_least_as_close():
    """awq_scales.best_clip: each (row, group) takes the clipped range whose rounding keeps that group's
    share of the output closest; with heavy-tailed weights some groups clip and their error falls, and
    no group's error rises over rounding its whole range (1 is on the grid)."""
    from flashgen.runtime.checkpoints.awq_scales import best_clip

    gen = torch.Generator().manual_seed(5)
    n, k, t, g = 32, 128, 512, 32
    torch.manual_seed(5)
    w = torch.distributions.StudentT(2.0).sample((n, k)).to(torch.float64)
    x = torch.randn(t, k, generator=gen, dtype=torch.float64)
    h = 2 * x.T @ x / t
    for sym in (True, False):
        clipped = best_clip(w, h, 4, g, sym)
        assert clipped.dtype == w.dtype and float((clipped - w).abs().max()) > 0
        assert torch.all(clipped.abs() <= w.abs().reshape(n, -1, g).amax(-1).repeat_interleave(g, 1))

        def group_err(v: torch.Tensor) -> torch.Tensor:
            d = (w - quantize_rtn(v, 4, g, sym).dequantize()).reshape(n, -1, g)
            blocks = torch.stack([h[i:i + g, i:i + g] for i in range(0, k, g)])
            return torch.einsum("ngi,gij,ngj->ng", d, blocks, d)
        assert torch.all(group_err(clipped) <= group_err(w) + 1e-12)
        assert int((group_err(clipped) < group_err(w) - 1e-12).sum()) > 0  # some groups gain by a clip
