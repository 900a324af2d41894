"""Numerics of generated Triton kernels on the CPU, through Triton's interpreter in child processes.

The children are spawned with TRITON_INTERPRET=1 so that their triton imports in interpreter mode;
the parent keeps compiling ahead of time. Used by the tests and by anyone checking a schedule without
a GPU.
"""
from __future__ import annotations

import multiprocessing
import os
from dataclasses import asdict
from typing import Any

from flashgen.check import OutputCheck, check
from flashgen.kernel_classes import current_schedule
from flashgen.processes import ignore_sigint, sigint_deferred
from flashgen.workload import Schedule, Workload


def _launcher(wl: Workload, schedule: Schedule, target_name: str):
    """A child's launcher of the workload's kernel(s): run(inputs, outputs, params)."""
    from flashgen.targets import staged
    from flashgen.targets.descriptor import get_target
    from flashgen.targets.kernel import bind_dims
    from flashgen.targets.triton.codegen import generate
    from flashgen.targets.triton.launch import TritonLauncher

    target = get_target(target_name)
    launcher = staged.launcher(wl, schedule, target, lambda w, s: TritonLauncher(generate(w, s), w, target))

    def run(inputs, outputs, full_params):
        launcher({**inputs, **outputs}, full_params, bind_dims(wl, inputs))
    return run


def _check_in_child(wl_json: dict, schedule: Schedule, target_name: str, seeds: list[int],
                    params: dict[str, float] | None) -> list[dict[str, Any]]:
    wl = Workload.from_json(wl_json)
    run = _launcher(wl, schedule, target_name)
    # one launcher for every seed: its scratch buffers carry over from call to call, as in the runtime
    return [asdict(c) for seed in seeds for c in check(wl, run, seed, params=params)]


def _run_in_child(wl_json: dict, schedule: Schedule, target_name: str, inputs: dict,
                  params: dict[str, float]) -> dict:
    from flashgen.check import poisoned
    from flashgen.targets.kernel import bind_dims

    wl = Workload.from_json(wl_json)
    outputs = poisoned(wl, bind_dims(wl, inputs), "cpu")
    _launcher(wl, schedule, target_name)(inputs, outputs, {**wl.op.params, **params})
    return outputs


class InterpreterPool:
    """A pool of interpreter processes: `pool.check(workload, schedule, target, seed)`."""

    def __init__(self, processes: int = 1):
        ctx = multiprocessing.get_context("spawn")
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            with sigint_deferred():
                self.pool = ctx.Pool(processes, initializer=ignore_sigint)
        finally:
            if old is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = old

    def check(self, wl: Workload, schedule: Schedule, target: str, seed: int | list[int],
              params: dict[str, float] | None = None) -> list[OutputCheck]:
        """Every output's check, for each seed in turn (one kernel launcher serves all the seeds)."""
        seeds = [seed] if isinstance(seed, int) else list(seed)
        rows = self.pool.apply(_check_in_child, (wl.to_json(), current_schedule(wl, schedule), target, seeds, params))
        return [OutputCheck(**r) for r in rows]

    def run(self, wl: Workload, schedule: Schedule, target: str, inputs: dict,
            params: dict[str, float] | None = None) -> dict:
        """The kernel's outputs on the given CPU input tensors (the outputs poisoned first, as `check` does)."""
        return self.pool.apply(_run_in_child, (wl.to_json(), current_schedule(wl, schedule), target, inputs, params or {}))

    def close(self) -> None:
        self.pool.terminate()
        self.pool.join()

    def __enter__(self) -> "InterpreterPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
