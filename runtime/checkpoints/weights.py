"""Loading a Hugging Face Llama-family checkpoint folder (Mixtral and Qwen2-MoE included, their
experts stored one tensor per expert and projection, as transformers' save_pretrained writes them):
safetensors weights, sharded or not.

Every tensor the config implies is checked before any is read (present, the expected shape, a float
dtype), and every tensor in the files must be one the decoder computes with: a checkpoint with more
layers than its config, a bias the config does not name, an lm_head of another vocabulary, or a tied
model's stored lm_head that is not its embedding is refused with the file, the tensor and the expected and
found shapes. Shard names stay inside the folder; a sharded folder's index must name every tensor in the
shard that holds it, no tensor may be stored twice, and a model.safetensors beside an index that does not
name it is refused. Float weights must be finite (NaN or inf is refused as it is read).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from flashgen.errors import FlashgenError
from flashgen.runtime.checkpoints.model_config import ModelConfig
from flashgen.runtime.checkpoints.int_weight import shape_fits
from flashgen.runtime.checkpoints.prequant import LINEARS, stored_tensors

FLOAT_DTYPES = ("F32", "F16", "BF16")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers older checkpoints saved; the decoder derives them


class MoeNames(NamedTuple):
    """One MoE layer's tensors, as the checkpoint names them."""
    router: str                         # [experts, hidden]
    experts: list[tuple[str, str, str]]  # each expert's gate, up and down projections
    shared: tuple[str, str, str] | None  # Qwen2-MoE's shared expert's gate, up and down
    shared_gate: str | None              # its sigmoid gate, [1, hidden]


def moe_names(c: ModelConfig, layer: int) -> MoeNames:
    """Mixtral's `block_sparse_moe` (experts' w1 = gate, w3 = up, w2 = down), or Qwen2-MoE's and
    Qwen3-MoE's `mlp` names (Qwen3-MoE has no shared expert)."""
    if c.model_type == "mixtral":
        p = f"model.layers.{layer}.block_sparse_moe."
        return MoeNames(p + "gate.weight", [tuple(f"{p}experts.{e}.{n}.weight" for n in ("w1", "w3", "w2"))
                                            for e in range(c.num_experts)], None, None)
    p = f"model.layers.{layer}.mlp."
    experts = [tuple(f"{p}experts.{e}.{n}_proj.weight" for n in ("gate", "up", "down")) for e in range(c.num_experts)]
    if not c.shared_expert_intermediate_size:  # Qwen3-MoE
        return MoeNames(p + "gate.weight", experts, None, None)
    return MoeNames(p + "gate.weight", experts, tuple(f"{p}shared_expert.{n}_proj.weight" for n in ("gate", "up", "down")),
                    p + "shared_expert_gate.weight")


DTYPE_WORDS = {"I32": "the packed int32 (I32)", "I64": "int64 (I64)", "I8": "int8 (I8)",
               "F8_E4M3": "float8 e4m3 (F8_E4M3)"}


def _mlp_shapes(c: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """`layer`'s MLP tensors: the dense MLP's, or the router's, every expert's and the shared expert's."""
    h, p = c.hidden_size, f"model.layers.{layer}.mlp."
    if not c.layer_moe(layer):
        ff = c.intermediate_size
        out = {p + "gate_proj.weight": (ff, h), p + "up_proj.weight": (ff, h), p + "down_proj.weight": (h, ff)}
        if c.mlp_bias:
            out.update({p + "gate_proj.bias": (ff,), p + "up_proj.bias": (ff,), p + "down_proj.bias": (h,)})
        return out
    names = moe_names(c, layer)
    sized = [(e, c.moe_intermediate_size) for e in names.experts]
    if names.shared:
        sized.append((names.shared, c.shared_expert_intermediate_size))
    out = {names.router: (c.num_experts, h)}
    for (gate, up, down), ff in sized:
        out.update({gate: (ff, h), up: (ff, h), down: (h, ff)})
    if names.shared_gate:
        out[names.shared_gate] = (1, h)
    return out


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder reads for `c`, by checkpoint name."""
    return {name: shape for name, (shape, _) in expected_tensors(c).items()}


def expected_tensors(c: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Every tensor the decoder reads for `c`, by checkpoint name: its shape and the safetensors
    dtypes it may be stored in (float, but for a pre-quantized checkpoint's linears)."""
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, h)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    **_mlp_shapes(c, i)})
        if c.qkv_bias:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,)})
        if c.o_bias:
            out[p + "self_attn.o_proj.bias"] = (h,)
        if c.qk_norm:
            out.update({p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,)})
    tensors = {name: (shape, FLOAT_DTYPES) for name, shape in out.items()}
    if c.prequant is not None:  # each linear's weight as its stored tensors (runtime/checkpoints/prequant.py)
        for i in range(c.num_layers):
            for lin in LINEARS:
                name = f"model.layers.{i}.{lin}"
                n, k = tensors.pop(name + ".weight")[0]
                tensors.update({f"{name}.{x}": form for x, form in stored_tensors(c.prequant, n, k).items()})
    return tensors


def _shards(folder: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """The weight files, and the index's map of tensor name -> file where the folder is sharded. A
    model.safetensors beside an index that does not name it is refused: transformers would load that
    file and this loader the index's, so which weights the folder holds is not clear."""
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        if (folder / "model.safetensors").exists():
            return [folder / "model.safetensors"], None
        raise FlashgenError(f"{folder} has no model.safetensors nor model.safetensors.index.json")
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        items = list(weight_map.items())
    except (OSError, KeyError, TypeError, AttributeError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FlashgenError(f"{index} is unreadable: {e}") from None
    root, where = folder.resolve(), {}
    for tensor, name in items:
        path = (folder / str(name)).resolve()
        if not isinstance(name, str) or path.parent != root:
            raise FlashgenError(f"{index} names a shard outside the folder: {name!r}")
        where[tensor] = path
    shards = sorted(set(where.values()))
    for path in shards:
        if not path.exists():
            raise FlashgenError(f"{folder}: shard {path.name} named by the index is missing")
    single = (folder / "model.safetensors").resolve()
    if single.exists() and single not in shards:
        raise FlashgenError(f"{folder} holds both model.safetensors and {index.name}, which does not name it: "
                            "remove the one that is not the model")
    return shards, where


def _headers(shards: list[Path]) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """name -> (file, safetensors dtype, shape), read from the files' headers (nothing is allocated)."""
    from safetensors import SafetensorError, safe_open

    out: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    for path in shards:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if name in out:  # (the later file's copy would silently win)
                        raise FlashgenError(f"tensor {name} is stored twice, in {out[name][0].name} and {path.name}")
                    s = f.get_slice(name)
                    out[name] = (path, s.get_dtype(), tuple(s.get_shape()))
        except (SafetensorError, OSError, ValueError) as e:
            raise FlashgenError(f"{path} is truncated or not a safetensors file ({e})") from None
    return out


def check_weights(folder: str | Path, c: ModelConfig) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """The checkpoint's tensors, each checked against what `c` implies (module docstring)."""
    shards, index = _shards(Path(folder))
    found = _headers(shards)
    if index is not None:
        _check_index(index, found)
    want = expected_tensors(c)
    for name, (shape, dtypes) in want.items():
        if name not in found:
            raise FlashgenError(f"{folder}: tensor {name} (shape {list(shape)}) is missing")
        path, dtype, got = found[name]
        if not shape_fits(got, shape):
            raise FlashgenError(f"{path.name}: tensor {name} has shape {list(got)}, the config implies {list(shape)}")
        if dtype not in dtypes:
            words = "a float tensor (F32, F16, BF16)" if dtypes == FLOAT_DTYPES else \
                " or ".join(DTYPE_WORDS[d] for d in dtypes) + " as its format stores"
            raise FlashgenError(f"{path.name}: tensor {name} is {dtype}, not {words}")
    extra = sorted(n for n in found if n not in want and not n.endswith(IGNORED_SUFFIXES)
                   and not (c.tie_word_embeddings and n == "lm_head.weight"))
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise FlashgenError(f"{found[extra[0]][0].name}: tensor {', '.join(extra[:3])}{more} is not in the model "
                            f"its config describes ({c.num_layers} layers, biases: qkv={c.qkv_bias}, o={c.o_bias}, "
                            f"mlp={c.mlp_bias}): the decoder would ignore it")
    embed = want["model.embed_tokens.weight"][0]
    if c.tie_word_embeddings and "lm_head.weight" in found and found["lm_head.weight"][2] != embed:
        raise FlashgenError(f"{found['lm_head.weight'][0].name}: tensor lm_head.weight has shape "
                            f"{list(found['lm_head.weight'][2])}, the config implies {list(embed)}")
    return found


def _check_index(index: dict[str, Path], found: dict[str, tuple[Path, str, tuple[int, ...]]]) -> None:
    """The index must say where every tensor is: one it names that its shard lacks means a shard of
    another save (or a cut-short one), and one it does not name is not part of the model it describes."""
    for name, path in sorted(index.items()):
        if name not in found:
            raise FlashgenError(f"model.safetensors.index.json names tensor {name} in {path.name}, which does "
                                "not hold it (a shard of another save, or one cut short?)")
        if found[name][0] != path:
            raise FlashgenError(f"model.safetensors.index.json names tensor {name} in {path.name}, but it is "
                                f"in {found[name][0].name}")
    unnamed = sorted(set(found) - set(index))
    if unnamed:
        raise FlashgenError(f"{found[unnamed[0]][0].name} holds tensor {unnamed[0]}, which "
                            "model.safetensors.index.json does not name")


def load_weights(folder: str | Path, config: ModelConfig | None = None,
                 take: Callable[[str], tuple[slice, ...] | None] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by name (model.safetensors, or the shards its index names), checked
    against its config (the folder's, unless given) before anything is read. `take`, where given, says
    which part of each tensor to read (None: all of it), so a rank of a split model reads its own."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    folder = Path(folder)
    c = config or ModelConfig.from_folder(folder)
    shards = sorted({p for p, _, _ in check_weights(folder, c).values()})
    out: dict[str, torch.Tensor] = {}
    for path in shards:
        try:
            if take is None:
                got = load_file(str(path))
            else:
                with safe_open(str(path), framework="pt") as f:
                    got = {}
                    for name in f.keys():
                        index = take(name)
                        got[name] = f.get_tensor(name) if index is None else f.get_slice(name)[index]
        except (SafetensorError, OSError, ValueError) as e:
            raise FlashgenError(f"{path} is truncated or not a safetensors file ({e})") from None
        _check_finite(path, got)
        out.update(got)
    _check_tied(out, c, take)
    return out


def _check_finite(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Every float tensor finite: one NaN or infinity in a weight makes every logit NaN downstream, which
    greedy decoding turns into token 0 over and over, a wrong answer that looks like output. Checked in
    slices, so no copy of a whole tensor is made."""
    for name, t in tensors.items():
        if not t.is_floating_point():
            continue
        flat = t.reshape(-1)
        for part in flat.split(1 << 24):
            if not torch.isfinite(part.float() if t.element_size() == 1 else part).all():
                raise FlashgenError(f"{path.name}: tensor {name} holds NaN or infinite values: the decoder would "
                                    "compute NaN logits from it")


def _check_tied(out: dict[str, torch.Tensor], c: ModelConfig,
                take: Callable[[str], tuple[slice, ...] | None] | None) -> None:
    """A tied model whose files also store an lm_head must store the embedding there: the decoder computes
    logits with the embedding, so a different stored head would be silently ignored."""
    head = out.get("lm_head.weight")
    if not c.tie_word_embeddings or head is None:
        return
    index = take("lm_head.weight") if take is not None else None
    embed = out["model.embed_tokens.weight"]
    if not torch.equal(head, embed if index is None else embed[index]):
        raise FlashgenError("tensor lm_head.weight differs from model.embed_tokens.weight, but the config sets "
                            "tie_word_embeddings: the decoder would compute logits with the embedding and ignore "
                            "the stored head")
