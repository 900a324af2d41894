"""Pre-quantized checkpoints end to end: a tiny random Llama's linears quantized here (asymmetric int4
in groups of 32, or 8-bit per channel), packed as GPTQ (with and without act-order) and AWQ store
them, or stored as compressed-tensors does (int8 W8A8 and W8A16, e4m3 FP8, packed W4A16 with
act-order, W4A8), written as a Hugging Face folder with its quantization_config; the decoder's logits
against transformers running the same model with the dequantized weights (and, for schemes that
quantize activations, each linear's input quantized per token as the scheme says), and the refusals
of malformed folders, each naming the tensor."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashgen.errors import FlashgenError  # noqa: E402
from flashgen.runtime.decoder.model import Decoder  # noqa: E402
from flashgen.runtime.checkpoints.weights import ModelConfig, load_weights  # noqa: E402
from flashgen.runtime.checkpoints.prequant import AWQ_ORDER  # noqa: E402
from tests.prefill import prefill_logits  # noqa: E402
from tests.test_decoder import COMMON, PROMPTS  # noqa: E402
from tests.test_compressed_tensors import FP8, INT8, scheme, weights  # noqa: E402
from tests.test_prequant import pack_cols, pack_rows  # noqa: E402
from flashgen.oplib._common import quantize_ref  # noqa: E402

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FORMATS = {  # name -> quantization_config
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": False},
    "gptq-act-order": {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": True},
    "gptq-8bit": {"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": True, "desc_act": False,
                  "checkpoint_format": "gptq_v2"},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True},
    "ct-w8a8": scheme("int-quantized", weights(8, "channel"), INT8),
    "ct-w8a16-tensor": scheme("int-quantized", weights(8, "tensor"), None),
    "ct-fp8": scheme("float-quantized", weights(8, "channel", "float"), FP8),
    "ct-w4a16-act-order": scheme("pack-quantized", weights(4, "group", group=32, actorder="group")),
    "ct-w4a8": scheme("pack-quantized", weights(4, "channel"), INT8),
}
MODE = {"gptq-8bit": "w8a16", "ct-w8a8": "w8a8", "ct-w8a16-tensor": "w8a16", "ct-fp8": "fp8", "ct-w4a8": "w4a8"}
ACTIVATIONS = {"ct-w8a8": "int8", "ct-fp8": "fp8e4m3", "ct-w4a8": "int8"}  # per-token quantized inputs


def ct_quantize(w: torch.Tensor, qc: dict, order: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A [N, K] weight's tensors as compressed-tensors stores them in `qc`'s scheme (module docstring of
    runtime/checkpoints/compressed_tensors.py), and the float weight they stand for."""
    fmt, args = qc["format"], qc["config_groups"]["group_0"]["weights"]
    n, k, wd = *w.shape, w.double()
    if fmt != "pack-quantized":
        qmax = 448.0 if fmt == "float-quantized" else 127.0
        amax = wd.abs().amax(1, keepdim=True) if args["strategy"] == "channel" else wd.abs().amax().reshape(1)
        s = (amax / qmax).to(torch.bfloat16)
        v = wd / s.double().reshape(-1, 1)
        v = v.to(torch.float8_e4m3fn) if fmt == "float-quantized" else torch.round(v).clamp(-128, 127).to(torch.int8)
        return {"weight": v, "weight_scale": s}, (v.double() * s.double().reshape(-1, 1)).float()
    g = args["group_size"] or k
    g_idx = order // g if args["actorder"] == "group" else torch.arange(k) // g
    s = torch.stack([wd[:, g_idx == j].abs().amax(1) for j in range(k // g)], 1) / 7  # [N, K/G]
    s = s.half()
    q = torch.round(wd / s.double()[:, g_idx]).clamp(-8, 7).long()
    out = {"weight_packed": pack_cols(q + 8, 4), "weight_scale": s, "weight_shape": torch.tensor([n, k])}
    if args["actorder"] == "group":
        out["weight_g_idx"] = g_idx.to(torch.int32)
    return out, (q.double() * s.double()[:, g_idx]).float()


def quantize(w: torch.Tensor, qc: dict, order: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A [N, K] weight's packed tensors in `qc`'s format, and the float weight they stand for; act-order
    takes the k in `order` into groups (GPTQ orders by its Hessian: one order for the linears of one x)."""
    if qc["quant_method"] == "compressed-tensors":
        return ct_quantize(w, qc, order)
    bits, n, k = qc["bits"], *w.shape
    g = k if qc["group_size"] == -1 else qc["group_size"]
    g_idx = (order // g if qc.get("desc_act") else torch.arange(k) // g)
    wt = w.T.double()                                          # [K, N], the formats' orientation
    groups = torch.stack([wt[g_idx == j] for j in range(k // g)])  # [K/G, G, N]
    top = (1 << bits) - 1
    if qc.get("sym", False):
        s = groups.abs().amax(1) / (top // 2) + 1e-8
        z = torch.full_like(s, 1 << (bits - 1))
    else:
        lo, hi = groups.amin(1), groups.amax(1)
        s = (hi - lo) / top + 1e-8
        z = torch.round(-lo / s).clamp(0, top)
    s = s.half()
    q = torch.round(wt / s.double()[g_idx] + z[g_idx]).clamp(0, top).long()  # [K, N]
    dq = ((q - z[g_idx]) * s.double()[g_idx]).T.float()
    if qc["quant_method"] == "awq":
        return {"qweight": pack_cols(q, 4, AWQ_ORDER), "qzeros": pack_cols(z.long(), 4, AWQ_ORDER), "scales": s}, dq
    stored = z.long() - (1 if qc.get("checkpoint_format", "gptq") == "gptq" else 0)
    return {"qweight": pack_rows(q, bits), "qzeros": pack_cols(stored, bits), "scales": s,
            "g_idx": g_idx.to(torch.int32)}, dq


def write_quantized(hf: torch.nn.Module, qc: dict, folder: Path) -> Path:
    """`hf` saved with its linears packed in `qc`'s format; `hf` then holds the dequantized weights."""
    from safetensors.torch import save_file
    gen = torch.Generator().manual_seed(5)
    tensors = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    for i in range(hf.config.num_hidden_layers):
        orders: dict[str, torch.Tensor] = {}
        for lin in LINEARS:
            name = f"model.layers.{i}.{lin}"
            w = tensors.pop(name + ".weight")
            short = lin.split(".")[1]
            x = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(short, short)
            packed, dq = quantize(w, qc, orders.setdefault(x, torch.randperm(w.shape[1], generator=gen)))
            tensors.update({f"{name}.{x}": v.contiguous() for x, v in packed.items()})
            hf.get_submodule(name).weight.data.copy_(dq)
    tensors.pop("lm_head.weight", None) if hf.config.tie_word_embeddings else None
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = hf.config.to_dict()
    config["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module", params=sorted(FORMATS))
def quantized(request, tmp_path_factory):
    torch.manual_seed(11)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).eval()
    hf.config._attn_implementation = "eager"
    folder = write_quantized(hf, FORMATS[request.param], tmp_path_factory.mktemp(request.param))
    if request.param in ACTIVATIONS:  # the reference quantizes each linear's input per token, as the scheme says
        qdtype = ACTIVATIONS[request.param]
        for i in range(hf.config.num_hidden_layers):
            for lin in LINEARS:
                hf.get_submodule(f"model.layers.{i}.{lin}").register_forward_pre_hook(
                    lambda mod, args: tuple(_fake_quant(a, qdtype) for a in args))
    return request.param, hf, folder


def _fake_quant(x: torch.Tensor, qdtype: str) -> torch.Tensor:
    q, s = quantize_ref(x.double(), qdtype)
    return (q * s[..., None]).to(x.dtype)


def test_logits_match_the_dequantized_model(quantized):
    kind, hf, folder = quantized
    c = ModelConfig.from_folder(folder)
    model = Decoder(c, load_weights(folder))
    mode = MODE.get(kind, "w4a16")
    assert model.quant == mode
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[1]])).logits[0]
    got = prefill_logits(model, PROMPTS[1])
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4, kind  # (the unquantized inputs: 7e-3 or more off)
    other = "w4a8" if mode != "w4a8" else "w8a8"
    with pytest.raises(FlashgenError, match=rf"checkpoint computes as {mode}, not {other}"):
        Decoder(c, load_weights(folder), quant=other)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_logits_on_gpu_match_the_dequantized_model(quantized):
    """The generated int4 GEMMs with the checkpoint's zero points, x gathered in act-order's order."""
    kind, hf, folder = quantized
    model = Decoder(ModelConfig.from_folder(folder), load_weights(folder), "cuda", torch.bfloat16)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[1]])).logits[0]
    got = prefill_logits(model, PROMPTS[1]).float().cpu()
    assert float((got - ref).norm() / ref.norm()) < 0.03, kind


def test_malformed_folders_are_refused_by_name(quantized, tmp_path):
    from safetensors.torch import load_file, save_file
    kind, _, folder = quantized
    t = load_file(str(folder / "model.safetensors"))
    name = next(f"model.layers.1.mlp.down_proj.{x}" for x in ("qweight", "weight_packed", "weight")
                if f"model.layers.1.mlp.down_proj.{x}" in t)
    stored = {"I32": "the packed int32", "I8": "int8", "F8_E4M3": "float8 e4m3"}
    dtype = {torch.int32: "I32", torch.int8: "I8", torch.float8_e4m3fn: "F8_E4M3"}[t[name].dtype]
    for edit, match in ((lambda d: d.pop(name), rf"tensor {name} \(shape \[\d+, \d+\]\) is missing"),
                        (lambda d: d.update({name: d[name][:, :4].contiguous()}), rf"tensor {name} has shape"),
                        (lambda d: d.update({name: d[name].float()}), rf"tensor {name} is F32, not {stored[dtype]}")):
        d = dict(t)
        edit(d)
        bad = tmp_path / "bad"
        bad.mkdir(exist_ok=True)
        (bad / "config.json").write_text((folder / "config.json").read_text())
        save_file(d, str(bad / "model.safetensors"))
        with pytest.raises(FlashgenError, match=match):
            load_weights(bad)
    if kind == "gptq-act-order":  # q, k and v read one x: one permutation, or the stack is refused
        d = dict(t)
        d["model.layers.0.self_attn.k_proj.g_idx"] = torch.arange(64, dtype=torch.int32) // 32
        save_file(d, str(bad / "model.safetensors"))
        with pytest.raises(FlashgenError, match="have different act-order permutations"):
            Decoder(ModelConfig.from_folder(bad), load_weights(bad))
