"""Features and the analytic latency estimate of moe schedules (grouped GEMMs over routed pairs).

A random router touches E * (1 - (1 - KT / E) ** M) of the E experts on average; the kernel reads
those experts' weights once per row tile of the expert (decode has one), the pairs' A rows once per
column tile, and writes the outputs. The time is the larger of those bytes over the copy bandwidth
and the FLOPs over the matrix rate at an efficiency growing with the tile, stretched by the last
wave's fill, plus a fixed launch cost; programs past the last tile return at once, at a small cost each,
and with the ids routing every program first scans the top-k ids.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from flashgen.ir import dtypes
from flashgen.ir.op import Contract
from flashgen.schedules.moe_space import contracts, touched_experts
from flashgen.oplib.moe import IDS_SCAN
from flashgen.targets.descriptor import Target
from flashgen.workload import Workload

KNOBS = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
FEATURE_NAMES: tuple[str, ...] = (*KNOBS, *(f"log2_{k}" for k in KNOBS), "log2_m", "log2_n", "log2_k", "log2_e",
                                  "topk", "contracts", "by_ids", "weight_bytes", "log2_touched", "log2_bytes", "log2_flops",
                                  "log2_programs", "log2_waves", "last_wave_fill", "log2_estimate_us", "sm_count",
                                  "log2_copy_gbs")
WEIGHT_BYTES = {"half": 2.0, "w8a16": 1.0, "w4a16g128": 0.5, "w8a8": 1.0, "w4a8g128": 0.5}
LAUNCH_US, EXIT_US = 3.0, 0.0005
SCAN_US = 0.05  # an ids-routed program's scan of IDS_SCAN ids, per SM (it runs beside the other programs)


def columns(wl: Workload, schedules: list[Mapping[str, Any]], target: Target) -> dict[str, np.ndarray]:
    d = wl.dim
    kv = {k: np.asarray([float(s[k]) for s in schedules]) for k in KNOBS}
    ones = np.ones(len(schedules))
    m, n, k, e, kt = d["M"], d["N"], d["K"], d["E"], d["KT"]
    tiles_w = contracts(wl)
    pairs = m * kt
    touched = touched_experts(m, e, kt)
    operand = next(st for st in wl.op.body(wl.attr) if isinstance(st, Contract)).operand_dtype(wl.attr)
    elem = dtypes.BYTES[operand]  # an activation's bytes (int8 ones: 1)
    wbytes = WEIGHT_BYTES[wl.attr["weights"]]
    col_tiles = np.ceil(n / kv["block_n"])
    row_tiles = touched * np.ceil(pairs / touched / kv["block_m"])  # each touched expert's, its last partial
    nbytes = (tiles_w * n * k * wbytes * row_tiles
              + col_tiles * pairs * k * elem + pairs * n * (dtypes.BYTES[wl.attr["dtype"]] if tiles_w > 1 else 8.0))
    flops = 2.0 * pairs * tiles_w * n * k
    peak = target.peak_tflops[operand] * 1e6
    eff = np.clip(kv["block_m"] * kv["block_n"] / (128.0 * 128.0), 0.05, 1.0) ** 0.5
    programs = row_tiles * col_tiles
    sms = max(target.sm_count, 1)
    waves = programs / sms
    stretch = np.maximum(1.0, np.ceil(waves) / waves)
    # (targets/triton/moe.py) ids: every program scans the ids, M / block_m row blocks of each expert, or
    # of each pair when pairs are fewer; sorted: a row tile more per expert, never more tiles than pairs
    by_ids = wl.attr["routing"] == "ids"
    launched = (min(e, pairs) * np.ceil(m / kv["block_m"]) if by_ids
                else np.minimum(np.ceil(pairs / kv["block_m"]) + e, pairs)) * col_tiles
    scan = launched * np.ceil(pairs / IDS_SCAN) * SCAN_US / sms if by_ids else 0.0
    est = (np.maximum(nbytes / (target.copy_gbs * 1e3), flops / (peak * eff)) * stretch
           + (launched - programs) * EXIT_US + scan + LAUNCH_US)
    cols = {key: kv[key] for key in KNOBS}
    cols.update({f"log2_{key}": np.log2(kv[key]) for key in KNOBS})
    cols.update({"log2_m": ones * np.log2(m), "log2_n": ones * np.log2(n), "log2_k": ones * np.log2(k),
                 "log2_e": ones * np.log2(e), "topk": ones * kt, "contracts": ones * tiles_w, "by_ids": ones * by_ids,
                 "weight_bytes": ones * wbytes, "log2_touched": ones * np.log2(touched),
                 "log2_bytes": np.log2(nbytes), "log2_flops": ones * np.log2(flops), "log2_programs": np.log2(programs),
                 "log2_waves": np.log2(waves), "last_wave_fill": waves / np.ceil(waves), "log2_estimate_us": np.log2(est),
                 "sm_count": ones * sms, "log2_copy_gbs": ones * np.log2(target.copy_gbs), "_latency_us": est})
    return cols
