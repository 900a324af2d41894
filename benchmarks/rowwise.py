"""Rowwise/pointwise kernels with the analytic default schedule vs torch eager, torch.compile and the
copy-bandwidth roofline, all measured in one run on the current GPU.

    python benchmarks/rowwise.py [--ops rmsnorm,rope] [--out-dir benchmarks/results]

N is the hidden size; for rope it picks Llama-shaped heads (N=4096: Hq=32 Hkv=8 D=128; N=8192:
Hq=64 Hkv=8 D=128) and a 4096-entry cos/sin cache.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, bench_side_by_side, copy_gbs, environment, print_table, write_results  # noqa: E402
from peers import PEERS  # noqa: E402

import flashgen  # noqa: E402
from flashgen.check import check  # noqa: E402
from flashgen.roofline import bytes_moved  # noqa: E402
from flashgen.targets import target_for_device  # noqa: E402
from flashgen.targets.triton.launch import device_arch  # noqa: E402

MS = (1, 32, 4096, 16384)
NS = (4096, 8192)
OPS = ("rmsnorm", "add_rmsnorm", "dynamic_quant", "silu_mul", "rope")


def make_workload(op: str, m: int, n: int) -> flashgen.Workload:
    if op == "rope":
        return flashgen.workload("rope", M=m, Hq=n // 128, Hkv=8, D=128, L=4096, dtype="bf16")
    if op in ("dynamic_quant", "rmsnorm_quant"):
        return flashgen.workload(op, M=m, N=n, dtype="fp16", out_dtype="int8")
    return flashgen.workload(op, M=m, N=n, dtype="bf16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch._dynamo.config.cache_size_limit = 256
    dev = torch.device("cuda")
    target = target_for_device(torch.cuda.get_device_name(), device_arch(dev))
    bw = copy_gbs()
    print(f"{target.id}: measured copy bandwidth {bw:.0f} GB/s", flush=True)
    header = ("op", "M", "N", "schedule", "flashgen_us", "eager_us", "compile_us", "roofline_us",
              "vs_eager", "vs_compile", "of_roofline", "GB/s")
    rows = []
    for op in args.ops.split(","):
        peer = PEERS[op]
        compiled = torch.compile(peer, dynamic=False)
        for n in NS:
            for m in map(int, args.ms.split(",")):
                wl = make_workload(op, m, n)
                kernel = flashgen.compile(wl, target)
                bad = [c for c in check(wl, lambda i, o: kernel.run(i, o), 0, dev) if not c.ok]
                if bad:
                    raise SystemExit(f"{wl}: wrong result {bad}")
                gen = torch.Generator().manual_seed(1)
                ins = {k: v.to(dev) for k, v in wl.op.make_inputs(wl.dim, wl.attr, gen).items()}
                outs = kernel.run(ins)
                compiled(**ins)
                t = bench_side_by_side({"fg": lambda: kernel.run(ins, outs), "eager": lambda: peer(**ins),
                                        "compile": lambda: compiled(**ins)}, bytes_moved(wl),
                                       target.get("l2_bytes"))
                t_fg, t_eager, t_comp = t["fg"], t["eager"], t["compile"]
                nbytes = bytes_moved(wl)
                t_roof = nbytes / (bw * 1e3)
                row = (op, m, n, kernel.schedule, t_fg, t_eager, t_comp, t_roof, t_eager / t_fg,
                       t_comp / t_fg, t_roof / t_fg, nbytes / (t_fg * 1e3))
                rows.append(row)
                print(f"{op:14s} M={m:<6d} N={n:<5d} fg {t_fg:8.2f} us  eager {t_eager:8.2f}  "
                      f"compile {t_comp:8.2f}  roof {t_roof:8.2f}", flush=True)
    meta = {**environment(), "target": target.id, "copy_gbs": bw}
    note = ("vs_eager / vs_compile: peer time / flashgen time (above 1: flashgen faster). of_roofline: "
            "roofline time / flashgen time, roofline = bytes moved / measured copy bandwidth "
            f"({bw:.0f} GB/s). Default (untuned) schedules.")
    write_results("rowwise", header, [[*r[:3], str(r[3]), *r[4:]] for r in rows], meta, args.out_dir, note)
    print_table(("op", "M", "N", "fg_us", "vs_compile", "of_roofline"),
                [(r[0], r[1], r[2], r[4], r[9], r[10]) for r in rows])


if __name__ == "__main__":
    main()
