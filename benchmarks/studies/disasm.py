"""What the tuned GEMM kernels are made of, from their SASS: rebuilds each workload's fastest recorded
schedule ahead of time (no GPU needed) and counts the instructions that decide GEMM speed on sm_90:
warpgroup MMA (HGMMA/IGMMA/QGMMA) against the older warp MMA (HMMA/IMMA), 16-byte global loads (LDG.128,
and LDGSTS.128 asynchronous copies to shared memory) against narrower ones, TMA copies (UTMALDG), and
shared-memory stores of a dequantized tile (STS), per kernel, whole binary.

    python benchmarks/studies/disasm.py benchmarks/results/h200_gemm_records.jsonl [--ops gemm,gemm_w4a16]

Uses the nvdisasm that ships with Triton.
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import RESULTS, environment, print_table, replayed_records, write_results  # noqa: E402

import flashgen  # noqa: E402
from flashgen.workload import Workload, recorded_workload  # noqa: E402

SHAPES = {(8192, 8192): "8192x8192", (6144, 4096): "qkv", (28672, 4096): "gate_up", (4096, 14336): "down"}
OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def nvdisasm() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"


def sass_text(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(nvdisasm()), f.name], check=True, capture_output=True, text=True).stdout


def opcodes(cubin: bytes) -> collections.Counter:
    """Opcode counts (with modifiers) of a cubin's SASS."""
    return collections.Counter(OPCODE.findall(sass_text(cubin)))


MATRIX = re.compile(r"[HIQ]GMMA|HMMA|IMMA")


def loop_opcodes(cubin: bytes) -> collections.Counter:
    """Opcode counts of a GEMM's steady k loop, whose count per k step says what a tile costs apart
    from the pipeline's prologue and epilogue: the narrowest loop (backward branch) that holds a matrix
    instruction (a persistent program's tile loop and a warp-specialized kernel's partitions hold it
    too, wider), else the widest loop (ALU tiles)."""
    lines = sass_text(cubin).splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\s*(\.L_x_\d+):", line))}
    spans = [(labels[m.group(1)], i) for i, line in enumerate(lines)  # a branch to itself is no loop body
             if (m := re.search(r"BRA `?\(?(\.L_x_\d+)", line)) and labels.get(m.group(1), i) < i - 1]
    if not spans:
        return collections.Counter()
    matrix = [sp for sp in spans if any(MATRIX.match(op) for op in OPCODE.findall("\n".join(lines[sp[0]:sp[1] + 1])))]
    first, last = (min(matrix, key=lambda sp: sp[1] - sp[0]) if matrix
                   else max(spans, key=lambda sp: sp[1] - sp[0]))
    return collections.Counter(OPCODE.findall("\n".join(lines[first:last + 1])))


def summary(ops: collections.Counter) -> dict[str, int]:
    def count(pred) -> int:
        return sum(n for op, n in ops.items() if pred(op))

    return {
        "wgmma": count(lambda o: re.match(r"[HIQ]GMMA", o) is not None),
        "warp_mma": count(lambda o: re.match(r"(HMMA|IMMA)", o) is not None),
        "loads_16B": count(lambda o: o.startswith(("LDG.", "LDGSTS.")) and ".128" in o),
        "loads_narrow": count(lambda o: o.startswith(("LDG.", "LDGSTS.")) and ".128" not in o),
        "tma": count(lambda o: o.startswith("UTMALDG")),
        "sts": count(lambda o: o.startswith("STS")),
        # 2-byte stores; STSM (stmatrix, an epilogue's 16-byte matrix rows) is not one
        "sts_16bit": count(lambda o: o.startswith("STS.") and (".U16" in o or ".16" in o)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", type=Path, help="JSON-lines records (flashgen db export)")
    ap.add_argument("--ops", default="gemm,gemm_w4a16,gemm_w8a8,gemm_fp8")
    ap.add_argument("--target", default="cuda:sm_90/h200")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    ops = args.ops.split(",")
    with replayed_records(args.records) as (db, _):
        best = [r for r in db.best_all(args.target)
                if r.workload.get("op") in ops and recorded_workload(r.workload, r.workload_key)]
    best.sort(key=lambda r: (ops.index(r.workload["op"]), SHAPES.get((r.workload["dims"]["N"], r.workload["dims"]["K"]), ""),
                             r.workload["dims"]["M"]))
    rows = []
    for i, rec in enumerate(best):
        wl = Workload.from_json(rec.workload)
        d = wl.dim
        kernel = flashgen.compile(wl, args.target, schedule=rec.schedule)
        s = summary(opcodes(kernel.binary))
        loop = sum(loop_opcodes(kernel.binary).values())
        rows.append([wl.op_name, SHAPES.get((d["N"], d["K"]), f"{d['N']}x{d['K']}"), d["M"], rec.latency_us,
                     *s.values(), loop, str(rec.schedule)])
        print(f"[{i + 1}/{len(best)}] {wl.op_name} M={d['M']} N={d['N']} K={d['K']}: {s}", flush=True)
    meta = environment(f"{args.target} (AOT, no GPU)")
    header = ("op", "shape", "M", "recorded_us", *summary(collections.Counter()), "k_loop_instructions", "schedule")
    write_results("disasm", header, rows, meta, args.out_dir,
                  "Counts over the whole SASS of each workload's fastest recorded schedule (static instructions, "
                  "not executions). wgmma: HGMMA/IGMMA/QGMMA (sm_90 warpgroup MMA); warp_mma: HMMA/IMMA; "
                  "loads_16B: LDG.128 and LDGSTS.128 (cp.async); tma: UTMALDG; sts_16bit: 2-byte shared stores. "
                  "k_loop_instructions: static instructions of the k loop (the narrowest loop holding a matrix instruction, else the widest: one k step per thread).")
    print_table(("op", "shape", "M", "us", "wgmma", "warp_mma", "loads_16B", "loads_narrow", "sts_16bit"),
                [(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[10]) for r in rows])


if __name__ == "__main__":
    main()
