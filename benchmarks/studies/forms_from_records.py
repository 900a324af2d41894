"""Each contraction form's best record per workload, side by side, from tuning records (CPU): which
generator form won where, and by how much, as the tuner measured them (not timed again).

    python benchmarks/studies/forms_from_records.py RECORDS.jsonl [...] --op gemm_w4a8 --forms tile_lanes,tile_lanes_scaled
        [--same-tile] [--name NAME] [--out-dir DIR]

Per workload (op, dims, attrs; timed alone or behind the same producer) and target: the fastest ok record
of each form in --forms, and each form's time over the first one's. With --same-tile also the forms'
records of one tile (block_m, block_n, block_k, num_warps, num_stages and the counts alike), where every
form measured it: the change of form alone.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import RESULTS, environment, print_table, write_results  # noqa: E402

from flashgen.errors import FlashgenError  # noqa: E402


def load(paths: list[Path], op: str) -> list[dict]:
    """The ok records of `op` in the files."""
    out = []
    for p in paths:
        for line in p.read_text().splitlines():
            r = json.loads(line)
            if r["workload"]["op"] == op and r["status"] == "ok":
                out.append(r)
    if not out:
        raise FlashgenError(f"no ok record of {op} in {', '.join(map(str, paths))}")
    return out


def key(r: dict) -> tuple:
    """A record's workload, target and timing context."""
    w, extra = r["workload"], r.get("extra") or {}
    return (json.dumps(w["dims"], sort_keys=True), json.dumps(w["attrs"], sort_keys=True), r["target_key"],
            json.dumps(extra.get("behind"), sort_keys=True))


def tile(s: dict) -> str:
    """A schedule less its form."""
    return json.dumps({k: v for k, v in s.items() if k != "variant"}, sort_keys=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", nargs="+", type=Path)
    ap.add_argument("--op", required=True)
    ap.add_argument("--forms", required=True, help="variants, comma-separated; ratios are over the first")
    ap.add_argument("--same-tile", action="store_true", help="also each tile every form measured")
    ap.add_argument("--name", default="forms_from_records")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    forms = args.forms.split(",")
    records = load(args.records, args.op)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[key(r)].append(r)
    header = ["dims", "tile", *[f"{f}_us" for f in forms], *[f"{f}_vs_{forms[0]}" for f in forms[1:]], "records"]
    rows = []
    for k in sorted(groups, key=lambda k: (json.loads(k[0]).get("M", 0), k)):
        rs = groups[k]
        by_form: dict[str, dict[str, float]] = defaultdict(dict)  # form -> tile -> fastest
        for r in rs:
            f, t = r["schedule"].get("variant"), tile(r["schedule"])
            if f in forms:
                by_form[f][t] = min(by_form[f].get(t, float("inf")), r["latency_us"])
        if not all(by_form[f] for f in forms):
            continue
        dims = " ".join(f"{d}={v}" for d, v in json.loads(k[0]).items())
        best = [min(by_form[f].values()) for f in forms]
        rows.append([dims, "best of each", *best, *[best[0] / b for b in best[1:]], len(rs)])
        if args.same_tile:
            for t in sorted(set.intersection(*(set(by_form[f]) for f in forms))):
                us = [by_form[f][t] for f in forms]
                rows.append([dims, t, *us, *[us[0] / u for u in us[1:]], ""])
    if not rows:
        raise FlashgenError(f"no workload has records of every form in {args.forms}")
    devices = sorted({r["device"] for r in records})
    note = (f"{args.op}: per workload, each form's fastest record as the tuner measured it (records of "
            f"{', '.join(map(str, args.records))}, device {', '.join(devices)}); X_vs_{forms[0]} = {forms[0]}'s "
            f"time over X's (above 1: X faster)." + (" Rows with a tile: that schedule in every form." if args.same_tile else ""))
    write_results(args.name, header, rows, environment(", ".join(devices)), args.out_dir, note)
    print_table(header[:-1], [r[:-1] for r in rows])


if __name__ == "__main__":
    main()
