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
grid, so the search never does worse on its calibration inputs. Then each group of each row of v, o,
gate, up and down (not q and k, whose errors the attention scores multiply) is clipped to the fraction
of its range, on a grid from 1 down to 0.55, that keeps that group's share of the output closest
(`best_clip`: the group's error through its block of the Hessian); 1 is on the grid.
"""
from __future__ import annotations

import torch

from flashgen.quant import quantize_rtn

ALPHAS = tuple(i / 20 for i in range(20))  # the exponents tried
CLIPS = tuple(1 - i / 20 for i in range(10))  # the fractions of a group's range tried, 1 down to 0.55
CLIPPED = ("self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


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


def best_clip(w: torch.Tensor, hessian: torch.Tensor, bits: int, group: int | None, symmetric: bool) -> torch.Tensor:
    """`w` [N, K] with each (row, group) clipped to the fraction of its range in CLIPS whose rounding to
    nearest (on `quantize_rtn`'s grid) keeps the group's share of the output closest: the error through
    the group's diagonal block of `hessian` (float64)."""
    w64 = w.to(torch.float64)
    n, k = w64.shape
    g = k if group is None else group
    blocks = torch.stack([hessian[i:i + g, i:i + g] for i in range(0, k, g)]).to(torch.float64)  # [K / g, g, g]
    wg = w64.reshape(n, k // g, g)
    hi, lo = wg.amax(-1, keepdim=True), wg.amin(-1, keepdim=True)
    if symmetric:
        hi = torch.maximum(hi, -lo)
        lo = -hi
    best, best_err = wg, None
    for c in CLIPS:
        clipped = torch.minimum(torch.maximum(wg, c * lo), c * hi)
        d = wg - quantize_rtn(clipped.reshape(n, k), bits, group, symmetric).dequantize().reshape(n, k // g, g)
        err = torch.einsum("ngi,gij,ngj->ng", d, blocks, d)
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best = torch.where(better[..., None], clipped, best)
        best_err = torch.where(better, err, best_err)
    return best.reshape(n, k).to(w.dtype)


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
