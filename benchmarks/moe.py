"""The generated MoE experts (moe_gemm_gate_up + moe_gemm_down, bf16) against torch._grouped_mm, a loop
of cuBLAS GEMMs per expert (what transformers runs) and the roofline, side by side in one run.

    python benchmarks/moe.py --db DB [--trials 8] [--shapes mixtral,qwen3] [--ms 1,16,64,256,4096]
        [--name moe] [--rounds 2]

Each (shape, M): a router's top-k of random logits (softmax, top-k, renormalised); the same tokens,
weights and routing for every version. Versions timed:
- flashgen: the two generated grouped GEMMs (y zeroed, gate_up, down) in the routing the decoder
  uses at that M (ids up to 64 tokens: the kernels read the router's ids; sorted beyond: pairs ordered
  by `moe_align` first), after each is tuned briefly (`--trials` new measured schedules, every
  candidate checked against the float64 reference); flashgen+align adds the alignment of the sorted
  routing (torch's sort and a scatter, as the decoder runs it; the ids routing has none);
- grouped_mm: the same pairs through torch._grouped_mm (gather, gate_up, SiLU·mul, down, weights,
  index_add); grouped_mm GEMMs: its two grouped GEMMs alone, the kernels flashgen's replace;
- loop: per touched expert, its tokens gathered, x @ w13.T, SiLU·mul, @ w2.T, weighted, index_add
  (the expert lists made outside the timing, which favours the loop).
Roofline: the touched experts' weight bytes plus the activations, over the measured copy bandwidth.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, bench_side_by_side, copy_gbs, environment, print_table, tuning_session, write_results  # noqa: E402

import flashgen  # noqa: E402
from flashgen.db import Database  # noqa: E402
from flashgen.oplib.moe import moe_align  # noqa: E402
from flashgen.runtime.decoder.model import IDS_ROUTING_MAX_TOKENS  # noqa: E402
from flashgen.schedules.tuner import TuneTask, tune  # noqa: E402
from flashgen.targets import device_target  # noqa: E402

# (experts, top-k, hidden, intermediate)
SHAPES = {"mixtral": (8, 2, 4096, 14336), "qwen3": (128, 8, 2048, 768)}


def routing(m: int, e: int, k: int, dev: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids [m, k] and renormalised weights of a random router."""
    logits = torch.randn(m, e, generator=gen).to(dev)
    w, ids = logits.softmax(-1).topk(k, dim=-1)
    return ids.to(torch.int32), (w / w.sum(-1, keepdim=True)).float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default="1,16,64,256,4096")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default="moe")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    dev = torch.device("cuda")
    target = device_target(dev)
    bw = copy_gbs()
    header = ("shape", "M", "routing", "touched", "flashgen_us", "flashgen+align_us", "grouped_mm_gemms_us", "grouped_mm_us",
              "loop_us", "roofline_us", "of_roofline", "vs_loop", "vs_grouped_mm_gemms", "gate_up schedule",
              "down schedule")
    rows = []
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    with Database(args.db) as db, tuning_session(target) as session:
        for shape in args.shapes.split(","):
            e, k, hidden, inter = SHAPES[shape]
            w13 = (torch.randn(e, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dev, torch.bfloat16)
            w2 = (torch.randn(e, hidden, inter, generator=gen) / inter ** 0.5).to(dev, torch.bfloat16)
            w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)  # [E, K, N] views, column-major per expert
            for m in map(int, args.ms.split(",")):
                routing_form = "ids" if m <= IDS_ROUTING_MAX_TOKENS else "sorted"
                kw = dict(M=m, E=e, topk=str(k), dtype="bf16", routing=routing_form)
                wl_up = flashgen.workload("moe_gemm_gate_up", N=inter, K=hidden, **kw)
                wl_down = flashgen.workload("moe_gemm_down", N=hidden, K=inter, **kw)
                for wl in (wl_up, wl_down):
                    tune(TuneTask(wl, target, args.trials, strategy="evolutionary"), db, progress=None, **session)
                k_up = flashgen.compile(wl_up, target, db=db)
                k_down = flashgen.compile(wl_down, target, db=db)
                x = torch.randn(m, hidden, generator=gen).to(dev, torch.bfloat16)
                ids, weights = routing(m, e, k, dev, gen)
                pairs, offsets = moe_align(ids, e)
                flat_w = weights.flatten().contiguous()
                tokens = (pairs // k).long()
                y = torch.zeros(m, hidden, dtype=torch.float32, device=dev)
                route = {"topk_ids": ids} if routing_form == "ids" else {"sorted_pairs": pairs, "expert_offsets": offsets}
                up_in = {"x": x, "w": w13, **route}
                h = k_up.run(up_in)["h"]
                down_in = {"h": h, "w": w2, "topk_weights": flat_w, "y": y, **route}

                up_call, down_call = k_up.bind(up_in, {"h": h}), k_down.bind(down_in, {})  # checked once

                def ours() -> None:
                    y.zero_()
                    up_call()
                    down_call()

                def ours_aligned() -> None:
                    if routing_form == "sorted":
                        p, o = moe_align(ids, e)
                        pairs.copy_(p)
                        offsets.copy_(o)
                    ours()

                ends = offsets[1:].contiguous()
                xs = x[tokens]
                a_sorted = torch.empty(m * k, inter, dtype=torch.bfloat16, device=dev)

                def grouped_gemms() -> None:
                    torch._grouped_mm(xs, w13_t, offs=ends)
                    torch._grouped_mm(a_sorted, w2_t, offs=ends)

                def grouped() -> torch.Tensor:
                    g = torch._grouped_mm(x[tokens], w13_t, offs=ends)
                    act = F.silu(g[:, :inter]) * g[:, inter:]
                    o = torch._grouped_mm(act, w2_t, offs=ends) * flat_w[pairs.long(), None]
                    return torch.zeros(m, hidden, dtype=torch.bfloat16, device=dev).index_add_(0, tokens, o.to(torch.bfloat16))

                counts = (offsets[1:] - offsets[:-1]).tolist()
                lists = [(i, tokens[offsets[i]:offsets[i + 1]], flat_w[pairs[offsets[i]:offsets[i + 1]].long(), None])
                         for i in range(e) if counts[i]]

                def loop() -> torch.Tensor:
                    out = torch.zeros(m, hidden, dtype=torch.bfloat16, device=dev)
                    for i, tok, wt in lists:
                        g = x[tok] @ w13[i].T
                        out.index_add_(0, tok, ((F.silu(g[:, :inter]) * g[:, inter:]) @ w2[i].T * wt).to(torch.bfloat16))
                    return out

                ours()
                ref = loop().float()
                err = ((y - ref).norm() / ref.norm()).item()
                assert err < 2e-2, f"{shape} M={m}: flashgen's experts differ from the loop's by {err:.2e}"
                fns = {"flashgen": ours, "aligned": ours_aligned, "loop": loop}
                try:
                    grouped_gemms()
                    fns.update(grouped=grouped, grouped_gemms=grouped_gemms)
                except (RuntimeError, AttributeError) as exc:  # torch without a grouped GEMM for this device
                    print(f"  torch._grouped_mm unavailable: {str(exc).splitlines()[0]}")
                touched = len(lists)
                nbytes = touched * 3 * inter * hidden * 2 + m * hidden * (2 + 4) + m * k * inter * 4
                t = bench_side_by_side(fns, nbytes, target.get("l2_bytes"), rounds=args.rounds)
                roof = nbytes / (bw * 1e3)
                gm, gg = t.get("grouped", float("nan")), t.get("grouped_gemms", float("nan"))
                rows.append([shape, m, routing_form, touched, t["flashgen"], t["aligned"], gg, gm, t["loop"], roof,
                             roof / t["flashgen"], t["loop"] / t["flashgen"], gg / t["flashgen"],
                             str(k_up.schedule), str(k_down.schedule)])
                print(f"{shape:8s} M={m:<5d} flashgen {t['flashgen']:9.2f} us  grouped_mm gemms {gg:9.2f}  "
                      f"loop {t['loop']:9.2f}  roof {roof:8.2f}  err {err:.1e}  ({time.perf_counter() - t0:.0f}s)",
                      flush=True)
                write_results(args.name, header, rows, {**environment(), "target": target.id, "copy_gbs": bw},
                              args.out_dir, NOTE.format(trials=args.trials, bw=bw))
            del w13, w2, w13_t, w2_t
            torch.cuda.empty_cache()
    print_table(("shape", "M", "routing", "us", "+align", "of_roof", "vs_loop", "vs_gmm"),
                [(r[0], r[1], r[2], r[4], r[5], r[10], r[11], r[12]) for r in rows])


NOTE = ("bf16 experts. Each generated GEMM tuned with {trials} new measured schedules (the analytic default first, "
        "then the cost model's ranking). flashgen_us: y zeroed + gate_up + down, in the routing the decoder uses "
        "at that M; flashgen+align_us adds moe_align (sorted routing only). "
        "grouped_mm_gemms_us: torch._grouped_mm's two GEMMs alone; grouped_mm_us: its whole layer. loop_us: a cuBLAS "
        "GEMM pair per touched expert. Roofline: the touched experts' weights and the activations over the measured "
        "copy bandwidth {bw:.0f} GB/s. of_roofline = roofline / flashgen; vs_* = peer / flashgen (above 1: flashgen "
        "faster).")


if __name__ == "__main__":
    main()
