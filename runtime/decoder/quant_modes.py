"""The decoder's linear modes, one class each: what a layer keeps of its weight (`prepare`, or a
checkpoint dialect's loader building the object from stored codes) and how a call computes with it
(`gemm` on a GPU, `cpu_product` on the CPU). runtime/decoder/linear.py runs the part every mode shares (the
norm and the gate that feed a linear, the residual it adds); nothing else asks which mode a layer is in.

Modes: bf16 (the weight as is), w8a16 and w4a16 (weight-only int8 / int4, RTN-quantized at load, int4
in groups of 128, 64 or 32 along K, the largest K allows, else per channel: `_group`), w8a8 (int8
weights and per-token dynamically quantized int8 activations), w4a8 (gemm_w4a8: 4-bit weights with
integer group scales on int8 tensor cores, activations as w8a8's; flashgen/quant.py `quantize_w4a8`), fp8
(e4m3 weights with per-channel scales and per-token dynamically quantized e4m3 activations: gemm_fp8,
sm_90), w4fp8 (w4a16's weights times per-token e4m3 activations on fp8 tensor cores: gemm_w4fp8, sm_90),
and mixed, which prepares
a w4a16, a w8a8 and a w4a8 linear, keeps those its layer shape's plan picks for some row count
(runtime/decoder/mixed.py `ModePlan`, `settle`) and lets each call take the one planned for its row
count; its two 4-bit linears hold the same codes, each packed in the layout its GEMM reads (w4a16's
scales are w4a8's two levels multiplied out, in the activation dtype). w4a8's codes are packed once, at
load, in gemm_w4a8's `lanes` layout (flashgen/quant.py `pack_int4_lanes`: one AND per four int8 lanes).

On the CPU torch multiplies (reported as a fallback): w8a8 and w4a8 as their GEMMs compute (activations
quantized per token by the generated dynamic_quant kernel, int8 products summed in int32, scaled per
token and per channel; w4a8's int8 operand is (u - 8) times its group scale), fp8 with its activations
quantized per token to e4m3 by the op's reference (the cpu target has no fp8), so that a CPU run
previews the GPU's numerics; the weight-only modes on the dequantized weight, a float32 weight reordered
once for oneDNN (`cpu_weight`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
import torch.nn.functional as F

from flashgen.errors import FlashgenError
from flashgen.ir import dtypes
from flashgen.oplib._common import quantize_ref
from flashgen.oplib.moe import INT4_GROUP, w4a8_expert
from flashgen.quant import W4A8Weight, pack_int4, pack_int4_lanes, quantize_fp8, quantize_rtn, quantize_w4a8


def cpu_weight(w: torch.Tensor) -> torch.Tensor:
    """A float32 CPU weight reordered for oneDNN (as torch.compile's CPU freezing does): `torch_linear`
    multiplies it 1.4-2.5x faster than F.linear does the plain tensor at 1-8 rows on these AMD EPYC
    cores, where MKL's GEMV is slow. Other weights as they are."""
    if w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2 and torch.backends.mkldnn.is_available():
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)
    return w


def torch_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T + bias in torch, w plain or reordered for oneDNN (`cpu_weight`)."""
    if not w.is_mkldnn:
        return F.linear(x, w, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, bias, "none", [], "")


def _on_cpu(w: torch.Tensor) -> bool:
    return w.device.type != "cuda"


INT4_GROUPS = (INT4_GROUP, 64, 32)  # a 4-bit weight's groups along K, the largest K allows first


def _group(k: int) -> int:
    """A 4-bit weight's group along K: the largest of INT4_GROUPS that divides K, else the whole row (per
    channel), so that a row's outliers set the step of its group, not of the whole row: SmolLM2's hidden
    size 576 (4.5 x 128) takes groups of 64, which took its W4A16 perplexity from +89% to +60% of bf16's
    (docs/results.md). Every int4 GEMM takes groups of 32 and 64; the forms that need a block of 128 k
    per scale (PTX-unpacked GEMV tiles, operand scaling, Gluon int4 tiles) are outside such a
    workload's ScheduleSpace."""
    return next((g for g in INT4_GROUPS if k % g == 0), k)


@dataclass
class QuantLinear:
    """One linear layer's weights in its mode. `weight` is what the CPU multiplies where the mode runs
    torch's float product there (the dequantized weight; bf16's own weight on every device)."""
    mode: ClassVar[str] = ""
    activations: ClassVar[str | None] = None  # the dtype activations are quantized to per token, if any
    fused: ClassVar[bool] = False             # whether its GEMMs take the feeding norm and gate (FUSED_MAX_ROWS)
    expert_weights: ClassVar[str | None] = None  # the moe ops' `weights` attr of its stacked experts, if they take it
    pack: ClassVar[str | None] = None  # its GEMM's `pack` attr (the weight layout it packs), where the op has one

    shape: tuple[int, int]  # [N, K]
    weight: torch.Tensor | None = field(default=None, kw_only=True)

    @classmethod
    def prepare(cls, w: torch.Tensor) -> QuantLinear:
        """The layer's weights for this mode, quantized where `w` lies (a GPU quantizes an 8B model in
        seconds). A GPU keeps only the quantized weights; the CPU keeps what `cpu_product` multiplies."""
        raise NotImplementedError

    @staticmethod
    def weight_bytes(dtype_bytes: int) -> float:
        """Bytes a decode step reads per weight element (scales included)."""
        raise NotImplementedError

    def choose(self, rows: int, chooser: Callable[[int, int, int], str] | None) -> QuantLinear:
        """The linear that computes a call of `rows` rows: itself (mixed picks one of its own)."""
        return self

    def settle(self, plan: Any, form: Any = None) -> QuantLinear:
        """The linear as the decoder keeps it, once `plan` (runtime/decoder/mixed.py `ModePlan`) has
        decided its modes for calls in `form` (runtime/decoder/linear.py `CallForm`; None: plain):
        itself (mixed keeps only the modes chosen)."""
        return self

    def gemm(self, ops: Any, x: torch.Tensor, prologue: str, args: dict[str, Any], epi: dict[str, Any]) -> torch.Tensor:
        """The generated GEMM of x (a GPU call): `prologue` names the fused norm or gate ("rmsnorm_",
        "silu_mul_" or ""), `args` holds x under its input name with the norm's weight and eps, `epi` the
        bias and residual."""
        raise NotImplementedError

    def cpu_product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W.T + bias on the CPU, computed as the mode's GEMM computes it."""
        return torch_linear(x, self.weight, bias)

    @property
    def cpu_fallback(self) -> str | None:
        """How the CPU computes this mode, for the decoder's fallbacks (None: as the GPU does)."""
        return f"{self.mode} linear (torch on the dequantized weight on cpu)"

    @classmethod
    def stacked_format(cls, hidden: int, intermediate: int) -> str | None:
        """The moe ops' `weights` attr for experts in this mode, or None where they have no stacked form."""
        return cls.expert_weights

    @classmethod
    def expert(cls, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """An expert linear's tensors as the moe ops take them (modes with a stacked form), quantized as
        the mode's dense linear is."""
        return cls.prepare(w).expert_fields()

    def expert_fields(self) -> dict[str, torch.Tensor]:
        """This linear's tensors as the moe ops take them (modes with a stacked form)."""
        raise NotImplementedError


@dataclass
class Bf16Linear(QuantLinear):
    """The weight as it is, in the decoder's dtype."""
    mode: ClassVar[str] = "bf16"
    fused: ClassVar[bool] = True
    expert_weights: ClassVar[str | None] = "half"

    @classmethod
    def prepare(cls, w: torch.Tensor) -> Bf16Linear:
        return cls((w.shape[0], w.shape[1]), weight=cpu_weight(w))

    @staticmethod
    def weight_bytes(dtype_bytes: int) -> float:
        return float(dtype_bytes)

    def gemm(self, ops, x, prologue, args, epi):
        return getattr(ops, prologue + "gemm")(w=self.weight, **args)

    @property
    def cpu_fallback(self) -> str | None:
        return None

    def expert_fields(self) -> dict[str, torch.Tensor]:
        return {"w": self.weight}


@dataclass
class W8A16Linear(QuantLinear):
    """int8 codes with per-channel fp32 scales; activations in the decoder's dtype."""
    mode: ClassVar[str] = "w8a16"
    expert_weights: ClassVar[str | None] = "w8a16"
    w8: torch.Tensor | None = None        # int8 [N, K]
    w8_scale: torch.Tensor | None = None  # fp32 [N]

    @classmethod
    def prepare(cls, w: torch.Tensor) -> W8A16Linear:
        q8 = quantize_rtn(w, bits=8)
        return cls((w.shape[0], w.shape[1]), q8.codes, q8.scales[:, 0].contiguous(),
                   weight=cpu_weight(q8.dequantize().to(w.dtype)) if _on_cpu(w) else None)

    @staticmethod
    def weight_bytes(dtype_bytes: int) -> float:
        return 1.0

    def gemm(self, ops, x, prologue, args, epi):
        return getattr(ops, prologue + "gemm_w8a16")(w=self.w8, w_scale=self.w8_scale, **args)

    def expert_fields(self) -> dict[str, torch.Tensor]:
        return {"w_q": self.w8, "w_scale": self.w8_scale}


@dataclass
class W4A16Linear(QuantLinear):
    """Packed int4 codes with group scales in the activation dtype (zero points and an act-order
    permutation where a pre-quantized checkpoint has them)."""
    mode: ClassVar[str] = "w4a16"
    w4: torch.Tensor | None = None         # int32 [N, packed_words(K)] (flashgen/quant.py)
    w4_scales: torch.Tensor | None = None  # [N, K / group], the activation dtype
    group: int = 0
    w4_zeros: torch.Tensor | None = None   # int8 [N, K / group]: zero points (a pre-quantized checkpoint's)
    perm: torch.Tensor | None = None       # act-order: the k order of the packed codes, x gathered so first

    @classmethod
    def prepare(cls, w: torch.Tensor) -> W4A16Linear:
        group = _group(w.shape[1])
        q4 = quantize_rtn(w, bits=4, group=group)
        return cls((w.shape[0], w.shape[1]), pack_int4(q4.codes), q4.scales.to(w.dtype), group,
                   weight=cpu_weight(q4.dequantize().to(w.dtype)) if _on_cpu(w) else None)

    @staticmethod
    def weight_bytes(dtype_bytes: int) -> float:
        return 0.5 + dtype_bytes / INT4_GROUP

    def gemm(self, ops, x, prologue, args, epi):
        n, k = self.shape
        if self.perm is not None:  # (no norm nor gate fused here: they ran before, ahead of the gather)
            name = "xg" if prologue == "silu_mul_" else "x"
            args = {**args, name: args[name].index_select(1, self.perm)}
        zp = {"zp": "asym", "zeros": self.w4_zeros} if self.w4_zeros is not None else {}
        return getattr(ops, prologue + "gemm_w4a16")(w_packed=self.w4, scales=self.w4_scales,
                                                      group="group" if self.group != k else "channel",
                                                      dims=[x.shape[0], n, k, self.group], **zp, **args)

    @classmethod
    def stacked_format(cls, hidden: int, intermediate: int) -> str | None:
        return "w4a16g128" if hidden % INT4_GROUP == 0 and intermediate % INT4_GROUP == 0 else None

    def expert_fields(self) -> dict[str, torch.Tensor]:
        return {"w_packed": self.w4, "scales": self.w4_scales}


@dataclass
class _QuantizedActivations(QuantLinear):
    """Modes whose activations are quantized per token before the GEMM: on a GPU by the generated
    rmsnorm_quant (the norm in the same kernel) or dynamic_quant kernel; norms and gates never fuse."""

    def gemm(self, ops, x, prologue, args, epi):
        norm = args.get("norm_w")
        if norm is not None:
            xq, xs = ops.rmsnorm_quant(x, norm, args["eps"], out_dtype=self.activations)
        else:
            xq, xs = ops.dynamic_quant(x, out_dtype=self.activations)
        return self.quantized_gemm(ops, xq, xs, dtypes.of_torch(x.dtype), epi)

    def quantized_gemm(self, ops, xq: torch.Tensor, xs: torch.Tensor, dtype: str, epi: dict[str, Any]) -> torch.Tensor:
        raise NotImplementedError

    @property
    def cpu_fallback(self) -> str | None:
        a = self.activations
        return f"{self.mode} linear (torch on {a} product of per-token {a} activations on cpu)"

    def int8_operand(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 weight and its per-channel scale the CPU's integer product takes."""
        raise NotImplementedError

    def cpu_product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """gemm_w8a8's (and gemm_w4a8's) y = (x_int8 @ w_int8.T) * x_scale[m] * w_scale[n] + bias in torch,
        x quantized per token by the generated dynamic_quant kernel, the sums exact in int32 as on a GPU
        (torch._int_mm: oneDNN's int8 GEMM)."""
        xq, xs = torch.ops.flashgen.dynamic_quant(x, out_dtype="int8")
        w8, scale = self.int8_operand()
        y = torch._int_mm(xq, w8.t()) * xs[:, None] * scale
        return (y if bias is None else y + bias).to(x.dtype)


@dataclass
class W8A8Linear(_QuantizedActivations):
    """int8 codes with per-channel scales, times int8 activations quantized per token."""
    mode: ClassVar[str] = "w8a8"
    activations: ClassVar[str | None] = "int8"
    expert_weights: ClassVar[str | None] = "w8a8"
    w8: torch.Tensor | None = None        # int8 [N, K]
    w8_scale: torch.Tensor | None = None  # fp32 [N]

    @classmethod
    def prepare(cls, w: torch.Tensor) -> W8A8Linear:
        q8 = quantize_rtn(w, bits=8)
        return cls((w.shape[0], w.shape[1]), q8.codes, q8.scales[:, 0].contiguous())

    @staticmethod
    def weight_bytes(dtype_bytes: int) -> float:
        return 1.0

    def expert_fields(self) -> dict[str, torch.Tensor]:
        return {"w_q": self.w8, "w_scale": self.w8_scale}

    def quantized_gemm(self, ops, xq, xs, dtype, epi):
        return ops.gemm_w8a8(xq, xs, self.w8, self.w8_scale, dtype=dtype, **epi)

    def int8_operand(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w8, self.w8_scale


@dataclass
class W4A8Linear(_QuantizedActivations):
    """int4 codes packed in gemm_w4a8's `lanes` layout with a per-channel fp32 scale and int8 group
    scales in 1..16 (None: per channel), on int8 tensor cores; the CPU keeps the int8 operand
    (u - 8) * group scale."""
    mode: ClassVar[str] = "w4a8"
    activations: ClassVar[str | None] = "int8"
    pack: ClassVar[str] = "lanes"  # the layout of `w4` (gemm_w4a8's `pack` attr)
    w4: torch.Tensor | None = None          # int32 [N, packed_words(K)], pack_int4_lanes
    w4a8_scale: torch.Tensor | None = None  # fp32 [N]
    w4a8_group: torch.Tensor | None = None  # int8 [N, K / group] in 1..16 (None: per channel)
    group: int = 0
    w4a8_int8: torch.Tensor | None = None   # int8 [N, K], cpu only: the operand (u - 8) * group scale

    @classmethod
    def prepare(cls, w: torch.Tensor) -> W4A8Linear:
        return cls.of_codes(quantize_w4a8(w, _group(w.shape[1])))

    @classmethod
    def of_codes(cls, qa: W4A8Weight) -> W4A8Linear:
        """The layer of quantized codes (u in 0..15, zero point 8), packed once for gemm_w4a8; on the
        CPU, the int8 operand its product takes."""
        return cls(tuple(qa.codes.shape), pack_int4_lanes(qa.codes), qa.channel_scales, qa.group_scales, qa.group,
                   qa.operand() if _on_cpu(qa.codes) else None)

    @staticmethod
    def weight_bytes(dtype_bytes: int) -> float:
        return 0.5 + 1 / INT4_GROUP

    @classmethod
    def stacked_format(cls, hidden: int, intermediate: int) -> str | None:
        return "w4a8g128" if hidden % INT4_GROUP == 0 and intermediate % INT4_GROUP == 0 else None

    @classmethod
    def expert(cls, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """quantize_w4a8's codes in groups of 128 in pack_int4's layout (the moe ops' own, whatever
        layout the dense gemm_w4a8 reads), with the int8 group scales and the per-row scale."""
        return w4a8_expert(w)

    def quantized_gemm(self, ops, xq, xs, dtype, epi):
        n, k = self.shape
        grouped = self.w4a8_group is not None
        return ops.gemm_w4a8(xq, xs, self.w4, self.w4a8_scale, **({"w_group": self.w4a8_group} if grouped else {}),
                             group="group" if grouped else "channel", pack=self.pack, dims=[xq.shape[0], n, k, self.group],
                             dtype=dtype, **epi)

    def int8_operand(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w4a8_int8, self.w4a8_scale


@dataclass
class _Fp8Activations(_QuantizedActivations):
    """Modes whose activations are quantized per token to e4m3 (sm_90); the CPU keeps the dequantized
    weight."""
    activations: ClassVar[str | None] = "fp8e4m3"

    def cpu_product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x quantized per token to e4m3 by dynamic_quant's reference (the cpu target has no fp8), times
        the dequantized weight in float32."""
        xq, xs = quantize_ref(x.float(), "fp8e4m3")
        return torch_linear((xq * xs[:, None]).to(x.dtype), self.weight, bias)


@dataclass
class Fp8Linear(_Fp8Activations):
    """e4m3 weights with per-channel scales, times e4m3 activations quantized per token (sm_90)."""
    mode: ClassVar[str] = "fp8"
    f8: torch.Tensor | None = None        # float8_e4m3fn [N, K]
    f8_scale: torch.Tensor | None = None  # fp32 [N]

    @classmethod
    def prepare(cls, w: torch.Tensor) -> Fp8Linear:
        qf = quantize_fp8(w)
        return cls((w.shape[0], w.shape[1]), qf.values, qf.scales,
                   weight=cpu_weight(qf.dequantize().to(w.dtype)) if _on_cpu(w) else None)

    @staticmethod
    def weight_bytes(dtype_bytes: int) -> float:
        return 1.0

    def quantized_gemm(self, ops, xq, xs, dtype, epi):
        return ops.gemm_fp8(xq, xs, self.f8, self.f8_scale, dtype=dtype, **epi)


@dataclass
class W4Fp8Linear(_Fp8Activations):
    """w4a16's weights (int4 codes packed as pack_int4 does, group scales in the activation dtype),
    times e4m3 activations quantized per token, on fp8 tensor cores (gemm_w4fp8, sm_90): each group's
    fp32 sum times its scale."""
    mode: ClassVar[str] = "w4fp8"
    w4: W4A16Linear | None = None  # the codes and scales, as w4a16 keeps them

    @classmethod
    def prepare(cls, w: torch.Tensor) -> W4Fp8Linear:
        q = W4A16Linear.prepare(w)
        return cls(q.shape, q, weight=q.weight)

    @staticmethod
    def weight_bytes(dtype_bytes: int) -> float:
        return W4A16Linear.weight_bytes(dtype_bytes)

    def quantized_gemm(self, ops, xq, xs, dtype, epi):
        n, k = self.shape
        q = self.w4
        return ops.gemm_w4fp8(xq, xs, q.w4, q.w4_scales, group="group" if q.group != k else "channel",
                              dims=[xq.shape[0], n, k, q.group], dtype=dtype, **epi)


@dataclass
class MixedLinear(QuantLinear):
    """A w4a16, a w8a8 and a w4a8 linear of one weight (those of them its plan picks, once settled), the
    two 4-bit ones of the same codes (each in its GEMM's layout); each call computes in the one its
    chooser picks for its row count (w4a16 without a chooser)."""
    mode: ClassVar[str] = "mixed"
    choices: dict[str, QuantLinear] = field(default_factory=dict)  # by mode: w4a16, w8a8, w4a8

    @classmethod
    def prepare(cls, w: torch.Tensor) -> MixedLinear:
        shape, group, cpu = (w.shape[0], w.shape[1]), _group(w.shape[1]), _on_cpu(w)
        qa = quantize_w4a8(w, group)
        levels = qa.channel_scales[:, None] * (qa.group_scales.float() if qa.group_scales is not None else 1.0)
        w4a16 = W4A16Linear(shape, pack_int4(qa.codes), levels.to(w.dtype), group,
                            weight=cpu_weight(qa.dequantize().to(w.dtype)) if cpu else None)
        return cls(shape, {"w4a16": w4a16, "w8a8": W8A8Linear.prepare(w), "w4a8": W4A8Linear.of_codes(qa)})

    @staticmethod
    def weight_bytes(dtype_bytes: int) -> float:
        return W4A16Linear.weight_bytes(dtype_bytes)  # (what a decode step reads: small M runs a 4-bit mode)

    def choose(self, rows, chooser):
        mode = chooser(*self.shape, rows) if chooser else "w4a16"
        if mode not in self.choices:
            raise FlashgenError(f"mixed {self.shape[0]}x{self.shape[1]} linear: {mode} was chosen for {rows} rows, "
                                f"but it keeps {', '.join(self.choices)} only")
        return self.choices[mode]

    def settle(self, plan, form=None):
        """Only the modes `plan` picks for this shape at some row count: a layer that never runs w8a8
        keeps no int8 weight, one that never runs w4a8 no w4a8 scales (the codes stay w4a16's)."""
        used = plan.plan(self.choices, form)
        return MixedLinear(self.shape, {mode: q for mode, q in self.choices.items() if mode in used})

    # Experts run its w4a16 linear at every row count (the grouped GEMMs have no chooser): a decode
    # step's few pairs per expert are where w4a16 is chosen for dense linears too.
    @classmethod
    def stacked_format(cls, hidden: int, intermediate: int) -> str | None:
        return W4A16Linear.stacked_format(hidden, intermediate)

    def expert_fields(self) -> dict[str, torch.Tensor]:
        return self.choices["w4a16"].expert_fields()


MODES: dict[str, type[QuantLinear]] = {cls.mode: cls for cls in (Bf16Linear, W8A16Linear, W4A16Linear, W8A8Linear,
                                                                  W4A8Linear, Fp8Linear, W4Fp8Linear, MixedLinear)}


def quant_mode(name: str) -> type[QuantLinear]:
    """The class of the mode named `name` (what --quant and Decoder(quant=) take)."""
    if name not in MODES:
        raise FlashgenError(f"unknown quantization mode {name!r}; valid: {', '.join(MODES)}")
    return MODES[name]


def prepare(w: torch.Tensor, mode: str) -> QuantLinear:
    """The layer's weights for `mode` (`QuantLinear.prepare`)."""
    return quant_mode(mode).prepare(w)
