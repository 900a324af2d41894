"""Mixtral, Qwen2-MoE and Qwen3-MoE against Hugging Face transformers (float32, eager attention and experts) on tiny
random checkpoints it writes itself: logits, 32 greedy tokens of a ragged batch, and the refusals of a
router top-k beyond the experts, a router of the wrong width and a missing expert weight."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from flashgen.errors import FlashgenError  # noqa: E402
from flashgen.runtime.decoder.engine import Engine  # noqa: E402
from flashgen.runtime.decoder.sampling import SamplingParams  # noqa: E402
from flashgen.runtime.decoder.model import Decoder  # noqa: E402
from flashgen.runtime.checkpoints.model_config import ModelConfig  # noqa: E402
from flashgen.runtime.checkpoints.weights import load_weights  # noqa: E402
from tests.prefill import prefill_logits, write_checkpoint  # noqa: E402
from tests.test_decoder import PROMPTS, QK_NORMS, hf_greedy  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, num_experts_per_tok=2,
              eos_token_id=None)  # (no EOS: greedy runs are compared at full length)
QWEN = dict(COMMON, num_experts=6, moe_intermediate_size=32, shared_expert_intermediate_size=48)
MODELS = {
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**COMMON, num_local_experts=8, sliding_window=8)),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**QWEN)),
    # renormalised top-k, and layer 1 a dense MLP
    "qwen2_moe-dense1": lambda: transformers.Qwen2MoeForCausalLM(
        transformers.Qwen2MoeConfig(**QWEN, norm_topk_prob=True, mlp_only_layers=[1])),
    # per-head q/k norms, no shared expert
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, num_experts=6, moe_intermediate_size=32, norm_topk_prob=True, head_dim=16)),
}
ERRORS: dict[str, float] = {}  # the measured max logit error of each model, relative to its largest logit


@pytest.fixture(scope="module", params=sorted(MODELS))
def checkpoint(request, tmp_path_factory) -> tuple[str, torch.nn.Module, Path]:
    torch.manual_seed(sorted(MODELS).index(request.param))
    hf = MODELS[request.param]()
    hf.config._experts_implementation = "eager"
    # (near-uniform routers would put near-ties in every top-k)
    folder = write_checkpoint(hf, tmp_path_factory.mktemp(request.param),
                              (".gate.weight", "shared_expert_gate.weight", *QK_NORMS))
    return request.param, hf, folder


def test_logits_match_transformers(checkpoint):
    kind, hf, folder = checkpoint
    c = ModelConfig.from_folder(folder)
    model = Decoder(c, load_weights(folder))
    assert c.model_type == kind.split("-")[0] and c.experts_per_tok == 2
    assert c.moe_layers == ((True, False) if kind == "qwen2_moe-dense1" else (True, True))
    assert c.qkv_bias == kind.startswith("qwen2_moe") and c.sliding_window == (8 if kind == "mixtral" else None)
    prompt = PROMPTS[1]
    ours = prefill_logits(model, prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    ERRORS[kind] = float((ours - ref).abs().max() / ref.abs().max())
    print(f"{kind}: max |logit error| / max |logit| = {ERRORS[kind]:.2e}")
    assert ERRORS[kind] < 1e-4
    assert "moe experts (torch)" in model.fallbacks and not model.capturable


def test_greedy_generation_matches_transformers(checkpoint):
    """A ragged batch prefilled together, then decoded together, 32 steps, token for token."""
    kind, hf, folder = checkpoint
    model = Decoder(ModelConfig.from_folder(folder), load_weights(folder))
    outs = Engine(model, num_blocks=64).generate(PROMPTS, SamplingParams(max_new_tokens=32))
    for prompt, req in zip(PROMPTS, outs):
        assert req.output == hf_greedy(hf, prompt, 32), (kind, prompt)


def test_quantized_experts_track_the_float_model(checkpoint):
    """The experts run in the decoder's quant mode: w8a16 changes the logits by about its rounding."""
    _, _, folder = checkpoint
    c, w = ModelConfig.from_folder(folder), load_weights(folder)
    ref, q = (prefill_logits(Decoder(c, w, quant=m), PROMPTS[1]) for m in ("bf16", "w8a16"))
    assert 0 < float((q - ref).norm() / ref.norm()) < 0.05


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    dst.mkdir(exist_ok=True)
    c = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**c, **changes}))
    (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    return dst


def _edit_tensors(src: Path, dst: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file
    _edit_config(src, dst)
    t = load_file(str(src / "model.safetensors"))
    edit(t)
    save_file(t, str(dst / "model.safetensors"))
    return dst


def test_refusals(checkpoint, tmp_path):
    kind, _, folder = checkpoint
    config = json.loads((folder / "config.json").read_text())
    experts_key = "num_experts" if "num_experts" in config else "num_local_experts"  # (transformers saves either)
    experts = config[experts_key]
    with pytest.raises(FlashgenError, match=rf"num_experts_per_tok must be an integer in \[1, {experts}\], got 9$"):
        ModelConfig.from_folder(_edit_config(folder, tmp_path / "topk", num_experts_per_tok=9))
    with pytest.raises(FlashgenError, match=rf"{experts_key} must be an integer in \[1, 65536\], got 0$"):
        ModelConfig.from_folder(_edit_config(folder, tmp_path / "none", **{experts_key: 0}))

    block = "block_sparse_moe" if kind == "mixtral" else "mlp"
    router = f"model.layers.0.{block}.gate.weight"

    def narrow(t: dict[str, torch.Tensor]) -> None:
        t[router] = t[router][:, :48].contiguous()

    with pytest.raises(FlashgenError, match=rf"^model.safetensors: tensor {router} has shape \[{experts}, 48\], "
                                            rf"the config implies \[{experts}, 64\]$"):
        load_weights(_edit_tensors(folder, tmp_path / "router", narrow))
    with pytest.raises(FlashgenError, match=rf"tensor {router} has shape \[{experts - 1}, 64\]"):
        load_weights(_edit_tensors(folder, tmp_path / "experts", lambda t: t.update({router: t[router][1:].clone()})))

    down = f"model.layers.0.{block}.experts.{experts - 1}." + ("w2.weight" if kind == "mixtral" else "down_proj.weight")
    ff = 96 if kind == "mixtral" else 32
    with pytest.raises(FlashgenError, match=rf"tensor {down} \(shape \[64, {ff}\]\) is missing$"):
        load_weights(_edit_tensors(folder, tmp_path / "missing", lambda t: t.pop(down)))


def test_qwen2_moe_config_refusals(tmp_path):
    """The Qwen2-MoE keys' ranges, each refused in one line naming the key."""
    base = {"model_type": "qwen2_moe", **QWEN, "num_experts_per_tok": 2}
    for key, value, why in (("mlp_only_layers", [2], r"must list layer indices in \[0, 2\), got \[2\]"),
                            ("moe_intermediate_size", 0, r"must be an integer in \[1, 1048576\], got 0"),
                            ("shared_expert_intermediate_size", None, "is missing"),
                            ("decoder_sparse_step", 0, r"must be an integer in \[1, 1048576\], got 0"),
                            ("norm_topk_prob", "yes", "must be true or false, got 'yes'")):
        (tmp_path / "config.json").write_text(json.dumps({**base, key: value}))
        with pytest.raises(FlashgenError, match=rf": {key} {why}$"):
            ModelConfig.from_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**base, "decoder_sparse_step": 2}))
    assert ModelConfig.from_folder(tmp_path).moe_layers == (False, True)  # every second layer sparse


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_expert_count_keys_must_agree(tmp_path, kind):
    """num_experts and num_local_experts (transformers saves either, and reads one through the other)
    giving two counts are refused in one line naming both; giving one count, they load."""
    base = {"model_type": kind, **QWEN, "num_experts_per_tok": 2}
    for local, why in ((8, "num_experts (6) and num_local_experts (8) disagree"), (6, None)):
        (tmp_path / "config.json").write_text(json.dumps({**base, "num_experts": 6, "num_local_experts": local}))
        if why is None:
            assert ModelConfig.from_folder(tmp_path).num_experts == 6
            continue
        with pytest.raises(FlashgenError, match=rf"config.json: {re.escape(why)}$") as e:
            ModelConfig.from_folder(tmp_path)
        assert "\n" not in str(e.value)


def _graphs_give_the_eager_tokens(model) -> None:
    """Eight greedy tokens of each prompt, decoded in CUDA graphs and eagerly: the same."""
    sampling = SamplingParams(max_new_tokens=8)
    eng = Engine(model, num_blocks=64)
    assert eng.graphs is not None
    graphed = [r.output for r in eng.generate(PROMPTS, sampling)]
    eager = [r.output for r in Engine(model, num_blocks=64, cuda_graphs=False).generate(PROMPTS, sampling)]
    assert graphed == eager and all(len(o) == 8 for o in graphed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_moe_decoder_on_gpu_tracks_the_cpu(checkpoint):
    """On a GPU with bf16 experts the generated grouped GEMMs run them (no torch expert loop), the
    logits of a prompt (ids routing) and of a 70-token one (sorted routing) track transformers' float32
    ones, and decode steps are captured in CUDA graphs, giving the tokens eager steps give. w8a16
    experts run generated too, captured; int4 experts of a width the group of 128 does not divide take
    the torch loop, uncaptured."""
    _, hf, folder = checkpoint
    c, w = ModelConfig.from_folder(folder), load_weights(folder)
    model = Decoder(c, w, "cuda", torch.bfloat16)
    long = (PROMPTS[1] * 4)[:70]  # past IDS_ROUTING_MAX_TOKENS
    refs = {}
    for prompt in (PROMPTS[1], long):
        with torch.no_grad():
            refs[len(prompt)] = ref = hf(torch.tensor([prompt])).logits[0]
        got = prefill_logits(model, prompt).float().cpu()
        assert float((got - ref).norm() / ref.norm()) < 0.03, len(prompt)
    assert "moe experts (torch)" not in model.fallbacks
    _graphs_give_the_eager_tokens(model)
    ref = refs[len(PROMPTS[1])]
    for quant, generated in (("w8a16", True), ("w4a16", False)):  # (int4 of width 64: no group of 128)
        quantized = Decoder(c, load_weights(folder), "cuda", torch.bfloat16, quant=quant)
        assert (Engine(quantized, num_blocks=64).graphs is not None) == generated
        got = prefill_logits(quantized, PROMPTS[1]).float().cpu()
        assert float((got - ref).norm() / ref.norm()) < (0.05 if quant == "w8a16" else 0.3), quant
        assert ("moe experts (torch)" in quantized.fallbacks) != generated


def test_routing_runs_the_generated_router(checkpoint):
    """The top-k choice is the generated moe_route kernel's (the torch router is only for other k)."""
    _, _, folder = checkpoint
    model = Decoder(ModelConfig.from_folder(folder), load_weights(folder))
    prefill_logits(model, PROMPTS[0])
    assert "moe experts (torch)" in model.fallbacks
    assert not any(f.startswith("moe router") for f in model.fallbacks)


@pytest.mark.parametrize("quant,weights", [("bf16", "half"), ("w8a16", "w8a16"), ("w4a16", "w4a16g128")])
def test_stacked_experts_are_the_ops_layout(quant, weights):
    """The experts a GPU decoder stacks for the generated grouped GEMMs, through the ops' float64
    references, give what each expert's own quantized linears give (the torch loop's weights): the
    stacked codes and scales mean what the ops read. Modes without a stacked form are named."""
    from flashgen.oplib.moe import MOE_GEMM_DOWN, MOE_GEMM_GATE_UP
    from flashgen.runtime.decoder.moe_experts import stack_experts
    from flashgen.runtime.decoder.quant_modes import prepare, quant_mode
    assert quant_mode(quant).stacked_format(256, 384) == weights
    assert quant_mode("w4a16").stacked_format(64, 384) is None and quant_mode("fp8").stacked_format(256, 384) is None
    g = torch.Generator().manual_seed(7)
    e, kt, m, hidden, inter = 4, 2, 5, 256, 384
    w13 = [(torch.randn(2 * inter, hidden, generator=g) / hidden ** 0.5).half() for _ in range(e)]
    w2 = [(torch.randn(hidden, inter, generator=g) / inter ** 0.5).half() for _ in range(e)]
    up, down = stack_experts([(lambda a=a: a, lambda b=b: b) for a, b in zip(w13, w2)], quant_mode(quant))
    x = torch.randn(m, hidden, generator=g).half()
    ids = torch.stack([torch.randperm(e, generator=g)[:kt] for _ in range(m)]).to(torch.int32)
    tw = torch.rand(m * kt, generator=g) + 0.1
    attrs = {"dtype": "fp16", "weights": weights, "topk": str(kt), "routing": "ids"}
    dims = {"M": m, "E": e, "KT": kt}
    h = MOE_GEMM_GATE_UP.reference({"x": x, "topk_ids": ids, **up}, {}, {**dims, "N": inter, "K": hidden}, attrs)["h"]
    y = MOE_GEMM_DOWN.reference({"h": h.half(), "topk_weights": tw, "y": torch.zeros(m, hidden), "topk_ids": ids,
                                 **down}, {}, {**dims, "N": hidden, "K": inter}, attrs)["y"]

    def dense(w: torch.Tensor) -> torch.Tensor:  # the weight a torch expert loop multiplies
        return (w if quant == "bf16" else prepare(w, quant).weight).double()

    want = torch.zeros(m, hidden, dtype=torch.float64)
    for p, (tok, ex) in enumerate((p // kt, int(ids.flatten()[p])) for p in range(m * kt)):
        gu = x[tok].double() @ dense(w13[ex]).T
        act = (F.silu(gu[:inter]) * gu[inter:]).half().double()
        want[tok] += tw[p].double() * (act @ dense(w2[ex]).T)
    assert float((y - want).norm() / want.norm()) < 2e-3


NO_EXPERT = {"E": None, "minus_one": -1, "huge": 2**31 - 1, "most_negative": -2**31}


@pytest.mark.parametrize("bad", NO_EXPERT.values(), ids=NO_EXPERT.keys())
def test_torch_experts_skip_ids_of_no_expert(checkpoint, bad):
    """The torch expert loop (the CPU's, and modes without stacked experts) given a pair whose id is
    outside [0, E) leaves it out: the sum is the one with that pair's weight 0, nothing is read for it."""
    _, _, folder = checkpoint
    model = Decoder(ModelConfig.from_folder(folder), load_weights(folder))
    block, c = model.layers[0]["moe"], model.c
    g = torch.Generator().manual_seed(3)
    h = torch.randn(5, c.hidden_size, generator=g)
    chosen = torch.stack([torch.randperm(c.num_experts, generator=g)[:c.experts_per_tok] for _ in range(5)])
    weights = torch.rand(5, c.experts_per_tok, generator=g) + 0.1
    without = weights.clone()
    without[2, 1] = 0.0
    want = model._torch_experts(h, block.experts, chosen, without)
    chosen[2, 1] = c.num_experts if bad is None else bad
    torch.testing.assert_close(model._torch_experts(h, block.experts, chosen, weights), want, rtol=1e-6, atol=1e-6)


def poison_router(monkeypatch, model: Decoder, seq: int, call: int, row: str) -> None:
    """Make `model`'s forward number `call` (0: the next) break the first MoE layer's router logits of
    sequence `seq`'s tokens: one NaN, every one NaN, or one +inf (an overflow; softmax's NaN)."""
    import flashgen.runtime.decoder.model as model_module
    router = next(L["moe"].router for L in model.layers if "moe" in L)
    linear, forward, calls, now = model_module.torch_linear, model.forward, iter(range(1 << 30)), {}

    def poisoned_forward(batch, cache, **kw):
        now.update(call=next(calls), batch=batch)
        return forward(batch, cache, **kw)

    def poisoned_linear(x, w, *args, **kw):
        out = linear(x, w, *args, **kw)
        batch = now.get("batch")
        if w is router and now["call"] == call and seq in batch.seqs:
            i = batch.seqs.index(seq)
            rows = slice(sum(batch.lens[:i]), sum(batch.lens[:i + 1]))
            out = out.clone()
            if row == "all_nan":
                out[rows] = float("nan")
            else:
                out[rows, 1] = float("nan") if row == "one_nan" else float("inf")
        return out
    monkeypatch.setattr(model, "forward", poisoned_forward)
    monkeypatch.setattr(model_module, "torch_linear", poisoned_linear)


def run_with_broken_routing(model: Decoder, monkeypatch, row: str,
                            **engine: bool) -> tuple[Engine, list[list[int]], list[int]]:
    """PROMPTS batched in an engine whose every cache block they take (1 + 2 + 1 of 16 tokens), the
    second's router logits broken at step 2 (`poison_router`): the engine after, each prompt's solo
    output, and the requests' ids."""
    sampling = SamplingParams(max_new_tokens=6)
    want = [Engine(model, num_blocks=16, **engine).generate([p], sampling)[0].output for p in PROMPTS]
    eng = Engine(model, num_blocks=4, **engine)
    ids = [eng.add(p, sampling) for p in PROMPTS]
    poison_router(monkeypatch, model, ids[1], call=2, row=row)  # (call 0 is the prefill: step 2 of each)
    while eng.waiting or eng.running or eng.pending:
        eng.step()
    monkeypatch.undo()
    return eng, want, ids


@pytest.mark.parametrize("row", ["one_nan", "all_nan", "inf"])
def test_nan_routing_fails_its_request_alone(checkpoint, monkeypatch, row):
    """A request whose router logits break in a decode step (NaN, or +inf: softmax's NaN) fails alone,
    naming the step, as a request whose logits break does: its routing weights are NaN, so its expert
    output, and then its logits, are (before, a NaN expert was skipped for finite weights, +inf gave
    weights [1, 0], an all-NaN row expert E, which the expert loop skipped: the request went on). The
    requests batched with it give their solo outputs."""
    _, _, folder = checkpoint
    eng, want, ids = run_with_broken_routing(Decoder(ModelConfig.from_folder(folder), load_weights(folder)),
                                             monkeypatch, row)
    bad = eng.finished[ids[1]]
    assert bad.error == "the logits at step 2 (new token 3) are NaN or inf" and bad.output == want[1][:2]
    assert [eng.finished[i].output for i in (ids[0], ids[2])] == [want[0], want[2]]
    assert not any(eng.finished[i].error for i in (ids[0], ids[2]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("row", ["one_nan", "all_nan", "inf"])
def test_nan_routing_fails_its_request_alone_on_gpu(checkpoint, monkeypatch, row):
    """The same with bf16 experts run by the generated grouped GEMMs (eager steps: the router is
    broken from Python, which a replayed graph would not run)."""
    _, _, folder = checkpoint
    model = Decoder(ModelConfig.from_folder(folder), load_weights(folder), "cuda", torch.bfloat16)
    eng, want, ids = run_with_broken_routing(model, monkeypatch, row, cuda_graphs=False)
    assert "moe experts (torch)" not in model.fallbacks
    bad = eng.finished[ids[1]]
    assert bad.error == "the logits at step 2 (new token 3) are NaN or inf" and bad.output == want[1][:2]
    assert [eng.finished[i].output for i in (ids[0], ids[2])] == [want[0], want[2]]


def test_a_request_on_a_failed_requests_blocks_is_unharmed(checkpoint, monkeypatch):
    """The failed request's token at step 2 wrote NaN keys and values into the cache (its hidden state
    was NaN from its first MoE layer on); two requests taking every block after it, that one among
    them, give their solo outputs (the torch decode attention selects the slots a query sees before it
    multiplies: a NaN past its context is never 0 * NaN)."""
    _, _, folder = checkpoint
    model = Decoder(ModelConfig.from_folder(folder), load_weights(folder))
    eng, want, _ = run_with_broken_routing(model, monkeypatch, "all_nan")
    assert any(v.isnan().any() for v in eng.cache.v)
    outs = eng.generate([PROMPTS[1]] * 2, SamplingParams(max_new_tokens=6))
    assert [(r.output, r.error) for r in outs] == [(want[1], "")] * 2


class ReferenceOps:
    """torch.ops.flashgen as the decoder's generated experts call it, the grouped GEMMs computed by
    their float64 references (the moe class has no CPU generator) and dynamic_quant by its CPU kernel."""

    @staticmethod
    def dynamic_quant(x: torch.Tensor, out_dtype: str):
        return torch.ops.flashgen.dynamic_quant(x, out_dtype=out_dtype)

    @staticmethod
    def _call(op, kw: dict, rows: torch.Tensor, n: int) -> dict:
        from flashgen.ir import dtypes
        tensors = {k: v for k, v in kw.items() if isinstance(v, torch.Tensor)}
        attrs = {k: v for k, v in kw.items() if isinstance(v, str)}
        e = next(v for k, v in tensors.items() if k in ("w", "w_q", "w_packed")).shape[0]
        dims = {"M": rows.shape[0], "N": n, "E": e, "KT": int(attrs["topk"])}
        out = op.reference(tensors, {}, dims, {"routing": "sorted", **attrs})
        return {k: v.to(dtypes.TORCH[attrs["dtype"]] if k == "h" else torch.float32) for k, v in out.items()}

    def moe_gemm_gate_up(self, **kw) -> torch.Tensor:
        from flashgen.oplib.moe import MOE_GEMM_GATE_UP
        x = kw.get("x", kw.get("x_q"))
        n = next(v for k, v in kw.items() if k in ("w", "w_q", "w_packed")).shape[1] // 2
        return self._call(MOE_GEMM_GATE_UP, kw, x, n)["h"]

    def moe_gemm_down(self, **kw) -> None:
        from flashgen.oplib.moe import MOE_GEMM_DOWN
        kw["y"].copy_(self._call(MOE_GEMM_DOWN, kw, kw["y"], kw["y"].shape[1])["y"])


@pytest.fixture(scope="module")
def mixtral_128(tmp_path_factory) -> Path:
    """A tiny Mixtral whose widths the int4 group of 128 divides (w4a8 experts have a stacked form),
    five experts (not a power of two)."""
    torch.manual_seed(11)
    hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **{**COMMON, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1}, num_local_experts=5))
    return write_checkpoint(hf, tmp_path_factory.mktemp("mixtral_128"), (".gate.weight",))


@pytest.mark.parametrize("quant,weights", [("w8a8", "w8a8"), ("w4a8", "w4a8g128"), ("mixed", "w4a16g128")])
@pytest.mark.parametrize("routing", ["ids", "sorted"])
def test_generated_experts_compute_as_the_modes_dense_linears(mixtral_128, quant, weights, routing):
    """The decoder's generated-experts call (`run_experts`: activations quantized per token for x and
    per pair for h by dynamic_quant, the stacked experts of the mode) through the ops' float64
    references gives what the torch expert loop gives with each expert's own dense linears of that
    mode (int8 products summed exactly, scaled per token and per channel), a pair of no expert (id
    -1) left out by both."""
    from flashgen.oplib.moe import moe_align
    from flashgen.runtime.decoder.moe_experts import run_experts, stack_experts
    from flashgen.runtime.checkpoints.weights import moe_names
    c, w = ModelConfig.from_folder(mixtral_128), load_weights(mixtral_128)
    model = Decoder(c, dict(w), quant=quant)
    mode = model.mode
    assert mode.stacked_format(c.hidden_size, c.moe_intermediate_size) == weights
    names = moe_names(c, 0)
    stacked = stack_experts([(lambda g=g, u=u: torch.cat([w[g], w[u]]), lambda d=d: w[d]) for g, u, d in names.experts],
                            mode)
    g = torch.Generator().manual_seed(5)
    t = 7
    h = torch.randn(t, c.hidden_size, generator=g)
    chosen = torch.stack([torch.randperm(c.num_experts, generator=g)[:2] for _ in range(t)]).to(torch.int32)
    chosen[3, 1] = -1
    weights_ = torch.rand(t, 2, generator=g) + 0.1
    want = model._torch_experts(h, model.layers[0]["moe"].experts, chosen, weights_)
    route = ({"routing": "ids", "topk_ids": chosen} if routing == "ids"
             else dict(zip(("sorted_pairs", "expert_offsets"), moe_align(chosen, c.num_experts))))
    got = run_experts(ReferenceOps(), h, stacked, route, weights_.flatten(), {"topk": "2", "weights": weights},
                      mode.activations)
    err = float((got - want).norm() / want.norm())
    assert err < 1e-3, err
    # (the comparison sees the mode: the float experts' sum differs by the quantization's error)
    floats = Decoder(c, dict(w), quant="bf16")
    assert float((floats._torch_experts(h, floats.layers[0]["moe"].experts, chosen, weights_) - want).norm()
                 / want.norm()) > 10 * max(err, 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("quant", ["w8a8", "w4a8", "mixed"])
def test_int8_experts_on_gpu(mixtral_128, quant, monkeypatch):
    """On a GPU, w8a8 and w4a8 experts (and mixed's) run as the generated grouped GEMMs (no torch
    expert loop), decode steps captured in CUDA graphs giving the tokens eager steps give, and the
    logits of a prompt (ids routing) and of a 70-token one (sorted routing) track the CPU decoder's
    of the same mode (its torch experts on each expert's dense linears). A mixed CPU decoder plans its
    modes as the GPU's does (for the GPU's target), so that each call computes in the same mode."""
    from flashgen.runtime.serving.torch_ops import dispatcher
    c = ModelConfig.from_folder(mixtral_128)
    model = Decoder(c, load_weights(mixtral_128), "cuda", torch.bfloat16, quant=quant)
    with monkeypatch.context() as m:
        m.setattr(dispatcher(), "target_for", lambda device: model.chooser.target)
        cpu = Decoder(c, load_weights(mixtral_128), quant=quant)
    assert cpu.chooser.plans == model.chooser.plans
    for prompt in (PROMPTS[1], (PROMPTS[1] * 4)[:70]):
        ref = prefill_logits(cpu, prompt)
        got = prefill_logits(model, prompt).float().cpu()
        assert float((got - ref).norm() / ref.norm()) < 0.03, len(prompt)
    assert "moe experts (torch)" not in model.fallbacks and model.capturable
    _graphs_give_the_eager_tokens(model)
