"""Where one decode step's time goes: the decoder's kernels in step order with their device times,
totals per kernel name, and the step's wall time against the sum of its kernels (the difference is
idle device time: launch gaps, host work, the token's trip to the host).

    python benchmarks/studies/decode_profile.py [--batch 1] [--quant bf16] [--prompt-len 2000] [--steps 20]
                                        [--no-chain] [--floor] [--name decode_profile_b1_bf16]

FLASHGEN_PDL=0 in the environment builds the kernels without programmatic dependent launch.

--floor adds the step's read floor (benchmarks/bare_read.py): one CUDA graph of as many bare-read
kernels as the step launches, each reading once what its kernel must read (a linear's codes and scales,
a layer's keys and values of the step's contexts, the lm_head's weight; the norms, rope, quantization
and sampling kernels a row of activations), each in the fastest of the reader's configurations for its
size; and the chain of the linears' reads alone, beside the generated GEMM kernels' time per step. Run
it with FLASHGEN_PDL=0: the chain launches without programmatic dependent launch, and with it a
kernel's time includes its wait for the last.

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
from bare_read import fastest, reader  # noqa: E402

from flashgen.runtime.decoder import bench  # noqa: E402
from flashgen.runtime.decoder.engine import Engine  # noqa: E402
from flashgen.runtime.decoder.sampling import SamplingParams  # noqa: E402
from flashgen.runtime.decoder.model import Decoder  # noqa: E402
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


def _timed_graph(calls: list, device: torch.device, replays: int = 10) -> float:
    """Median device time in us of one replay of a CUDA graph of `calls` in turn."""
    from flashgen.runtime.serving.graphs import cuda_graph

    graph, _ = cuda_graph(lambda: [c() for c in calls], device)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times)


def _linear_bytes(q: object) -> torch.Tensor:
    """A linear's device tensors (codes and scales, or its weight) as one byte buffer."""
    parts = [t.detach().reshape(-1).view(torch.uint8) for t in vars(q).values()
             if isinstance(t, torch.Tensor) and t.is_cuda]
    if not parts:
        raise RuntimeError(f"{type(q).__name__} holds no tensors of its own (mixed holds its modes'): "
                           "the floor reads a single mode's linears")
    return torch.cat(parts)


def read_chain_us(model: Decoder, kernel_names: list[str], batch: int, context: int) -> dict[str, float]:
    """The step's read floor: a graph of one bare read per kernel of the step (`kernel_names`, in step
    order), and the chain of the linears' reads alone. Each linear's tensors are read as one buffer
    (their bytes copied together once), each layer's keys and values as a buffer of their size, the
    lm_head as it is, every other kernel as a row of activations per sequence."""
    dev, c = model.device, model.c
    l2 = device_target(dev).get("l2_bytes")
    names = ("qkv", "o", "gate_up", "down")
    gemms = sum(n.startswith("gemm") for n in kernel_names)
    attention = sum(n.startswith("paged_decode_attention") for n in kernel_names)
    if gemms != len(names) * len(model.layers) or attention != len(model.layers):
        raise RuntimeError(f"the floor reads {len(names)} linears and one attention a layer; the step launched "
                           f"{gemms} generated GEMMs and {attention} attentions for {len(model.layers)} layers")
    small = len(kernel_names) - gemms - attention - 1  # less the lm_head
    linears = [[_linear_bytes(layer[n]) for n in names] for layer in model.layers]
    kv = [torch.empty(2 * c.num_kv_heads * c.head_dim * 2 * batch * context, dtype=torch.uint8, device=dev)
          for _ in model.layers]
    row = torch.empty(batch * c.hidden_size * 2, dtype=torch.uint8, device=dev)
    best: dict[int, object] = {}

    def read(t: torch.Tensor):
        if t.numel() not in best:
            best[t.numel()] = fastest(t, l2)[0]
        return reader(t, best[t.numel()])

    per_layer, rest = divmod(small, len(model.layers))
    step, gemm = [], []
    for i, ws in enumerate(linears):
        step += [read(row)] * per_layer
        gemm += [read(w) for w in ws]
        step += [gemm[-4], read(kv[i]), *gemm[-3:]]
    step += [read(row)] * rest + [read(model.lm_head)]
    return {"gemm_read_chain_us": _timed_graph(gemm, dev), "step_read_chain_us": _timed_graph(step, dev)}


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
    floor, floors = "", {}
    if args.floor:
        gemm_us = sum(us for n, _, us, _ in totals if n.startswith("gemm"))
        floors = read_chain_us(model, names, args.batch, args.prompt_len)
        chain = floors["step_read_chain_us"]
        floor = (f" Generated GEMM kernels {gemm_us:.0f} us a step against {floors['gemm_read_chain_us']:.0f} us for "
                 f"a chain of bare reads of their weights ({floors['gemm_read_chain_us'] / gemm_us:.2f}); a chain of "
                 f"{len(names)} bare reads, one per kernel of the step, each reading what its kernel must, takes "
                 f"{chain:.0f} us: {limit_us / chain:.0%} of the bandwidth limit is this step's read floor "
                 f"(measured: {limit_us / wall_us:.0%}, {chain / wall_us:.2f} of the floor's speed).")
    meta = {**environment(), "floor": floor.strip(), **floors, "chain": not args.no_chain, "pdl": os.environ.get("FLASHGEN_PDL", "1") != "0",
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
