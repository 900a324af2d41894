"""Timing one kernel call on a GPU or the CPU: median and spread of many runs.

GPU work is timed with CUDA events after a warm-up (the first call of a kernel also loads its module,
so nothing is estimated from it). Two regimes, chosen by the caller:
- `flush_l2=True`: a buffer twice the L2 is read (summed) before each timed call, so the call reads its
  inputs from memory; used when a workload's bytes are too many to stay in the L2 between calls.
  Reading, not writing, the buffer matters: a zeroed buffer leaves the L2 full of dirty lines whose
  write-back then competes with the timed kernel (seen: 2x slower timings of a 64 MB rmsnorm).
- `flush_l2=False`: the calls are captured in a CUDA graph and replayed, so host launch overhead
  is gone and inputs are L2-hot, as a small activation is right after the kernel that wrote it.
A call of `POWER_CALL_US` or more is first repeated for `POWER_WARMUP_MS` of device time, so that it
is timed in the steady state of sustained work, as a prefill runs it. Under load the H200 sits at
its power cap from about 100 ms on and clocks down: long GEMMs, cuBLAS included, then run 15-20%
slower than in their first 50 ms, and the plateau's median after 300 ms and after 1 s agree within
1.3% (`benchmarks/results/sustained_load.md`). Timed cold, a call is ranked by a speed it does not keep,
and two calls timed at different points of that ramp compare unlike speeds.
Short calls are timed as replays of a CUDA graph (runtime/serving/graphs.py `cuda_graph`, as the decoder's steps run).
`behind_cost` times a call where a decode step runs it: right behind the kernel that writes its input.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from flashgen.runtime.serving.graphs import cuda_graph


@dataclass(frozen=True)
class Timing:
    median_us: float
    spread_us: float  # interquartile range
    runs: int


def _summary(samples_us: list[float]) -> Timing:
    samples_us = sorted(samples_us)
    q = statistics.quantiles(samples_us, n=4) if len(samples_us) > 1 else [samples_us[0]] * 3
    return Timing(statistics.median(samples_us), q[2] - q[0], len(samples_us))


_FLUSH: dict[int, torch.Tensor] = {}
SLEEP_CYCLES = 100_000  # ~50 us at 2 GHz
MIN_GRAPH_CALLS = 20  # a replay costs a few microseconds of its own: spread it over many calls
POWER_CALL_US = 100.0  # calls at least this long are timed in the steady state of back-to-back work
POWER_WARMUP_MS = 300.0  # device time of back-to-back calls that reaches it


def flush_buffer(device: torch.device, l2_bytes: int) -> torch.Tensor:
    """Twice the L2, kept per device: summing it leaves the L2 holding none of a call's data."""
    idx = device.index or 0
    if idx not in _FLUSH:
        _FLUSH[idx] = torch.empty(2 * l2_bytes // 4, dtype=torch.int32, device=device)
    return _FLUSH[idx]


def gpu_time(fn: Callable[[], Any], device: torch.device, flush_l2: bool, l2_bytes: int,
             runs: int = 30, warmup_ms: float = 5.0, graph_us: float = 200.0, power_warmup: bool = True) -> Timing:
    """Median device time of one `fn()` call in microseconds (`power_warmup=False`: a long call timed
    without the sustained warm-up, as it runs after an idle gap)."""
    with torch.cuda.device(device):
        fn()
        deadline = time.perf_counter() + warmup_ms / 1e3
        while time.perf_counter() < deadline:
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        end.record()
        torch.cuda.synchronize()
        once_us = max(start.elapsed_time(end) * 1e3 / 5, 0.5)
        if power_warmup and once_us >= POWER_CALL_US:  # counted in calls, not host time, so the queue holds only that much
            for _ in range(int(POWER_WARMUP_MS * 1e3 / once_us)):
                fn()
            torch.cuda.synchronize()
        if flush_l2:
            buf = flush_buffer(device, l2_bytes)
            sink = torch.empty((), dtype=torch.int64, device=device)
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(runs)]
            for s, e in events:
                torch.cuda._sleep(SLEEP_CYCLES)  # lets the host queue the call before the GPU needs it
                torch.sum(buf, dim=0, out=sink)
                s.record()
                fn()
                e.record()
            torch.cuda.synchronize()
            return _summary([s.elapsed_time(e) * 1e3 for s, e in events])
        calls = max(MIN_GRAPH_CALLS, min(200, int(graph_us / once_us)))

        def repeated() -> None:  # each output freed at once, as in a loop of calls: the next reuses its memory
            for _ in range(calls):
                fn()

        graph, _ = cuda_graph(repeated, device)
        graph.replay()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(runs)]
        for s, e in events:
            s.record()
            graph.replay()
            e.record()
        torch.cuda.synchronize()
        return _summary([s.elapsed_time(e) * 1e3 / calls for s, e in events])


BEHIND_ATTEMPTS = 3  # timings behind a producer before a difference of 0 us or less stands


def behind_cost(call: Callable[[], Any], produce: Callable[[], Any], device: torch.device, l2_bytes: int,
                rounds: int = 5, runs: int = 30) -> Timing:
    """A call's cost right behind `produce`, the kernel that writes its input. On a GPU: each (L2 flush,
    produce, call) against (L2 flush, produce), both replayed from CUDA graphs, where the call's programs
    start while the producer still runs (programmatic dependent launch) and its first weight loads can
    overlap it, which timing the call alone cannot see. On the CPU: the two in sequence against `produce`.
    The result is the median of `rounds` interleaved differences of medians, the spread their range. A
    median of 0 us or less (the call hidden in the noise, as on a loaded CPU) is timed again, up to
    `BEHIND_ATTEMPTS` times in all, and then returned as it is: the runner records it as no timing. On a GPU the pair first runs back to back for
    `POWER_WARMUP_MS`: the tuner builds a batch before it measures one, and an idle H200 clocks down.
    (The first candidate of a tune still read 1.1-1.4 us apart across rounds on the H200, most others
    0.1-0.4: why is not established, and the median does not follow one such round.)"""
    if device.type == "cuda":
        buf = flush_buffer(device, l2_bytes)
        sink = torch.empty((), dtype=torch.int64, device=device)

        def base() -> None:
            torch.sum(buf, dim=0, out=sink)
            produce()

        def timed(fn: Callable[[], Any]) -> float:
            return gpu_time(fn, device, False, l2_bytes, runs=runs).median_us
    else:
        base = produce

        def timed(fn: Callable[[], Any]) -> float:
            return cpu_time(fn, runs=runs).median_us

    def both() -> None:
        base()
        call()

    if device.type == "cuda":
        deadline = time.perf_counter() + POWER_WARMUP_MS / 1e3
        while time.perf_counter() < deadline:
            both()
        torch.cuda.synchronize(device)
    for _ in range(BEHIND_ATTEMPTS):
        diffs = [timed(both) - timed(base) for _ in range(rounds)]
        if statistics.median(diffs) > 0:
            break
    return Timing(statistics.median(diffs), max(diffs) - min(diffs), rounds * runs)


def cpu_time(fn: Callable[[], Any], runs: int = 20, min_run_s: float = 0.002) -> Timing:
    """Median wall time of one `fn()` call on the CPU; each sample averages enough calls to last
    `min_run_s`, so that timer resolution does not dominate short kernels."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    calls = max(1, int(min_run_s / once))
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return _summary(samples)
