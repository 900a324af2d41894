"""Why the Gluon GEMM tiles run where they do against the Triton ones and cuBLAS: for each bf16 GEMM
workload (or W4A16, `--op gemm_w4a16`: fp16, groups of 128; or every recorded packed prefill of equal
lengths, `--op flash_prefill_attention`: its key-tile loop is the k loop), the fastest recorded schedule of each
generator form (Triton; Gluon with one consumer; Gluon with two taking turns; a prefill's persistent
Gluon programs apart; weights dequantized first are not counted), what their machine code is made of, and, on the GPU, what Nsight Compute
reads while they run.

    R="benchmarks/results/h200_gemm_records.jsonl benchmarks/results/h200_gluon_records.jsonl"
    python benchmarks/studies/gluon_vs_triton.py $R --sass                        # CPU: SASS table
    ncu --clock-control none --csv --page raw --metrics "$(python benchmarks/studies/gluon_vs_triton.py $R --metrics)" \\
        -k regex:"gemm|nvjet|xmma|cutlass|flash|fmha|sdpa|cudnn" python benchmarks/studies/gluon_vs_triton.py $R --launch > ncu.csv   # GPU
    python benchmarks/studies/gluon_vs_triton.py $R --ncu ncu.csv                 # CPU: counter table
    python benchmarks/studies/gluon_vs_triton.py benchmarks/results/h200_gluon_int4_records.jsonl --sass \
        --op gemm_w4a16 --shapes o,qkv,gate_up,down --ms 16,64,256             # CPU: the int4 tiles' SASS
    python benchmarks/studies/gluon_vs_triton.py benchmarks/results/h200_attention_records.jsonl \
        benchmarks/results/h200_gluon_attention_records.jsonl --sass --op flash_prefill_attention   # CPU: prefill

`--launch` runs each form's kernel, then its library peers (`peers`: cuBLAS, or SDPA's flash and cuDNN
backends), LAUNCHES times each in that order (the order the counter table is read in: both generators
give their kernel the op's name). Uses the nvdisasm and cuobjdump
that ship with Triton.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import csv
import io
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import RESULTS, environment, print_table, replayed_records, write_results  # noqa: E402
from disasm import loop_opcodes, nvdisasm, opcodes  # noqa: E402
from gemm import SHAPES, make_workload, peer  # noqa: E402

import flashgen  # noqa: E402
from flashgen.schedules.space import ScheduleSpace  # noqa: E402
from flashgen.targets import get_target  # noqa: E402

TARGET = "cuda:sm_90/h200"
FORMS = {"triton": (0, 1), "gluon": (1, 1), "gluon_2_consumers": (1, 2)}  # (backend, consumers), not dequantized first
LAUNCHES = 3
# Nsight Compute metrics (`--metrics`, raw page) and their column names here
COUNTERS = {"gpu__time_duration.sum": "duration_us",
            "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active": "tensor_pipe_pct",
            "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
            "sm__cycles_active.avg.pct_of_peak_sustained_elapsed": "sm_active_pct",
            "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
            "launch__registers_per_thread": "registers",
            "smsp__warp_issue_stalled_barrier_per_warp_active.pct": "stall_barrier_pct",
            "smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct": "stall_long_scoreboard_pct",
            "smsp__warp_issue_stalled_wait_per_warp_active.pct": "stall_wait_pct",
            "smsp__warp_issue_stalled_math_pipe_throttle_per_warp_active.pct": "stall_math_throttle_pct"}


@contextlib.contextmanager
def records(files: list[Path]) -> Iterator[Any]:
    """A scratch database holding every file's records."""
    with replayed_records(files[0]) as (db, _):
        for f in files[1:]:
            db.import_jsonl(f)
        yield db


def form_of(wl: flashgen.Workload, s: dict) -> str | None:
    """A schedule's generator form, spelled out flat (`ScheduleSpace.flat`), (None: weights dequantized first); a persistent Gluon
    prefill is a form of its own."""
    for form, (backend, consumers) in FORMS.items():
        if (s["backend"], s["consumers"], s.get("dequant_first", 0)) == (backend, consumers, 0):
            return form + ("_persistent" if wl.op.name == "flash_prefill_attention" and s.get("persistent") else "")
    return None


def best_per_form(db: Any, wl: flashgen.Workload) -> dict[str, Any]:
    """The fastest correct record of each generator form (None where none was measured)."""
    space = ScheduleSpace(wl, get_target(TARGET))
    best: dict[str, Any] = {}
    for rec in db.records(wl.key, TARGET, status="ok"):
        form = form_of(wl, space.flat(rec.schedule))
        if form is not None and (form not in best or rec.latency_us < best[form].latency_us):
            best[form] = rec
    order = [f + suffix for f in FORMS for suffix in ("", "_persistent")]  # the launch order
    return {form: best[form] for form in order if form in best}


def resources(cubin: bytes) -> dict[str, int]:
    """Registers per thread, spill stores and loads (bytes) from the cubin's resource usage."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(nvdisasm().with_name("cuobjdump")), "--dump-resource-usage", f.name],
                             check=True, capture_output=True, text=True).stdout
    reg = re.search(r"REG:(\d+)", out)
    return {"registers": int(reg.group(1)) if reg else -1}


def sass_row(cubin: bytes) -> dict[str, int]:
    ops, loop = opcodes(cubin), loop_opcodes(cubin)

    def count(c: collections.Counter, *prefixes: str) -> int:
        return sum(n for op, n in c.items() if op.startswith(prefixes))

    return {**resources(cubin), "spill_ops": count(ops, "LDL", "STL"), "wgmma": count(ops, "HGMMA"),
            "wgmma_waits": count(ops, "WARPGROUP.DEPBAR"), "mbarrier_ops": count(ops, "SYNCS"),
            "bar_sync": count(ops, "BAR.SYNC", "BAR.ARV", "BAR.RED"), "setmaxnreg": count(ops, "USETMAXREG"),
            "k_loop_instructions": sum(loop.values()), "k_loop_wgmma": count(loop, "HGMMA"),
            "k_loop_bar_sync": count(loop, "BAR.SYNC")}


def workloads(args: argparse.Namespace, db: Any) -> list[tuple[str, flashgen.Workload]]:
    """The GEMM shapes asked for; for prefill, every recorded workload of equal sequence lengths
    (labelled by its batch)."""
    if args.op == "flash_prefill_attention":
        recorded = {r.workload_key: r.workload for r in db.records(target_key=TARGET, status="ok")
                    if r.workload["op"] == args.op}
        wls = [flashgen.Workload.from_json(w) for w in recorded.values()]
        return [(f"B{wl.dim['B']}xT{wl.dim['T']}", wl) for wl in sorted(wls, key=lambda w: (w.dim["B"], w.dim["T"]))
                if wl.dim["T"] % wl.dim["B"] == 0]  # equal lengths: the peers' batched call
    return [(shape, make_workload(args.op, m, *SHAPES[shape]))
            for shape in args.shapes.split(",") for m in map(int, args.ms.split(","))]


def rows_of(wl: flashgen.Workload) -> int:
    """The workload's rows (M of a GEMM, T packed tokens of a prefill): the tables' M column."""
    return wl.dim[wl.op.row_dims[0]]


def result_name(args: argparse.Namespace, table: str) -> str:
    return f"gluon_vs_triton_{table}" + ("" if args.op == "gemm" else f"_{args.op}")


def sass(args: argparse.Namespace) -> None:
    rows = []
    with records(args.records) as db:
        for shape, wl in workloads(args, db):
            for form, rec in best_per_form(db, wl).items():
                kernel = flashgen.compile(wl, TARGET, schedule=rec.schedule)
                r = sass_row(kernel.binary)
                rows.append([shape, rows_of(wl), form, rec.latency_us, *r.values(), str(rec.schedule)])
                print(f"{shape} M={rows_of(wl)} {form}: {r}", flush=True)
    header = ("shape", "M", "form", "recorded_us", *ROW_KEYS, "schedule")
    write_results(result_name(args, "sass"), header, rows, environment(f"{TARGET} (AOT, no GPU)"), args.out_dir,
                  f"Static SASS counts of each form's fastest recorded {args.op} schedule. spill_ops: LDL/STL; "
                  "wgmma: HGMMA; wgmma_waits: WARPGROUP.DEPBAR; mbarrier_ops: SYNCS.*; bar_sync: CTA barriers; "
                  "k_loop_*: the k loop (the narrowest loop holding the matrix instructions: one k step of the MMA warps).")
    print_table(("shape", "M", "form", "us", "regs", "wgmma", "loop", "loop_bar"),
                [(r[0], r[1], r[2], r[3], r[4], r[6], r[11], r[13]) for r in rows])


ROW_KEYS = ("registers", "spill_ops", "wgmma", "wgmma_waits", "mbarrier_ops", "bar_sync", "setmaxnreg",
            "k_loop_instructions", "k_loop_wgmma", "k_loop_bar_sync")


def peers(op: str, wl: flashgen.Workload, dev: Any) -> tuple[dict, dict[str, Any]]:
    """The inputs the forms and their library peers run on, and the peers by name: cuBLAS for a GEMM
    (benchmarks/gemm.py `peer`), SDPA's flash and cuDNN backends for a prefill of equal lengths
    (benchmarks/attention.py `prefill_case`)."""
    import torch

    if op != "flash_prefill_attention":
        ins = {k: v.to(dev) for k, v in wl.op.make_inputs(wl.dim, wl.attr, torch.Generator().manual_seed(0)).items()}
        return ins, {"cublas": peer(op, ins)}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attention import prefill_case
    case, ins, sdpa = prefill_case([wl.dim["T"] // wl.dim["B"]] * wl.dim["B"], dev)
    assert case.key == wl.key, (case.key, wl.key)

    def backend(be: Any) -> Any:
        def run() -> None:
            with sdpa_kernel([be]):
                sdpa()
        return run
    return ins, {"sdpa_flash": backend(SDPBackend.FLASH_ATTENTION), "sdpa_cudnn": backend(SDPBackend.CUDNN_ATTENTION)}


PEER_NAMES = {"flash_prefill_attention": ("sdpa_flash", "sdpa_cudnn")}  # else ("cublas",)


def launch(args: argparse.Namespace) -> None:
    """Each form's kernel, then each peer, LAUNCHES times each, per workload, in the order `ncu_table` reads."""
    import torch

    dev = torch.device("cuda")
    with records(args.records) as db:
        for shape, wl in workloads(args, db):
            ins, named = peers(args.op, wl, dev)
            for form, rec in best_per_form(db, wl).items():
                kernel = flashgen.compile(wl, TARGET, schedule=rec.schedule)
                out = kernel.run(ins)
                for _ in range(LAUNCHES - 1):
                    kernel.run(ins, out)
            for fn in named.values():
                for _ in range(LAUNCHES):
                    fn()
            torch.cuda.synchronize()
            print(f"# launched {shape} M={rows_of(wl)}", file=sys.stderr, flush=True)


def ncu_table(args: argparse.Namespace) -> None:
    """The counters of the last launch of each (workload, form), each peer as its own form, in launch order."""
    text = Path(args.ncu).read_text()
    units, *table = csv.DictReader(io.StringIO(text[text.index('"ID"'):]))
    to_us = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[units[next(iter(COUNTERS))]]
    rows, i = [], 0
    with records(args.records) as db:
        for shape, wl in workloads(args, db):
            for form in [*best_per_form(db, wl), *PEER_NAMES.get(args.op, ("cublas",))]:
                last = table[i + LAUNCHES - 1]
                i += LAUNCHES
                values = [float(last[m].replace(",", "")) if last.get(m) not in (None, "", "n/a") else float("nan")
                          for m in COUNTERS]
                values[0] *= to_us
                rows.append([shape, rows_of(wl), form, last["Kernel Name"][:40], *values])
    write_results(result_name(args, "ncu"), ("shape", "M", "form", "kernel", *COUNTERS.values()), rows,
                  {**environment("NVIDIA H200 (Nsight Compute, --clock-control none)"), "ncu_csv": str(args.ncu)},
                  args.out_dir, f"Nsight Compute counters of the last of {LAUNCHES} launches of each form's fastest "
                  "recorded schedule and of its library peers (cuBLAS: torch.matmul; sdpa_*: SDPA's backends). "
                  "sm_active_pct: share of the run the SMs had a program; stall_*: share of active warps' cycles stalled so.")
    print_table(("shape", "M", "form", "us", "tensor%", "sm%", "active%", "dram%", "regs", "barrier", "long_sb", "wait"),
                [(r[0], r[1], r[2], *r[4:13]) for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", type=Path, nargs="+", help="JSON-lines records (flashgen db export)")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--sass", action="store_true", help="SASS counts of each form's kernel (no GPU)")
    mode.add_argument("--launch", action="store_true", help="run the kernels, under ncu (GPU)")
    mode.add_argument("--ncu", help="the CSV ncu wrote for --launch: its table")
    mode.add_argument("--metrics", action="store_true", help="print the metrics to give ncu")
    ap.add_argument("--op", default="gemm", choices=("gemm", "gemm_w4a16", "flash_prefill_attention"))
    ap.add_argument("--shapes", default="qkv,gate_up")
    ap.add_argument("--ms", default="256,4096")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.metrics:
        print(",".join(COUNTERS))
        return
    (sass if args.sass else launch if args.launch else ncu_table)(args)


if __name__ == "__main__":
    main()
