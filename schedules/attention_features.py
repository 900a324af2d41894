"""Features and the analytic latency estimate of attention schedules (decode and prefill).

Decode: a program per (sequence, KV head) streams that head's cache once; the time is the cache bytes
over the bandwidth, stretched when B x Hkv programs fill the SMs unevenly, plus a latency per loop step
(a page-table lookup and a dependent load) that more pages per step and deeper pipelines amortise.
Prefill: causal attention is compute-bound; the time is half the dense FLOPs over the matrix rate at an
efficiency growing with the tile, plus the per-step latency of each query tile's walk over its keys.
One feature set covers both (knobs a kind lacks read 1), so one model serves the class.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from flashgen.ir.op import Attend
from flashgen.roofline import bytes_moved
from flashgen.targets.descriptor import Target
from flashgen.workload import Workload

KNOBS = ("pages", "splits", "block_m", "block_n", "num_warps", "num_stages", "consumers")
SWITCHES = ("tma", "early_kv", "backend", "pingpong", "persistent")  # 0/1 knobs of one kind each; a record before them reads 0
FEATURE_NAMES: tuple[str, ...] = (*KNOBS, *(f"log2_{k}" for k in KNOBS), *SWITCHES, "is_prefill", "log2_b", "log2_len",
                                  "group", "log2_d", "log2_bytes_moved", "log2_flops", "log2_programs",
                                  "log2_waves", "last_wave_fill", "log2_steps", "log2_estimate_us", "sm_count",
                                  "log2_copy_gbs")
STEP_US = 0.4


def columns(wl: Workload, schedules: list[Mapping[str, Any]], target: Target) -> dict[str, np.ndarray]:
    d = wl.dim
    prefill = next(st.kind for st in wl.op.body(wl.attr) if isinstance(st, Attend)) == "prefill"
    kv = {k: np.asarray([float(s.get(k, 1)) for s in schedules]) for k in KNOBS}
    ones = np.ones(len(schedules))
    sms = max(target.sm_count, 1)
    nbytes = float(bytes_moved(wl))
    if prefill:
        length = d["T"] / d["B"]
        flops = 2.0 * 2.0 * d["Hq"] * d["D"] * d["B"] * length * length / 2  # QK^T and PV, causal half
        peak = target.peak_tflops[wl.attr["dtype"]] * 1e6
        programs = np.ceil(length / kv["block_m"]) * d["B"] * d["Hq"]
        eff = np.clip(kv["block_m"] * kv["block_n"] / (128.0 * 128.0), 0.1, 1.0) ** 0.5
        steps = np.ceil(length / kv["block_n"])
        waves = programs / sms
        est = flops / (peak * eff) * np.maximum(1.0, np.ceil(waves) / waves) + steps * STEP_US / kv["num_stages"] + 3.0
    else:
        length, flops = float(d["L"]), 4.0 * d["B"] * d["Hq"] * d["D"] * d["L"]
        programs = d["B"] * d["Hkv"] * kv["splits"]
        steps = np.ceil(d["L"] / (d["BS"] * kv["pages"] * kv["splits"]))
        waves = programs / sms
        est = nbytes / (target.copy_gbs * 1e3) * np.maximum(1.0, np.ceil(waves) / waves) \
            + steps * STEP_US / kv["num_stages"] + 2.0
    cols = {k: kv[k] for k in KNOBS}
    cols.update({f"log2_{k}": np.log2(kv[k]) for k in KNOBS})
    cols.update({k: np.asarray([float(s.get(k, 0)) for s in schedules]) for k in SWITCHES})
    cols.update({"is_prefill": ones * prefill, "log2_b": ones * np.log2(d["B"]), "log2_len": ones * np.log2(length),
                 "group": ones * d["Hq"] / d["Hkv"], "log2_d": ones * np.log2(d["D"]),
                 "log2_bytes_moved": ones * np.log2(nbytes), "log2_flops": ones * np.log2(flops),
                 "log2_programs": np.log2(programs), "log2_waves": np.log2(waves),
                 "last_wave_fill": waves / np.ceil(waves), "log2_steps": np.log2(steps), "log2_estimate_us": np.log2(est),
                 "sm_count": ones * sms, "log2_copy_gbs": ones * np.log2(target.copy_gbs), "_latency_us": est})
    return cols

