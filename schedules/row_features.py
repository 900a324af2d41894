"""Features of rowwise and pointwise schedules for the cost model, and their analytic latency estimate.

One feature vector describes one schedule of one workload on one target. Three kinds of numbers go in:
- the knobs themselves (and their log2), so the model can learn what no formula here knows;
- the workload: domain shape, kernel class, reductions, dtype size, bytes it must move, its roofline;
- analytic quantities derived from the target's descriptor: programs launched, how many fit on an SM
  at once (threads and a register estimate), waves over the SMs and the last wave's fill, occupancy,
  elements per thread, passes over the row and the bytes actually read with re-reads, masked-tail
  waste, bytes per program, and the target's SM count, bandwidth, warp size and L2 size.
Because the descriptor's numbers are features, one model learns across targets, and because sizes
enter as log2 and time as a ratio to the roofline, one model serves every shape of a kernel class.

The same quantities give a latency estimate ("_latency_us"): the prior the search ranks by before
any measurement exists. Everything is vectorised over schedules (numpy), so featurising a
space of thousands of schedules takes milliseconds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from flashgen.ir import dtypes
from flashgen.ir.op import Reduce
from flashgen.kernel_classes import kernel_class
from flashgen.roofline import bytes_moved, roofline_us, tensor_bytes
from flashgen.targets.descriptor import Target
from flashgen.workload import Workload, domain

FEATURE_NAMES: tuple[str, ...] = (
    # knobs
    "block_r", "block_c", "num_warps", "log2_block_r", "log2_block_c", "log2_num_warps",
    # workload
    "log2_rows", "log2_cols", "is_rowwise", "is_pointwise", "n_reductions", "dtype_bytes",
    "log2_bytes_moved", "log2_roofline_us",
    # analytic, workload x schedule x target
    "log2_programs", "resident_per_sm", "occupancy", "log2_waves", "wave_efficiency", "last_wave_fill",
    "log2_threads", "log2_elems_per_thread", "regs_per_thread", "looped", "passes", "loop_iters",
    "reread_factor", "log2_bytes_read", "l2_reread_hit", "row_tail_waste", "col_tail_waste",
    "log2_bytes_per_program", "bw_efficiency", "log2_analytic_slowdown",
    # target
    "sm_count", "log2_copy_gbs", "warp_size", "log2_l2_bytes",
)

# Constants of the analytic estimate; rough on purpose: the learned model corrects them from data.
LAUNCH_US = 2.0             # a launch's fixed cost (driver + first program start)
MEM_LATENCY_US = 0.7        # one DRAM round trip a program waits through per pass over its rows
TILE_ITER_US = 0.03         # one iteration of a looped row walk (address math, loop control)
SYNC_US = 0.02              # one cross-warp reduction step (shared memory + barrier)
INFLIGHT_BYTES_PER_THREAD = 64   # loads one thread keeps in flight at best (4 x 16-byte vectors)
L2_REREAD_COST = 0.3        # a re-read served from L2 costs this fraction of one from DRAM
MAX_BLOCKS_PER_SM = 32
VECTOR_BYTES = 16           # the widest load a thread issues


@dataclass(frozen=True)
class _WorkloadInfo:
    rows: int
    cols: int
    rowwise: bool
    n_reduce: int
    dtype_bytes: int
    bytes_moved: float
    in_bytes: float        # bytes of the inputs (what a looped row walk re-reads)
    in_bytes_per_row: float
    roofline_us: float


_INFO_CACHE: dict[tuple[Workload, str, float], _WorkloadInfo] = {}


def _info(wl: Workload, target: Target) -> _WorkloadInfo:
    # Target holds dicts, so it is not hashable; its id and bandwidth identify what matters here.
    key = (wl, target.id, target.copy_gbs)
    info = _INFO_CACHE.get(key)
    if info is None:
        if len(_INFO_CACHE) > 4096:
            _INFO_CACHE.clear()
        info = _INFO_CACHE[key] = _compute_info(wl, target)
    return info


def _compute_info(wl: Workload, target: Target) -> _WorkloadInfo:
    rows, cols = domain(wl)
    op = wl.op
    n_reduce = sum(isinstance(st, Reduce) for st in op.body(wl.attr))
    in_bytes = sum(tensor_bytes(wl, t) for t in wl.inputs)
    return _WorkloadInfo(
        rows=rows, cols=cols, rowwise=not kernel_class(op.kclass).tiles_cols, n_reduce=n_reduce,
        dtype_bytes=dtypes.BYTES[wl.attr.get("dtype", "fp32")], bytes_moved=float(bytes_moved(wl)),
        in_bytes=float(in_bytes), in_bytes_per_row=in_bytes / max(1, rows),
        roofline_us=max(roofline_us(wl, target), 1e-6) if target.copy_gbs > 0 else 1e-6)


def _knob_arrays(schedules: Iterable[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a = np.array([(s["block_r"], s["block_c"], s["num_warps"]) for s in schedules], dtype=np.float64)
    a = a.reshape(-1, 3)
    return a[:, 0], a[:, 1], a[:, 2]


def columns(wl: Workload, schedules: Iterable[Mapping[str, Any]], target: Target) -> dict[str, np.ndarray]:
    """Every feature (and the analytic latency, key "_latency_us") as float64 arrays over schedules."""
    info = _info(wl, target)
    br, bc, nw = _knob_arrays(schedules)
    n = br.shape[0]
    rows, cols = float(info.rows), float(info.cols)
    ws = float(max(1, target.warp_size))
    sm = float(max(1, target.sm_count))
    threads = nw * ws
    max_thr_sm = np.maximum(threads, float(target.get("max_threads_per_sm", 2048) or 1))
    regs_sm = float(target.get("regs_per_sm", 0) or 0)
    l2 = float(target.get("l2_bytes", 0) or 0)

    row_tiles = np.ceil(rows / br)
    col_tiles = np.ceil(cols / bc)
    programs = row_tiles * (1.0 if info.rowwise else col_tiles)
    tile = br * bc
    ept = tile / threads
    looped = (bc < cols) if info.rowwise else np.zeros(n, dtype=bool)
    passes = np.where(looped, info.n_reduce + 1.0, 1.0)
    loop_iters = passes * (col_tiles if info.rowwise else 1.0)

    # Registers: a base for addresses and indices plus the values each thread holds; a rowwise tile
    # that covers the row keeps it live across the reduction, which costs more than a streamed tile.
    regs = np.minimum(255.0, 32.0 + ept * np.where(info.rowwise & ~looped, 2.0, 1.25))
    resident = np.floor(max_thr_sm / threads)
    if regs_sm > 0:
        resident = np.minimum(resident, np.floor(regs_sm / (regs * threads)))
    resident = np.clip(resident, 1.0, MAX_BLOCKS_PER_SM)
    capacity = sm * resident
    waves = programs / capacity
    full_waves = np.ceil(waves)
    wave_eff = waves / full_waves
    last_fill = (programs - (full_waves - 1.0) * capacity) / capacity
    active_per_sm = np.minimum(resident, programs / sm)
    occupancy = active_per_sm * threads / max_thr_sm

    row_waste = (row_tiles * br - rows) / (row_tiles * br)
    col_waste = (col_tiles * bc - cols) / (col_tiles * bc)

    # Re-reads of a looped row walk hit L2 when the rows in flight fit in (half of) it.
    inflight_row_bytes = np.minimum(programs, capacity) * br * info.in_bytes_per_row
    l2_hit = np.clip(0.5 * l2 / np.maximum(inflight_row_bytes, 1.0), 0.0, 1.0) if l2 > 0 else np.zeros(n)
    reread_bytes = info.in_bytes * (passes - 1.0) * (1.0 - (1.0 - L2_REREAD_COST) * l2_hit)
    reread = (info.bytes_moved + reread_bytes) / max(info.bytes_moved, 1.0)
    bytes_read = info.in_bytes * passes

    # Bandwidth reached: bytes in flight per SM (Little's law) against what the target needs to
    # cover its memory latency; masked lanes carry nothing.
    need_per_sm = target.copy_gbs * 1e3 * MEM_LATENCY_US / sm if target.copy_gbs > 0 else 1.0
    per_thread = np.minimum(ept * info.dtype_bytes, INFLIGHT_BYTES_PER_THREAD)
    inflight = active_per_sm * threads * per_thread * (1.0 - row_waste) * (1.0 - col_waste)
    # Narrower than 16-byte vector loads per thread costs load instructions, even with enough in flight.
    vector = 0.75 + 0.25 * np.minimum(1.0, ept * info.dtype_bytes / VECTOR_BYTES)
    bw_eff = np.clip(inflight / need_per_sm, 1e-3, 1.0) * vector

    # Latency: bandwidth time with re-reads, stretched by wave quantisation (a partial last wave runs
    # with the bandwidth mostly idle), or the latency floor of the waves' passes, plus the launch.
    quant = 1.0 + 0.5 * (full_waves - waves) / full_waves
    t_bw = info.roofline_us * reread / bw_eff * quant
    t_lat = full_waves * passes * MEM_LATENCY_US + full_waves * loop_iters * TILE_ITER_US
    t_sync = full_waves * passes * info.n_reduce * np.log2(np.maximum(nw, 1.0)) * SYNC_US
    latency = LAUNCH_US + np.maximum(t_bw, t_lat) + t_sync

    log2 = np.log2
    c = lambda v: np.full(n, float(v))  # noqa: E731
    return {
        "block_r": br, "block_c": bc, "num_warps": nw,
        "log2_block_r": log2(br), "log2_block_c": log2(bc), "log2_num_warps": log2(nw),
        "log2_rows": c(math.log2(rows)), "log2_cols": c(math.log2(cols)),
        "is_rowwise": c(info.rowwise), "is_pointwise": c(not info.rowwise),
        "n_reductions": c(info.n_reduce), "dtype_bytes": c(info.dtype_bytes),
        "log2_bytes_moved": c(math.log2(max(info.bytes_moved, 1.0))),
        "log2_roofline_us": c(math.log2(info.roofline_us)),
        "log2_programs": log2(programs), "resident_per_sm": resident, "occupancy": occupancy,
        "log2_waves": log2(waves), "wave_efficiency": wave_eff, "last_wave_fill": last_fill,
        "log2_threads": log2(threads), "log2_elems_per_thread": log2(ept), "regs_per_thread": regs,
        "looped": looped.astype(np.float64), "passes": passes, "loop_iters": loop_iters,
        "reread_factor": reread, "log2_bytes_read": log2(np.maximum(bytes_read, 1.0)),
        "l2_reread_hit": l2_hit, "row_tail_waste": row_waste, "col_tail_waste": col_waste,
        "log2_bytes_per_program": log2(np.maximum(info.bytes_moved / programs, 1.0)),
        "bw_efficiency": bw_eff, "log2_analytic_slowdown": log2(latency / info.roofline_us),
        "sm_count": c(target.sm_count), "log2_copy_gbs": c(math.log2(max(target.copy_gbs, 1.0))),
        "warp_size": c(target.warp_size), "log2_l2_bytes": c(math.log2(max(l2, 1.0))),
        "_latency_us": latency,
    }

