"""Features and the analytic latency estimate of paged decode attention schedules.

A program per (sequence, KV head) streams that head's keys and values once: the time is the cache
bytes over the bandwidth, stretched when B x Hkv programs fill the SMs unevenly, plus a latency per
loop step (one page table lookup and a dependent load) that more pages per step and deeper pipelines
amortise.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np

from flashgen.roofline import bytes_moved
from flashgen.targets.descriptor import Target
from flashgen.workload import Workload

KNOBS = ("pages", "num_warps", "num_stages")
FEATURE_NAMES: tuple[str, ...] = (*KNOBS, *(f"log2_{k}" for k in KNOBS), "log2_b", "log2_l", "group", "log2_d",
                                  "log2_bs", "log2_bytes_moved", "log2_programs", "log2_waves", "last_wave_fill",
                                  "log2_steps", "log2_estimate_us", "sm_count", "log2_copy_gbs")
STEP_US = 0.4


def _columns(wl: Workload, schedules: list[Mapping[str, Any]], target: Target) -> dict[str, np.ndarray]:
    d = wl.dim
    kv = {k: np.asarray([float(s[k]) for s in schedules]) for k in KNOBS}
    ones = np.ones(len(schedules))
    programs = d["B"] * d["Hkv"]
    waves = programs / max(target.sm_count, 1)
    steps = np.ceil(d["L"] / (d["BS"] * kv["pages"]))
    mem_us = bytes_moved(wl) / (target.copy_gbs * 1e3)
    est = mem_us * max(1.0, np.ceil(waves) / waves) + steps * STEP_US / kv["num_stages"] + 2.0
    cols = {k: kv[k] for k in KNOBS}
    cols.update({f"log2_{k}": np.log2(kv[k]) for k in KNOBS})
    cols.update({"log2_b": ones * np.log2(d["B"]), "log2_l": ones * np.log2(d["L"]), "group": ones * d["Hq"] / d["Hkv"],
                 "log2_d": ones * np.log2(d["D"]), "log2_bs": ones * np.log2(d["BS"]),
                 "log2_bytes_moved": ones * np.log2(bytes_moved(wl)), "log2_programs": ones * np.log2(programs),
                 "log2_waves": ones * np.log2(waves), "last_wave_fill": ones * waves / np.ceil(waves),
                 "log2_steps": np.log2(steps), "log2_estimate_us": np.log2(est), "sm_count": ones * target.sm_count,
                 "log2_copy_gbs": ones * np.log2(target.copy_gbs), "_latency_us": est})
    return cols


def feature_matrix(wl: Workload, schedules: Iterable[Mapping[str, Any]], target: Target) -> np.ndarray:
    cols = _columns(wl, list(schedules), target)
    return np.stack([cols[name] for name in FEATURE_NAMES], axis=1).astype(np.float32)


def analytic_latency_us(wl: Workload, schedules: Iterable[Mapping[str, Any]], target: Target) -> np.ndarray:
    return _columns(wl, list(schedules), target)["_latency_us"]
