"""Builder: compiles candidate schedules in parallel worker processes into the artifact cache.

Compilation is CPU work that does not need the GPU, so it runs ahead of measurement on every core;
the runner then loads each kernel from the cache. Spawned workers never touch the CUDA context.
"""
from __future__ import annotations

import multiprocessing
import os
import traceback
from concurrent.futures import ProcessPoolExecutor

from flashgen.processes import ignore_sigint, sigint_deferred
from flashgen.schedules.space import Schedule
from flashgen.targets.descriptor import Target
from flashgen.workload import Workload


def _build_one(wl_json: dict, schedule: Schedule, target_id: str) -> str | None:
    from flashgen.compiler import compile as compile_kernel
    from flashgen.targets.descriptor import get_target

    try:
        compile_kernel(Workload.from_json(wl_json), get_target(target_id), schedule=schedule)
        return None
    except Exception as e:  # noqa: BLE001 - any failure of a candidate is recorded, not raised
        return f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"


class Builder:
    """`build(workload, schedules)` -> per schedule None (built) or the compile error's text."""

    def __init__(self, target: Target, workers: int | None = None):
        self.target = target
        self.workers = workers or max(1, (os.cpu_count() or 2) - 1)
        self._pool: ProcessPoolExecutor | None = None

    def build(self, wl: Workload, schedules: list[Schedule]) -> list[str | None]:
        if self.target.backend != "triton" or not schedules:
            return [None] * len(schedules)  # cpu kernels build in ~0.1 s: the runner builds them
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=ignore_sigint)
        with sigint_deferred():  # the pool starts its processes as work is submitted
            futures = [self._pool.submit(_build_one, wl.to_json(), s, self.target.id) for s in schedules]
        return [f.result() for f in futures]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None
