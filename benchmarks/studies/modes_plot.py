"""Decode tokens/s against batch, one line per quant mode, from a benchmarks/model.py result (JSON):
where each mode wins, and whether `mixed` follows the best of them.

    python benchmarks/studies/modes_plot.py RESULT.json [--out PNG]   # a benchmarks/model.py --name RESULT run
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", type=Path)
    ap.add_argument("--out", type=Path, help="default: the result's path with .png")
    args = ap.parse_args()
    data = json.loads(args.result.read_text())
    col = {c: i for i, c in enumerate(data["columns"])}
    lines: dict[str, list[tuple[int, float]]] = {}
    for r in data["rows"]:
        if r[col["system"]].startswith("flashgen"):
            lines.setdefault(r[col["system"]], []).append((r[col["batch"]], r[col["tokens_per_s"]]))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, pts in lines.items():
        pts.sort()
        mixed = "mixed" in name
        ax.plot([b for b, _ in pts], [t for _, t in pts], marker="o", label=name.replace("flashgen ", ""),
                linewidth=3 if mixed else 1.5, linestyle="--" if mixed else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (sequences per decode step)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{data['meta']['device']}: decode by quant mode")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    out = args.out or args.result.with_suffix(".png")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    main()
