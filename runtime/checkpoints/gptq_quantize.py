"""Making a GPTQ checkpoint of a float model folder (`flashgen quantize --method gptq`), which
runtime/checkpoints/prequant.py then loads as any other: the decoder's linears (q, k, v, o, gate, up,
down; not the embeddings nor the head) quantized by GPTQ (flashgen/quant.py `quantize_gptq`) on
calibration text, layer by layer on the CPU, in transformers' float32 model of the folder. Each layer
sees what the layers before it, already quantized, make of the calibration tokens: its linears'
inputs give their Hessians 2 X X^T / n (the linears that read one input, q|k|v and gate|up, share
it and are quantized as one weight stacked along N, which is the same as one by one: GPTQ treats
each output row alone), then the quantized layer runs again to give the next layer its inputs.

The written folder: the source's files but its weights and config.json (tokenizer and generation
files copied), a config.json with `quantization_config` (quant_method gptq, desc_act false: the k
in order), and model.safetensors holding each quantized linear as GPTQ stores it (`qweight`,
`qzeros`, `scales` in fp16, `g_idx`: prequant.py's docstring) and every other tensor as the source
holds it. Symmetric codes (zero point 2^(bits - 1), the grid of the decoder's RTN modes) are written
in the original format (`checkpoint_format: gptq`, each zero point stored less one); codes with
zero points in `gptq_v2`, which stores them as they are (the original cannot store a zero point of
0). The folder is written whole under a temporary name and renamed: a failed run leaves nothing.

Without calibration tokens (`--method rtn`) each linear is GPTQ with an identity Hessian, which is
round-to-nearest on the same grid with the same stored scales: the control that shows what GPTQ's
error feedback alone gains. `--method awq` first scales each stack's input channels by its activations
(runtime/checkpoints/awq_scales.py: the scales searched on the same calibration inputs, folded into the
norms and the linears before) and clips each group's range where that keeps the output closer, then
rounds to nearest, and writes the AWQ format (`quant_method: awq`,
`version: gemm`; prequant.py's docstring), zero points included as that format has them.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from flashgen.errors import FlashgenError
from flashgen.quant import QuantizedWeight, quantize_gptq
from flashgen.runtime.checkpoints import awq_scales
from flashgen.runtime.checkpoints.int_weight import pack_cols, pack_rows
from flashgen.runtime.checkpoints.model_config import ModelConfig

# The decoder linears by the input they read, in the order a layer computes them
STACKS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
          ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")  # not copied: the quantized weights replace them
NOT_COPIED = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")


METHODS = ("gptq", "awq", "rtn")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column each nibble of an AWQ word holds (prequant.py reads it)


@dataclass(frozen=True)
class GptqOptions:
    bits: int = 4
    group: int = 128        # k per scale; -1: one scale per output channel
    symmetric: bool = True  # zero point 2^(bits - 1); False: a zero point per group (4 bits)
    damp: float = 0.01      # of the Hessian's mean diagonal, added to its diagonal
    batch: int = 8          # sequences per forward
    method: str = "gptq"    # METHODS: gptq and awq calibrate, rtn does not


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each decoder linear's (N outputs, K inputs)."""
    q, kv, h, i = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.hidden_size, \
        config.intermediate_size
    return {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}


def check(folder: Path, out: Path, options: GptqOptions) -> ModelConfig:
    """Everything that can be refused before the model loads, one line each."""
    if not (folder / "config.json").is_file():
        raise FlashgenError(f"{folder}: " + ("the folder holds no config.json" if folder.is_dir()
                                             else "no such folder"))
    if out.exists():
        raise FlashgenError(f"{out} exists: give a new folder to write the checkpoint in")
    config = ModelConfig.from_folder(folder)
    if config.prequant is not None:
        raise FlashgenError(f"{folder} is already quantized ({config.prequant.method}): give a float checkpoint")
    if config.num_experts:
        raise FlashgenError(f"{folder} is a mixture-of-experts model: GPTQ here quantizes dense models")
    if options.method not in METHODS:
        raise FlashgenError(f"the method must be one of {', '.join(METHODS)}, got {options.method!r}")
    if options.bits not in (4, 8):
        raise FlashgenError(f"bits must be 4 or 8, got {options.bits}")
    if options.method == "awq" and options.bits != 4:
        raise FlashgenError("AWQ checkpoints hold 4-bit codes: give --bits 4")
    if options.bits == 8 and (options.group != -1 or not options.symmetric):
        raise FlashgenError("8-bit codes load per channel and symmetric only (the int8 GEMM's weights): "
                            "give group -1, without zero points")
    if options.group != -1 and options.group < 1:
        raise FlashgenError(f"the group must be a positive number of inputs or -1 (per channel), got {options.group}")
    if not 0 <= options.damp < 1:
        raise FlashgenError(f"the damping must be a fraction in [0, 1), got {options.damp}")
    per, shapes = 32 // options.bits, linear_shapes(config)
    for name, (n, k) in shapes.items():
        if n % per or k % per:
            raise FlashgenError(f"{name} has {n} outputs and {k} inputs, which {per}-value words do not pack")
    for name, (n, k) in shapes.items():
        if options.group != -1 and k % options.group:
            fits = max((g for g in (128, 64, 32, 16, 8) if all(k_ % g == 0 for _, k_ in shapes.values())), default=-1)
            raise FlashgenError(f"group {options.group} does not divide {name}'s {k} inputs (a GPTQ checkpoint has "
                                f"one group size): give one that divides every linear's inputs, e.g. {fits}")
    return config


def calibration_tokens(folder: Path, config: ModelConfig, text: str, samples: int, seq_len: int) -> torch.Tensor:
    """`samples` sequences of `seq_len` tokens [samples, seq_len] from the text (tokenized without special
    tokens), spread evenly over it without overlapping."""
    from flashgen.runtime.checkpoints.tokenizer import load_tokenizer

    _check_tokens(config, samples, seq_len)
    ids = load_tokenizer(folder, config.vocab_size).encode(text, add_special_tokens=False).ids
    if len(ids) < samples * seq_len:
        raise FlashgenError(f"the calibration text has {len(ids)} tokens, fewer than {samples} samples of {seq_len}")
    step = (len(ids) - seq_len) // max(1, samples - 1)
    return torch.tensor([ids[i * step:i * step + seq_len] for i in range(samples)], dtype=torch.int64)


def _check_tokens(config: ModelConfig, samples: int, seq_len: int) -> None:
    if samples < 1 or not 2 <= seq_len <= config.max_position_embeddings:
        raise FlashgenError(f"{samples} samples of {seq_len} tokens: need at least one sample of 2 to "
                            f"{config.max_position_embeddings} tokens (the model's positions)")


class _Caught(Exception):
    """Stops the model at its first layer, whose inputs are then kept."""


def _layer_inputs(hf: torch.nn.Module, tokens: torch.Tensor, batch: int) -> list[tuple[torch.Tensor, dict]]:
    """The first decoder layer's input and keyword arguments (positions, rotary embeddings, mask) per
    batch of sequences, as the model passes them to every layer."""
    caught: list[tuple[torch.Tensor, dict]] = []

    def catch(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs.pop("hidden_states")
        caught.append((x, kwargs))
        raise _Caught

    hook = hf.model.layers[0].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        for part in tokens.split(batch):
            try:
                hf(part, use_cache=False)
            except _Caught:
                pass
    finally:
        hook.remove()
    return caught


def _run(layer: torch.nn.Module, inputs: list[tuple[torch.Tensor, dict]]) -> list[tuple[torch.Tensor, dict]]:
    out = []
    for x, kwargs in inputs:
        y = layer(x, **kwargs)
        out.append((y[0] if isinstance(y, tuple) else y, kwargs))
    return out


def _input_stats(layer: torch.nn.Module, inputs: list[tuple[torch.Tensor, dict]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per stack of linears, by its first name: 2 X X^T / n of the input it reads and the input's mean
    magnitude per channel (float64), over every calibration token."""
    sums: dict[str, torch.Tensor] = {}
    mags: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def add(name: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        sums[name] = sums.get(name, 0) + (x.T @ x).double()
        mags[name] = mags.get(name, 0) + x.abs().sum(0).double()
        counts[name] = counts.get(name, 0) + x.shape[0]

    hooks = [layer.get_submodule(s[0]).register_forward_pre_hook(lambda m, args, name=s[0]: add(name, args[0]))
             for s in STACKS]
    try:
        _run(layer, inputs)
    finally:
        for h in hooks:
            h.remove()
    return {name: (2 * sums[name] / counts[name], mags[name] / counts[name]) for name in sums}


def gptq_tensors(q: QuantizedWeight) -> dict[str, torch.Tensor]:
    """One linear's codes as GPTQ stores them (prequant.py's docstring; `checkpoint_format` gptq where
    symmetric, each zero point less one, else gptq_v2)."""
    n, k = q.codes.shape
    codes = q.codes.to(torch.int64) + (128 if q.bits == 8 else 0)  # (8-bit codes are signed: zero point 128)
    zeros = q.zeros.to(torch.int64) if q.zeros is not None else \
        torch.full(q.scales.shape, 1 << (q.bits - 1), dtype=torch.int64)
    stored = zeros - (1 if q.zeros is None else 0)
    return {"qweight": pack_rows(codes.T, q.bits), "qzeros": pack_cols(stored.T, q.bits),
            "scales": q.scales.T.half().contiguous(), "g_idx": (torch.arange(k) // q.group).to(torch.int32)}


def awq_tensors(q: QuantizedWeight) -> dict[str, torch.Tensor]:
    """One linear's 4-bit codes as AWQ's GEMM format stores them (prequant.py's docstring): eight
    columns of one k per word in AWQ_ORDER, the zero points packed alike (8 where symmetric)."""
    def packed(vals: torch.Tensor) -> torch.Tensor:  # [R, C] -> [R, C / 8], nibble j holding column AWQ_ORDER[j]
        r = vals.to(torch.int64)
        return pack_cols(r.reshape(r.shape[0], -1, 8)[:, :, list(AWQ_ORDER)].reshape(r.shape[0], -1), 4)
    zeros = q.zeros if q.zeros is not None else torch.full(q.scales.shape, 8, dtype=torch.uint8)
    return {"qweight": packed(q.codes.T), "qzeros": packed(zeros.T), "scales": q.scales.T.half().contiguous()}


def quantization_config(options: GptqOptions) -> dict:
    if options.method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": options.group, "version": "gemm", "zero_point": True}
    return {"quant_method": "gptq", "bits": options.bits, "group_size": options.group, "sym": options.symmetric,
            "desc_act": False, "damp_percent": options.damp, "true_sequential": False,
            "checkpoint_format": "gptq" if options.symmetric else "gptq_v2"}


def quantize_folder(folder: Path, out: Path, tokens: torch.Tensor | None, options: GptqOptions,
                    progress: Callable[[str], None] = lambda line: None) -> dict[str, QuantizedWeight]:
    """`folder`'s decoder linears quantized by `options.method` on calibration `tokens` [samples, seq_len]
    (rtn: None), written to `out` (module docstring); returns each linear's codes by its full name
    (`model.layers.0.mlp.down_proj`)."""
    from safetensors.torch import save_file

    from flashgen.extras import require

    config = check(folder, out, options)
    if (tokens is None) != (options.method == "rtn"):
        raise FlashgenError(f"{options.method} " + ("takes no calibration tokens" if tokens is not None
                                                     else "needs calibration tokens"))
    if tokens is not None:
        _check_tokens(config, *tokens.shape)
    transformers = require("transformers", "flashgen quantize")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    group = None if options.group == -1 else options.group
    codes: dict[str, QuantizedWeight] = {}
    with torch.no_grad():
        inputs = _layer_inputs(hf, tokens, options.batch) if tokens is not None else None
        for i, layer in enumerate(hf.model.layers):
            stats = _input_stats(layer, inputs) if inputs is not None else None
            if options.method == "awq":
                progress(f"layer {i + 1}/{config.num_layers}: " + _awq_fold(layer, stats, options, group))
            for stack in STACKS:
                linears = [layer.get_submodule(name) for name in stack]
                k = linears[0].weight.shape[1]
                h = stats[stack[0]][0] if options.method == "gptq" else torch.eye(k, dtype=torch.float64)
                q = quantize_gptq(torch.cat([m.weight for m in linears]), h, options.bits, group,
                                  options.symmetric, options.damp, scale_dtype=torch.float16)
                dq, row = q.dequantize(), 0
                for name, m in zip(stack, linears):
                    rows = slice(row, row + m.weight.shape[0])
                    m.weight.copy_(dq[rows])  # (the next layers see this layer's quantized output)
                    codes[f"model.layers.{i}.{name}"] = QuantizedWeight(
                        q.codes[rows], q.scales[rows], None if q.zeros is None else q.zeros[rows], q.bits, q.group)
                    row = rows.stop
            inputs = _run(layer, inputs) if inputs is not None else None
            progress(f"layer {i + 1}/{config.num_layers} quantized")
    tensors = {name: t.detach().contiguous() for name, t in hf.state_dict().items()
               if name.removesuffix(".weight") not in codes}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    stored = awq_tensors if options.method == "awq" else gptq_tensors
    for name, q in codes.items():
        tensors.update({f"{name}.{part}": t for part, t in stored(q).items()})
    part = out.with_name(out.name + ".partial")
    shutil.rmtree(part, ignore_errors=True)
    try:
        part.mkdir(parents=True)
        for f in folder.iterdir():
            if f.is_file() and f.name not in NOT_COPIED and not f.name.endswith(WEIGHT_FILES):
                shutil.copy2(f, part / f.name)
        source = json.loads((folder / "config.json").read_text())
        (part / "config.json").write_text(json.dumps({**source, "quantization_config": quantization_config(options)},
                                                     indent=2) + "\n")
        save_file(tensors, str(part / "model.safetensors"), metadata={"format": "pt"})
        os.replace(part, out)
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise
    return codes


def _awq_fold(layer: torch.nn.Module, stats: dict[str, tuple[torch.Tensor, torch.Tensor]], options: GptqOptions,
              group: int | None) -> str:
    """Every stack's AWQ scales searched on the float layer, then folded in, and the ranges of v, o,
    gate, up and down clipped (awq_scales.py); a line of each stack's output error against plain
    rounding's (before clipping)."""
    scales = {}
    for stack in STACKS:
        w = torch.cat([layer.get_submodule(name).weight for name in stack])
        hessian, mean_abs = stats[stack[0]]
        s, err, plain = awq_scales.best_scale(w, mean_abs, hessian, options.bits, group, options.symmetric)
        scales[stack] = (s, err / plain if plain > 0 else 1.0)
    notes = []
    for stack, (s, ratio) in scales.items():
        folded = awq_scales.fold(layer, stack, s)
        notes.append(f"{stack[0].split('.')[-1].removesuffix('_proj')} {ratio:.2f}" if folded else
                     f"{stack[0].split('.')[-1].removesuffix('_proj')} unscaled")
        hessian = stats[stack[0]][0]
        if folded:  # the input is x / s now
            hessian = hessian / (s[:, None] * s[None, :])
        for name in stack:
            if name in awq_scales.CLIPPED:
                m = layer.get_submodule(name)
                m.weight.copy_(awq_scales.best_clip(m.weight, hessian, options.bits, group, options.symmetric))
    return "output error against rounding alone: " + ", ".join(notes) + "; ranges clipped"
