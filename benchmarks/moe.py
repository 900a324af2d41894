"""The generated MoE experts (moe_gemm_gate_up + moe_gemm_down) in each expert format against
torch._grouped_mm, a loop of cuBLAS GEMMs per expert (what transformers runs; both bf16) and the
roofline, side by side in one run.

    python benchmarks/moe.py --db DB [--trials 8] [--shapes mixtral,qwen3] [--ms 1,16,64,256,4096]
        [--weights half,w8a16,w4a16g128,w8a8,w4a8g128] [--name moe] [--rounds 2]

Each (shape, M): a router's top-k of random logits (softmax, top-k, renormalised); the same tokens,
weights and routing for every version. Versions timed:
- flashgen, once per `--weights` format (the bf16 weights stacked and quantized as the decoder's mode
  of that format does, runtime/decoder/moe_experts.py): the two generated grouped GEMMs (y zeroed,
  gate_up, down; with int8 activations, x quantized per token and h per pair by the generated
  dynamic_quant kernels before each) in the routing the decoder
  uses at that M (ids up to 64 tokens: the kernels read the router's ids; sorted beyond: pairs ordered
  by `moe_align` first), after each is tuned briefly (`--trials` new measured schedules, every
  candidate checked against the float64 reference); flashgen+align adds the alignment of the sorted
  routing (torch's sort and a scatter, as the decoder runs it; the ids routing has none);
- grouped_mm: the same pairs through torch._grouped_mm (gather, gate_up, SiLU·mul, down, weights,
  index_add); grouped_mm GEMMs: its two grouped GEMMs alone, the kernels flashgen's replace;
- loop: per touched expert, its tokens gathered, x @ w13.T, SiLU·mul, @ w2.T, weighted, index_add
  (the expert lists made outside the timing, which favours the loop).
Roofline: the touched experts' weight bytes (in the format) plus the activations, over the measured
copy bandwidth. err_vs_bf16: the format's output against the bf16 loop's (its quantization error).
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
from flashgen.oplib.moe import INT8_ACTIVATIONS, WEIGHTS, moe_align  # noqa: E402
from flashgen.runtime.decoder.model import IDS_ROUTING_MAX_TOKENS  # noqa: E402
from flashgen.runtime.decoder.moe_experts import stack_experts  # noqa: E402
from flashgen.runtime.decoder.quant_modes import MODES  # noqa: E402
from flashgen.schedules.moe_features import WEIGHT_BYTES  # noqa: E402
from flashgen.schedules.tuner import TuneTask, tune  # noqa: E402
from flashgen.targets import device_target  # noqa: E402

# (experts, top-k, hidden, intermediate)
SHAPES = {"mixtral": (8, 2, 4096, 14336), "qwen3": (128, 8, 2048, 768)}


def routing(m: int, e: int, k: int, dev: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids [m, k] and renormalised weights of a random router."""
    logits = torch.randn(m, e, generator=gen).to(dev)
    w, ids = logits.softmax(-1).topk(k, dim=-1)
    return ids.to(torch.int32), (w / w.sum(-1, keepdim=True)).float()


def expert_modes(hidden: int, inter: int) -> dict[str, type]:
    """The decoder's quant mode class of each moe `weights` format, for experts of these widths (the
    first mode giving a format: mixed's experts are its w4a16 linear's)."""
    modes: dict[str, type] = {}
    for cls in MODES.values():
        fmt = cls.stacked_format(hidden, inter)
        if fmt is not None:
            modes.setdefault(fmt, cls)
    return modes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default="1,16,64,256,4096")
    ap.add_argument("--weights", default="half", help=f"expert formats, side by side: any of {','.join(WEIGHTS)}")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default="moe")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    formats = args.weights.split(",")
    bad = [f for f in formats if f not in WEIGHTS]
    if bad:
        ap.error(f"unknown expert format(s) {', '.join(bad)}; valid: {', '.join(WEIGHTS)}")
    dev = torch.device("cuda")
    target = device_target(dev)
    bw = copy_gbs()
    header = ("shape", "M", "weights", "routing", "touched", "flashgen_us", "flashgen+align_us", "grouped_mm_gemms_us",
              "grouped_mm_us", "loop_us", "roofline_us", "of_roofline", "vs_loop", "vs_grouped_mm_gemms", "err_vs_bf16",
              "gate_up schedule", "down schedule")
    rows = []
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    with Database(args.db) as db, tuning_session(target) as session:
        for shape in args.shapes.split(","):
            e, k, hidden, inter = SHAPES[shape]
            w13 = (torch.randn(e, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dev, torch.bfloat16)
            w2 = (torch.randn(e, hidden, inter, generator=gen) / inter ** 0.5).to(dev, torch.bfloat16)
            w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)  # [E, K, N] views, column-major per expert
            modes = expert_modes(hidden, inter)
            stacked = {f: stack_experts([(lambda i=i: w13[i], lambda i=i: w2[i]) for i in range(e)], modes[f])
                       for f in formats if f in modes}
            for m in map(int, args.ms.split(",")):
                routing_form = "ids" if m <= IDS_ROUTING_MAX_TOKENS else "sorted"
                x = torch.randn(m, hidden, generator=gen).to(dev, torch.bfloat16)
                ids, weights = routing(m, e, k, dev, gen)
                pairs, offsets = moe_align(ids, e)
                flat_w = weights.flatten().contiguous()
                tokens = (pairs // k).long()
                route = {"topk_ids": ids} if routing_form == "ids" else {"sorted_pairs": pairs, "expert_offsets": offsets}
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

                ref = loop().float()
                peers = {"loop": loop}
                try:
                    grouped_gemms()
                    peers.update(grouped=grouped, grouped_gemms=grouped_gemms)
                except (RuntimeError, AttributeError) as exc:  # torch without a grouped GEMM for this device
                    print(f"  torch._grouped_mm unavailable: {str(exc).splitlines()[0]}")
                touched = len(lists)
                for fmt in formats:
                    if fmt not in stacked:
                        print(f"  {shape}: no stacked form of {fmt} experts at widths {hidden} x {inter}")
                        continue
                    ours, ours_aligned, schedules, err = flashgen_experts(
                        db, target, session, args.trials, fmt, stacked[fmt], x, route, flat_w, ids, pairs, offsets,
                        dict(M=m, E=e, topk=str(k), dtype="bf16", routing=routing_form), inter, ref)
                    assert err < ERR_BOUND[fmt], f"{shape} M={m} {fmt}: flashgen's experts differ from bf16's by {err:.2e}"
                    nbytes = int(touched * 3 * inter * hidden * WEIGHT_BYTES[fmt] + m * hidden * (2 + 4) + m * k * inter * 4)
                    t = bench_side_by_side({"flashgen": ours, "aligned": ours_aligned, **peers}, nbytes,
                                           target.get("l2_bytes"), rounds=args.rounds)
                    roof = nbytes / (bw * 1e3)
                    gm, gg = t.get("grouped", float("nan")), t.get("grouped_gemms", float("nan"))
                    rows.append([shape, m, fmt, routing_form, touched, t["flashgen"], t["aligned"], gg, gm, t["loop"], roof,
                                 roof / t["flashgen"], t["loop"] / t["flashgen"], gg / t["flashgen"], err, *schedules])
                    print(f"{shape:8s} M={m:<5d} {fmt:10s} flashgen {t['flashgen']:9.2f} us  grouped_mm gemms {gg:9.2f}  "
                          f"loop {t['loop']:9.2f}  roof {roof:8.2f}  err {err:.1e}  ({time.perf_counter() - t0:.0f}s)",
                          flush=True)
                    write_results(args.name, header, rows, {**environment(), "target": target.id, "copy_gbs": bw},
                                  args.out_dir, NOTE.format(trials=args.trials, bw=bw))
            del w13, w2, w13_t, w2_t, stacked
            torch.cuda.empty_cache()
    print_table(("shape", "M", "weights", "routing", "us", "+align", "of_roof", "vs_loop", "vs_gmm"),
                [(r[0], r[1], r[2], r[3], r[5], r[6], r[11], r[12], r[13]) for r in rows])


ERR_BOUND = {"half": 2e-2, "w8a16": 5e-2, "w8a8": 5e-2, "w4a16g128": 0.25, "w4a8g128": 0.25}  # vs the bf16 loop


def flashgen_experts(db, target, session, trials: int, fmt: str, stacked, x, route, flat_w, ids, pairs, offsets,
                     kw: dict, inter: int, ref: torch.Tensor):
    """The generated experts of format `fmt` tuned briefly and bound: (the call, the call with the
    sorted routing's alignment, the two schedules, the error against the bf16 loop). Formats with
    int8 activations quantize x per token and h per pair first, by the generated dynamic_quant
    kernels (bound too), as the decoder does (runtime/decoder/moe_experts.py)."""
    m, hidden = x.shape
    e, k = kw["E"], int(kw["topk"])
    up_w, down_w = stacked
    wl_up = flashgen.workload("moe_gemm_gate_up", N=inter, K=hidden, weights=fmt, **kw)
    wl_down = flashgen.workload("moe_gemm_down", N=hidden, K=inter, weights=fmt, **kw)
    quant = fmt in INT8_ACTIVATIONS
    wl_qx = flashgen.workload("dynamic_quant", M=m, N=hidden, dtype="bf16", out_dtype="int8")
    wl_qh = flashgen.workload("dynamic_quant", M=m * k, N=inter, dtype="bf16", out_dtype="int8")
    for wl in (wl_up, wl_down, *((wl_qx, wl_qh) if quant else ())):
        tune(TuneTask(wl, target, trials, strategy="evolutionary"), db, progress=None, **session)
    k_up, k_down = flashgen.compile(wl_up, target, db=db), flashgen.compile(wl_down, target, db=db)
    y = torch.zeros(m, hidden, dtype=torch.float32, device=x.device)
    h = torch.empty(m * k, inter, dtype=torch.bfloat16, device=x.device)
    calls = []
    if quant:
        xq = torch.empty(m, hidden, dtype=torch.int8, device=x.device)
        xs = torch.empty(m, dtype=torch.float32, device=x.device)
        hq = torch.empty(m * k, inter, dtype=torch.int8, device=x.device)
        hs = torch.empty(m * k, dtype=torch.float32, device=x.device)
        calls.append(flashgen.compile(wl_qx, target, db=db).bind({"x": x}, {"q": xq, "scale": xs}))
        up_acts, down_acts = {"x_q": xq, "x_scale": xs}, {"h_q": hq, "h_scale": hs}
    else:
        up_acts, down_acts = {"x": x}, {"h": h}
    calls.append(k_up.bind({**up_acts, **up_w, **route}, {"h": h}))
    if quant:
        calls.append(flashgen.compile(wl_qh, target, db=db).bind({"x": h}, {"q": hq, "scale": hs}))
    calls.append(k_down.bind({**down_acts, **down_w, "topk_weights": flat_w, "y": y, **route}, {}))

    def ours() -> None:
        y.zero_()
        for call in calls:
            call()

    def ours_aligned() -> None:
        if "sorted_pairs" in route:
            p, o = moe_align(ids, e)
            pairs.copy_(p)
            offsets.copy_(o)
        ours()

    ours()
    err = ((y - ref).norm() / ref.norm()).item()
    return ours, ours_aligned, (str(k_up.schedule), str(k_down.schedule)), err


NOTE = ("Each generated GEMM (and dynamic_quant kernel) tuned with {trials} new measured schedules (the analytic default first, "
        "then the cost model's ranking). flashgen_us: y zeroed + gate_up + down, in the routing the decoder uses "
        "at that M (with int8 activations, their per-row quantization too); flashgen+align_us adds moe_align "
        "(sorted routing only). The peers run bf16 experts. "
        "grouped_mm_gemms_us: torch._grouped_mm's two GEMMs alone; grouped_mm_us: its whole layer. loop_us: a cuBLAS "
        "GEMM pair per touched expert. Roofline: the touched experts' weights and the activations over the measured "
        "copy bandwidth {bw:.0f} GB/s. of_roofline = roofline / flashgen; vs_* = peer / flashgen (above 1: flashgen "
        "faster).")


if __name__ == "__main__":
    main()
