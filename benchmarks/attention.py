"""Generated attention against torch SDPA (flash / cuDNN / efficient backends, contiguous KV,
enable_gqa) and the bandwidth / compute rooflines, side by side in one run on the current GPU.
Each workload is tuned briefly first (analytic default, then the prior's best few).

    python benchmarks/attention.py --db DB [--trials 6] [--part decode,prefill] [--rerank 4] [--fix backend=1]
        [--variant persistent=1 ...]

Decode: Hq=32 Hkv=8 D=128, cache blocks of 16 tokens scattered at random, full contexts:
B=32 L=4096, B=8 L=32768, B=1 L=131072 (the peer reads the same keys from a contiguous cache).
Prefill, causal, H=32 D=128: B=4 S=4096, B=1 S=16384, and 8 sequences of 1k-16k tokens packed
(the peer runs SDPA once on the [B, H, S, D] batch where the lengths are equal, else once per sequence).
Where the space has more than one generator (sm_90 prefill: Triton and Gluon, the `backend` knob), the
fastest recorded schedule of each is timed in the same run, and the row reports both.

The tuner measures each candidate on the op's own random inputs (decode: contexts drawn from 1..L;
prefill: random sequence lengths), which are not the inputs timed here (full contexts, the lengths
above). So the database's `--rerank` fastest schedules are re-timed side by side on these inputs first,
and the fastest of them is the one compared with the peers, in a run of its own. `--variant KNOB=VALUE`
adds each generator's kernel with that knob changed to that run (a row each, "kind [generator knob=value]"),
where the schedule is valid and computes what the kernel does.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (RESULTS, bench_side_by_side, copy_gbs, environment, knob_values, print_table,  # noqa: E402
                    tuning_session, variant, write_results)

import flashgen  # noqa: E402
from flashgen.db import Database  # noqa: E402
from flashgen.db.record import schedule_key  # noqa: E402
from flashgen.kernel_classes import SCHEDULE_BACKENDS, schedule_backend  # noqa: E402
from flashgen.roofline import bytes_moved  # noqa: E402
from flashgen.schedules.space import ScheduleSpace  # noqa: E402
from flashgen.schedules.tuner import TuneTask, tune  # noqa: E402
from flashgen.workload import Workload  # noqa: E402
from flashgen.targets import device_target  # noqa: E402
from flashgen.targets.descriptor import Target  # noqa: E402
from flashgen.targets.kernel import Kernel  # noqa: E402

BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
HQ, HKV, D, BS = 32, 8, 128, 16


def decode_case(b: int, length: int, dev):
    nb = b * length // BS
    wl = flashgen.workload("paged_decode_attention", B=b, Hq=HQ, Hkv=HKV, D=D, BS=BS, NB=nb, MAXB=length // BS,
                           L=length, dtype="bf16")
    g = torch.Generator(device=dev).manual_seed(0)
    kc = torch.randn(nb, BS, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    vc = torch.randn_like(kc)
    perm = torch.randperm(nb, device=dev, generator=g).to(torch.int32)
    ins = {"q": torch.randn(b, HQ, D, device=dev, dtype=torch.bfloat16, generator=g), "k_cache": kc, "v_cache": vc,
           "block_tables": perm.reshape(b, length // BS), "context_lens": torch.full((b,), length, device=dev,
                                                                                    dtype=torch.int32)}
    k = kc[perm.long()].reshape(b, length, HKV, D).transpose(1, 2).contiguous()
    v = vc[perm.long()].reshape(b, length, HKV, D).transpose(1, 2).contiguous()
    q4 = ins["q"][:, :, None, :]
    return wl, ins, lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)


def prefill_case(lengths: list[int], dev):
    total = sum(lengths)
    wl = flashgen.workload("flash_prefill_attention", T=total, B=len(lengths), Hq=HQ, Hkv=HKV, D=D, dtype="bf16")
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(total, HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(total, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device=dev, dtype=torch.int32)
    ins = {"q": q, "k": k, "v": v, "cu_seqlens": cu}
    if len(set(lengths)) == 1:  # one batched call: [B, H, S, D] views of the packed tensors
        b, n = len(lengths), lengths[0]
        seqs = [tuple(x.view(b, n, x.shape[1], D).transpose(1, 2) for x in (q, k, v))]
    else:
        seqs = [(q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None])
                for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())]

    def peer():
        for qq, kk, vv in seqs:
            F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
    return wl, ins, peer


def fastest_recorded(db: Database, wl: Workload, target: Target, space: ScheduleSpace, k: int,
                     backend: int | None = None) -> list[dict]:
    """The k fastest distinct valid schedules the database holds for the workload (a record older than a
    knob read with its neutral value), fastest first; only those of one generator, given `backend`."""
    seen, out = set(), []
    for r in sorted(db.records(wl.key, target.id, status="ok"), key=lambda r: r.latency_us):
        s = space.complete(r.schedule)
        key = schedule_key(s)
        if key not in seen and space.is_valid(s) and backend in (None, s.get("backend", 0)):
            seen.add(key)
            out.append(s)
    return out[:k]


def rerank(kernels: list[Kernel], ins: dict, nbytes: int, l2_bytes: int) -> tuple[Kernel, int]:
    """The kernel fastest on these inputs, and its place in the database's order."""
    if len(kernels) == 1:
        return kernels[0], 0
    outs = [k.run(ins) for k in kernels]
    t = bench_side_by_side({str(i): (lambda k=k, o=o: k.run(ins, o)) for i, (k, o) in enumerate(zip(kernels, outs))},
                           nbytes, l2_bytes, rounds=1)
    place = min(range(len(kernels)), key=lambda i: t[str(i)])
    return kernels[place], place


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--part", default="decode,prefill")
    ap.add_argument("--rerank", type=int, default=4, help="the database's fastest schedules re-timed on the "
                    "benchmark's inputs (1: the database's best as is)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default="attention", help="result files: <out-dir>/<name>.json and .md")
    ap.add_argument("--fix", action="append", default=[], metavar="KNOB=VALUE",
                    help="tune only schedules with this knob value (repeatable); every generator's best is timed")
    ap.add_argument("--variant", action="append", default=[], metavar="KNOB=VALUE",
                    help="also time each generator's kernel with this knob changed, side by side (repeatable)")
    args = ap.parse_args()
    fixed = knob_values(args.fix)
    variants = [pair for arg in args.variant for pair in knob_values([arg]).items()]
    dev = torch.device("cuda")
    target = device_target(dev)
    bw = copy_gbs()
    cases = []
    if "decode" in args.part:
        cases += [("decode", f"B={b} L={n}", *decode_case(b, n, dev)) for b, n in ((32, 4096), (8, 32768), (1, 131072))]
    if "prefill" in args.part:
        ragged = [1024, 16384, 2048, 5000, 12000, 1500, 8192, 3000]
        cases += [("prefill", name, *prefill_case(lens, dev)) for name, lens in
                  (("B=4 S=4096", [4096] * 4), ("B=1 S=16384", [16384]), ("ragged 8x 1k-16k", ragged))]
    rows = []
    with Database(args.db) as db, tuning_session(target) as session:
        for kind, name, wl, ins, peer in cases:
            space = ScheduleSpace(wl, target)
            pinned = TuneTask.pinned({k: v for k, v in fixed.items() if k in space.knobs()})
            tune(TuneTask(wl, target, args.trials, strategy="evolutionary", fixed=pinned), db, progress=None, **session)
            best = {}  # generator -> (its kernel fastest on these inputs, that kernel's place in the db's order)
            for backend in space.knobs().get("backend", (0,)):
                candidates = fastest_recorded(db, wl, target, space, max(1, args.rerank), backend)
                if candidates:
                    best[SCHEDULE_BACKENDS[backend]] = rerank([flashgen.compile(wl, target, schedule=c) for c in candidates],
                                                              ins, bytes_moved(wl), target.get("l2_bytes"))
            if not best:
                kern = flashgen.compile(wl, target, db=db)
                best[schedule_backend(kern.schedule)] = kern, 0
            fns = {gen: (lambda k=k, o=k.run(ins): k.run(ins, o)) for gen, (k, _) in best.items()}
            varied = {}  # label -> (generator, schedule)
            for gen, (k, _) in best.items():
                out = k.run(ins) if variants else None
                for knob, value in variants:
                    if (found := variant(wl, target, space, k.schedule, knob, value, ins, out)) is not None:
                        vk, s = found
                        label = f"{gen} {knob}={value}"
                        fns[label], varied[label] = (lambda vk=vk, o=vk.run(ins): vk.run(ins, o)), (gen, s)
            for be in BACKENDS:
                def run_peer(be=be):
                    with sdpa_kernel([be]):
                        peer()
                try:
                    run_peer()
                    fns[be.name.lower()] = run_peer
                except RuntimeError as e:
                    print(f"  {be.name} refused: {str(e).splitlines()[0][:80]}")
            t = bench_side_by_side(fns, bytes_moved(wl), target.get("l2_bytes"), rounds=2)
            gen = min(best, key=lambda g: t[g])
            kern, place = best[gen]
            t["flashgen"] = t[gen]
            best_peer = min((v, k) for k, v in t.items() if k not in ("flashgen", *best, *varied))
            if kind == "decode":
                roof = bytes_moved(wl) / (bw * 1e3)
            else:
                flops = sum(4.0 * HQ * D * n * n / 2 for n in torch.diff(ins["cu_seqlens"]).tolist())
                roof = flops / (target.peak_tflops["bf16"] * 1e6)
            for label, (g, sched, rank) in {"flashgen": (gen, kern.schedule, place + 1),
                                            **{v: (*varied[v], None) for v in varied}}.items():
                ratio = lambda peer: t[peer] / t[label] if peer in t else None  # noqa: E731
                rows.append([kind if label == "flashgen" else f"{kind} [{label}]", name, t[label], g, t.get("triton"),
                             t.get("gluon"), best_peer[1], best_peer[0], best_peer[0] / t[label],
                             ratio("flash_attention"), ratio("cudnn_attention"), roof, roof / t[label], rank, str(sched)])
            print(f"{kind:8s} {name:18s} flashgen {t['flashgen']:9.1f} us  {best_peer[1]} {best_peer[0]:9.1f}  "
                  f"roof {roof:8.1f}", flush=True)
            write_results(args.name, ("kind", "shape", "flashgen_us", "generator", "triton_us", "gluon_us", "best_sdpa",
                                      "sdpa_us", "vs_sdpa", "vs_flash", "vs_cudnn", "roofline_us", "of_roofline",
                                      "db_rank", "schedule"), rows,
                          {**environment(), "target": target.id, "copy_gbs": bw}, args.out_dir,
                          "flashgen = the faster of the generators' fastest kernels (triton_us, gluon_us: each timed "
                          "in the same run). vs_sdpa = fastest SDPA backend's time / flashgen time; vs_flash, "
                          "vs_cudnn: SDPA's flash and cuDNN backends'. Decode roofline: KV bytes / "
                          f"measured copy bandwidth ({bw:.0f} GB/s); prefill: causal FLOPs / datasheet bf16 peak. "
                          f"db_rank: the schedule's place among the database's {args.rerank} fastest (measured on "
                          "the tuner's inputs) that were re-timed on these inputs.")
    print_table(("kind", "shape", "us", "generator", "vs_flash", "vs_cudnn", "of_roof"),
                [(r[0], r[1], r[2], r[3], r[9], r[10], r[12]) for r in rows])


if __name__ == "__main__":
    main()
