"""A Hugging Face Llama-family config.json (Mixtral and Qwen2-MoE included) read into what the decoder
computes, or refused.

Every key that changes what the model computes is either computed (RoPE scaling in both config forms,
biases, an explicit head_dim, tied embeddings, sliding windows per layer, EOS ids, experts and their
routing) or refused in one
line naming it: a folder never loads to compute something other than what its config says. Sizes and
ranges are checked before anything is allocated from them. generation_config.json adds EOS ids (its
decoding settings: runtime/checkpoints/generation_config.py).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashgen.errors import FlashgenError
from flashgen.runtime.checkpoints.compressed_tensors import CompressedConfig, ignored
from flashgen.runtime.checkpoints.prequant import LINEARS, PrequantConfig, parse_config

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
QK_NORM = ("qwen3", "qwen3_moe")  # per-head RMSNorm of q and k before RoPE
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")  # routed experts in (some of) the layers
ATTENTION_BIAS = ("llama", *QK_NORM)  # where attention_bias biases q, k, v and o
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
MAX_SIZE = 1 << 20  # any hidden, intermediate or head size, head count or vocabulary beyond this is not a model


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    sliding_window: int | None
    qkv_bias: bool
    tie_word_embeddings: bool
    o_bias: bool = False            # Llama's attention_bias also biases o_proj
    mlp_bias: bool = False
    rope_type: str = "default"
    rope_params: tuple[tuple[str, Any], ...] = ()  # the scaling parameters of rope_type, as the config gives them
    window_layers: tuple[bool, ...] = ()  # per layer, whether sliding_window applies; () = every layer
    eos_token_ids: tuple[int, ...] = field(default=())
    num_experts: int = 0                      # routed experts of each MoE layer; 0: a dense model
    experts_per_tok: int = 0                  # the router's top-k
    moe_intermediate_size: int = 0            # each routed expert's
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert behind a sigmoid gate; 0: none
    norm_topk_prob: bool = False              # whether the top-k router weights are renormalised to sum to 1
    moe_layers: tuple[bool, ...] = ()         # per layer, whether its MLP is the MoE block; (): none is
    qk_norm: bool = False                     # Qwen3: q and k RMS-normalised per head (q_norm, k_norm) before RoPE
    prequant: PrequantConfig | CompressedConfig | None = None  # a pre-quantized checkpoint's quantization_config (runtime/checkpoints/prequant.py)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`'s attention, None for full attention."""
        if self.sliding_window is None or (self.window_layers and not self.window_layers[layer]):
            return None
        return self.sliding_window

    def layer_moe(self, layer: int) -> bool:
        """Whether `layer`'s MLP is the routed-experts block (else the dense MLP of intermediate_size)."""
        return bool(self.moe_layers) and self.moe_layers[layer]

    @staticmethod
    def from_folder(folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        try:
            c = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FlashgenError(f"{folder} is not a model folder: it has no config.json") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FlashgenError(f"{path} is unreadable: {e}") from None
        if not isinstance(c, dict):
            raise FlashgenError(f"{path} is not a JSON object")
        return parse(c, path, _generation_eos(Path(folder)))


def _fail(path: Path, key: str, why: str) -> FlashgenError:
    return FlashgenError(f"{path}: {key} {why}")


def _int(c: dict, key: str, path: Path, default: int | None = None, lo: int = 1, hi: int = MAX_SIZE) -> int:
    value = c.get(key, default)
    if value is None:
        raise _fail(path, key, "is missing")
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _fail(path, key, f"must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _float(c: dict, key: str, path: Path, default: float) -> float:
    value = c.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _fail(path, key, f"must be a positive number, got {value!r}")
    return float(value)


def _bool(c: dict, key: str, path: Path, default: bool = False) -> bool:
    """A true/false key; a string such as "false" is refused, not read by Python's truthiness."""
    value = c.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _fail(path, key, f"must be true or false, got {value!r}")
    return value


def _refuse_uncomputed(c: dict, kind: str, path: Path) -> None:
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise _fail(path, "hidden_act", f"is {act!r}: the decoder computes silu only")
    prf = c.get("partial_rotary_factor", 1.0)
    if prf != 1.0:
        raise _fail(path, "partial_rotary_factor", f"is {prf!r}: this model family rotates the whole head")
    for key, kinds in (("attention_bias", ATTENTION_BIAS), ("mlp_bias", ("llama",))):
        if _bool(c, key, path) and kind not in kinds:
            raise _fail(path, key, f"is set, which {kind} models do not compute")


def _rope(c: dict, path: Path) -> tuple[float, str, tuple[tuple[str, Any], ...]]:
    """(theta, type, scaling parameters) from `rope_parameters` (transformers 5) or `rope_scaling` with a
    top-level `rope_theta` (Llama 3.1+ folders)."""
    key = "rope_parameters" if c.get("rope_parameters") is not None else "rope_scaling"
    params = c.get(key) or {}
    other = c.get("rope_scaling") if key == "rope_parameters" else None
    if other and _rope_form(other) != _rope_form(params):  # transformers reads one, older code the other
        raise _fail(path, "rope_scaling", f"({other!r}) disagrees with rope_parameters ({params!r})")
    if not isinstance(params, dict):
        raise _fail(path, key, f"must be an object, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise _fail(path, f"{key}.rope_type", f"is {kind!r}, which the decoder does not compute "
                                              f"(computed: {', '.join(ROPE_TYPES)})")
    theta = _float({"rope_theta": params.get("rope_theta", c.get("rope_theta", 10000.0))}, "rope_theta", path, 1.0)
    rest = {k: v for k, v in params.items() if k not in ("rope_type", "type", "rope_theta")}
    if kind in ("llama3", "yarn"):
        rest.setdefault("original_max_position_embeddings",
                        c.get("original_max_position_embeddings", c.get("max_position_embeddings")))
    needed = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "default": ()}[kind]
    for name in (*needed, *(n for n in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                                        "original_max_position_embeddings", "attention_factor") if n in rest)):
        value = rest.get(name)
        if value is None and name not in needed:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise _fail(path, f"{key}.{name}", f"must be a positive number, got {value!r}")
    for name in ("mscale", "mscale_all_dim"):  # (0 turns yarn's attention factor off)
        value = rest.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise _fail(path, f"{key}.{name}", f"must be a number >= 0, got {value!r}")
    if not isinstance(rest.get("truncate", True), bool):
        raise _fail(path, f"{key}.truncate", f"must be true or false, got {rest['truncate']!r}")
    if kind == "llama3" and rest["high_freq_factor"] <= rest["low_freq_factor"]:
        raise _fail(path, f"{key}.high_freq_factor", "must exceed low_freq_factor")
    return theta, kind, tuple(sorted(rest.items()))


def _rope_form(params: Any) -> Any:
    """A RoPE parameters object as compared: `type` read as `rope_type`, the theta (kept apart by older
    configs) left out."""
    if not isinstance(params, dict):
        return params
    form = {k: v for k, v in params.items() if k not in ("type", "rope_theta")}
    form.setdefault("rope_type", params.get("type", "default"))
    return form


def _windows(c: dict, kind: str, layers: int, path: Path) -> tuple[int | None, tuple[bool, ...]]:
    """The sliding window and which layers use it: every Mistral layer; Qwen2's `layer_types` (or, without
    them, the layers from `max_window_layers` on) when `use_sliding_window` is set."""
    if kind == "llama" or (kind in ("qwen2", "qwen2_moe", *QK_NORM) and not _bool(c, "use_sliding_window", path)):
        return None, ()
    if kind in QK_NORM:  # transformers' Qwen3 windows are not computed here
        raise _fail(path, "use_sliding_window", f"is set, which the decoder does not compute for {kind}")
    if c.get("sliding_window") is None:
        return None, ()
    window = _int(c, "sliding_window", path)
    types = c.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers or \
                any(t not in ("sliding_attention", "full_attention") for t in types):
            raise _fail(path, "layer_types", f"must list {layers} of sliding_attention / full_attention")
        return window, tuple(t == "sliding_attention" for t in types)
    if kind == "qwen2":
        first = _int(c, "max_window_layers", path, default=layers, lo=0)
        return window, tuple(i >= first for i in range(layers))
    if kind == "qwen2_moe":  # transformers' rule for these: every other layer below max_window_layers
        limit = _int(c, "max_window_layers", path, default=layers, lo=0)
        return window, tuple(i % 2 == 0 and i < limit for i in range(layers))
    return window, ()


def _moe(c: dict, kind: str, layers: int, path: Path) -> dict[str, Any]:
    """The experts: Mixtral's (of intermediate_size, top-k renormalised) in every layer; Qwen2-MoE's (of
    moe_intermediate_size, with a shared expert) and Qwen3-MoE's (no shared expert) in the layers that
    decoder_sparse_step and mlp_only_layers leave sparse, the others dense MLPs of intermediate_size."""
    if kind not in MOE_TYPES:
        return {}
    if "num_experts" in c and "num_local_experts" in c and c["num_experts"] != c["num_local_experts"]:
        # (transformers saves either name, and reads one through the other: two counts name no model)
        raise _fail(path, "num_experts", f"({c['num_experts']!r}) and num_local_experts ({c['num_local_experts']!r}) "
                                         "disagree")
    key = "num_local_experts" if kind == "mixtral" or "num_experts" not in c else "num_experts"  # (either name)
    experts = _int(c, key, path, hi=1 << 16)
    top_k = _int(c, "num_experts_per_tok", path, hi=experts)
    if kind == "mixtral":
        return dict(num_experts=experts, experts_per_tok=top_k, moe_intermediate_size=_int(c, "intermediate_size", path),
                    norm_topk_prob=True, moe_layers=(True,) * layers)
    step = _int(c, "decoder_sparse_step", path, default=1)
    dense = c.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers
                                          for i in dense):
        raise _fail(path, "mlp_only_layers", f"must list layer indices in [0, {layers}), got {dense!r}")
    norm = c.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise _fail(path, "norm_topk_prob", f"must be true or false, got {norm!r}")
    shared = 0 if kind == "qwen3_moe" else _int(c, "shared_expert_intermediate_size", path)  # Qwen3-MoE has none
    return dict(num_experts=experts, experts_per_tok=top_k, moe_intermediate_size=_int(c, "moe_intermediate_size", path),
                shared_expert_intermediate_size=shared, norm_topk_prob=norm,
                moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)))


def _eos(value: Any, where: str) -> tuple[int, ...]:
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise FlashgenError(f"{where}: eos_token_id must be a non-negative integer or a list of them, got {value!r}")
    return tuple(ids)


def json_object(path: Path) -> dict:
    """The JSON object in an optional file of a model folder ({} where there is none): one that does not
    parse, or holds a list or a number, is refused rather than read as "nothing set"."""
    if not path.exists():
        return {}
    try:
        g = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FlashgenError(f"{path} is unreadable: {e}") from None
    if not isinstance(g, dict):
        raise FlashgenError(f"{path} is not a JSON object")
    return g


def _generation_eos(folder: Path) -> tuple[int, ...]:
    path = folder / "generation_config.json"
    return _eos(json_object(path).get("eos_token_id"), str(path))


def _eos_in_vocab(ids: tuple[int, ...], vocab_size: int, where: Path) -> tuple[int, ...]:
    """`ids` where each is a token the model can produce: an EOS id past the vocabulary never comes, so
    generation would never stop where the folder says it does."""
    for i in ids:
        if i >= vocab_size:
            raise FlashgenError(f"{where}: eos_token_id {i} is past the model's vocab_size of {vocab_size}")
    return ids


def parse(c: dict, path: Path, generation_eos: tuple[int, ...] = ()) -> ModelConfig:
    """The config's model, every size and range checked, or the one-line reason it is refused."""
    kind = c.get("model_type")
    if kind not in SUPPORTED:
        raise _fail(path, "model_type", f"{kind!r} is not supported; supported: {', '.join(SUPPORTED)}")
    _refuse_uncomputed(c, kind, path)
    hidden, heads = _int(c, "hidden_size", path), _int(c, "num_attention_heads", path)
    kv_heads = _int(c, "num_key_value_heads", path, default=heads)
    if heads % kv_heads:
        raise _fail(path, "num_key_value_heads", f"({kv_heads}) must divide num_attention_heads ({heads})")
    if c.get("head_dim") is None and hidden % heads:
        raise _fail(path, "num_attention_heads", f"({heads}) must divide hidden_size ({hidden}) when there is no head_dim")
    head_dim = _int(c, "head_dim", path) if c.get("head_dim") is not None else hidden // heads
    if head_dim % 2:
        raise _fail(path, "head_dim", f"must be even for rotary embeddings, got {head_dim}")
    layers = _int(c, "num_hidden_layers", path, hi=4096)
    theta, rope_type, rope_params = _rope(c, path)
    window, window_layers = _windows(c, kind, layers, path)
    attention_bias = _bool(c, "attention_bias", path) and kind in ATTENTION_BIAS
    qkv_bias = kind == "qwen2" or (kind == "qwen2_moe" and _bool(c, "qkv_bias", path, True)) or attention_bias
    vocab = _int(c, "vocab_size", path, hi=1 << 24)
    eos = _eos_in_vocab(_eos(c.get("eos_token_id"), str(path)), vocab, path) + \
        _eos_in_vocab(generation_eos, vocab, path.with_name("generation_config.json"))
    return ModelConfig(
        model_type=kind, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=_int(c, "intermediate_size", path), num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=_float(c, "rms_norm_eps", path, 1e-6),
        rope_theta=theta, max_position_embeddings=_int(c, "max_position_embeddings", path, default=4096, hi=(1 << 31) - 1),
        sliding_window=window, qkv_bias=qkv_bias,
        tie_word_embeddings=_bool(c, "tie_word_embeddings", path), o_bias=attention_bias,
        mlp_bias=_bool(c, "mlp_bias", path) and kind == "llama", rope_type=rope_type, rope_params=rope_params,
        window_layers=window_layers,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        qk_norm=kind in QK_NORM, prequant=_prequant(c, path), **_moe(c, kind, layers, path))


def _prequant(c: dict, path: Path) -> PrequantConfig | CompressedConfig | None:
    """A pre-quantized checkpoint's format, where the decoder computes it: dense models' linears, 4-bit
    codes, or 8-bit ones that are per-channel and symmetric (w8a16's int8 GEMM); compressed-tensors
    with every decoder linear in its one scheme."""
    if c.get("quantization_config") is None:
        return None
    q = parse_config(c["quantization_config"], path)
    if c.get("model_type") in MOE_TYPES:
        raise _fail(path, "quantization_config", f"is {q.method}: pre-quantized MoE experts are not loaded; give a "
                                                 "float checkpoint and choose --quant")
    if q.method == "gptq" and q.bits == 8 and (q.group != -1 or not q.sym):
        raise _fail(path, "quantization_config", "is 8-bit GPTQ with group scales or zero points: the int8 GEMM "
                                                 "takes per-channel symmetric weights only (group_size -1, sym true)")
    if q.method == "compressed-tensors":
        kept = [f"model.layers.{i}.{lin}" for i in range(_int(c, "num_hidden_layers", path)) for lin in LINEARS
                if ignored(f"model.layers.{i}.{lin}", q.ignore)]
        if kept:
            more = f" and {len(kept) - 1} more" if len(kept) > 1 else ""
            raise _fail(path, "quantization_config.ignore", f"keeps {kept[0]}{more} in float: the decoder "
                                                            "computes every linear in the checkpoint's scheme")
    return q
