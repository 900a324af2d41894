"""AWQ's activation-aware scales (Lin et al., 2023) for `flashgen quantize --method awq`.

A few input channels of a linear carry most of its activations' magnitude; their weights deserve the
finest steps. Per stack of linears that read one input (runtime/checkpoints/gptq_quantize.py STACKS), a
scale per input channel s = mean|x|^alpha, normalized so that max(s) * min(s) = 1, multiplies the
weight's columns before rounding to nearest, and 1 / s folds into what produces the input, so that the
float model computes the same: the layer's norm weight for q|k|v and gate|up, up's rows for down, v's
rows for o where every query head reads a value head of its own (with grouped heads one v row feeds
several o columns, which may want different scales: o is left unscaled there). alpha is chosen on a grid
in [0, 1) to keep the stack's output on the calibration inputs, ||X (W - Q(W s) / s)^T||^2, which the
inputs' Hessian 2 X^T X / n gives without the tokens: alpha = 0 (plain round to nearest) is on the
grid, so the search never does worse on its calibration inputs. Only the scales are searched (AWQ also
searches a clipping range per group, which is not done here).
"""
from __future__ import annotations

import torch

from flashgen.quant import quantize_rtn

ALPHAS = tuple(i / 20 for i in range(20))  # the exponents tried


def output_error(w: torch.Tensor, dq: torch.Tensor, hessian: torch.Tensor) -> float:
    """||X (w - dq)^T||^2 up to the factor n / 2: the trace of D H D^T, D = w - dq (float64)."""
    d = (w - dq).to(torch.float64)
    return float(((d @ hessian) * d).sum())


def best_scale(w: torch.Tensor, mean_abs: torch.Tensor, hessian: torch.Tensor, bits: int, group: int | None,
               symmetric: bool) -> tuple[torch.Tensor, float, float]:
    """The input scale [K] of `w` [N, K] with the least output error once W * s is rounded to nearest on
    the grid of `quantize_rtn`, and that error beside plain rounding's (alpha = 0)."""
    w64, x = w.to(torch.float64), mean_abs.to(torch.float64).clamp_min(1e-4)
    best: tuple[torch.Tensor, float] | None = None
    plain = None
    for alpha in ALPHAS:
        s = x.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        dq = quantize_rtn(w64 * s, bits, group, symmetric).dequantize() / s
        err = output_error(w64, dq, hessian)
        plain = err if alpha == 0 else plain
        if best is None or err < best[1]:
            best = (s, err)
    return best[0], best[1], plain


def fold(layer: torch.nn.Module, stack: tuple[str, ...], s: torch.Tensor) -> bool:
    """Multiplies the stack's weight columns by `s` and divides what produces their input by it, so the
    float layer computes the same; False where there is nothing to fold into (o with grouped heads)."""
    producer = _producer(layer, stack)
    if producer is None:
        return False
    s32 = s.to(torch.float32)
    for name in stack:
        layer.get_submodule(name).weight.mul_(s32)
    module, rows = producer
    if rows:  # a linear's output rows (and bias)
        module.weight.div_(s32[:, None])
        if module.bias is not None:
            module.bias.div_(s32)
    else:  # a norm's weight
        module.weight.div_(s32)
    return True


def _producer(layer: torch.nn.Module, stack: tuple[str, ...]) -> tuple[torch.nn.Module, bool] | None:
    """What writes the stack's input: (module, whether it is a linear whose rows to scale), or None."""
    first = stack[0]
    if first == "self_attn.q_proj":
        return layer.input_layernorm, False
    if first == "mlp.gate_proj":
        return layer.post_attention_layernorm, False
    if first == "mlp.down_proj":
        return layer.mlp.up_proj, True
    v, o = layer.self_attn.v_proj, layer.self_attn.o_proj
    return (v, True) if v.weight.shape[0] == o.weight.shape[1] else None
