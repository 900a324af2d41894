"""Where one decode step's time goes: the decoder's kernels in step order with their device times,
totals per kernel name, and the step's wall time against the sum of its kernels (the difference is
idle device time: launch gaps, host work, the token's trip to the host).

    python benchmarks/studies/decode_profile.py [--batch 1] [--quant bf16] [--prompt-len 2000] [--steps 20]
                                        [--no-chain] [--floor] [--name decode_profile_b1_bf16]

FLASHGEN_PDL=0 in the environment builds the kernels without programmatic dependent launch.

--floor adds the weight-read floor of the layers' GEMMs: each linear's tensors (codes and scales) read
by the faster of two torch passes (benchmarks/gemm.py `weight_reads`) after an L2 flush, summed over the
layers, beside the generated GEMM kernels' time per step, and the step as it would be were each GEMM as
fast as that read (its wall less the GEMM kernels, plus the floor) against the bandwidth limit. Run it
with FLASHGEN_PDL=0: with programmatic dependent launch a kernel's time includes its wait for the last.

Kernel times come from torch.profiler (CUPTI sees the kernels inside CUDA-graph replays); the wall time
per step is measured separately, without the profiler.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import RESULTS, copy_gbs, environment, print_table, write_results  # noqa: E402
from gemm import weight_reads  # noqa: E402

from flashgen.runtime.decoder import bench  # noqa: E402
from flashgen.runtime.decoder.engine import Engine  # noqa: E402
from flashgen.runtime.decoder.sampling import SamplingParams  # noqa: E402
from flashgen.runtime.decoder.model import Decoder  # noqa: E402
from flashgen.runtime.decoder.quant_modes import QuantLinear  # noqa: E402
from flashgen.schedules.timing import gpu_time  # noqa: E402
from flashgen.targets.device import device_target  # noqa: E402


def step_kernels(engine: Engine, steps: int) -> list[list[tuple[str, float]]]:
    """(kernel name, device us) in launch order, for each of `steps` decode steps."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    kernels = sorted(((e.time_range.start, e.name, e.time_range.elapsed_us()) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[0])
    per = len(kernels) // steps
    if per * steps != len(kernels):
        raise RuntimeError(f"{len(kernels)} kernels do not split into {steps} equal steps")
    return [[(n, us) for _, n, us in kernels[i * per:(i + 1) * per]] for i in range(steps)]


def read_floor_us(model: Decoder) -> float:
    """Device time per step of reading every layer's linear weights once (codes and scales, each tensor
    by the faster of weight_reads' passes after an L2 flush); the layers share shapes, so layer 0's
    reads count once per layer."""
    dev = model.device
    l2 = device_target(dev).get("l2_bytes")
    us = 0.0
    for name, q in model.layers[0].items():
        if not isinstance(q, QuantLinear):
            continue
        for t in (v for v in vars(q).values() if isinstance(v, torch.Tensor) and v.is_cuda):
            us += min(gpu_time(f, dev, True, l2).median_us for f in weight_reads({"w": t.contiguous()}).values())
    return us * len(model.layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--quant", default="bf16")
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-chain", action="store_true", help="every step waits for its tokens (Engine chain=False)")
    ap.add_argument("--floor", action="store_true", help="also time the layers' weight-read floor")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default=None, help="result files (default decode_profile_b<batch>_<quant>)")
    args = ap.parse_args()
    name = args.name or f"decode_profile_b{args.batch}_{args.quant}"
    dev, dtype = torch.device("cuda"), torch.bfloat16
    c = bench.CONFIGS["llama3-8b"]
    c = replace(c, max_position_embeddings=max(c.max_position_embeddings, args.prompt_len + 4 * args.steps + 64))
    model = Decoder(c, bench.random_weights(c, dtype, dev), dev, dtype, quant=args.quant)
    per_seq = -(-(args.prompt_len + 4 * args.steps + 16) // 16)
    engine = Engine(model, num_blocks=args.batch * per_seq + 4, chain=not args.no_chain)
    prompts = torch.randint(0, c.vocab_size, (args.batch, args.prompt_len),
                            generator=torch.Generator().manual_seed(0)).tolist()
    engine.generate(prompts, SamplingParams(max_new_tokens=2))   # builds kernels, captures the graph
    for p in prompts:
        engine.add(p, SamplingParams(max_new_tokens=4 * args.steps))
    engine.step()                                                   # prefill
    for _ in range(args.steps):                                     # warm
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) / args.steps * 1e6
    steps = step_kernels(engine, args.steps)
    names = [n for n, _ in steps[0]]
    if any([n for n, _ in s] != names for s in steps):
        raise RuntimeError("decode steps launched different kernel sequences")
    order = [(i, n, statistics.median(s[i][1] for s in steps)) for i, n in enumerate(names)]
    busy = sum(us for _, _, us in order)
    by_name: dict[str, list[float]] = defaultdict(list)
    for _, n, us in order:
        by_name[n].append(us)
    totals = sorted(((n, len(v), sum(v), sum(v) / busy) for n, v in by_name.items()), key=lambda r: -r[2])
    bw = copy_gbs()
    limit_us = bench.step_bytes(c, args.quant, 2, args.batch, args.prompt_len) / (bw * 1e3)
    rows = [[n[:90], calls, us, share] for n, calls, us, share in totals]   # torch's kernel names run long
    floor = ""
    if args.floor:
        gemm_us = sum(us for n, _, us, _ in totals if n.startswith("gemm"))
        read_us = read_floor_us(model)
        step_floor = wall_us - gemm_us + read_us
        floor = (f" Generated GEMM kernels {gemm_us:.0f} us a step against {read_us:.0f} us for reading their "
                 f"weights once ({read_us / gemm_us:.2f}); with each GEMM at that floor the step would take "
                 f"{step_floor:.0f} us, {limit_us / step_floor:.0%} of the bandwidth limit (measured: "
                 f"{limit_us / wall_us:.0%}).")
    meta = {**environment(), "floor": floor.strip(), "chain": not args.no_chain, "pdl": os.environ.get("FLASHGEN_PDL", "1") != "0",
            "copy_gbs": bw, "wall_us_per_step": wall_us, "kernel_us_per_step": busy,
            "idle_us_per_step": wall_us - busy, "bandwidth_limit_us_per_step": limit_us,
            "kernels_per_step": len(order), "step_order": [[i, n[:120], us] for i, n, us in order]}
    mode = (f"{'chained' if meta['chain'] else 'each waiting for its tokens'}, programmatic dependent launch "
            f"{'on: a kernel starts before the previous one ends, so kernel times overlap' if meta['pdl'] else 'off'}")
    write_results(name, ("kernel", "calls_per_step", "us_per_step", "share_of_kernel_time"), rows, meta,
                  args.out_dir, f"Llama-3-8B-shaped random weights, batch {args.batch}, {args.quant}, prompt "
                  f"{args.prompt_len}, median over {args.steps} CUDA-graph decode steps ({mode}). Wall per step {wall_us:.0f} us, "
                  f"kernels {busy:.0f} us, idle {wall_us - busy:.0f} us, bandwidth limit {limit_us:.0f} us "
                  f"(weights + KV / {bw:.0f} GB/s).{floor} The JSON's step_order lists every kernel of a step in order.")
    print_table(("kernel", "calls", "us/step", "share"), [(n[:60], k, us, s) for n, k, us, s in totals[:15]])
    print(f"wall {wall_us:.0f} us/step, kernels {busy:.0f}, idle {wall_us - busy:.0f}, limit {limit_us:.0f}.{floor}")


if __name__ == "__main__":
    main()
