"""The decoder with records of its own for some decode row counts against the decoder without them,
side by side on the current GPU: the GEMM lines of those rows (decode_workloads.py's lines, each
behind its producer) are tuned into a database of their own, then benchmarks/model.py runs with that
database and with an empty one, in alternating rounds, each run a fresh process.

    python benchmarks/studies/rows_records_ab.py --rows 4,8,128 --modes w4a8,w8a8 [--linears qkv,gate_up] --target h100
        [--trials 2] [--quant w4a8,w8a8,mixed] [--batch 4,8,128] [--rounds 2] [--out-dir DIR] [--name rows_ab]
    python benchmarks/studies/rows_records_ab.py ... --dry-run   # the commands, nothing run (no GPU needed)

`--trials 2` measures each line's analytic default and the schedule dispatch served it. The records
stay in DIR/NAME.db and DIR/NAME_records.jsonl (`flashgen db export`), ready for `python -m
flashgen.db.ship`; each run's own files are DIR/NAME_new_R and DIR/NAME_ship_R; DIR/NAME.{json,md}
hold decode tokens/s per mode and batch with and without the records, the mean of the rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from common import RESULTS, environment, print_table, write_results  # noqa: E402
from decode_workloads import LINEARS, lines  # noqa: E402

from flashgen.runtime.decoder.bench import CONFIGS  # noqa: E402


def commands(args: argparse.Namespace) -> tuple[list[list[str]], list[tuple[str, dict[str, str], list[str]]]]:
    """The tune and export commands, then each (run name, extra environment, model.py command) in order."""
    out, name = args.out_dir, args.name
    db, work = out / f"{name}.db", out / f"{name}_workloads.jsonl"
    cli = [sys.executable, "-m", "flashgen.cli"]
    tune = [cli + ["tune", "--workloads", str(work), "--target", args.target, "--trials", str(args.trials),
                   "--db", str(db)],
            cli + ["db", "export", "--db", str(db), str(out / f"{name}_records.jsonl"), "--force"]]
    runs = []
    for r in range(1, args.rounds + 1):
        for side, env in (("new", {"FLASHGEN_DB": str(db)}), ("ship", {"FLASHGEN_DB": str(out / f"{name}_empty_{r}.db")})):
            runs.append((f"{name}_{side}_{r}", env,
                         [sys.executable, str(HERE.parent / "model.py"), "--config", args.config, "--batch", args.batch,
                          "--prompt-len", "256", "--new-tokens", "32", "--quant", args.quant, "--peer-batch", "none",
                          "--out-dir", str(out), "--name", f"{name}_{side}_{r}"]))
    return tune, runs


def summary(out: Path, name: str, rounds: int) -> list[list]:
    """(system, batch, tokens/s with, without, with / without) from the runs' JSON, the mean of the rounds."""
    means: dict[tuple[str, int], dict[str, list[float]]] = {}
    for r in range(1, rounds + 1):
        for side in ("new", "ship"):
            for row in json.loads((out / f"{name}_{side}_{r}.json").read_text())["rows"]:
                means.setdefault((row[0], row[1]), {"new": [], "ship": []})[side].append(row[3])
    table = []
    for (system, batch), v in means.items():
        new, ship = sum(v["new"]) / len(v["new"]), sum(v["ship"]) / len(v["ship"])
        table.append([system, batch, new, ship, new / ship])
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="llama3-8b", choices=sorted(CONFIGS))
    ap.add_argument("--rows", required=True, help="decode row counts whose GEMM lines are tuned, comma-separated")
    ap.add_argument("--modes", required=True, help="quant modes of those lines (w4a16, w8a8, w4a8, bf16)")
    ap.add_argument("--linears", default=",".join(LINEARS), help="the layer's GEMMs tuned (default: all four)")
    ap.add_argument("--target", required=True)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--quant", default=None, help="the decoder's modes (default: --modes)")
    ap.add_argument("--batch", default=None, help="the decoder's batches (default: --rows)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default="rows_ab")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and write the workload file only")
    args = ap.parse_args()
    args.quant, args.batch = args.quant or args.modes, args.batch or args.rows
    rows = tuple(int(r) for r in args.rows.split(","))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    work = args.out_dir / f"{args.name}_workloads.jsonl"
    text = "\n".join(lines(CONFIGS[args.config], tuple(args.modes.split(",")), rows, tuple(args.linears.split(",")))) + "\n"
    work.write_text(text)
    print(f"{work}: {text.count(chr(10))} GEMM lines", flush=True)
    tune, runs = commands(args)
    for cmd in tune:
        print("$", " ".join(cmd), flush=True)
        if not args.dry_run:
            subprocess.run(cmd, check=True)
    for name, env, cmd in runs:
        print("$", " ".join(f"{k}={v}" for k, v in env.items()), " ".join(cmd), flush=True)
        if not args.dry_run:
            subprocess.run(cmd, check=True, env={**os.environ, **env})
    if args.dry_run:
        return
    header = ("system", "batch", "tokens_per_s_with", "tokens_per_s_without", "with_over_without")
    table = summary(args.out_dir, args.name, args.rounds)
    print_table(header, table)
    write_results(args.name, header, table, {**environment(), "records": str(args.out_dir / f"{args.name}_records.jsonl")},
                  args.out_dir, f"The decoder with the records of the {args.modes} GEMM lines at rows {args.rows} "
                  f"(tuned behind their producers, {args.trials} trials each) and without them, "
                  f"{args.rounds} alternating rounds, mean decode tokens/s.")


if __name__ == "__main__":
    main()
