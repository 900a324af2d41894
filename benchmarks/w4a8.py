"""gemm_w4a8 and its fp8 flavour gemm_w4fp8 against cuBLAS fp16 and flashgen's own W8A8 and W4A16 GEMMs,
side by side in one run on the current GPU, on Llama-3-8B's linear shapes. The `--tuned` modes
(gemm_w4a8: groups of 128, bf16 out, its codes in the `--pack` layout, `lanes` by default, the one the
decoder's w4a8 linears pack; gemm_w4fp8: w4a16's codes and groups of 128 times e4m3 activations, sm_90
only) are tuned briefly first (`--trials` new measured schedules, every candidate checked against the
float64 reference); the other GEMMs (W8A8 bf16, W4A16 groups of 128 fp16) time the database's best
records (the shipped ones where the database has none), after `--peer-trials` new ones each. The peer: torch.matmul fp16 on the
W4A16 weight dequantized. Every record stays in the database, which the decoder's `quant=mixed` then
chooses from (runtime/decoder/linear.py).

    python benchmarks/w4a8.py --db DB [--trials 6] [--tuned w4a8] [--peer-trials 0] [--shapes qkv,o,gate_up,down]
        [--ms 1,16,256,4096] [--pack lanes] [--name w4a8]
    python benchmarks/w4a8.py --db DB --dry-run sm_90   # no GPU: every workload's default kernel built AOT
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, bench_side_by_side, copy_gbs, environment, print_table, tuning_session, write_results  # noqa: E402
from gemm import SHAPES, peer  # noqa: E402

import flashgen  # noqa: E402
from flashgen.db import Database  # noqa: E402
from flashgen.roofline import bytes_moved  # noqa: E402
from flashgen.schedules.tuner import TuneTask, tune  # noqa: E402
from flashgen.targets import device_target  # noqa: E402

MODES = {"w4a8": ("gemm_w4a8", {"G": 128, "dtype": "bf16"}), "w8a8": ("gemm_w8a8", {"dtype": "bf16"}),
         "w4a16": ("gemm_w4a16", {"G": 128, "dtype": "fp16"}), "w4fp8": ("gemm_w4fp8", {"G": 128, "dtype": "bf16"})}


def workloads(ms: str, shapes: str, pack: str, fp8: bool = True):
    """(M, shape, {mode: workload}) of the run, in its order (w4fp8 only where the target has e4m3: `fp8`)."""
    for m in map(int, ms.split(",")):
        for shape in shapes.split(","):
            n, k = SHAPES[shape]
            yield m, shape, {mode: flashgen.workload(op, M=m, N=n, K=k, **kw, **({"pack": pack} if mode == "w4a8" else {}))
                             for mode, (op, kw) in MODES.items() if fp8 or mode != "w4fp8"}


def dry_run(args) -> None:
    """What the run would build, without a GPU: each workload's default schedule compiled ahead of time
    for `args.dry_run`."""
    from flashgen.schedules.space import ScheduleSpace
    from flashgen.targets import get_target

    target = get_target(args.dry_run)
    for m, shape, wls in workloads(args.ms, args.shapes, args.pack, "fp8e4m3" in target.dtypes):
        for mode, wl in wls.items():
            s = ScheduleSpace(wl, target).default()
            kern = flashgen.compile(wl, target, schedule=s)
            print(f"{shape:8s} M={m:<5d} {mode:6s} {s.get('variant')}: {len(kern.binary or b'')} bytes", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("--trials", type=int, default=6, help="new measured schedules of the --tuned modes' GEMMs per workload")
    ap.add_argument("--tuned", default="w4a8", help=f"modes tuned with --trials, comma-separated ({', '.join(MODES)})")
    ap.add_argument("--peer-trials", type=int, default=0, help="and of the W8A8 and W4A16 GEMMs")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--ms", default="1,16,256,4096")
    ap.add_argument("--pack", default="lanes", help="gemm_w4a8's weight layout (flashgen/quant.py PACKS)")
    ap.add_argument("--dry-run", metavar="TARGET", help="build every workload's default kernel for TARGET, no GPU")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default="w4a8")
    args = ap.parse_args()
    if args.dry_run:
        return dry_run(args)
    dev = torch.device("cuda")
    target = device_target(dev)
    bw = copy_gbs()
    tuned = set(args.tuned.split(","))
    if tuned - set(MODES):
        raise SystemExit(f"--tuned: unknown modes {sorted(tuned - set(MODES))}; valid: {', '.join(MODES)}")
    header = ("shape", "M", "N", "K", "w4a8_us", "w8a8_us", "w4a16_us", "cublas_fp16_us", "vs_cublas_fp16",
              "vs_w8a8", "vs_w4a16", "roofline_us", "of_roofline", "w4a8 schedule", "w4fp8_us", "w4fp8_vs_w8a8",
              "w4fp8_vs_w4a8", "w4fp8 schedule")
    rows = []
    t0 = time.perf_counter()
    with Database(args.db) as db, tuning_session(target) as session:
        for m, shape, wls in workloads(args.ms, args.shapes, args.pack, "fp8e4m3" in target.dtypes):
            n, k = SHAPES[shape]
            fns, kernels = {}, {}
            for mode, wl in wls.items():
                trials = args.trials if mode in tuned else args.peer_trials
                res = tune(TuneTask(wl, target, trials, strategy="evolutionary"), db, progress=None, **session)
                if res.best is None and trials:
                    print(f"{wl}: no correct schedule", flush=True)
                    continue
                kern = flashgen.compile(wl, target, db=db)
                ins = {kk: v.to(dev) for kk, v in wl.op.make_inputs(wl.dim, wl.attr, torch.Generator().manual_seed(3)).items()}
                out = kern.run(ins)
                fns[mode], kernels[mode] = (lambda kern=kern, ins=ins, out=out: kern.run(ins, out)), (kern, wl, ins)
                if mode == "w4a16":
                    p = peer("gemm_w4a16", ins)
                    if p is not None:
                        fns["cublas_fp16"] = p
            if "w4a8" not in fns:
                continue
            nbytes = 2 * n * k  # the fp16 weight's: every version's weights flushed from the L2 alike
            t = bench_side_by_side(fns, nbytes, target.get("l2_bytes"), rounds=args.rounds)
            kern, wl, _ = kernels["w4a8"]
            roof = max(2.0 * m * n * k / (target.peak_tflops["int8"] * 1e6), bytes_moved(wl) / (bw * 1e3))
            nan = float("nan")
            w4 = t["w4a8"]
            f8 = t.get("w4fp8", nan)
            rows.append([shape, m, n, k, w4, t.get("w8a8", nan), t.get("w4a16", nan), t.get("cublas_fp16", nan),
                         t.get("cublas_fp16", nan) / w4, t.get("w8a8", nan) / w4, t.get("w4a16", nan) / w4,
                         roof, roof / w4, str(kern.schedule), f8, t.get("w8a8", nan) / f8, w4 / f8,
                         str(kernels["w4fp8"][0].schedule) if "w4fp8" in kernels else ""])
            print(f"{shape:8s} M={m:<5d} w4a8 {w4:8.2f} us  w8a8 {t.get('w8a8', nan):8.2f}  w4a16 "
                  f"{t.get('w4a16', nan):8.2f}  w4fp8 {f8:8.2f}  cuBLAS fp16 {t.get('cublas_fp16', nan):8.2f}  "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
            write_results(args.name, header, rows, {**environment(), "target": target.id, "copy_gbs": bw},
                          args.out_dir, NOTE.format(trials=args.trials, tuned=args.tuned, peer_trials=args.peer_trials,
                                                    bw=bw, pack=args.pack))
    print_table(("shape", "M", "w4a8_us", "vs_cublas", "vs_w8a8", "vs_w4a16", "of_roof", "w4fp8_us", "fp8_vs_w8a8",
                 "fp8_vs_w4a8"), [(r[0], r[1], r[4], r[8], r[9], r[10], r[12], r[14], r[15], r[16]) for r in rows])


NOTE = ("gemm_w4a8 (groups of 128, bf16 out, pack {pack}) and gemm_w4fp8 (w4a16's g128 codes, e4m3 activations, bf16 out); "
        "the modes {tuned} tuned with {trials} new measured schedules per workload, the others the database's best after "
        "{peer_trials} new ones. vs_* = the other's time / w4a8's (above 1: w4a8 faster); w4fp8_vs_* the same for w4fp8. cuBLAS fp16: torch.matmul on the W4A16 weight dequantized. Weights flushed from "
        "the L2 before each timed call. Roofline = max(flops / int8 datasheet peak, w4a8's bytes / measured copy "
        "bandwidth {bw:.0f} GB/s).")


if __name__ == "__main__":
    main()
