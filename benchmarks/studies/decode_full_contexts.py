"""Paged decode-attention schedules timed side by side at the attention benchmark's full contexts
(`attention.py`'s decode cases), with SDPA (cuDNN, flash) in the same rounds: the tuner times
candidates on ragged contexts, so this says which schedules lead where every sequence is L long.

    python benchmarks/studies/decode_full_contexts.py [--out-dir benchmarks/results]

Grids: B=32 L=4096, splits 4/8/16 x pages 4/8 x 4/8 warps x 1-3 stages; B=8 L=32768, splits 8/16/32
x pages 4/8 x 2-3 stages x early_kv 0/1 (4 warps). Prints each case's ten fastest; writes every time
(us) by schedule to decode_full_contexts.json.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from attention import decode_case  # noqa: E402
from common import RESULTS, bench_side_by_side  # noqa: E402

import flashgen  # noqa: E402
from flashgen.roofline import bytes_moved  # noqa: E402
from flashgen.schedules.space import ScheduleSpace  # noqa: E402
from flashgen.targets import device_target  # noqa: E402

GRIDS = {(32, 4096): dict(splits=(4, 8, 16), pages=(4, 8), num_warps=(4, 8), num_stages=(1, 2, 3), early_kv=(0,)),
         (8, 32768): dict(splits=(8, 16, 32), pages=(4, 8), num_warps=(4,), num_stages=(2, 3), early_kv=(0, 1))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    dev = torch.device("cuda")
    target = device_target(dev)
    out = {}
    for (b, n), grid in GRIDS.items():
        wl, ins, peer = decode_case(b, n, dev)
        space = ScheduleSpace(wl, target)
        fns = {}
        for vals in itertools.product(*grid.values()):
            s = dict(zip(grid.keys(), vals))
            if not space.is_valid(s):
                continue
            kernel = flashgen.compile(wl, target, schedule=s)
            o = kernel.run(ins)
            fns[json.dumps(s, sort_keys=True)] = (lambda k=kernel, o=o: k.run(ins, o))
        for be in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
            def run_peer(be=be):
                with sdpa_kernel([be]):
                    peer()
            fns[be.name] = run_peer
        t = bench_side_by_side(fns, bytes_moved(wl), target.get("l2_bytes"), rounds=2)
        peer_t = min(v for k, v in t.items() if not k.startswith("{"))
        out[f"B={b} L={n}"] = t
        print(f"B={b} L={n}: best SDPA {peer_t:.1f} us")
        for k, v in sorted(t.items(), key=lambda kv: kv[1])[:10]:
            print(f"  {v:8.1f}  {peer_t / v:.3f}  {k}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "decode_full_contexts.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
