"""Host cost per launch of a small generated kernel, each way it can be called.

The kernel is rmsnorm, M=1, bf16 (about 2 us on the GPU); the ways: `kernel.run` (checks, then the native
launch), the same with Triton's launcher of the binary (FLASHGEN_NATIVE_LAUNCH=0), a bound call
(`kernel.bind`: checked once, the native launch alone), Triton's launcher of the binary with its
arguments gathered once, the torch custom op, Triton's own JIT launch of the same generated source, torch
eager, and a CUDA graph of 100 calls replayed.

    python benchmarks/launch.py [--n 4096] [--calls 20000] [--rounds 5] [--out-dir DIR]

The calls are issued back to back with no synchronization inside the loop; the GPU finishes each before
the host issues the next, so the loop's time per call is the host's cost (goal: at most 5 us).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, environment, print_table, write_results  # noqa: E402
from peers import PEERS  # noqa: E402

import flashgen  # noqa: E402
from flashgen.ir.op import eval_int  # noqa: E402
from flashgen.runtime import register_all  # noqa: E402
from flashgen.runtime.serving.graphs import cuda_graph  # noqa: E402
from flashgen.schedules.timing import gpu_time  # noqa: E402
from flashgen.targets import device_target  # noqa: E402
from flashgen.targets.kernel import Kernel, bind_dims  # noqa: E402
from flashgen.targets.triton.build import load_function  # noqa: E402
from flashgen.targets.triton.codegen import grid  # noqa: E402

GRAPH_CALLS = 100
WARMUP_S = 0.1  # an idle H200 clocks down: bring it up before the first timed loop


def launch_args(kernel: Kernel, tensors: dict[str, torch.Tensor]) -> tuple[tuple[int, int, int], list[Any]]:
    """The grid and argument list the kernel's launcher passes for these tensors (inputs and outputs),
    with the op's default params."""
    wl, launcher = kernel.workload, kernel.launcher
    dims = bind_dims(wl, {t.name: tensors[t.name] for t in wl.inputs})
    args = launcher.args(tensors, dict(wl.op.params), dims)
    return grid(launcher.ks, wl, eval_int(wl.op.domain[0], dims), int(launcher.target.sm_count), dims), args


def triton_jit(kernel: Kernel, tensors: dict[str, torch.Tensor]) -> Callable[[], Any]:
    """A call of the generated source's @triton.jit function through Triton's JIT launcher (which
    specializes and caches on its own), with the same grid, arguments and launch options."""
    g, args = launch_args(kernel, tensors)
    fn = load_function(kernel.launcher.ks)
    options = {"num_warps": kernel.schedule["num_warps"], "num_stages": kernel.schedule.get("num_stages", 1)}
    return lambda: fn[g](*args, **options)


def host_time(fn: Callable[[], Any], calls: int, rounds: int, per_call: int = 1) -> tuple[float, float]:
    """Median over rounds of (host us per call: the loop alone; wall us: the loop and the GPU catching up)."""
    deadline = time.perf_counter() + WARMUP_S
    while time.perf_counter() < deadline:
        fn()
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) / (calls * per_call) * 1e6)
        wall.append((t2 - t0) / (calls * per_call) * 1e6)
    return statistics.median(host), statistics.median(wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096, help="row length N")
    ap.add_argument("--calls", type=int, default=20000, help="back-to-back calls per timed loop")
    ap.add_argument("--rounds", type=int, default=5, help="timed loops per method (the median is kept)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    dev = torch.device("cuda")
    target = device_target(dev)
    wl = flashgen.workload("rmsnorm", M=1, N=args.n, dtype="bf16")
    kernel = flashgen.compile(wl, target)
    ins = {k: v.to(dev) for k, v in wl.op.make_inputs(wl.dim, wl.attr, torch.Generator().manual_seed(0)).items()}
    outs = kernel.run(ins)
    os.environ["FLASHGEN_NATIVE_LAUNCH"] = "0"  # read at a kernel's first launch
    tritons = flashgen.compile(wl, target)
    tritons.run(ins, outs)
    del os.environ["FLASHGEN_NATIVE_LAUNCH"]
    bound_out = {"y": torch.empty_like(outs["y"])}
    bound = kernel.bind(ins, bound_out)
    bound()
    torch.testing.assert_close(bound_out["y"], outs["y"])
    register_all()
    g, packed = launch_args(kernel, {**ins, **outs})
    jit_out = {"y": torch.empty_like(outs["y"])}
    jit = triton_jit(kernel, {**ins, **jit_out})
    jit()
    torch.testing.assert_close(jit_out["y"], outs["y"])  # the JIT call reads and writes what the binary does
    torch.testing.assert_close(torch.ops.flashgen.rmsnorm(ins["x"], ins["w"]), outs["y"])
    y = torch.empty_like(outs["y"])

    def graph_calls() -> None:
        for _ in range(GRAPH_CALLS):
            kernel.run(ins, outs)

    graph, _ = cuda_graph(graph_calls, dev)
    methods: dict[str, Callable[[], Any]] = {
        "flashgen kernel.run(ins, out)": lambda: kernel.run(ins, outs),
        "flashgen kernel.run(ins, out), Triton's launcher": lambda: tritons.run(ins, outs),
        "flashgen bound call (kernel.bind)": bound,
        "Triton's launcher of the binary, arguments gathered once": lambda: kernel.launcher.compiled[g](*packed),
        "torch.ops.flashgen.rmsnorm": lambda: torch.ops.flashgen.rmsnorm(ins["x"], ins["w"]),
        "Triton JIT launch of the generated source": jit,
        "torch eager rmsnorm (peers.py: 9 kernels)": lambda: PEERS["rmsnorm"](**ins),
        "torch eager, one op (mul into out)": lambda: torch.mul(ins["x"], ins["w"], out=y),
    }
    l2 = target.get("l2_bytes", 1 << 26)
    rows = []
    for name, fn in methods.items():
        host, wall = host_time(fn, args.calls, args.rounds)
        rows.append([name, host, wall, gpu_time(fn, dev, False, l2).median_us])
        print(f"{name:57s} host {host:7.2f} us  wall {wall:7.2f} us  gpu {rows[-1][3]:6.2f} us", flush=True)
    host, wall = host_time(graph.replay, max(1, args.calls // GRAPH_CALLS), args.rounds, GRAPH_CALLS)
    rows.append([f"CUDA graph of {GRAPH_CALLS} kernel.run calls, per call", host, wall, rows[0][3]])
    print(f"{rows[-1][0]:57s} host {host:7.2f} us  wall {wall:7.2f} us", flush=True)
    header = ("method", "host_us_per_call", "wall_us_per_call", "gpu_us_per_call")
    meta = {**environment(), "target": target.id, "workload": wl.key, "schedule": kernel.schedule,
            "calls": args.calls, "rounds": args.rounds}
    note = (f"rmsnorm M=1 N={args.n} bf16, schedule {kernel.schedule}. host_us_per_call: time of {args.calls} "
            "back-to-back calls, no synchronization inside the loop, over the calls; wall_us_per_call adds the "
            "wait for the GPU to finish them; median of the rounds. gpu_us_per_call: device time of one call, "
            "from CUDA-graph replay (the graph row reports the kernel's). Goal for the flashgen launch: "
            "host_us_per_call <= 5.")
    write_results("launch", header, rows, meta, args.out_dir, note)
    print_table(header, rows)


if __name__ == "__main__":
    main()
