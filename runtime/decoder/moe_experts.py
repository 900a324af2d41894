"""A MoE layer's experts stacked in the moe ops' layouts (flashgen/oplib/moe.py), in the decoder's
quantization mode, so that the generated grouped GEMMs run them whatever the mode allows, and the two
grouped GEMMs' call.

Each expert is quantized as a dense linear would be (its mode's `expert`, runtime/decoder/quant_modes.py:
the same RTN codes and scales), then the experts' tensors are stacked along a new first axis: gate|up
[E, 2I, H] and down [E, H, I] as 16-bit weights, int8 codes with per-row fp32 scales (w8a16, w8a8),
packed int4 codes with group-128 scales (w4a16; mixed, whose experts run its w4a16 linear), or packed
4-bit codes with int8 group-128 scales and per-row fp32 scales (w4a8). Modes the moe ops do not take
(fp8, int4 of a width that is not a multiple of the group) have no stacked form: the decoder runs those
experts in torch.

Modes with int8 activations quantize them per row with the generated dynamic_quant kernel, as their
dense linears do: x once per token, before any of its k pairs gathers it (a pair's row is its token's,
so quantizing per pair would repeat the same work k times for the same codes), and h per pair (each
pair's SiLU(gate) * up row is its own).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from flashgen.ir import dtypes
from flashgen.runtime.decoder.quant_modes import QuantLinear

Stacked = dict[str, torch.Tensor]  # the moe op's weight inputs by name (w; w_q, w_scale; w_packed, scales, ...)


def stack_experts(experts: list[tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]],
                  mode: type[QuantLinear]) -> tuple[Stacked, Stacked]:
    """gate|up and down of every expert in `mode` (one with a stacked form: `QuantLinear.stacked_format`),
    stacked; `experts` gives each expert's gate|up [2I, H] and down [H, I] float weights as calls, so that
    each is made (and let go) only while it is quantized."""
    ups: list[Stacked] = []
    downs: list[Stacked] = []
    for gate_up, down in experts:
        ups.append(mode.expert(gate_up()))
        downs.append(mode.expert(down()))
    return ({k: torch.stack([u[k] for u in ups]) for k in ups[0]},
            {k: torch.stack([d[k] for d in downs]) for k in downs[0]})


def _activation(ops: Any, name: str, x: torch.Tensor, quantized: str | None) -> dict[str, torch.Tensor]:
    """The moe op's activation input `name`: x as it is, or quantized per row (x_q, x_scale)."""
    if quantized is None:
        return {name: x}
    xq, xs = ops.dynamic_quant(x, out_dtype=quantized)
    return {f"{name}_q": xq, f"{name}_scale": xs}


def run_experts(ops: Any, h: torch.Tensor, stacked: tuple[Stacked, Stacked], routing: dict[str, Any],
                topk_weights: torch.Tensor, attrs: dict[str, str], activations: str | None) -> torch.Tensor:
    """The routed experts' weighted sum [T, hidden] (float32) of the normed hidden states `h` by the
    grouped GEMMs of `ops` (torch.ops.flashgen): `routing` the ids or the aligned pairs, `attrs` the
    ops' topk and weights, `activations` the dtype the mode quantizes activations to, if any."""
    gate_up, down = stacked
    kw = {**routing, **attrs, "dtype": dtypes.of_torch(h.dtype)}
    act = ops.moe_gemm_gate_up(**_activation(ops, "x", h, activations), **gate_up, **kw)
    out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    ops.moe_gemm_down(topk_weights=topk_weights, y=out, **_activation(ops, "h", act, activations), **down, **kw)
    return out
