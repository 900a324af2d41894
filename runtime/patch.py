"""`flashgen.patch(model, quant=...)`: flashgen's ops inside a transformers Llama, Mistral, Qwen2 or Qwen3
model, for inference, in one call.

What it replaces, per model instance, by module (the model's own classes, found in its modeling module):
- every RMSNorm (the layers' two, the final one, Qwen3's q_norm and k_norm) by `torch.ops.flashgen.rmsnorm`
  on the same weight;
- every MLP by one gate|up linear whose output feeds silu_mul, then the down linear (`gated`: on a GPU at
  one row, silu_mul runs inside the down GEMM), as the decoder's MLP runs (runtime/decoder/linear.py);
- every decoder layer by a `FusedDecoderLayer` holding its (patched) norms, attention and MLP, whose two
  residual adds run fused: the attention's with the post-attention norm (`add_rmsnorm`), the MLP's as the
  down linear's epilogue. The residual adds are lines of the layer's forward, not modules, so the layer
  is replaced whole, its forward written from the data flow the four architectures share; a layer with
  other children than those four (a future extra norm) keeps its own forward;
- the attention's q, k, v and o projections by linears in the chosen mode (runtime/decoder/quant_modes.py:
  each mode quantizes its weights at patch time, on the weight's device). The lm_head stays as it is, as
  in the decoder;
- the rotary embedding module by a fixed cos/sin table (computed once by the original module, so every
  rope type with fixed frequencies is served as transformers computes it), which it hands to attention in
  place of per-call cos and sin, with the positions; attention's `apply_rotary_pos_emb` is a function of
  the modeling module that it looks up at each call, so that function is replaced there, by one that runs
  `torch.ops.flashgen.rope` when given a table and positions and the original otherwise: models of the
  same architecture that are not patched compute as before. The original is put back when the last
  patched model of its module is unpatched.

The table has `max_position_embeddings` rows: a position past it is refused (a FlashgenError in eager
mode; an assertion on the device inside torch.compile), never rotated by a row that is not its own.
The returned `Patch` maps each replaced module's name to what it became and keeps the replaced modules,
so that `unpatch()` can put them back: drop it to free the float weights of a quantized patch. Patch
after the model has its device and dtype: the quantized weights are not parameters and do not follow
`model.to()`.
"""
from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Iterator, Mapping
from typing import Any, Callable

import torch
from torch import nn

from flashgen.errors import FlashgenError
from flashgen.ir import dtypes
from flashgen.runtime.decoder.linear import CallForm, apply
from flashgen.runtime.decoder.mixed import ModePlan
from flashgen.runtime.decoder.quant_modes import QuantLinear, quant_mode
from flashgen.runtime.serving.torch_ops import dispatcher, register_all
from flashgen.targets.device import device_target

ARCHITECTURES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}  # model_type -> class prefix
DEVICES = ("cpu", "cuda")  # (ROCm tensors report cuda)
# a decoder layer's children that FusedDecoderLayer computes with, and the class suffix of each
LAYER_CHILDREN = {"input_layernorm": "RMSNorm", "self_attn": "Attention", "post_attention_layernorm": "RMSNorm",
                  "mlp": "MLP"}
_PATCHED_ROPE: dict[str, tuple[Callable, int]] = {}  # modeling module -> (its original rope function, patched models)


class PatchedRMSNorm(nn.Module):
    """An RMSNorm of the last axis as `torch.ops.flashgen.rmsnorm`, on the replaced module's weight."""

    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.flashgen.rmsnorm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)


class PatchedLinear(nn.Module):
    """A linear in a quant mode (`QuantLinear`), run by runtime/decoder/linear.py's `apply` on the
    flattened rows of its input; `gated` takes x = [g | u] and multiplies silu(g) * u."""

    def __init__(self, q: QuantLinear, bias: torch.Tensor | None, chooser: ModePlan, fallbacks: set[str],
                 gated: bool = False):
        super().__init__()
        self.q, self.bias, self.chooser, self.fallbacks, self.gated = q, bias, chooser, fallbacks, gated

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """y = linear(x) (+ `residual`, of y's shape, added in the GEMM's epilogue)."""
        rows = None if residual is None else residual.reshape(-1, residual.shape[-1])
        y = apply(x.reshape(-1, x.shape[-1]), self.q, self.bias, self.fallbacks, self.chooser, gated=self.gated,
                  residual=rows)
        return y.view(*x.shape[:-1], y.shape[-1])

    def extra_repr(self) -> str:
        return f"{self.q.mode}, out_features={self.q.shape[0]}, in_features={self.q.shape[1]}, gated={self.gated}"


class PatchedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) as one gate|up linear and a gated down linear."""

    def __init__(self, gate_up: PatchedLinear, down: PatchedLinear):
        super().__init__()
        self.gate_up, self.down = gate_up, down

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.down(self.gate_up(x), residual=residual)


class FusedDecoderLayer(nn.Module):
    """A decoder layer (pre-norm attention, then pre-norm MLP, each added to the residual stream) whose
    residual adds run fused: `add_rmsnorm` gives the attention's sum and its post-attention norm in one
    kernel, and the down linear adds the MLP's in its epilogue. It holds the replaced layer's children
    under their names; attention gets the layer's keyword arguments as the layer got them (its cache,
    mask, positions, a sliding window), and the layer returns the new residual stream as the model's
    loop takes it."""

    def __init__(self, input_layernorm: PatchedRMSNorm, self_attn: nn.Module, post_attention_layernorm: PatchedRMSNorm,
                 mlp: PatchedMLP):
        super().__init__()
        self.input_layernorm, self.self_attn = input_layernorm, self_attn
        self.post_attention_layernorm, self.mlp = post_attention_layernorm, mlp

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        a = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)[0]
        norm = self.post_attention_layernorm
        h, x = torch.ops.flashgen.add_rmsnorm(a.reshape(-1, a.shape[-1]), hidden_states.reshape(-1, a.shape[-1]),
                                              norm.weight, norm.eps)
        return self.mlp(h.view(a.shape), residual=x.view(a.shape))


class RotaryTable(nn.Module):
    """In place of a rotary embedding module: the cos/sin table the rope op reads ([L, D] fp32: cos then
    sin of each position's first D/2 angles) and the positions, as the `(cos, sin)` pair attention takes."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.register_buffer("table", table, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.table.shape[0]
        if torch.compiler.is_compiling():
            torch._assert_async((position_ids < rows).all(), "flashgen.patch: a position is past the rope table")
        elif position_ids.numel() and int(position_ids.max()) >= rows:
            raise FlashgenError(f"position {int(position_ids.max())} is past the rope table of the model's "
                                f"max_position_embeddings={rows} positions")
        return self.table, position_ids


def rope(q: torch.Tensor, k: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, S, D] and k [B, Hkv, S, D] (transformers' layout) rotated by `torch.ops.flashgen.rope`
    at `positions` ([B or 1, S]) of `table`."""
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    qo, ko = torch.ops.flashgen.rope(q.transpose(1, 2).reshape(b * s, hq, d), k.transpose(1, 2).reshape(b * s, hkv, d),
                                     positions.expand(b, s).reshape(-1), table.to(q.device))
    return qo.view(b, s, hq, d).transpose(1, 2), ko.view(b, s, hkv, d).transpose(1, 2)


def _rope_or(original: Callable) -> Callable:
    """A modeling module's `apply_rotary_pos_emb` that runs `rope` for a patched model (whose RotaryTable
    passes a table and integer positions as cos and sin) and `original` for any other."""
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if sin.is_floating_point():
            return original(q, k, cos, sin, *args, **kwargs)
        if args or kwargs:
            raise FlashgenError("flashgen.patch: apply_rotary_pos_emb was called with an unsqueeze_dim; "
                                "patched attention passes q and k as [batch, heads, tokens, head_dim]")
        return rope(q, k, cos, sin)
    return apply_rotary_pos_emb


class Patch(Mapping):
    """What `patch` replaced: module name -> what it became. `fallbacks` names what computes in torch
    instead of a generated kernel (a CPU's linears), once the model has run; `unpatch()` puts every
    replaced module back."""

    def __init__(self, model: nn.Module, modeling: str, replaced: dict[str, str], originals: dict[str, nn.Module],
                 fallbacks: set[str]):
        self.model, self.modeling, self.replaced, self.originals = model, modeling, replaced, originals
        self._fallbacks = fallbacks

    def __getitem__(self, name: str) -> str:
        return self.replaced[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.replaced)

    def __len__(self) -> int:
        return len(self.replaced)

    def __repr__(self) -> str:
        return f"Patch({len(self.originals)} modules of {type(self.model).__name__}: {self.replaced})"

    @property
    def fallbacks(self) -> list[str]:
        return sorted(self._fallbacks)

    def unpatch(self) -> None:
        """The model as it was before `patch` (its original modules, the modeling module's rope function
        once no other patched model uses it)."""
        if not self.originals:
            raise FlashgenError(f"this patch of {type(self.model).__name__} was undone already")
        for name, module in reversed(self.originals.items()):  # (a layer before the children patched in it)
            _set_submodule(self.model, name, module)
        self.originals = {}
        original, users = _PATCHED_ROPE.pop(self.modeling)
        if users > 1:
            _PATCHED_ROPE[self.modeling] = (original, users - 1)
        else:
            sys.modules[self.modeling].apply_rotary_pos_emb = original


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def _classes(model: nn.Module) -> tuple[str, dict[str, type]]:
    """The model's modeling module and its RMSNorm, MLP, Attention, RotaryEmbedding and DecoderLayer
    classes; refuses a model that is not one of ARCHITECTURES."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ARCHITECTURES:
        raise FlashgenError(f"flashgen.patch takes transformers {', '.join(ARCHITECTURES)} models, not "
                            f"{type(model).__name__} (model_type {model_type!r})")
    name = f"transformers.models.{model_type}.modeling_{model_type}"
    modeling = importlib.import_module(name)
    prefix = ARCHITECTURES[model_type]
    return name, {kind: getattr(modeling, prefix + kind) for kind in
                  ("RMSNorm", "MLP", "Attention", "RotaryEmbedding", "DecoderLayer")}


def _fusable(layer: nn.Module, cls: dict[str, type]) -> bool:
    """Whether `layer`'s children are exactly the norms, attention and MLP that FusedDecoderLayer computes
    with (LAYER_CHILDREN, of the model's own classes)."""
    children = dict(layer.named_children())
    return children.keys() == LAYER_CHILDREN.keys() and all(isinstance(children[n], cls[k])
                                                            for n, k in LAYER_CHILDREN.items())


def _output_hooks(model: nn.Module, layer: str) -> None:
    """Installs now the hooks by which transformers records each decoder layer's output
    (`output_hidden_states`), where this version records so: the layer's model (the nearest
    PreTrainedModel above it, whose forward records) puts them on the modules of the layer's class at
    its first call that asks, and a FusedDecoderLayer is not of that class, so they are made here and
    carried over (`_carry_hooks`). Installed once per model (transformers marks it)."""
    try:
        from transformers import PreTrainedModel
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # (a version that records outputs otherwise)
        return
    parts = layer.split(".")
    above = (model.get_submodule(".".join(parts[:i])) for i in range(len(parts) - 1, -1, -1))
    maybe_install_capturing_hooks(next(m for m in above if isinstance(m, PreTrainedModel)))


def _carry_hooks(layer: nn.Module, fused: nn.Module) -> None:
    """`fused` runs `layer`'s forward hooks (the layer keeps them, for unpatch)."""
    for hooks in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                  "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
        getattr(fused, hooks).update(getattr(layer, hooks))


def _check_tensors(modules: dict[str, nn.Module], mode: type[QuantLinear]) -> None:
    """Each tensor the patched modules compute with lies on a device and in a dtype flashgen's kernels run
    (and, on a GPU, the mode's activations are a dtype its target has), all in one dtype (an op's inputs
    share theirs): else one line naming it."""
    first: tuple[str, torch.dtype] | None = None
    for name, module in modules.items():
        for pname, t in module.named_parameters():
            where = f"{name}.{pname} is {str(t.dtype).removeprefix('torch.')} on {t.device}"
            first = first or (f"{name}.{pname}", t.dtype)
            if t.dtype != first[1]:
                raise FlashgenError(f"flashgen.patch: {where}, {first[0]} {str(first[1]).removeprefix('torch.')}; "
                                    f"the ops take their inputs in one dtype")
            if t.device.type not in DEVICES:
                raise FlashgenError(f"flashgen.patch: {where}; flashgen's kernels run on the CPU and on GPUs")
            target = device_target(t.device)
            dt = next((n for n, d in dtypes.TORCH.items() if d == t.dtype), None)
            if dt not in target.dtypes or not dtypes.is_float(dt):
                floats = ", ".join(d for d in target.dtypes if d in dtypes.FLOAT)
                raise FlashgenError(f"flashgen.patch: {where}; flashgen's kernels compute in {floats} there")
            if t.device.type != "cpu" and mode.activations is not None and mode.activations not in target.dtypes:
                raise FlashgenError(f"flashgen.patch: {mode.mode} quantizes activations to {mode.activations}, "
                                    f"which {target.id} ({name}) does not compute in")


def _linear(linears: list[nn.Linear], mode: type[QuantLinear], plans: dict, fallbacks: set[str],
            gated: bool = False) -> PatchedLinear:
    """One PatchedLinear of `linears` stacked along their outputs, its weight quantized in `mode` as the
    decoder's are (`QuantLinear.prepare`, `settle` in the form a fused layer calls it: a gated linear is
    the down linear, which adds the residual)."""
    w = torch.cat([lin.weight.detach() for lin in linears]) if len(linears) > 1 else linears[0].weight.detach()
    key = (w.device, w.dtype)
    if key not in plans:
        plans[key] = ModePlan(dispatcher().target_for(w.device), dispatcher().db_path, w.dtype)
    bias = torch.cat([lin.bias.detach() for lin in linears]) if linears[0].bias is not None else None
    form = CallForm(gated=gated, residual=gated, bias=bias is not None)
    return PatchedLinear(mode.prepare(w).settle(plans[key], form), bias, plans[key], fallbacks, gated)


def patch(model: nn.Module, quant: str = "bf16") -> Patch:
    """Run `model`'s RMSNorms, rotary embedding, SiLU-mul and decoder-layer linears on flashgen's ops,
    the linears in mode `quant` (bf16: the weights as they are, in the model's dtype; w8a16, w4a16, w8a8,
    w4a8, fp8, mixed: quantized here). Inference only. Returns what it replaced (`Patch`)."""
    if not isinstance(model, nn.Module):
        raise FlashgenError(f"flashgen.patch takes a transformers model, not {type(model).__name__}")
    modeling, cls = _classes(model)
    if model.training:
        raise FlashgenError("flashgen.patch is for inference: the model is in training mode (call model.eval() first)")
    mode = quant_mode(quant)
    ours = (PatchedRMSNorm, PatchedMLP, PatchedLinear, RotaryTable, FusedDecoderLayer)
    if any(isinstance(m, ours) for m in model.modules()):
        raise FlashgenError(f"{type(model).__name__} is patched already: unpatch it first")
    found = {kind: {n: m for n, m in model.named_modules() if isinstance(m, c)} for kind, c in cls.items()}
    if model.config.hidden_act != "silu":
        raise FlashgenError(f"flashgen.patch runs SiLU MLPs; this model's activation is {model.config.hidden_act}")
    for rot in found["RotaryEmbedding"].values():
        if "dynamic" in rot.rope_type or rot.rope_type == "longrope":
            raise FlashgenError(f"rope_type {rot.rope_type} changes its frequencies with the sequence length; "
                                f"flashgen.patch serves rope from a fixed table")
    projections = {f"{n}.{p}": getattr(att, p) for n, att in found["Attention"].items()
                   for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    _check_tensors({**found["RMSNorm"], **found["MLP"], **projections}, mode)
    register_all()

    new: dict[str, nn.Module] = {}
    replaced: dict[str, str] = {}
    plans: dict = {}
    fallbacks: set[str] = set()
    with torch.no_grad():
        for name, norm in found["RMSNorm"].items():
            new[name], replaced[name] = PatchedRMSNorm(norm.weight, norm.variance_epsilon), "rmsnorm"
        for name, mlp in found["MLP"].items():
            gate_up = _linear([mlp.gate_proj, mlp.up_proj], mode, plans, fallbacks)
            new[name] = PatchedMLP(gate_up, _linear([mlp.down_proj], mode, plans, fallbacks, gated=True))
            replaced[name] = f"silu_mul, gate_proj|up_proj and down_proj as {mode.mode} linears"
        for name, lin in projections.items():
            new[name], replaced[name] = _linear([lin], mode, plans, fallbacks), f"{mode.mode} linear"
        for name, rot in found["RotaryEmbedding"].items():
            dev = rot.inv_freq.device
            positions = torch.arange(model.config.max_position_embeddings, device=dev)[None]
            cos, sin = rot(torch.empty(0, device=dev), positions)  # (float32: x gives only the device and dtype)
            half = cos.shape[-1] // 2
            new[name] = RotaryTable(torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1).float().contiguous())
            replaced[name] = f"rope table of {cos.shape[1]} positions"
    for name, layer in found["DecoderLayer"].items():
        if _fusable(layer, cls):
            _output_hooks(model, name)
            children = (new.get(f"{name}.{child}", getattr(layer, child)) for child in LAYER_CHILDREN)
            new[name] = FusedDecoderLayer(*children)
            _carry_hooks(layer, new[name])
            replaced[name] = "add_rmsnorm after attention, the MLP's residual added in the down linear's epilogue"
    originals = {name: model.get_submodule(name) for name in new}
    for name, module in new.items():
        _set_submodule(model, name, module)
    original, users = _PATCHED_ROPE.get(modeling, (sys.modules[modeling].apply_rotary_pos_emb, 0))
    _PATCHED_ROPE[modeling] = (original, users + 1)
    if not users:
        sys.modules[modeling].apply_rotary_pos_emb = _rope_or(original)
    replaced[f"{modeling}.apply_rotary_pos_emb"] = "rope for patched models (others run the original)"
    return Patch(model, modeling, replaced, originals, fallbacks)
