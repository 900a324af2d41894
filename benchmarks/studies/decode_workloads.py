"""The workloads to tune so that every decode row count of the decoder has records of its own kernel
regime: each GEMM a Llama-3-8B decode step launches in the bf16, w4a16, w8a8 and w4a8 modes (mixed runs
the last three), at each row count, behind the kernel it runs behind in the step.

    python benchmarks/studies/decode_workloads.py [--rows 16,32,64,128,256] [--modes w4a8] [--linears qkv,gate_up]
        [--out benchmarks/workloads/decode_rows.jsonl]
    flashgen tune --workloads benchmarks/workloads/decode_rows.jsonl --target h200 --trials N   # on a GPU

The workloads are read off the decoder's own code, not written by hand: each mode class prepares a
layer's weights, and `linear.apply` runs its four linears as `Decoder.forward` calls them (qkv and
gate_up behind their norm, o adding the residual behind the attention, down gated and adding the
residual) with `runtime/decoder/calls.Recorder` standing for the GPU's ops, so the ops, dims and attrs
are those dispatch binds (the fused rmsnorm_gemm / silu_mul_gemm of bf16 up to FUSED_MAX_ROWS, the
rmsnorm_quant and dynamic_quant producers of the int8 modes). `--modes` takes any decoder mode
(w4fp8's lines: `--modes w4fp8`). Two layers are traced, so that the first
GEMM of a step in which nothing runs between it and the last layer's (bf16's fused qkv at one row)
names that GEMM as its producer. The attention the o projection runs behind is the decode attention
of `rows` sequences over a cache holding each one's whole context (the model's 8192 positions).

Rows: 1 has records already (benchmarks/workloads/*_m1*.jsonl). 2, 4 and 8, the decoder's other
CUDA-graph buckets, are not needed for every bucket to have records of its regime: dispatch never
serves them a one-row GEMV record (runtime/serving/dispatch.py), and the M=16 matrix tiles serve them
as they serve 16 rows. Tuning them too (`--rows 2,4,8,...`) would let GEMV tiles of 2-8 rows, which read
the weight once, serve them instead.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from flashgen.ir import dtypes
from flashgen.runtime.checkpoints.model_config import ModelConfig
from flashgen.runtime.decoder.bench import CONFIGS
from flashgen.runtime.decoder.calls import Recorder
from flashgen.runtime.decoder.linear import apply
from flashgen.runtime.decoder.quant_modes import prepare
from flashgen.workload import Workload, workload

OUT = Path(__file__).resolve().parents[1] / "workloads" / "decode_rows.jsonl"
MODES = ("bf16", "w4a16", "w8a8", "w4a8")
LINEARS = ("qkv", "o", "gate_up", "down")  # a dense layer's GEMMs, in the order a step launches them
ROWS = (16, 32, 64, 128, 256)
BLOCK_SIZE = 16  # the paged cache's tokens per block (runtime/decoder/kv_cache.py's default)


def attention(c: ModelConfig, rows: int, dtype: torch.dtype) -> Workload:
    """The decode attention of `rows` sequences, bound as `Decoder._generated_attention` binds it, over
    a cache of every sequence's whole context."""
    width = -(-c.max_position_embeddings // BLOCK_SIZE)
    blocks = rows * width
    return workload("paged_decode_attention", B=rows, Hq=c.num_heads, Hkv=c.num_kv_heads, D=c.head_dim, BS=BLOCK_SIZE,
                    NB=blocks, MAXB=width, L=min(width, blocks) * BLOCK_SIZE, dtype=dtypes.of_torch(dtype))


def layer_gemms(c: ModelConfig, mode: str, rows_list: tuple[int, ...], dtype: torch.dtype = torch.bfloat16
                ) -> list[tuple[str, Workload, Workload | None]]:
    """(linear, GEMM workload, the kernel before it) of each linear of a dense layer in `mode`, per row count."""
    h, q, kv, ff = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    weights = {"qkv": prepare(torch.zeros(q + 2 * kv, h, dtype=dtype), mode),
               "o": prepare(torch.zeros(h, q, dtype=dtype), mode),
               "gate_up": prepare(torch.zeros(2 * ff, h, dtype=dtype), mode),
               "down": prepare(torch.zeros(h, ff, dtype=dtype), mode)}
    out = []
    for rows in rows_list:
        def meta(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, dtype=dtype, device="meta")

        rec, norm = Recorder(), meta(h)
        for _ in range(2):  # (the second layer's GEMMs: behind what the first one launched last)
            first = len(rec.calls)
            apply(meta(rows, h), weights["qkv"], None, set(), norm=norm, eps=c.rms_norm_eps, ops=rec)
            rec.launched(attention(c, rows, dtype))
            apply(meta(rows, q), weights["o"], None, set(), residual=meta(rows, h), ops=rec)
            apply(meta(rows, h), weights["gate_up"], None, set(), norm=norm, eps=c.rms_norm_eps, ops=rec)
            apply(meta(rows, 2 * ff), weights["down"], None, set(), gated=True, residual=meta(rows, h), ops=rec)
        gemms = [(wl, rec.calls[i - 1]) for i, wl in enumerate(rec.calls) if i >= first and wl.op.kclass == "contraction"]
        out += [(name, wl, behind) for name, (wl, behind) in zip(LINEARS, gemms, strict=True)]
    return out


def lines(c: ModelConfig, modes: tuple[str, ...] = MODES, rows: tuple[int, ...] = ROWS,
          linears: tuple[str, ...] = LINEARS) -> list[str]:
    """The workload file's lines: one per (GEMM, producer) of the `linears` named, in mode then row
    order, no repeats."""
    unknown = set(linears) - set(LINEARS)
    if unknown:
        raise SystemExit(f"unknown linears {sorted(unknown)}: a dense layer's are {', '.join(LINEARS)}")
    out: dict[str, None] = {}
    for mode in modes:
        for name, wl, behind in layer_gemms(c, mode, rows):
            if name in linears:
                out[json.dumps({**wl.to_json(), "behind": behind.to_json()})] = None
    return list(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="llama3-8b", choices=sorted(CONFIGS))
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="decode row counts, comma-separated")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--linears", default=",".join(LINEARS), help="the layer's GEMMs to write, comma-separated")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    rows = tuple(int(r) for r in args.rows.split(","))
    text = "\n".join(lines(CONFIGS[args.config], tuple(args.modes.split(",")), rows, tuple(args.linears.split(",")))) + "\n"
    args.out.write_text(text)
    print(f"{args.out}: {text.count(chr(10))} workloads")


if __name__ == "__main__":
    main()
