"""The checkpoints people have: each config key the decoder computes gives transformers' float32 logits
on a tiny random folder written by transformers (RoPE scaling in both config forms, biases, an explicit
head_dim, tied embeddings, Qwen2's per-layer sliding windows, EOS ids), and every other key, bad
range or tensor is refused in one line naming it, before anything is allocated from it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashgen.errors import FlashgenError  # noqa: E402
from flashgen.runtime.decoder.engine import Engine  # noqa: E402
from flashgen.runtime.decoder.model import Decoder  # noqa: E402
from flashgen.runtime.checkpoints.model_config import ModelConfig  # noqa: E402
from flashgen.runtime.checkpoints.weights import load_weights  # noqa: E402
from tests.prefill import prefill_logits, write_checkpoint  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
              eos_token_id=None)  # (no EOS: greedy runs are compared at full length; EOS has its own test)
PROMPT = [(7 * i + 3) % 96 for i in range(70)]  # past every scaled RoPE's original context below
ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16,
                    "mscale": 1.0, "mscale_all_dim": 0.5},
}


def _llama(tmp_path: Path, seed: int = 0, **kw) -> tuple[torch.nn.Module, Path]:
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**COMMON, **kw})).eval()
    return hf, write_checkpoint(hf, tmp_path)


def _error(hf: torch.nn.Module, folder: Path, prompt: list[int] = PROMPT) -> float:
    """Max |logit difference| over the prompt's tokens, relative to the largest logit."""
    ours = prefill_logits(Decoder(ModelConfig.from_folder(folder), load_weights(folder)), prompt, num_blocks=16)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    return float((ours - ref).abs().max() / ref.abs().max())


def _legacy_form(folder: Path) -> None:
    """config.json as Llama 3.1-3.3 folders hold it: `rope_scaling` and a top-level `rope_theta`."""
    c = json.loads((folder / "config.json").read_text())
    params = c.pop("rope_parameters")
    c["rope_theta"] = params.pop("rope_theta")
    c["rope_scaling"] = params
    (folder / "config.json").write_text(json.dumps(c))


@pytest.mark.parametrize("form", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("rope", sorted(ROPES))
def test_scaled_rope_matches_transformers(tmp_path, rope, form):
    hf, folder = _llama(tmp_path, rope_parameters={**ROPES[rope], "rope_theta": 10000.0})
    if form == "rope_scaling":
        _legacy_form(folder)
    c = ModelConfig.from_folder(folder)
    assert c.rope_type == ROPES[rope]["rope_type"]
    assert _error(hf, folder) < 1e-4


def test_scaled_rope_differs_from_plain_rope(tmp_path):
    """The check above can fail: a llama3 folder computed with plain RoPE is far off."""
    hf, folder = _llama(tmp_path, rope_parameters={**ROPES["llama3"], "rope_theta": 10000.0})
    c = json.loads((folder / "config.json").read_text())
    c["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(c))
    assert _error(hf, folder) > 1e-3  # (ten times the tolerance the checks above pass with)


@pytest.mark.parametrize("kw", [dict(attention_bias=True), dict(mlp_bias=True), dict(head_dim=32),
                                dict(tie_word_embeddings=True), dict(attention_bias=True, mlp_bias=True, head_dim=8)],
                         ids=["attention_bias", "mlp_bias", "head_dim", "tied", "all"])
def test_llama_config_keys_match_transformers(tmp_path, kw):
    hf, folder = _llama(tmp_path, **kw)
    c = ModelConfig.from_folder(folder)
    assert (c.o_bias, c.mlp_bias) == (kw.get("attention_bias", False), kw.get("mlp_bias", False))
    assert _error(hf, folder) < 1e-4


@pytest.mark.parametrize("max_window_layers", [0, 1, 2])
def test_qwen2_sliding_window_layers_match_transformers(tmp_path, max_window_layers):
    torch.manual_seed(1)
    cfg = transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8,
                                   max_window_layers=max_window_layers)
    hf = transformers.Qwen2ForCausalLM(cfg).eval()
    folder = write_checkpoint(hf, tmp_path)
    c = ModelConfig.from_folder(folder)
    assert [c.layer_window(i) for i in range(2)] == [None if i < max_window_layers else 8 for i in range(2)]
    assert _error(hf, folder, PROMPT[:30]) < 1e-4


def test_eos_ids_come_from_config_and_generation_config(tmp_path):
    _, folder = _llama(tmp_path, eos_token_id=[5, 9])
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 11]}))
    assert ModelConfig.from_folder(folder).eos_token_ids == (5, 9, 11)


def test_generation_stops_at_eos_by_default(tmp_path):
    from flashgen.runtime.decoder.sampling import SamplingParams
    _, folder = _llama(tmp_path)
    c = ModelConfig.from_folder(folder)
    model = Decoder(c, load_weights(folder))
    free = Engine(model, num_blocks=8).generate([[3, 1, 4]], SamplingParams(max_new_tokens=20))[0].output
    eos = free[6]
    _edit(folder, eos_token_id=eos)
    model = Decoder(ModelConfig.from_folder(folder), load_weights(folder))
    stopped = Engine(model, num_blocks=8).generate([[3, 1, 4]], SamplingParams(max_new_tokens=20))[0].output
    assert stopped == free[:free.index(eos) + 1]
    kept = Engine(model, num_blocks=8).generate([[3, 1, 4]], SamplingParams(max_new_tokens=20, stop_tokens=()))[0]
    assert kept.output == free  # an explicit stop set replaces the EOS ids


def _edit(folder: Path, **changes) -> None:
    c = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    (folder / "config.json").write_text(json.dumps(c))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return _llama(tmp_path_factory.mktemp("tiny"))[1]


@pytest.mark.parametrize("changes,message", [
    (dict(hidden_act="gelu"), "hidden_act is 'gelu'"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope_parameters.rope_type is 'longrope'"),
    (dict(rope_parameters=None, rope_scaling={"type": "su"}), "rope_scaling.rope_type is 'su'"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}), "rope_parameters.factor must be"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": -1}), "rope_theta must be a positive number"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale": "big", "rope_theta": 1e4}),
     "rope_parameters.mscale must be a number >= 0"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "truncate": "no", "rope_theta": 1e4}),
     "rope_parameters.truncate must be true or false"),
    (dict(quantization_config={"quant_method": "gptq"}), "quantization_config.bits is None: gptq checkpoints load with 4 or 8 bits"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config.quant_method is 'fp8': the decoder loads gptq, awq"),
    (dict(quantization_config={"quant_method": "gptq", "bits": 8, "group_size": 128}),
     "quantization_config is 8-bit GPTQ with group scales or zero points"),
    (dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
          quantization_config={"quant_method": "awq", "bits": 4, "group_size": 64}),
     "quantization_config is awq: pre-quantized MoE experts are not loaded"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope_parameters.factor must be"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, rope_scaling={"type": "linear", "factor": 2.0}),
     "rope_scaling ({'type': 'linear', 'factor': 2.0}) disagrees with rope_parameters"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false, got 'false'"),
    (dict(attention_bias=1), "attention_bias must be true or false, got 1"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor is 0.5"),
    (dict(model_type="qwen2", mlp_bias=True), "mlp_bias is set, which qwen2 models do not compute"),
    (dict(model_type="gpt2"), "model_type 'gpt2' is not supported"),
    (dict(hidden_size=-64), "hidden_size must be an integer"),
    (dict(num_attention_heads=3, head_dim=None), "num_key_value_heads (2) must divide num_attention_heads (3)"),
    (dict(num_attention_heads=6, num_key_value_heads=3, head_dim=None), "num_attention_heads (6) must divide hidden_size (64)"),
    (dict(rms_norm_eps=0), "rms_norm_eps must be a positive number"),
    (dict(vocab_size="96"), "vocab_size must be an integer"),
    (dict(num_hidden_layers=None), "num_hidden_layers is missing"),
    (dict(model_type="mistral", sliding_window=-4), "sliding_window must be an integer"),
    (dict(eos_token_id="</s>"), "eos_token_id must be a non-negative integer"),
])
def test_config_refusals_name_the_key(tiny, tmp_path, changes, message):
    import shutil
    folder = tmp_path / "m"
    shutil.copytree(tiny, folder)
    _edit(folder, **changes)
    with pytest.raises(FlashgenError, match="config.json: " + message.replace("(", r"\(").replace(")", r"\)")
                       .replace(".", r"\.")) as e:
        ModelConfig.from_folder(folder)
    assert "\n" not in str(e.value)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(folder / "model.safetensors"))


def _save(folder: Path, tensors: dict[str, torch.Tensor], name: str = "model.safetensors") -> None:
    from safetensors.torch import save_file
    save_file(tensors, str(folder / name))


@pytest.mark.parametrize("damage,message", [
    ("missing", r"tensor model\.layers\.1\.mlp\.up_proj\.weight \(shape \[96, 64\]\) is missing"),
    ("lm_head", r"model\.safetensors: tensor lm_head\.weight has shape \[100, 64\], the config implies \[96, 64\]"),
    ("int8", r"model\.safetensors: tensor model\.norm\.weight is I8, not a float tensor"),
    ("extra_layer", r"tensor model\.layers\.2\.input_layernorm\.weight.* is not in the model its config describes"),
    ("bias", r"tensor model\.layers\.0\.self_attn\.q_proj\.bias is not in the model"),
])
def test_weights_are_checked_against_the_config(tiny, tmp_path, damage, message):
    import shutil
    folder = tmp_path / "m"
    shutil.copytree(tiny, folder)
    t = _tensors(folder)
    if damage == "missing":
        del t["model.layers.1.mlp.up_proj.weight"]
    elif damage == "lm_head":
        t["lm_head.weight"] = torch.zeros(100, 64)
    elif damage == "int8":
        t["model.norm.weight"] = torch.ones(64, dtype=torch.int8)
    elif damage == "extra_layer":
        t.update({k.replace("layers.1.", "layers.2."): v.clone() for k, v in t.items() if "layers.1." in k})
    else:
        t["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    _save(folder, t)
    with pytest.raises(FlashgenError, match=message):
        load_weights(folder)


def test_a_tied_model_storing_another_head_is_refused(tiny, tmp_path):
    """A tied config with a stored lm_head: the embedding's copy loads (also as one rank's vocabulary
    slice), any other head is refused rather than ignored."""
    import shutil
    from flashgen.runtime.decoder.tensor_parallel import shard_weights
    folder = tmp_path / "m"
    shutil.copytree(tiny, folder)
    _edit(folder, tie_word_embeddings=True)
    t = _tensors(folder)
    t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    _save(folder, t)
    c = ModelConfig.from_folder(folder)
    assert torch.equal(load_weights(folder)["lm_head.weight"], t["model.embed_tokens.weight"])
    assert shard_weights(c, folder, 2, 1)["lm_head.weight"].shape[0] == 48
    t["lm_head.weight"][60, 3] += 1.0  # (in rank 1's half of the vocabulary)
    _save(folder, t)
    for load in (lambda: load_weights(folder), lambda: shard_weights(c, folder, 2, 1)):
        with pytest.raises(FlashgenError, match="lm_head.weight differs from model.embed_tokens.weight"):
            load()


def test_a_shard_outside_the_folder_is_refused(tiny, tmp_path):
    import shutil
    folder = tmp_path / "m"
    shutil.copytree(tiny, folder)
    outside = tmp_path / "elsewhere.safetensors"
    (folder / "model.safetensors").rename(outside)
    index = {"weight_map": {name: str(outside) for name in _tensors_at(outside)}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FlashgenError, match="names a shard outside the folder"):
        load_weights(folder)


def _tensors_at(path: Path) -> list[str]:
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def test_nothing_is_sized_from_a_huge_max_position(tiny, tmp_path):
    """A config claiming 10^9 positions: the RoPE table and block tables are sized by the cache."""
    import shutil
    folder = tmp_path / "m"
    shutil.copytree(tiny, folder)
    _edit(folder, max_position_embeddings=10 ** 9)
    model = Decoder(ModelConfig.from_folder(folder), load_weights(folder))
    eng = Engine(model, num_blocks=8, block_size=16)
    out = eng.generate([[1, 2, 3]])[0]
    assert len(out.output) == 32 and model.cos_sin.shape == (8 * 16, 16)
    assert model.table_width(eng.cache) == 8


def _shard(folder: Path, tensors: dict[str, torch.Tensor], parts: dict[str, list[str]],
           weight_map: dict[str, str] | None = None) -> None:
    """Replace model.safetensors by the shards `parts` (file -> tensor names) and an index: `weight_map`,
    or the true one."""
    (folder / "model.safetensors").unlink()
    for name, keys in parts.items():
        _save(folder, {k: tensors[k] for k in keys}, name)
    true = {k: name for name, keys in parts.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map or true}))


@pytest.mark.parametrize("damage,message", [
    ("nan", r"model\.safetensors: tensor model\.layers\.0\.mlp\.up_proj\.weight holds NaN or infinite values"),
    ("inf", r"model\.safetensors: tensor model\.norm\.weight holds NaN or infinite values"),
    ("bf16-inf", r"tensor model\.norm\.weight holds NaN or infinite values"),
    ("index-names-absent", r"index\.json names tensor model\.layers\.9\.mlp\.up_proj\.weight in a\.safetensors, "
                           r"which does not hold it"),
    ("index-wrong-shard", r"index\.json names tensor model\.norm\.weight in b\.safetensors, but it is in a\.safetensors"),
    ("index-unnamed", r"b\.safetensors holds tensor model\.norm\.weight, which model\.safetensors\.index\.json "
                      r"does not name"),
    ("twice", r"tensor model\.norm\.weight is stored twice, in a\.safetensors and b\.safetensors"),
    ("single-and-index", r"holds both model\.safetensors and model\.safetensors\.index\.json, which does not name it"),
])
def test_weights_the_decoder_would_compute_wrong_are_refused(tiny, tmp_path, damage, message):
    """NaN or infinite weights (greedy decoding of NaN logits prints token 0 forever), and a sharded folder
    whose index and shards disagree on where a tensor is, or which holds a tensor twice (the later copy
    would win), or a model.safetensors beside an index that does not name it (transformers loads the one,
    this loader the other): refused in one line naming the file and tensor."""
    import shutil
    folder = tmp_path / "m"
    shutil.copytree(tiny, folder)
    t = _tensors(folder)
    names = sorted(t)
    rest = [n for n in names if n != "model.norm.weight"]
    if damage == "nan":
        t["model.layers.0.mlp.up_proj.weight"][3, 5] = float("nan")
        _save(folder, t)
    elif damage in ("inf", "bf16-inf"):
        t["model.norm.weight"][7] = float("-inf")
        if damage == "bf16-inf":
            t["model.norm.weight"] = t["model.norm.weight"].bfloat16()
        _save(folder, t)
    elif damage == "index-names-absent":
        _shard(folder, t, {"a.safetensors": names}, {**{n: "a.safetensors" for n in names},
                                                     "model.layers.9.mlp.up_proj.weight": "a.safetensors"})
    elif damage == "index-wrong-shard":
        _shard(folder, t, {"a.safetensors": ["model.norm.weight", rest[0]], "b.safetensors": rest[1:]},
               {**{n: "b.safetensors" for n in rest[1:]}, rest[0]: "a.safetensors", "model.norm.weight": "b.safetensors"})
    elif damage == "index-unnamed":
        _shard(folder, t, {"a.safetensors": rest[1:], "b.safetensors": ["model.norm.weight", rest[0]]},
               {**{n: "a.safetensors" for n in rest[1:]}, rest[0]: "b.safetensors"})
    elif damage == "twice":
        _shard(folder, t, {"a.safetensors": names, "b.safetensors": ["model.norm.weight"]})
    else:
        _save(folder, {k: v * 0 for k, v in t.items()}, "other.safetensors")
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: "other.safetensors"
                                                                                        for n in names}}))
    with pytest.raises(FlashgenError, match=message) as e:
        load_weights(folder)
    assert "\n" not in str(e.value)


def test_a_consistent_sharded_folder_loads_as_the_single_file(tiny, tmp_path):
    import shutil
    folder = tmp_path / "m"
    shutil.copytree(tiny, folder)
    t = _tensors(folder)
    names = sorted(t)
    _shard(folder, t, {"a.safetensors": names[:5], "b.safetensors": names[5:]})
    loaded = load_weights(folder)
    assert loaded.keys() == t.keys() and all(torch.equal(loaded[k], t[k]) for k in t)


@pytest.mark.parametrize("file,content,message", [
    ("config.json", dict(eos_token_id=[2, 96]), r"config\.json: eos_token_id 96 is past the model's vocab_size of 96"),
    ("generation_config.json", {"eos_token_id": 1000}, r"generation_config\.json: eos_token_id 1000 is past the "
                                                      r"model's vocab_size of 96"),
    ("generation_config.json", [1, 2], r"generation_config\.json is not a JSON object"),
    ("generation_config.json", 7, r"generation_config\.json is not a JSON object"),
])
def test_eos_ids_the_model_cannot_produce_are_refused(tiny, tmp_path, file, content, message):
    """An EOS id past the vocabulary never comes (generation would not stop where the folder says), and a
    generation_config.json that is not an object would read as "no EOS ids"."""
    import shutil
    folder = tmp_path / "m"
    shutil.copytree(tiny, folder)
    if file == "config.json":
        _edit(folder, **content)
    else:
        (folder / file).write_text(json.dumps(content))
    with pytest.raises(FlashgenError, match=message) as e:
        ModelConfig.from_folder(folder)
    assert "\n" not in str(e.value)


def test_generation_defaults_read_generation_config_as_transformers_writes_it(tiny, tmp_path):
    """A sampling folder's file (do_sample true) gives its settings; one transformers writes for greedy
    decoding (no do_sample) gives no temperature, so generation stays greedy, and transformers' top-k of
    50 for a user who samples all the same."""
    import shutil

    from flashgen.runtime.checkpoints.generation_config import generation_defaults
    folder = tmp_path / "m"
    shutil.copytree(tiny, folder)
    transformers.GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, top_k=20, min_p=0.02,
                                  repetition_penalty=1.05, max_length=4096, eos_token_id=[5, 9]).save_pretrained(folder)
    assert generation_defaults(folder) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.02,
                                           "repetition_penalty": 1.05, "max_length": 4096}
    assert ModelConfig.from_folder(folder).eos_token_ids == (5, 9)
    transformers.GenerationConfig(eos_token_id=5).save_pretrained(folder)
    assert generation_defaults(folder) == {"top_k": 50}
    transformers.GenerationConfig(num_beams=3, eos_token_id=5).save_pretrained(folder)
    with pytest.raises(FlashgenError, match="num_beams is 3, which asks for beam search"):
        generation_defaults(folder)
    (folder / "generation_config.json").unlink()
    assert generation_defaults(folder) == {"top_k": 50}
