"""Whether a change to the contraction code generator changed the machine code: builds a fixed set of
GEMM/GEMV kernels ahead of time for the H200 (sm_90, no GPU needed), the Llama-3-8B decode shapes'
fastest recorded schedules and analytic defaults chosen to cover every code path (GEMV tiles per
element, PTX pairs and quads, split K, TMA, persistent tiles, operand scaling, a fused norm's row
pass, a weight dequantized first), and saves or compares their SASS.

    python benchmarks/studies/contraction_sass.py --save /tmp/sass_before      # before the change
    python benchmarks/studies/contraction_sass.py --compare /tmp/sass_before   # after: table in results/

Instruction streams are compared with register numbers, labels and addresses normalized away, so a
renumbering alone reads as identical; any other difference is counted per kernel.
"""
from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import RESULTS, replayed_records  # noqa: E402
from disasm import sass_text  # noqa: E402

import flashgen  # noqa: E402
from flashgen.workload import Workload, workload  # noqa: E402

TARGET = "cuda:sm_90/h200"
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
W4 = {"dtype": "bf16", "G": 128, "pack": "k128"}
W4F = {**W4, "dtype": "fp16"}  # the M = 64 and 4096 records' activations
# (op, M, shape, attrs): the best recorded schedule of each
RECORDED = [("gemm", 1, "qkv", {}), ("gemm", 1, "down", {}), ("gemm", 64, "qkv", {}), ("gemm", 64, "o", {}),
            ("gemm", 4096, "qkv", {}), ("gemm", 4096, "gate_up", {}),
            *[("gemm_w4a16", 1, sh, W4) for sh in SHAPES],
            ("gemm_w4a16", 1, "o", {**W4, "with_residual": "yes"}),
            ("gemm_w4a16", 64, "qkv", W4F), ("gemm_w4a16", 64, "down", W4F),
            ("gemm_w4a16", 4096, "qkv", W4F), ("gemm_w4a16", 4096, "down", W4F),
            ("rmsnorm_gemm", 1, "qkv", {}), ("rmsnorm_gemm", 1, "gate_up", {}),
            ("silu_mul_gemm", 1, "down", {"with_residual": "yes"})]
# (op, M, shape, attrs, schedule overrides of the space's default)
ANALYTIC = [("gemm_w4a16", 1, "qkv", W4, {"ptx_unpack": 1, "block_k": 1024, "num_stages": 3}),
            ("gemm_w4a16", 1, "qkv", W4, {"ptx_unpack": 0, "block_k": 1024, "num_stages": 3}),
            ("gemm_w4a16", 16, "qkv", W4, {}),
            ("gemm_w4a16", 16, "o", W4, {"ptx_unpack": 0}),
            ("gemm_w4a16", 256, "qkv", W4, {}),
            ("gemm_w4a16", 4096, "qkv", W4, {}),
            ("gemm_w4a16", 64, "o", {**W4, "zp": "asym"}, {}),
            ("gemm", 256, "qkv", {}, {}),
            ("gemm", 256, "o", {}, {"tma": 0, "persistent": 1}),
            ("gemm_w8a16", 1, "qkv", {}, {}),
            ("gemm_w8a16", 64, "qkv", {}, {}),
            ("rmsnorm_gemm", 64, "qkv", {}, {}),
            ("rmsnorm_gemm_w4a16", 1, "qkv", W4, {}),
            ("rmsnorm_gemm_w4a16", 64, "qkv", W4, {}),
            ("silu_mul_gemm_w4a16", 1, "down", W4, {})]
RECORDS = [RESULTS / "h200_gemm_records.jsonl", RESULTS / "h200_fused_records.jsonl"]
INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
NORMAL = [(re.compile(r"\bU?R\d+\b"), "R"), (re.compile(r"\bU?P\d\b"), "P"), (re.compile(r"\.L_x_\d+"), "L"),
          (re.compile(r"0x[0-9a-f]+"), "0x")]


def kernels() -> list[tuple[str, Workload, dict]]:
    """(name, workload, schedule) of every kernel compared."""
    from flashgen.schedules.space import ScheduleSpace
    from flashgen.targets import get_target

    out = []
    with replayed_records(RECORDS[0]) as (db, _):
        db.import_jsonl(RECORDS[1])
        for op, m, shape, attrs in RECORDED:
            n, k = SHAPES[shape]
            wl = workload(op, M=m, N=n, K=k, **attrs)
            rec = db.best(wl.key, TARGET)
            if rec is None:
                print(f"no record for {op} M={m} {shape}", file=sys.stderr)
                continue
            tag = "-res" if attrs.get("with_residual") else "-fp16" if attrs.get("dtype") == "fp16" else ""
            out.append((f"{op}-M{m}-{shape}{tag}-best", wl, dict(rec.schedule)))
    target = get_target(TARGET)
    for i, (op, m, shape, attrs, over) in enumerate(ANALYTIC):
        n, k = SHAPES[shape]
        wl = workload(op, M=m, N=n, K=k, **attrs)
        space = ScheduleSpace(wl, target)
        s = {**space.default(), **over}
        assert space.why_invalid(s) is None, (op, m, s, space.why_invalid(s))
        out.append((f"{op}-M{m}-{shape}-{'zp' if attrs.get('zp') else ''}default{i}", wl, s))
    return out


def sass(wl: Workload, schedule: dict) -> str:
    """The SASS of the kernel's binaries (both parts of a weight dequantized first)."""
    k = flashgen.compile(wl, TARGET, schedule=schedule)
    parts = k.parts or (k,)
    return "\n".join(sass_text(p.binary) for p in parts)


def instructions(text: str, normal: bool = True) -> list[str]:
    """The instruction stream (the code sections' lines, not the debug line tables'), with `normal`
    register numbers, predicates, labels and constants aside."""
    out = []
    for raw in INSTRUCTION.findall(text):
        for pat, rep in NORMAL if normal else ():
            raw = pat.sub(rep, raw)
        out.append(" ".join(raw.split()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save", type=Path, help="folder to write each kernel's SASS to")
    mode.add_argument("--compare", type=Path, help="folder of SASS saved before, to compare with")
    ap.add_argument("--out", type=Path, default=RESULTS / "contraction_split_sass.md")
    args = ap.parse_args()
    rows = []
    for name, wl, s in kernels():
        t0 = time.time()
        text = sass(wl, s)
        if args.save:
            args.save.mkdir(parents=True, exist_ok=True)
            (args.save / f"{name}.sass").write_text(text)
            (args.save / f"{name}.json").write_text(json.dumps(s, sort_keys=True))
            print(f"{name}: {len(instructions(text))} instructions ({time.time() - t0:.1f}s)", flush=True)
            continue
        before = (args.compare / f"{name}.sass").read_text()
        a, b = instructions(before), instructions(text)
        exact = before == text
        diff = sum(1 for line in difflib.unified_diff(a, b, lineterm="", n=0)
                   if line[:1] in "+-" and not line.startswith(("+++", "---")))
        same = instructions(before, normal=False) == instructions(text, normal=False)
        rows.append((name, json.dumps(s, sort_keys=True), len(a), len(b), "yes" if a == b else f"no ({diff} lines)",
                     "yes" if same else "no", "yes" if exact else "no"))
        print(rows[-1], flush=True)
    if args.compare:
        lines = ["# Contraction code generator: SASS before and after",
                 "", f"`python benchmarks/studies/contraction_sass.py --compare DIR` on {TARGET} (AOT, no GPU). "
                 "identical: the instruction streams with register numbers, predicates, labels and constants "
                 "normalized; same registers: the instruction streams as they are; whole text: all of nvdisasm's "
                 "output, whose debug line tables name the generated module (by its source's hash) and its lines.",
                 "", "| kernel | schedule | instructions before | after | identical | same registers | whole text |",
                 "|---|---|---|---|---|---|---|"]
        lines += ["| " + " | ".join(str(v) if i != 1 else f"`{v}`" for i, v in enumerate(r)) + " |" for r in rows]
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
