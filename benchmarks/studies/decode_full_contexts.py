"""Paged decode-attention schedules timed side by side on chosen contexts, with SDPA (cuDNN, flash)
on the same keys in a contiguous cache in the same rounds: the tuner times candidates on contexts
drawn from 1..L, so this says which schedules lead where every sequence has one given length.

    python benchmarks/studies/decode_full_contexts.py [--out-dir benchmarks/results]
    python benchmarks/studies/decode_full_contexts.py --case 16:288:8192 --case 64:288:8192 --name decode_short

Default cases, full contexts (`attention.py`'s decode cases): B=32 L=4096, splits 4/8/16 x pages 4/8 x
4/8 warps x 1-3 stages; B=8 L=32768, splits 8/16/32 x pages 4/8 x 2-3 stages x early_kv 0/1 (4 warps).
`--case B:CTX:L`: B sequences of CTX tokens each in block tables as wide as the workload's L (the
decoder's tables span a whole context window, its calls carry that L), over the decode space
without early_kv (which pays only behind a previous kernel) and with 4 or 8 warps. Prints each case's
ten fastest with the KV bytes' share of the copy bandwidth; writes every time (us) by schedule to
<name>.json.
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
from attention import BS, D, HKV, HQ, decode_case  # noqa: E402
from common import RESULTS, bench_side_by_side, copy_gbs  # noqa: E402

import flashgen  # noqa: E402
from flashgen.roofline import bytes_moved  # noqa: E402
from flashgen.schedules.space import ScheduleSpace  # noqa: E402
from flashgen.targets import device_target  # noqa: E402

GRIDS = {(32, 4096, 4096): dict(splits=(4, 8, 16), pages=(4, 8), num_warps=(4, 8), num_stages=(1, 2, 3), early_kv=(0,)),
         (8, 32768, 32768): dict(splits=(8, 16, 32), pages=(4, 8), num_warps=(4,), num_stages=(2, 3), early_kv=(0, 1))}
CASE_GRID = dict(splits=(1, 2, 4, 8, 16, 32), pages=(1, 2, 4, 8), num_warps=(4, 8), num_stages=(1, 2), early_kv=(0,))


def short_case(b: int, ctx: int, length: int, dev):
    """B sequences of `ctx` tokens in tables `length` / BS blocks wide (the rest of each table padding),
    the workload at L=`length`; with SDPA on the same keys, contiguous."""
    width = length // BS
    used = -(-ctx // BS)
    nb = b * used + 1  # one spare block: the padding entries point at it
    wl = flashgen.workload("paged_decode_attention", B=b, Hq=HQ, Hkv=HKV, D=D, BS=BS, NB=nb, MAXB=width, L=length,
                           dtype="bf16")
    g = torch.Generator(device=dev).manual_seed(0)
    kc = torch.randn(nb, BS, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    vc = torch.randn_like(kc)
    perm = torch.randperm(nb - 1, device=dev, generator=g).to(torch.int32).reshape(b, used)
    tables = torch.full((b, width), nb - 1, device=dev, dtype=torch.int32)
    tables[:, :used] = perm
    ins = {"q": torch.randn(b, HQ, D, device=dev, dtype=torch.bfloat16, generator=g), "k_cache": kc, "v_cache": vc,
           "block_tables": tables, "context_lens": torch.full((b,), ctx, device=dev, dtype=torch.int32)}
    k = kc[perm.long()].reshape(b, used * BS, HKV, D)[:, :ctx].transpose(1, 2).contiguous()
    v = vc[perm.long()].reshape(b, used * BS, HKV, D)[:, :ctx].transpose(1, 2).contiguous()
    q4 = ins["q"][:, :, None, :]
    kv_bytes = 2 * b * ctx * HKV * D * 2
    return wl, ins, lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True), kv_bytes


def _case(text: str) -> tuple[int, int, int]:
    b, ctx, length = (int(x) for x in text.split(":"))
    if ctx > length:
        raise argparse.ArgumentTypeError(f"a context of {ctx} tokens does not fit L={length}")
    return b, ctx, length


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", type=_case, action="append", default=[], metavar="B:CTX:L")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default="decode_full_contexts")
    args = ap.parse_args()
    dev = torch.device("cuda")
    target = device_target(dev)
    gbs = copy_gbs()
    cases = {c: CASE_GRID for c in args.case} or GRIDS
    out = {"device": torch.cuda.get_device_name(dev), "copy_gbs": gbs, "cases": {}}
    for (b, ctx, length), grid in cases.items():
        if ctx == length:
            wl, ins, peer = decode_case(b, length, dev)
            kv = bytes_moved(wl)
        else:
            wl, ins, peer, kv = short_case(b, ctx, length, dev)
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
        t = bench_side_by_side(fns, kv, target.get("l2_bytes"), rounds=2, flush=True)  # a layer's KV is not in L2
        floor = kv / gbs / 1e3
        peer_t = min(v for k, v in t.items() if not k.startswith("{"))
        key = f"B={b} ctx={ctx} L={length}"
        out["cases"][key] = {"kv_floor_us": floor, "us": t}
        print(f"{key} ({torch.cuda.get_device_name(dev)}): KV read at {gbs:.0f} GB/s {floor:.1f} us, "
              f"best SDPA {peer_t:.1f} us")
        for k, v in sorted(t.items(), key=lambda kv: kv[1])[:10]:
            print(f"  {v:8.1f}  floor/t {floor / v:.2f}  SDPA/t {peer_t / v:.3f}  {k}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
