"""The decoder against Hugging Face transformers (float32, eager) on tiny random Llama, Mistral and Qwen2
checkpoints it writes itself: logits, and 32 greedy tokens of a ragged batch; loading errors; the
engine's batching, sampling and refusals."""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashgen.errors import FlashgenError  # noqa: E402
from flashgen.runtime.decoder.engine import Engine  # noqa: E402
from flashgen.runtime.decoder.sampling import SamplingParams  # noqa: E402
from flashgen.runtime.decoder.model import Batch, Decoder  # noqa: E402
from flashgen.runtime.checkpoints.weights import ModelConfig, load_weights  # noqa: E402
from tests.prefill import prefill_logits, write_checkpoint  # noqa: E402
from tests.eager_graphs import EagerGraphs  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
              eos_token_id=None)  # (no EOS: greedy runs are compared at full length; EOS has its own test)
MODELS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=8)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON, use_sliding_window=False)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, head_dim=16)),
}
QK_NORMS = (".q_norm.weight", ".k_norm.weight")  # Qwen3's, drawn (at init they are ones)
PROMPTS = [[1, 5, 9, 20, 33], [7, 8, 100, 3, 4, 5, 6, 77, 2, 1, 0, 9, 8, 7, 6, 5, 4, 3, 11, 12], [42]]


@pytest.fixture(scope="module", params=sorted(MODELS))
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(sorted(MODELS).index(request.param))
    hf = MODELS[request.param]()
    folder = write_checkpoint(hf, tmp_path_factory.mktemp(request.param), QK_NORMS)  # (Qwen2's qkv biases drawn)
    return request.param, hf, folder


def test_logits_match_transformers(checkpoint):
    kind, hf, folder = checkpoint
    model = Decoder(ModelConfig.from_folder(folder), load_weights(folder))
    assert model.c.model_type == kind and model.c.qkv_bias == (kind == "qwen2")
    prompt = PROMPTS[1]
    ours = prefill_logits(model, prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert (ours - ref).abs().max() < 1e-4 * ref.abs().max()


def hf_greedy(hf, prompt: list[int], steps: int, repetition_penalty: float = 1.0) -> list[int]:
    """Greedy decoding by transformers' full forward at every step, after its repetition penalty. (Its
    cached `generate` can part from its own full forward on near-ties: seen on a random Llama, a 0.06
    logit gap at step 9.)"""
    penalize = transformers.RepetitionPenaltyLogitsProcessor(repetition_penalty)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.tensor([seq])
            seq.append(int(penalize(ids, hf(ids).logits[:, -1]).argmax()))
    return seq[len(prompt):]


def test_greedy_generation_matches_transformers(checkpoint):
    """A ragged batch prefilled together, then decoded together, 32 steps, token for token."""
    kind, hf, folder = checkpoint
    model = Decoder(ModelConfig.from_folder(folder), load_weights(folder))
    outs = Engine(model, num_blocks=64).generate(PROMPTS, SamplingParams(max_new_tokens=32))
    for prompt, req in zip(PROMPTS, outs):
        assert req.output == hf_greedy(hf, prompt, 32), (kind, prompt)
    assert any("linear" in f for f in model.fallbacks)  # the CPU's torch fallbacks are reported


def test_greedy_with_a_repetition_penalty_matches_transformers(checkpoint):
    """A penalized greedy request picks the argmax of penalized logits, token for token with transformers,
    in a batch whose plain greedy requests keep chaining their steps (CPU stand-in for the CUDA graphs)
    until the penalized one joins, and still give their solo outputs."""
    kind, hf, folder = checkpoint
    model = Decoder(ModelConfig.from_folder(folder), load_weights(folder))
    eng = Engine(model, num_blocks=64)
    eng.graphs = EagerGraphs(model, eng.cache)
    plain = [eng.add(p, SamplingParams(max_new_tokens=24)) for p in (PROMPTS[0], PROMPTS[2])]
    for _ in range(4):
        eng.step()
    chained = eng.graphs.chained
    assert chained >= 1
    penalized = eng.add(PROMPTS[1], SamplingParams(max_new_tokens=16, repetition_penalty=3.0))
    while eng.waiting or eng.running or eng.pending:
        eng.step()
    assert eng.finished[penalized].output == hf_greedy(hf, PROMPTS[1], 16, 3.0), kind
    assert eng.finished[penalized].output != hf_greedy(hf, PROMPTS[1], 16), kind  # the penalty changed something
    assert [eng.finished[i].output for i in plain] == [hf_greedy(hf, p, 24) for p in (PROMPTS[0], PROMPTS[2])]


@pytest.mark.parametrize("params", [
    dict(temperature=0.7, top_k=12, top_p=0.8, min_p=0.05, repetition_penalty=1.3),
    dict(temperature=1.3, min_p=0.2),
    dict(temperature=0.5, top_p=0.95, repetition_penalty=0.7),  # a penalty below 1 favours the seen tokens
    dict(temperature=1.0, top_k=3),
    dict(temperature=0.0, repetition_penalty=2.5),
])
def test_the_sampling_distribution_is_transformers(params):
    """`distribution` against transformers' own processors in its order (penalty, temperature, top-k,
    top-p, min-p; do_sample as generate sets it), in float64, on fresh random logits with some negative
    ones among the seen tokens."""
    from flashgen.runtime.decoder.sampling import distribution
    torch.manual_seed(len(repr(params)))
    logits = torch.randn(300, dtype=torch.float64)
    seen = torch.randint(0, 300, (40,)).tolist() + [int(logits.argmax())] * 2
    p = SamplingParams(**params)
    procs = [transformers.RepetitionPenaltyLogitsProcessor(p.repetition_penalty)]
    if p.temperature > 0:
        procs += [transformers.TemperatureLogitsWarper(p.temperature)]
        procs += [transformers.TopKLogitsWarper(p.top_k)] if p.top_k else []
        procs += [transformers.TopPLogitsWarper(p.top_p)] if p.top_p < 1 else []
        procs += [transformers.MinPLogitsWarper(p.min_p)] if p.min_p else []
    scores = transformers.LogitsProcessorList(procs)(torch.tensor([seen]), logits[None].clone())[0]
    ours = distribution(logits, p, seen)
    if p.temperature > 0:
        want = torch.softmax(scores, -1)
        assert torch.equal(ours > 0, want > 0) and 1 < int((ours > 0).sum()) < 300
        torch.testing.assert_close(ours, want, rtol=1e-12, atol=1e-15)
    else:
        assert ours[int(scores.argmax())] == 1 and ours.sum() == 1 and int(scores.argmax()) != int(logits.argmax())


def test_engine_sampling_stops_and_refusals(checkpoint):
    _, _, folder = checkpoint
    model = Decoder(ModelConfig.from_folder(folder), load_weights(folder))
    eng = Engine(model, num_blocks=8, block_size=16)  # 128 tokens of cache
    p = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=20, top_p=0.9, seed=7)
    a = eng.generate([PROMPTS[0]], p)[0].output
    assert a == eng.generate([PROMPTS[0]], p)[0].output and len(a) == 12      # seeded: reproducible
    too_long = list(range(100)) * 3
    stop = a[3]
    reqs = eng.generate([too_long, PROMPTS[0], list(range(120))], SamplingParams(max_new_tokens=12, temperature=0.8,
                                                                                top_k=20, top_p=0.9, seed=7,
                                                                                stop_tokens=(stop,)))
    assert "exceeds the model's context" in reqs[0].error
    assert reqs[1].error == "" and reqs[1].output == a[:a.index(stop) + 1]      # stopped at the stop token
    assert "more KV cache blocks" in reqs[2].error
    m = eng.cache.manager  # every block free or idle in the prefix cache
    assert m.free == sorted(m.free, reverse=True) and len(m.free) + len(m.cached) == 8 and not m.tables


def test_requests_join_between_steps(checkpoint):
    _, _, folder = checkpoint
    model = Decoder(ModelConfig.from_folder(folder), load_weights(folder))
    alone = Engine(model, num_blocks=64).generate([PROMPTS[2]], SamplingParams(max_new_tokens=10))[0].output
    eng = Engine(model, num_blocks=64)
    first = eng.add(PROMPTS[0], SamplingParams(max_new_tokens=10))
    eng.step()
    eng.step()
    late = eng.add(PROMPTS[2], SamplingParams(max_new_tokens=10))
    while eng.waiting or eng.running:
        eng.step()
    assert eng.finished[late].output == alone and len(eng.finished[first].output) == 10


def test_loading_errors(tmp_path, checkpoint):
    _, _, folder = checkpoint
    with pytest.raises(FlashgenError, match="no config.json"):
        ModelConfig.from_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(FlashgenError, match="'gpt2' is not supported"):
        ModelConfig.from_folder(tmp_path)
    (tmp_path / "config.json").write_bytes((folder / "config.json").read_bytes())  # weights are read with their config
    data = (folder / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(FlashgenError, match="truncated"):
        load_weights(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "shard-2.safetensors"}}))
    with pytest.raises(FlashgenError, match="shard-2.safetensors named by the index is missing"):
        load_weights(tmp_path)


def test_cli_generate_streams_text(checkpoint, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    from flashgen.cli import main
    kind, hf, folder = checkpoint
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    tok.save(str(folder / "tokenizer.json"))
    assert main(["generate", "--model", str(folder), "--prompt", "w1 w5 w9 w20 w33", "--max-new-tokens", "8"]) == 0
    words = capsys.readouterr().out.split()
    assert words == [f"w{i}" for i in hf_greedy(hf, [1, 5, 9, 20, 33], 8)]
    assert main(["generate", "--model", str(folder), "--prompt", " ".join(["w3"] * 300)]) == 2
    assert "exceeds the model's context" in capsys.readouterr().err
    assert main(["generate", "--model", str(folder), "--prompt", "w1", "--top-p", "0"]) == 2
    assert capsys.readouterr().err.strip() == "flashgen: error: argument --top-p: must be a number in (0, 1], got '0'"
    assert main(["generate", "--model", str(tmp_path), "--prompt", "w1"]) == 2
    assert "no config.json" in capsys.readouterr().err


# (mixed runs the modes its plan picks from the rooflines: the cpu has no records)
@pytest.mark.parametrize("quant, tol", [("w8a16", 0.05), ("w4a16", 0.35), ("w8a8", 0.05), ("w4a8", 0.35), ("fp8", 0.1), ("mixed", 0.35)])
def test_quantized_modes_track_the_float_model(checkpoint, quant, tol):
    """RTN-quantized linears change the logits by about the quantization error, not more."""
    _, _, folder = checkpoint
    cfg, w = ModelConfig.from_folder(folder), load_weights(folder)
    prompt = PROMPTS[1]

    def logits(model):
        eng = Engine(model, num_blocks=8)
        eng.cache.manager.reserve(0, len(prompt))
        t = eng.cache.manager.tables[0]
        b = Batch(torch.tensor(prompt), torch.arange(len(prompt)),
                  torch.tensor([t[p // 16] * 16 + p % 16 for p in range(len(prompt))]), [0], [len(prompt)], [len(prompt)])
        return model.forward(b, eng.cache, last_only=False)

    ref, q = logits(Decoder(cfg, w)), logits(Decoder(cfg, w, quant=quant))
    err = ((q - ref).norm() / ref.norm()).item()
    assert 0 < err < tol, err
    out = Engine(Decoder(cfg, w, quant=quant), num_blocks=32).generate(PROMPTS, SamplingParams(max_new_tokens=4))
    assert all(len(r.output) == 4 for r in out)


TUNED_ROWS = (1, 16, 32, 64, 128, 256)  # records at 1 and at the rows of benchmarks/workloads/decode_rows.jsonl


def _mixed_records(db_path, linear, latencies: dict[str, dict[int, float]], form=None) -> None:
    """Records of each mode's GEMM of `linear` (a prepared mixed linear) at the given rows, called in
    `form` (plain by default), with the H200's default schedule of each workload (valid there, in the
    regime of its own rows)."""
    from flashgen.runtime.decoder.linear import PLAIN
    from flashgen.db import Database, Record
    from flashgen.runtime.decoder.calls import gemm_workload
    from flashgen.schedules.space import ScheduleSpace
    from flashgen.targets import get_target
    h200 = get_target("h200")
    with Database(db_path) as d:
        for mode, at in latencies.items():
            for m, us in at.items():
                wl = gemm_workload(linear.choices[mode], m, torch.bfloat16, form or PLAIN)
                d.add(Record(workload_key=wl.key, workload=wl.to_json(), target_key=h200.id,
                             schedule=ScheduleSpace(wl, h200).default(), status="ok", latency_us=us, device="NVIDIA H200"))


def test_mixed_plan_follows_the_records_of_each_regime(tmp_path):
    """Each row count's mode is the fastest of the three as dispatch would serve them: the one-row GEMV
    records decide one row only (with them, w4a16 would look 2.5 us at 2 rows; its 16-row matrix tile
    takes 10), and a linear keeps the weights of the modes its plan picks, no w4a8 here."""
    from flashgen.runtime.decoder.calls import gemm_workload
    from flashgen.runtime.decoder.mixed import ModePlan, planned_rows
    from flashgen.runtime.decoder.quant_modes import prepare
    from flashgen.schedules.contraction_space import flat_of
    from flashgen.schedules.space import ScheduleSpace
    from flashgen.targets import get_target
    g = torch.Generator().manual_seed(3)
    q = prepare(torch.randn(1024, 512, generator=g), "mixed")
    db = tmp_path / "t.db"
    _mixed_records(db, q, {"w4a16": dict(zip(TUNED_ROWS, (2.0, 10.0, 12.0, 16.0, 25.0, 40.0))),
                           "w8a8": dict(zip(TUNED_ROWS, (5.0, 6.0, 7.0, 9.0, 14.0, 25.0))),
                           "w4a8": dict(zip(TUNED_ROWS, (7.0, 8.0, 9.0, 11.0, 17.0, 30.0)))})
    for mode in ("w4a16", "w8a8"):  # (the premise: their one-row records are GEMV tiles of one row)
        wl = gemm_workload(q.choices[mode], 1, torch.bfloat16)
        assert flat_of(wl, ScheduleSpace(wl, get_target("h200")).default())["block_m"] == 1
    plan = ModePlan("h200", db, torch.bfloat16)
    kept = q.settle(plan)
    rows = planned_rows()
    assert rows[:9] == (1, 2, 4, 8, 16, 32, 64, 128, 256) and rows[-1] >= 4096
    assert [plan(1024, 512, m) for m in (1, 2, 3, 16, 17, 256, 5000, 10 ** 6)] == ["w4a16"] + ["w8a8"] * 7
    assert sorted(kept.choices) == ["w4a16", "w8a8"] and kept.choices["w8a8"] is q.choices["w8a8"]
    notes = plan.describe()
    assert len(notes) == 1 and notes[0].startswith("mixed 1024x512 on cuda:sm_90/h200: w4a16 at rows 1 (at 1: w4a16 2.0 us")
    assert "w8a8 at rows 2-" in notes[0] and "w4a16 10.0 us (records M=16)" in notes[0]
    with pytest.raises(FlashgenError, match="w4a8 was chosen for 5 rows, but it keeps w4a16, w8a8 only"):
        kept.choose(5, lambda n, k, m: "w4a8")


def test_mixed_layer_without_w8a8_keeps_no_int8_weight(tmp_path):
    """Where w8a8 is never the fastest, a mixed linear keeps the 4-bit codes (in each 4-bit GEMM's
    layout), w4a16's and w4a8's scales, and no int8 weight; it computes each call in its planned mode's numerics."""
    from flashgen.runtime.decoder.linear import apply
    from flashgen.runtime.decoder.mixed import ModePlan
    from flashgen.runtime.decoder.quant_modes import prepare
    g = torch.Generator().manual_seed(4)
    w = torch.randn(1024, 512, generator=g)
    q = prepare(w, "mixed")
    db = tmp_path / "t.db"
    _mixed_records(db, q, {"w4a16": dict(zip(TUNED_ROWS, (2.0, 3.0, 4.0, 6.0, 10.0, 20.0))),
                           "w4a8": dict(zip(TUNED_ROWS, (3.0, 2.5, 3.0, 5.0, 8.0, 15.0))),
                           "w8a8": dict(zip(TUNED_ROWS, (9.0, 9.0, 10.0, 12.0, 20.0, 40.0)))})
    plan = ModePlan("h200", db, torch.bfloat16)
    kept = q.settle(plan)
    assert sorted(kept.choices) == ["w4a16", "w4a8"]
    assert not any(hasattr(lin, "w8") for lin in kept.choices.values())  # (w8a8's int8 weight let go)
    assert [plan(1024, 512, m) for m in (1, 2, 256, 5000)] == ["w4a16", "w4a8", "w4a8", "w4a8"]
    x = torch.randn(3, 512, generator=g)
    for m, mode in ((1, "w4a16"), (3, "w4a8")):
        assert torch.equal(apply(x[:m], kept, None, set(), plan), apply(x[:m], kept.choices[mode], None, set()))


def test_mixed_plan_takes_no_unmeasured_mode_over_a_measured_one(tmp_path):
    """A mode known by its roofline alone (w4a8 here: no records) is not chosen while another is known
    by records, however low its bound; an int8 mode's estimate counts its activation quantization."""
    from flashgen.runtime.decoder.mixed import ModePlan
    from flashgen.runtime.decoder.quant_modes import prepare
    q = prepare(torch.randn(1024, 512, generator=torch.Generator().manual_seed(5)), "mixed")
    db = tmp_path / "t.db"
    _mixed_records(db, q, {"w4a16": dict(zip(TUNED_ROWS, (2.0, 10.0, 12.0, 16.0, 25.0, 40.0))),
                           "w8a8": dict(zip(TUNED_ROWS, (5.0, 6.0, 7.0, 9.0, 14.0, 25.0)))})
    plan = ModePlan("h200", db, torch.bfloat16)
    kept = q.settle(plan)
    assert sorted(kept.choices) == ["w4a16", "w8a8"]
    chosen = {c.rows: c for c in plan.plans[(1024, 512)]}
    for c in chosen.values():
        est = dict(c.estimates)
        assert not est["w4a8"].measured and est["w4a8"].us < est[c.mode].us  # (the bound is lower, yet not taken)
    at1 = dict(chosen[1].estimates)["w8a8"]
    assert at1.source.startswith("records M=1") and "+ dynamic_quant" in at1.source and at1.us > 5.0
    assert chosen[1].mode == "w4a16" and chosen[16].mode == "w8a8"


def test_mixed_plan_estimates_the_decoders_call_and_scales_another_gpus_records(tmp_path):
    """The plan estimates a call as the decoder makes it: o's residual epilogue is the GEMM's workload
    (its record serves, not the plain form's), the norm before qkv runs apart in w4a16 and fused with
    the quantization in w8a8; an H200 record stands for an H100 call times the ratio of their bounds."""
    from flashgen.roofline import contraction_us
    from flashgen.runtime.decoder.calls import gemm_workload
    from flashgen.runtime.decoder.linear import CallForm
    from flashgen.runtime.decoder.mixed import ModePlan
    from flashgen.runtime.decoder.quant_modes import prepare
    from flashgen.targets import get_target
    g = torch.Generator().manual_seed(6)
    o, qkv = prepare(torch.randn(1024, 512, generator=g), "mixed"), prepare(torch.randn(768, 512, generator=g), "mixed")
    db = tmp_path / "t.db"
    residual, norm = CallForm(residual=True), CallForm(norm=True)
    _mixed_records(db, o, {"w4a16": {16: 8.0}, "w8a8": {16: 6.0}}, residual)
    _mixed_records(db, o, {"w4a16": {16: 1.0}, "w8a8": {16: 1.0}})  # (the plain form's: not what o runs)
    plan = ModePlan("h100", db, torch.bfloat16)
    o.settle(plan, residual)
    est = dict(next(c for c in plan.plans[(1024, 512)] if c.rows == 16).estimates)
    wl = gemm_workload(o.choices["w4a16"], 16, torch.bfloat16, residual)
    assert wl.attr["with_residual"] == "yes"
    ratio = contraction_us(wl, get_target("h100")) / contraction_us(wl, get_target("h200"))
    assert ratio > 1.1  # (the H100 streams the weight more slowly)
    assert est["w4a16"].us == pytest.approx(8.0 * ratio) and "tuned on cuda:sm_90/h200 (x" in est["w4a16"].source
    assert est["w8a8"].source.startswith("records M=16,") and "+ dynamic_quant" in est["w8a8"].source
    plan.plan(qkv.choices, norm)
    est = dict(plan.plans[(768, 512)][0].estimates)
    assert "+ rmsnorm " in est["w4a16"].source and "+ rmsnorm_quant " in est["w8a8"].source
    assert "dynamic_quant" not in est["w8a8"].source


def test_mixed_plan_prefers_records_at_the_calls_rows_to_extrapolating_fewer(tmp_path):
    """A one-row record of the call's own form whose tile serves 16 rows, extrapolated, is an upper bound
    16x its time; a record of 16 rows in the plain form is the estimate of a 16-row call."""
    from flashgen.runtime.decoder.calls import gemm_workload
    from flashgen.runtime.decoder.linear import CallForm
    from flashgen.runtime.decoder.mixed import estimate
    from flashgen.runtime.decoder.quant_modes import prepare
    from flashgen.runtime.serving.dispatch import serving
    from flashgen.schedules.space import ScheduleSpace
    from flashgen.targets import get_target
    from flashgen.db import Database
    o = prepare(torch.randn(1024, 512, generator=torch.Generator().manual_seed(8)), "mixed")
    db, residual, h200 = tmp_path / "t.db", CallForm(residual=True), get_target("h200")
    _mixed_records(db, o, {"w4a8": {1: 6.0}}, residual)
    _mixed_records(db, o, {"w4a8": {16: 8.0}})
    wl = gemm_workload(o.choices["w4a8"], 16, torch.bfloat16, residual)
    one_row = next(r for r in Database(db).records() if r.workload_key != gemm_workload(o.choices["w4a8"], 16,
                                                                                         torch.bfloat16).key)
    assert one_row.workload["dims"]["M"] == 1
    assert len(serving([(1, 0.0, one_row)], 16, ScheduleSpace(wl, h200))) == 1  # (its tile serves 16 rows)
    est = estimate(wl, h200, db)
    assert est.us == pytest.approx(8.0) and est.source.startswith("records M=16, tuned as gemm_w4a8 with_residual=no")
    alone = tmp_path / "alone.db"
    _mixed_records(alone, o, {"w4a8": {1: 6.0}}, residual)
    assert estimate(wl, h200, alone).us == pytest.approx(6.0 * 16)  # (where nothing else is known: the bound)


def test_mixed_plan_bad_inputs_are_one_line_errors(tmp_path):
    from flashgen.runtime.decoder.mixed import ModePlan
    with pytest.raises(FlashgenError) as e:
        ModePlan("no-such-gpu", tmp_path / "t.db", torch.bfloat16)
    assert "\n" not in str(e.value) and "no-such-gpu" in str(e.value)
    with pytest.raises(FlashgenError, match="no mixed-mode plan for a 64x32 linear"):
        ModePlan("h200", tmp_path / "t.db", torch.bfloat16)(64, 32, 1)


def test_mixed_decoder_plans_its_shapes_at_load(checkpoint):
    """A CPU decoder in mixed mode plans each layer shape once (no records: the rooflines decide) and
    says so in its notes; its linears hold only the planned modes."""
    _, _, folder = checkpoint
    cfg, w = ModelConfig.from_folder(folder), load_weights(folder)
    model = Decoder(cfg, w, quant="mixed")
    shapes = {model.layers[0][name].shape for name in ("qkv", "o", "gate_up", "down")}
    assert set(model.chooser.plans) == shapes and len(model.notes) == len(shapes)
    assert all("roofline" in line for line in model.notes)
    for name in ("qkv", "o", "gate_up", "down"):
        lin = model.layers[0][name]
        assert set(lin.choices) == {c.mode for c in model.chooser.plans[lin.shape]}
    assert Decoder(cfg, w).notes == []


def test_bench_model_cli_runs_tiny(capsys):
    from flashgen.cli import main
    assert main(["bench-model", "--config", "tiny", "--batch", "1,3", "--prompt-len", "20", "--new-tokens", "6",
                 "--quant", "w4a16"]) == 0
    out = capsys.readouterr().out
    assert "decode tok/s" in out and "of limit" in out and "torch fallbacks" in out
    assert "CUDA graphs off" in out                                         # a GPU's only: none on the CPU
    assert main(["bench-model", "--config", "tiny", "--batch", "2", "--prompt-len", "5", "--new-tokens", "3",
                 "--no-cuda-graphs"]) == 0
    assert main(["bench-model", "--config", "gpt5", "--batch", "1"]) == 2
    assert main(["bench-model", "--config", "tiny", "--batch", "0"]) == 2


def test_chained_steps_keep_every_token():
    """Greedy decode steps chained ahead of the host give the tokens of unchained ones: through max_new_tokens
    reached at different steps (no step is computed past it), a stop token met inside a chained step (the
    one extra token is dropped and the request's blocks freed once), and requests joining mid-run, one of
    them sampled (chaining pauses for both)."""
    from flashgen.runtime.decoder.bench import CONFIGS, random_weights
    model = Decoder(CONFIGS["tiny"], random_weights(CONFIGS["tiny"], torch.float32, torch.device("cpu"), seed=1))

    def run(chain: bool, stops: tuple[int, ...] = ()) -> tuple[list[list[int]], int]:
        eng = Engine(model, num_blocks=64)
        eng.graphs, eng.chain = EagerGraphs(model, eng.cache), chain
        ids = [eng.add(p, SamplingParams(max_new_tokens=n, stop_tokens=stops)) for p, n in zip(PROMPTS, (16, 11, 16))]
        for _ in range(5):
            eng.step()
        ids.append(eng.add(PROMPTS[1], SamplingParams(max_new_tokens=8)))
        ids.append(eng.add(PROMPTS[0], SamplingParams(max_new_tokens=2, temperature=0.8, seed=3)))
        while eng.waiting or eng.running or eng.pending:
            eng.step()
        assert eng.pending is None and eng.cache.manager.available == 64
        outs = [eng.finished[i].output for i in ids]
        for i, o in zip(ids, outs):  # the first token comes from a prefill; one extra row only after a stop
            assert eng.graphs.rows.get(i, 0) <= len(o) - 1 + (o[-1] in stops), (i, o, eng.graphs.rows)
        return outs, eng.graphs.chained

    # a stop token that one of the first requests meets late, once the joins are over and chaining runs
    free, _ = run(False)
    req, at, stop = next((r, i, o[i]) for i in range(7, 16) for r, o in enumerate(free[:3])
                         if i < len(o) and o[i] not in o[:i])
    (plain, unchained), (chained, n_chained) = run(False, (stop,)), run(True, (stop,))
    assert unchained == 0 and n_chained >= 4, n_chained
    assert plain == chained
    assert [len(o) <= n for o, n in zip(plain, (16, 11, 16, 8, 2))] == [True] * 5
    assert plain[req] == free[req][:at + 1]


@pytest.mark.parametrize("window", [None, 5])
def test_torch_decode_attention_views_and_gathers_alike(window):
    """A CPU decode step's attention over all sequences at once, through a view of evenly spaced block
    runs or a gather of scattered tables, against each sequence's own attention (float64 softmax)."""
    from dataclasses import replace as with_
    from flashgen.runtime.decoder import bench
    from flashgen.runtime.decoder.kv_cache import PagedKVCache

    c = with_(bench.CONFIGS["tiny"], sliding_window=window)
    model = Decoder(c, bench.random_weights(c, torch.float32, torch.device("cpu")))
    g = torch.Generator().manual_seed(5)
    for tables in ([[2, 3, 4], [7, 8, 9, 10], [12, 13, 14]], [[1], [9, 3, 6], [0, 5]]):
        cache = PagedKVCache(1, 16, 4, c.num_kv_heads, c.head_dim, torch.float32, torch.device("cpu"))
        cache.k[0].normal_(generator=g)
        cache.v[0].normal_(generator=g)
        ctx = [min(4 * len(t), n) for t, n in zip(tables, (11, 9, 6))]
        cache.manager.tables = dict(enumerate(tables))
        batch = Batch(torch.zeros(3, dtype=torch.long), torch.tensor(ctx) - 1, torch.zeros(3, dtype=torch.long),
                      [0, 1, 2], [1, 1, 1], ctx)
        q = torch.randn(3, c.num_heads, c.head_dim, generator=g)
        got = model.attention(q, None, None, cache, 0, batch)
        group = c.num_heads // c.num_kv_heads
        for i, (t, n) in enumerate(zip(tables, ctx)):
            k = cache.k[0][t].reshape(-1, c.num_kv_heads, c.head_dim)[:n].double().repeat_interleave(group, 1)
            v = cache.v[0][t].reshape(-1, c.num_kv_heads, c.head_dim)[:n].double().repeat_interleave(group, 1)
            s = torch.einsum("hd,nhd->hn", q[i].double(), k) / c.head_dim ** 0.5
            if window:
                s[:, : max(0, n - window)] = float("-inf")
            want = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
            assert torch.allclose(got[i].double(), want, atol=1e-5), (tables, i)
