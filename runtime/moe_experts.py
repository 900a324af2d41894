"""A MoE layer's experts stacked in the moe ops' layouts (flashgen/oplib/moe.py), in the decoder's
quantization mode, so that the generated grouped GEMMs run them whatever the mode allows.

Each expert is quantized as a dense linear would be (runtime/linear.py's `prepare`: the same RTN
codes and scales), then the experts' tensors are stacked along a new first axis: gate|up [E, 2I, H]
and down [E, H, I] as 16-bit weights, int8 codes with per-row fp32 scales (w8a16), or packed int4
codes with group-128 scales (w4a16). Modes the moe ops do not take (w8a8, w4a8, mixed, int4 of a width
that is not a multiple of the group) have no stacked form: the decoder runs those experts in torch.
"""
from __future__ import annotations

from typing import Callable

import torch

from flashgen.oplib.moe import INT4_GROUP
from flashgen.runtime.linear import prepare

Stacked = dict[str, torch.Tensor]  # the moe op's weight inputs by name (w; w_q, w_scale; w_packed, scales)


def stacked_format(quant: str, hidden: int, intermediate: int) -> str | None:
    """The moe ops' `weights` attr for experts in mode `quant`, or None where they have no stacked form."""
    if quant == "bf16":
        return "half"
    if quant == "w8a16":
        return "w8a16"
    if quant == "w4a16" and hidden % INT4_GROUP == 0 and intermediate % INT4_GROUP == 0:
        return "w4a16g128"
    return None


def _fields(w: torch.Tensor, quant: str, weights: str) -> Stacked:
    if weights == "half":
        return {"w": w}
    q = prepare(w, quant)
    if weights == "w8a16":
        return {"w_q": q.w8, "w_scale": q.w8_scale}
    return {"w_packed": q.w4, "scales": q.w4_scales}


def stack_experts(experts: list[tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]], quant: str,
                  weights: str) -> tuple[Stacked, Stacked]:
    """gate|up and down of every expert, stacked; `experts` gives each expert's gate|up [2I, H] and down
    [H, I] float weights as calls, so that each is made (and let go) only while it is quantized."""
    ups: list[Stacked] = []
    downs: list[Stacked] = []
    for gate_up, down in experts:
        ups.append(_fields(gate_up(), quant, weights))
        downs.append(_fields(down(), quant, weights))
    return ({k: torch.stack([u[k] for u in ups]) for k in ups[0]},
            {k: torch.stack([d[k] for d in downs]) for k in downs[0]})
