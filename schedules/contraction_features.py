"""Features and the analytic latency estimate of contraction (GEMM) schedules, for the cost model.

The quantities a GEMM tile choice changes: tiles launched and how they fill the SMs (waves, last-wave
fill), padding waste along M and N, k steps, pipelining depth against shared memory, accumulator
registers per thread, how often A and W tiles are re-read (each W tile once per row of tiles, each A
tile once per column of tiles), and the tile's arithmetic intensity. The estimate is the larger of the
compute time (the matrix units at an efficiency that grows with the tile, plus the ALU work of
unpacking coded weights, again for every row of tiles) and the memory time of the bytes really moved
(an operand that fits its share of the L2 comes from memory once), stretched by wave quantization,
plus a per-k-step latency that deeper pipelines hide.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from flashgen.ir import dtypes
from flashgen.roofline import bytes_moved
from flashgen.ir.contraction import extents, int4_affine, int8_lanes, operand_dtype
from flashgen.schedules.contraction_space import ADDED_KNOBS, FLAT_KNOBS, current, flat_of, load_bytes, min_block_k
from flashgen.targets.descriptor import Target
from flashgen.workload import Workload

KNOBS = FLAT_KNOBS  # every option and count, as the schedule spelled out flat (`flat_of`) holds them
SIZES = KNOBS[:7]  # the knobs that are sizes or counts, never 0: also given as log2
FEATURE_NAMES: tuple[str, ...] = (
    *KNOBS, *(f"log2_{k}" for k in SIZES),
    "log2_m", "log2_n", "log2_k", "operand_bytes", "log2_flops", "log2_bytes_moved", "log2_roofline_us",
    "log2_tiles", "log2_waves", "last_wave_fill", "m_waste", "n_waste", "log2_k_steps", "smem_fraction",
    "acc_per_thread", "log2_w_reads", "log2_a_reads", "tile_intensity", "log2_traffic", "mma_efficiency", "loads_in_flight",
    "log2_estimate_us", "sm_count", "log2_copy_gbs", "warp_size", "log2_peak_tflops",
)
MEM_WARPS_PER_SM = 16  # warps per SM that keep enough loads in flight to stream at full bandwidth
STEP_LATENCY_US = 0.35  # one k step's load latency, hidden in proportion to the pipeline depth
# The share of the L2 an operand may take and stay resident while tiles re-read it (the rest holds the
# other operand's tiles and the output): a 1 MB decode activation read by 96 column tiles costs memory
# bandwidth once, not 96 times (charged 96 times, it ranked a 256-row W4A8 GEMM's fastest tile, 20.4 us
# on an H100, below 32-row tiles that took 30-104 us).
L2_RESIDENT_SHARE = 0.5
# fp32 instruction slots a matrix tile spends per weight code it unpacks (masks, shifts, integer
# multiply-adds at half the fp32 rate, the scale): about 0.9 integer instructions per code in W4A8's
# lanes tiles on sm_90 (SASS: 186 against W8A8's 128 per k step of one tile). 4 and 6 rank the
# recorded GEMM logs best in replay, alike (benchmarks/results/search_quality_replays.md#prior_slots).
UNPACK_SLOTS = 4.0


def _peak_tflops(wl: Workload, target: Target) -> float:
    """The matrix rate of the workload's operand dtype (every target states it: descriptor_check.peak_rates)."""
    return float(target.peak_tflops[operand_dtype(wl)])


def _flat(wl: Workload, s: Mapping[str, Any]) -> Mapping[str, Any]:
    """`s` spelled out flat: a variant-form schedule, or a record's (read as its variant where it has one,
    else as written, with the knobs it predates at their neutral values)."""
    s = current(wl, dict(s))
    return flat_of(wl, s) if "variant" in s else {**ADDED_KNOBS, **s}


def columns(wl: Workload, schedules: list[Mapping[str, Any]], target: Target) -> dict[str, np.ndarray]:
    m, n, k, _ = extents(wl)
    schedules = [_flat(wl, s) for s in schedules]
    kv = {name: np.asarray([float(s[name]) for s in schedules]) for name in KNOBS}
    bm, bn, bk, split = kv["block_m"], kv["block_n"], kv["block_k"], kv["split_k"]
    ob = dtypes.BYTES[operand_dtype(wl)]
    flops = 2.0 * m * n * k
    nbytes = float(bytes_moved(wl))
    peak = _peak_tflops(wl, target) * 1e6  # flop per us
    bw = target.copy_gbs * 1e3  # bytes per us
    tm, tn = np.ceil(m / bm), np.ceil(n / bn)
    tiles = tm * tn * split
    sms = max(target.sm_count, 1)
    waves = tiles / sms
    full = np.ceil(waves)
    threads = kv["num_warps"] * target.warp_size
    # Bytes per weight element as loaded (int4 codes: half a byte, plus their scales), per schedule.
    per_depth = {b: load_bytes(wl, int(b))[1] for b in set(bk)}  # (a prologue rewrite per k depth, not per schedule)
    w_bytes = n * k * np.asarray([per_depth[b] for b in bk])
    a_bytes = m * k * ob
    # W tiles are read once per row of tiles; grouping row tiles lets the L2 serve most repeats.
    w_reads = np.maximum(1.0, tm / np.where(kv["group_m"] > 1, np.minimum(kv["group_m"], tm), 1.0))
    # Split-K writes each partial tile once and the merging program reads them all back.
    partials = np.where(split > 1, 2.0 * tiles * bm * bn * 4, 0.0)
    # What comes from memory: an operand that fits its share of the L2 once, however often tiles re-read it.
    resident = L2_RESIDENT_SHARE * float(target.get("l2_bytes", 0))
    fetches = lambda size, reads: np.where(size <= resident, 1.0, reads)  # noqa: E731
    a_traffic = a_bytes * fetches(a_bytes, tn)
    traffic = w_bytes * fetches(w_bytes, w_reads) + a_traffic + (nbytes - w_bytes - a_bytes) + partials
    # A weight dequantized first: the dequant kernel reads the codes and writes the operand-dtype
    # weight, which the GEMM's tiles then read as W.
    staged = kv["dequant_first"] > 0
    if staged.any():
        coded, dense = n * k * load_bytes(wl, max(min_block_k(wl), 128))[1], n * k * ob
        traffic = np.where(staged, dense * fetches(dense, w_reads) + a_traffic + (nbytes - coded - a_bytes) + partials
                           + coded + dense, traffic)
    # A matrix tile unpacks its weight tile's codes again for every row of tiles, on the ALUs.
    unpacks = (np.asarray([per_depth[b] for b in bk]) < ob) & (bm >= 16) & ~staged
    # The instruction's 64 rows per warpgroup are the tile's rows; where int4 codes are unpacked into
    # its register operand (acc^T: float codes in int4_mma and the Gluon int4 tiles, `lanes` codes)
    # they are its weight rows, and few activation rows cost as they do elsewhere: the fewer of the two
    # counts. A 256 x 32 lanes tile fills half of each instruction (57 us on the 256-row W4A8 qkv where
    # 128 x 64 took 20.6, H100); gemm_w4a8's k128 codes enter a plain tile, not transposed.
    transposed = unpacks & bool(int4_affine(wl) or int8_lanes(wl))
    mma_rows = np.where(transposed, np.minimum(bm, bn), bm)
    mma_eff = np.clip((bm * bn) / (128.0 * 256.0), 0.05, 1.0) ** 0.3 * np.clip(mma_rows / 64.0, 0.25, 1.0)
    # Tiles under 16 rows run on the ALUs: about 4 instructions per weight and row (fp32 rate).
    alu_peak = float(target.peak_tflops["fp32"]) * 1e6 / 4.0
    compute_us = np.where(bm < 16, flops / alu_peak, flops / (peak * mma_eff))
    compute_us = compute_us + np.where(unpacks, n * k * tm * UNPACK_SLOTS / (alu_peak * 2.0), 0.0)
    # Streaming needs loads in flight on every SM: about 16 warps' worth each, or bandwidth falls.
    in_flight = np.clip(tiles * kv["num_warps"] / (sms * MEM_WARPS_PER_SM), 0.1, 1.0)
    memory_us = traffic / bw / in_flight
    k_steps = np.ceil(k / (bk * split))
    latency_us = k_steps * STEP_LATENCY_US / kv["num_stages"]
    est = (np.maximum(compute_us, memory_us) * (full / np.maximum(waves, 1e-9)).clip(1, 8) + latency_us
           + 2.0 * (1 + staged))  # a launch each
    smem = kv["num_stages"] * (bm + bn) * bk * ob
    roof_us = max(flops / peak, nbytes / bw)
    cols = {name: kv[name] for name in KNOBS}
    cols.update({f"log2_{name}": np.log2(kv[name]) for name in SIZES})
    ones = np.ones(len(schedules))
    cols.update({
        "log2_m": ones * np.log2(m), "log2_n": ones * np.log2(n), "log2_k": ones * np.log2(k),
        "operand_bytes": ones * ob, "log2_flops": ones * np.log2(flops), "log2_bytes_moved": ones * np.log2(nbytes),
        "log2_roofline_us": ones * np.log2(roof_us), "log2_tiles": np.log2(tiles), "log2_waves": np.log2(waves),
        "last_wave_fill": waves / full, "m_waste": tm * bm / m - 1, "n_waste": tn * bn / n - 1,
        "log2_k_steps": np.log2(k_steps), "smem_fraction": smem / max(int(target.get("smem_per_block", 1)), 1),
        "acc_per_thread": bm * bn / threads, "log2_w_reads": np.log2(w_reads), "log2_a_reads": np.log2(tn),
        "tile_intensity": 2 * bm * bn * bk / ((bm + bn) * bk * ob), "log2_traffic": np.log2(traffic),
        "mma_efficiency": mma_eff, "loads_in_flight": in_flight, "log2_estimate_us": np.log2(est), "sm_count": ones * sms,
        "log2_copy_gbs": ones * np.log2(target.copy_gbs), "warp_size": ones * target.warp_size,
        "log2_peak_tflops": ones * np.log2(_peak_tflops(wl, target)), "_latency_us": est,
    })
    return cols

