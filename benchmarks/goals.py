"""The GEMM speed goals checked against side-by-side results: a CPU replay of benchmarks/gemm.py's JSON.

For each row the goal (peer time / flashgen time to reach, by op and M), whether the run met it, and
what meeting it asks of any kernel: the fraction of the roofline that the goal time (peer time / goal)
stands for. A goal that needs more than the peer itself reaches asks a generated kernel to beat the
vendor library's use of the hardware; one that needs more than 1 is beyond the hardware.

    python benchmarks/goals.py RESULTS.json [RESULTS.json ...] [--name gemm_goals_check] [--out-dir DIR]

Rows of later files replace rows of earlier ones for the same op, shape and M; variant rows
("op [label]") are left out.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, print_table, write_results  # noqa: E402

# (op, smallest M, largest M, peer time / flashgen time to reach)
GOALS = (
    ("gemm", 256, math.inf, 0.95), ("gemm", 1, 64, 0.90),
    ("gemm_w4a16", 1, 16, 3.2), ("gemm_w4a16", 64, 64, 2.5), ("gemm_w4a16", 256, 256, 1.3),
    ("gemm_w4a16", 4096, math.inf, 0.9),
    ("gemm_w8a8", 1, math.inf, 0.95), ("gemm_fp8", 1, math.inf, 0.95),
)
HEADER = ("op", "shape", "M", "flashgen_us", "peer", "peer_us", "vs_peer", "goal", "met", "goal_us",
          "needs_of_roofline", "peer_of_roofline", "of_roofline")


def goal_for(op: str, m: int) -> float | None:
    return next((g for o, lo, hi, g in GOALS if o == op and lo <= m <= hi), None)


def read_rows(paths: list[Path]) -> list[dict]:
    """The plain rows of gemm.py result files as dicts, the last file's row winning per (op, shape, M)."""
    out: dict[tuple, dict] = {}
    for p in paths:
        data = json.loads(p.read_text())
        for r in (dict(zip(data["columns"], row)) for row in data["rows"]):
            if "[" not in r["op"]:
                out[(r["op"], r["shape"], r["M"])] = r
    return list(out.values())


def check(row: dict) -> list | None:
    """The row's goal check, or None when no goal covers its op and M."""
    goal = goal_for(row["op"], row["M"])
    if goal is None:
        return None
    peer_us, us, roof = row["peer_us"], row["flashgen_us"], row["roofline_us"]
    if peer_us is None or math.isnan(peer_us):  # the peer refused this shape (torch._int_mm at M <= 16)
        return [row["op"], row["shape"], row["M"], us, row["peer"], math.nan, math.nan, goal, "no peer", math.nan,
                math.nan, math.nan, roof / us]
    goal_us = peer_us / goal
    return [row["op"], row["shape"], row["M"], us, row["peer"], peer_us, peer_us / us, goal,
            "yes" if peer_us / us >= goal else "no", goal_us, roof / goal_us, roof / peer_us, roof / us]


def summary(checked: list[list]) -> list[list]:
    """Per goal: rows met of rows with a peer, the lowest ratio, and the most and least of the roofline
    that meeting it needs."""
    rows = []
    for op, lo, hi, goal in GOALS:
        mine = [c for c in checked if c[0] == op and lo <= c[2] <= hi and c[8] != "no peer"]
        if mine:
            ms = f"{lo}" + ("+" if hi == math.inf else "" if hi == lo else f"-{hi}")
            rows.append([op, ms, goal, sum(c[8] == "yes" for c in mine), len(mine), min(c[6] for c in mine),
                         min(c[10] for c in mine), max(c[10] for c in mine)])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--name", default="gemm_goals_check")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    first = json.loads(args.results[0].read_text())["meta"]
    checked = [c for c in map(check, read_rows(args.results)) if c is not None]
    checked.sort(key=lambda c: ([g[0] for g in GOALS].index(c[0]), c[1], c[2]))
    summ = summary(checked)
    sheader = ("op", "M", "goal", "met", "of", "lowest_ratio", "needs_of_roofline_min", "needs_of_roofline_max")
    meta = {**first, "command": " ".join(["python"] + sys.argv), "results": [str(p) for p in args.results],
            "summary_columns": list(sheader), "summary": summ}
    lines = ["needs_of_roofline: the fraction of the roofline (datasheet peak flops, measured copy bandwidth) "
             "that a kernel running at the goal time reaches; peer_of_roofline: the peer's own.", "",
             "| " + " | ".join(sheader) + " |", "|" + "---|" * len(sheader)]
    lines += ["| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in r) + " |" for r in summ]
    write_results(args.name, HEADER, checked, meta, args.out_dir, "\n".join(lines))
    print_table(("op", "shape", "M", "vs_peer", "goal", "met", "needs_of_roof", "peer_of_roof"),
                [(c[0], c[1], c[2], c[6], c[7], c[8], c[10], c[11]) for c in checked])
    print()
    print_table(sheader, summ)


if __name__ == "__main__":
    main()
