"""A MoE layer's experts stacked in the moe ops' layouts (flashgen/oplib/moe.py), in the decoder's
quantization mode, so that the generated grouped GEMMs run them whatever the mode allows.

Each expert is quantized as a dense linear would be (its mode's `prepare`, runtime/decoder/quant_modes.py: the
same RTN codes and scales), then the experts' tensors are stacked along a new first axis: gate|up [E, 2I, H]
and down [E, H, I] as 16-bit weights, int8 codes with per-row fp32 scales (w8a16), or packed int4
codes with group-128 scales (w4a16). Modes the moe ops do not take (w8a8, w4a8, mixed, int4 of a width
that is not a multiple of the group) have no stacked form: the decoder runs those experts in torch.
"""
from __future__ import annotations

from typing import Callable

import torch

from flashgen.runtime.decoder.quant_modes import QuantLinear

Stacked = dict[str, torch.Tensor]  # the moe op's weight inputs by name (w; w_q, w_scale; w_packed, scales)


def stack_experts(experts: list[tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]],
                  mode: type[QuantLinear]) -> tuple[Stacked, Stacked]:
    """gate|up and down of every expert in `mode` (one with a stacked form: `QuantLinear.stacked_format`),
    stacked; `experts` gives each expert's gate|up [2I, H] and down [H, I] float weights as calls, so that
    each is made (and let go) only while it is quantized."""
    ups: list[Stacked] = []
    downs: list[Stacked] = []
    for gate_up, down in experts:
        ups.append(mode.prepare(gate_up()).expert_fields())
        downs.append(mode.prepare(down()).expert_fields())
    return ({k: torch.stack([u[k] for u in ups]) for k in ups[0]},
            {k: torch.stack([d[k] for d in downs]) for k in downs[0]})
