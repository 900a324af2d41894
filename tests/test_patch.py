"""flashgen.patch on tiny random transformers Llama, Mistral, Qwen2 and Qwen3 models (float32 on the CPU):
the greedy tokens of `generate` are the unpatched model's and flashgen's ops computed them, the residual
adds fused; the quantized modes' logits are those of the same model in float64 with the weights their
codes stand for; the fused layers' recorded hidden states and a whole-graph trace; refusals; unpatch. On
a GPU (-m gpu): bf16 greedy tokens, patched against unpatched, and generate's compiled decode (CUDA
graphs) at two batch sizes in one process against the eager one."""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashgen  # noqa: E402
from flashgen.errors import FlashgenError  # noqa: E402
from flashgen.oplib._common import quantize_ref  # noqa: E402
from flashgen.quant import QuantizedWeight, unpack_int4  # noqa: E402
from flashgen.runtime import patch as patching  # noqa: E402
from flashgen.runtime.decoder import quant_modes  # noqa: E402
from flashgen.runtime.patch import ARCHITECTURES, PatchedLinear  # noqa: E402
from flashgen.runtime.serving.torch_ops import dispatcher  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, eos_token_id=None,
              pad_token_id=0)
CONFIGS = {
    "llama": lambda **kw: transformers.LlamaConfig(**COMMON, **kw),
    "mistral": lambda **kw: transformers.MistralConfig(**COMMON, sliding_window=8, **kw),
    "qwen2": lambda **kw: transformers.Qwen2Config(**COMMON, use_sliding_window=False, **kw),
    "qwen3": lambda **kw: transformers.Qwen3Config(**COMMON, head_dim=16, **kw),
}
# A left-padded batch (each row's positions start at its first token: generate reads them off the mask)
# of 64 rows, so that prefill and decode steps both reach the CPU's largest row tile: each op compiles
# one kernel (row_space.default), not one per row count.
_GEN = torch.Generator().manual_seed(0)
IDS = torch.randint(1, 128, (64, 7), generator=_GEN) * (torch.arange(7) >= torch.randint(0, 4, (64, 1), generator=_GEN))
MASK = (IDS != 0).long()


def tiny(kind: str, seed: int = 0, **kw) -> torch.nn.Module:
    """A random model of `kind` in eval mode, its biases and norm weights drawn too (at init they are
    zeros and ones, which a patch that dropped them would not show)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind](**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(0.5 * torch.randn_like(p))
    return model.eval()


def expected_names(model: torch.nn.Module) -> set[str]:
    """What a patch must replace: every RMSNorm, MLP, rotary module and decoder layer of the model's own
    classes and every attention projection (the lm_head stays)."""
    kinds = ("RMSNorm", "MLP", "RotaryEmbedding", "DecoderLayer")
    own = tuple(getattr(sys.modules[type(model).__module__], ARCHITECTURES[model.config.model_type] + k) for k in kinds)
    names = {n for n, m in model.named_modules() if isinstance(m, own)}
    return names | {n for n, _ in model.named_modules() if n.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj")}


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_patched_greedy_tokens_are_the_unpatched_models(kind, monkeypatch):
    """Every module is named in what the patch returns and replaced in the model; 8 greedy tokens of a
    left-padded batch equal the unpatched model's, computed by flashgen's rmsnorm, rope, silu_mul and
    add_rmsnorm (each layer's attention residual), each down linear adding the MLP's residual (the CPU
    adds it after its torch product; a GPU's GEMM in its epilogue) and no other linear adding any;
    unpatch gives the model back bit for bit, its recorded hidden states too."""
    model = tiny(kind)
    with torch.no_grad():
        ref = model.generate(IDS, attention_mask=MASK, max_new_tokens=8, do_sample=False)
        before = model(IDS, attention_mask=MASK, output_hidden_states=True)
    names = expected_names(model)
    modeling = sys.modules[type(model).__module__]
    rope = modeling.apply_rotary_pos_emb
    patched = flashgen.patch(model)
    assert set(patched) == names | {f"{modeling.__name__}.apply_rotary_pos_emb"}
    assert all(not type(model.get_submodule(n)).__module__.startswith("transformers") for n in names)
    ran, kernel = [], dispatcher().kernel
    monkeypatch.setattr(dispatcher(), "kernel", lambda op, *a, **kw: ran.append(op) or kernel(op, *a, **kw))
    linears, apply = set(), patching.apply
    monkeypatch.setattr(patching, "apply", lambda *a, **kw: linears.add((kw["gated"], kw["residual"] is not None))
                        or apply(*a, **kw))
    with torch.no_grad():
        out = model.generate(IDS, attention_mask=MASK, max_new_tokens=8, do_sample=False)
    assert out.tolist() == ref.tolist()
    assert {"rmsnorm", "rope", "silu_mul", "add_rmsnorm"} <= set(ran)
    assert linears == {(False, False), (True, True)}  # (gated: the down linear; with a residual)
    patched.unpatch()
    with torch.no_grad():
        after = model(IDS, attention_mask=MASK, output_hidden_states=True)
    assert torch.equal(after.logits, before.logits)
    assert len(after.hidden_states) == len(before.hidden_states)
    assert all(torch.equal(a, b) for a, b in zip(after.hidden_states, before.hidden_states))
    assert modeling.apply_rotary_pos_emb is rope


def test_fused_layers_record_hidden_states_and_trace_whole(monkeypatch):
    """A patched Llama records each fused layer's output as transformers records its own layers'
    (`output_hidden_states`, hooks it had not installed yet when patched), and dynamo traces its forward
    as one graph (plain float weights: the CPU's oneDNN-reordered ones are not traceable), which computes
    what the eager model does."""
    monkeypatch.setattr(quant_modes, "cpu_weight", lambda w: w)
    model = tiny("llama")
    plain = copy.deepcopy(model)
    patched = flashgen.patch(model)
    ids, mask = IDS[:4], MASK[:4]
    with torch.no_grad():
        want = plain(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        got = model(ids, attention_mask=mask, output_hidden_states=True)
        assert len(got.hidden_states) == len(want) == model.config.num_hidden_layers + 1
        for a, b in zip(got.hidden_states, want):
            assert (a - b).abs().max() < 1e-5 * b.abs().max()
        try:
            traced = torch.compile(model, backend="eager", fullgraph=True)(ids, attention_mask=mask).logits
        finally:
            torch._dynamo.reset()
    assert torch.equal(traced, got.logits)
    patched.unpatch()


def test_a_layer_of_other_children_keeps_its_forward():
    """A decoder layer with a child the fused layer does not compute with (a norm a future version adds)
    is not fused: its own forward runs, on its patched children."""
    model = tiny("llama")
    model.model.layers[1].extra = torch.nn.Identity()
    with torch.no_grad():
        want = model(IDS[:4], attention_mask=MASK[:4]).logits
    patched = flashgen.patch(model)
    assert "model.layers.0" in patched and "model.layers.1" not in patched and "model.layers.1.mlp" in patched
    assert type(model.model.layers[1]) is transformers.models.llama.modeling_llama.LlamaDecoderLayer
    with torch.no_grad():
        got = model(IDS[:4], attention_mask=MASK[:4]).logits
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    patched.unpatch()


def _dequantized(q) -> torch.Tensor:
    """The float64 weight a patched linear's codes stand for (its mode's own fields)."""
    if q.mode == "w4a16":
        return QuantizedWeight(unpack_int4(q.w4, q.shape[1]), q.w4_scales, None, 4, q.group).dequantize()
    return q.w8.double() * q.w8_scale.double()[:, None]


def _reference(model: torch.nn.Module, patched: torch.nn.Module) -> torch.nn.Module:
    """`model` (unpatched) in float64 with each linear's weight replaced by what `patched`'s codes stand for."""
    ref = copy.deepcopy(model).double()
    with torch.no_grad():
        for name, module in patched.named_modules():
            if not isinstance(module, PatchedLinear):
                continue
            w = _dequantized(module.q)
            if name.endswith(".gate_up"):
                mlp = ref.get_submodule(name.rsplit(".", 1)[0])
                mlp.gate_proj.weight.copy_(w[:w.shape[0] // 2])
                mlp.up_proj.weight.copy_(w[w.shape[0] // 2:])
            else:
                ref.get_submodule(name.replace(".down", ".down_proj")).weight.copy_(w)
    return ref


def _int8_product(lin: PatchedLinear, x: torch.Tensor) -> torch.Tensor:
    """What a w8a8 linear's output stands for, in float64: its input (after silu_mul where gated) as the
    dynamic_quant kernel's per-token int8 codes, times the weight its codes stand for, plus its bias."""
    x = x.reshape(-1, x.shape[-1])
    xq, xs = torch.ops.flashgen.dynamic_quant(torch.ops.flashgen.silu_mul(x) if lin.gated else x, out_dtype="int8")
    y = (xq.double() * xs.double()[:, None]) @ _dequantized(lin.q).T
    return y if lin.bias is None else y + lin.bias.double()


@pytest.mark.parametrize("mode,kind", [("w8a16", "qwen2"), ("w4a16", "llama"), ("w8a8", "qwen3")])
def test_quantized_logits_are_those_of_their_codes(mode, kind):
    """The patched model's logits against the float64 model whose linears hold the weights the mode's
    codes stand for: within float32 rounding, much closer than to the float model (the codes are the
    ones that computed). w8a8 also quantizes each linear's input per token, where an activation code
    that fp32 and float64 inputs round apart moves the logits by a code step: there every linear's output
    is checked against its own input's codes, and the logits against the float64 model with the same
    weights and activations quantized per token, within half the distance to the float model."""
    model = tiny(kind, seed=3)
    plain = copy.deepcopy(model)
    patched = flashgen.patch(model, quant=mode)
    ref = _reference(plain, model)
    calls = []
    for lin in model.modules():
        if isinstance(lin, PatchedLinear):
            lin.register_forward_hook(lambda lin, args, kw, out: calls.append((lin, args[0], kw.get("residual"), out)),
                                      with_kwargs=True)
    if mode == "w8a8":
        for name, lin in ref.named_modules():
            if isinstance(lin, torch.nn.Linear) and name != "lm_head":
                lin.register_forward_pre_hook(lambda _, args: (torch.mul(*_int8_per_token(args[0])),))
    with torch.no_grad():
        ours = model(IDS, attention_mask=MASK).logits.double()
        want = ref(IDS, attention_mask=MASK).logits
        unquantized = plain(IDS, attention_mask=MASK).logits.double()
    scale = want.abs().max()
    err, quant_err = (ours - want).abs().max() / scale, (unquantized - want).abs().max() / scale
    assert err < (quant_err / 2 if mode == "w8a8" else 1e-5) and quant_err > 1e-3, (err, quant_err)
    if mode == "w8a8":
        assert len(calls) == 2 * 6
        for lin, x, residual, y in calls:
            y_ref = _int8_product(lin, x)
            if residual is not None:  # (the down linear's: y adds it)
                y_ref = y_ref + residual.reshape(y_ref.shape).double()
            assert (y.reshape(y_ref.shape).double() - y_ref).abs().max() < 1e-5 * y_ref.abs().max()
    assert any(mode in f for f in patched.fallbacks)  # the CPU's linears are torch products, and say so
    patched.unpatch()


def _int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x quantized per token to int8 in float64: its codes and, broadcastable, their scales."""
    q, scale = quantize_ref(x, "int8")
    return q, scale[..., None]


def test_refusals_are_one_line():
    model = tiny("llama")
    with pytest.raises(FlashgenError, match="training mode"):
        flashgen.patch(model.train())
    model.eval()
    with pytest.raises(FlashgenError, match="unknown quantization mode 'int3'"):
        flashgen.patch(model, quant="int3")
    with pytest.raises(FlashgenError, match=r"model_type 'gpt2'"):
        flashgen.patch(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2,
                                                                            vocab_size=32)).eval())
    with pytest.raises(FlashgenError, match="not list"):
        flashgen.patch([model])
    with pytest.raises(FlashgenError, match=r"float64 on cpu; flashgen's kernels compute in fp32, fp16, bf16"):
        flashgen.patch(copy.deepcopy(model).double())
    mixed = copy.deepcopy(model)
    mixed.model.norm.half()
    with pytest.raises(FlashgenError, match=r"model.norm.weight is float16 on cpu, model.layers.0.input_layernorm.weight "
                                            r"float32; the ops take their inputs in one dtype"):
        flashgen.patch(mixed)
    with torch.device("meta"):
        on_meta = transformers.LlamaForCausalLM(CONFIGS["llama"]()).eval()
    with pytest.raises(FlashgenError, match="on meta; flashgen's kernels run on the CPU and on GPUs"):
        flashgen.patch(on_meta)
    with pytest.raises(FlashgenError, match="SiLU MLPs; this model's activation is gelu"):
        flashgen.patch(tiny("llama", hidden_act="gelu"))
    with pytest.raises(FlashgenError, match="rope_type dynamic"):
        flashgen.patch(tiny("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}))
    patched = flashgen.patch(model)
    with pytest.raises(FlashgenError, match="patched already"):
        flashgen.patch(model)
    with pytest.raises(FlashgenError, match="position 64 is past the rope table of the model's max_position_embeddings=64"):
        with torch.no_grad():
            model(torch.tensor([[1, 2]]), position_ids=torch.tensor([[63, 64]]))
    patched.unpatch()
    with pytest.raises(FlashgenError, match="undone already"):
        patched.unpatch()


def test_unpatched_models_of_the_same_architecture_compute_as_before():
    """While one Llama is patched, another computes exactly as transformers does (its rope included); the
    modeling module's rope function is the original again once the last patched Llama is unpatched."""
    modeling = sys.modules[transformers.LlamaForCausalLM.__module__]
    original = modeling.apply_rotary_pos_emb
    a, b, other = tiny("llama", 1), tiny("llama", 2), tiny("llama", 3)
    with torch.no_grad():
        before = other(IDS, attention_mask=MASK).logits
    pa, pb = flashgen.patch(a), flashgen.patch(b)
    with torch.no_grad():
        assert torch.equal(other(IDS, attention_mask=MASK).logits, before)
    pa.unpatch()
    assert modeling.apply_rotary_pos_emb is not original  # b still runs flashgen's rope
    pb.unpatch()
    assert modeling.apply_rotary_pos_emb is original


def test_benchmark_smoke_run(tmp_path, monkeypatch):
    """benchmarks/patch.py on the CPU, its tiny config at this file's shapes (their kernels compiled
    already), eager: one row per batch with both models' decode tokens/s and their ratio, in JSON and MD."""
    spec = importlib.util.spec_from_file_location("patch_bench", Path(__file__).parents[1] / "benchmarks" / "patch.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    small = dataclasses.replace(bench.CONFIGS["tiny"], vocab_size=128, hidden_size=64, intermediate_size=160,
                                num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64)
    monkeypatch.setitem(bench.CONFIGS, "tiny", small)
    assert bench.main(["--config", "tiny", "--batch", "64", "--prompt-len", "7", "--new-tokens", "3",
                       "--out-dir", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "patch_tiny.json").read_text())
    assert out["meta"]["device"] == "cpu" and (tmp_path / "patch_tiny.md").exists()
    (row,) = [dict(zip(out["columns"], r)) for r in out["rows"]]
    assert (row["compile"], row["batch"], row["new_tokens"]) == ("off", 64, 3)
    assert row["unpatched_tok_s"] > 0 and row["ratio"] == pytest.approx(row["patched_tok_s"] / row["unpatched_tok_s"])
    assert bench.main(["--config", "tiny", "--prompt-len", "60", "--new-tokens", "8", "--out-dir", str(tmp_path)]) == 2


def _gpu_llama() -> torch.nn.Module:
    """A bf16 Llama of random weights on the GPU, in eval mode."""
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                                   eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def _assert_greedy_agrees(new: torch.Tensor, want: torch.Tensor, logits: tuple[torch.Tensor, ...]) -> None:
    """Each row of greedy tokens `new` is `want`'s but where they part, which only a near-tie may cause:
    the reference's two best logits at the first token that differs lie within bf16 rounding of each other
    (the ops round once where transformers rounds at each step)."""
    for row in range(want.shape[0]):
        differ = (new[row] != want[row]).nonzero()
        if len(differ):
            step = logits[int(differ[0])][row].float()
            top2 = step.topk(2).values
            assert top2[0] - top2[1] < 2e-2 * step.abs().max(), (row, new[row], want[row])


@pytest.mark.gpu
def test_patched_greedy_tokens_on_gpu(monkeypatch):
    """bf16 on the GPU: the prompt's logits, patched against unpatched, within bf16 rounding; then 32 greedy
    tokens of a batch of 4 (`_assert_greedy_agrees`), computed with add_rmsnorm and a GEMM adding the
    residual in its epilogue."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    model = _gpu_llama()
    ids = torch.randint(1, 1024, (4, 40), device="cuda")
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=32, do_sample=False, output_logits=True, return_dict_in_generate=True)
        prompt = model(ids).logits.float()
    patched = flashgen.patch(model)
    ran, kernel = [], dispatcher().kernel
    monkeypatch.setattr(dispatcher(), "kernel", lambda op, tensors, *a, **kw: ran.append((op, "residual" in tensors))
                        or kernel(op, tensors, *a, **kw))
    with torch.no_grad():
        assert (model(ids).logits.float() - prompt).abs().max() < 2e-2 * prompt.abs().max()
        out = model.generate(ids, max_new_tokens=32, do_sample=False)
    assert ("add_rmsnorm", True) in ran and any("gemm" in op and residual for op, residual in ran), sorted(set(ran))
    _assert_greedy_agrees(out[:, ids.shape[1]:], ref.sequences[:, ids.shape[1]:], ref.logits)
    patched.unpatch()


@pytest.mark.gpu
def test_patched_decode_under_cuda_graphs_at_two_batch_sizes():
    """generate's compiled decode of a patched bf16 Llama (static cache: torch.compile with mode
    "reduce-overhead", CUDA graphs in one memory pool) at batch 1 and then 16 in one process, each twice
    (the second replays what the first recorded): its greedy tokens agree with the same patched model
    decoding eagerly (`_assert_greedy_agrees`). State a patched forward kept across calls would be
    overwritten by the other batch size's graphs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    model = _gpu_llama()
    patched = flashgen.patch(model)
    kw = dict(max_new_tokens=16, do_sample=False, cache_implementation="static", pad_token_id=0)
    torch._dynamo.reset()
    try:
        for batch in (1, 16):
            ids = torch.randint(1, 1024, (batch, 40), device="cuda")
            with torch.no_grad():
                want = model.generate(ids, disable_compile=True, output_logits=True, return_dict_in_generate=True, **kw)
                for _ in range(2):
                    out = model.generate(ids, **kw)
                    _assert_greedy_agrees(out[:, 40:], want.sequences[:, 40:], want.logits)
    finally:
        torch._dynamo.reset()
        patched.unpatch()
