"""Tuning spread over several GPUs of one machine: one worker process per GPU, each seeing only its own
(CUDA_VISIBLE_DEVICES), with its own Builder and Runner, all recording into one Database.

The plan's workloads are grouped first: a workload timed behind a producer that the plan also tunes
goes with that producer, after it, since its tune reads the producer's best schedule when it starts.
Workers take groups from one queue as they free up, so a long tune holds back no other GPU, and each
workload is tuned by exactly one worker: nothing is measured twice (the database's claims keep two
tunes of one workload apart besides). Every measurement is recorded the moment it ends, as in any tune,
so a worker that dies loses none; the workloads it had not finished are reported as failed, each by
its line.
"""
from __future__ import annotations

import multiprocessing
import os
from multiprocessing.connection import wait
from dataclasses import dataclass, field
from typing import Any, Callable

from flashgen.errors import FlashgenError, reason
from flashgen.processes import ignore_sigint, sigint_deferred
from flashgen.schedules.builder import Builder
from flashgen.schedules.measure import MEASURE_TIMEOUT_S, START_TIMEOUT_S
from flashgen.schedules.space import Schedule
from flashgen.schedules.tuner import TuneResult, TuneTask, tune, with_schedule
from flashgen.targets.descriptor import Target
from flashgen.workload import Workload

Plan = list[tuple[Workload, Workload | None]]  # (workload, the producer it is timed behind or None)


@dataclass(frozen=True)
class TuneOptions:
    """What every line of a plan is tuned with: its `TuneTask` less the workload and the producer, and
    the schedule each workload ran with before the run (`served`, by workload key: dispatch's choice)."""
    trials: int
    strategy: str = "evolutionary"
    seed: int = 0
    fixed: dict[str, int] = field(default_factory=dict)
    retry_failed: bool = False
    timeout_s: float = MEASURE_TIMEOUT_S
    start_timeout_s: float = START_TIMEOUT_S
    served: dict[str, Schedule] = field(default_factory=dict)

    def task(self, wl: Workload, target: Target, behind: tuple[Workload, Schedule] | None = None) -> TuneTask:
        return TuneTask(wl, target, self.trials, self.strategy, self.seed, TuneTask.pinned(self.fixed), behind,
                        self.retry_failed, self.timeout_s, self.start_timeout_s,
                        (self.served[wl.key],) if wl.key in self.served else ())


def gpu_slots(spec: str, gpus: int) -> list[str]:
    """`--gpus all|N` as CUDA_VISIBLE_DEVICES values, one per worker: this process's visible GPUs (its own
    CUDA_VISIBLE_DEVICES, if set, names them), the first N of them."""
    if spec != "all" and not (spec.isdigit() and int(spec) >= 1):
        raise FlashgenError(f"--gpus takes 'all' or a number of GPUs of at least 1, got {spec!r}")
    if gpus == 0:
        raise FlashgenError("--gpus: this machine has no GPU (tune the cpu target without --gpus)")
    n = gpus if spec == "all" else int(spec)
    if n > gpus:
        raise FlashgenError(f"--gpus {n}: this machine has {gpus} GPU{'s' if gpus > 1 else ''}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [v.strip() for v in visible.split(",")] if visible else [str(i) for i in range(gpus)]
    return names[:n]


def groups(plan: Plan) -> list[list[int]]:
    """Plan indices in groups that one worker tunes in order: a line joins the group of the last earlier
    line whose workload is its producer; the others stand alone."""
    out: list[list[int]] = []
    home: dict[str, int] = {}  # workload key -> its group
    for i, (wl, producer) in enumerate(plan):
        g = home.get(producer.key) if producer is not None else None
        if g is None:
            g = len(out)
            out.append([])
        out[g].append(i)
        home[wl.key] = g
    return out


def tune_line(wl: Workload, producer: Workload | None, target: Target, db: Any, options: TuneOptions,
              builder: Builder) -> TuneResult:
    """One plan line's tune in a worker: its producer's schedule as `db` has it now, the worker's Builder,
    no progress bar."""
    return tune(options.task(wl, target, with_schedule(producer, target, db)), db, builder=builder)


def _worker(plan: Plan, target: Target, db_path: str | None, options: TuneOptions, build_workers: int,
            tasks: Any, answers: Any) -> None:
    """One GPU's tunes: groups from `tasks` until None, each workload's TuneResult (or its error, one
    line) sent on `answers`; its Builder has the cores shared out among the workers."""
    from flashgen.db import Database

    ignore_sigint()
    builder = Builder(target, build_workers)
    with Database(db_path) as db:
        try:
            while (group := tasks.get()) is not None:
                answers.send(("start", group))
                for i in group:
                    try:
                        answers.send(("done", i, tune_line(*plan[i], target, db, options, builder)))
                    except Exception as e:  # noqa: BLE001 (this workload's failure; the worker goes on)
                        answers.send(("failed", i, reason(e)))
        finally:
            builder.close()


def fan_out(plan: Plan, target: Target, db_path: str | None, options: TuneOptions, slots: list[str | None],
            on_result: Callable[[int, TuneResult | str], None]) -> None:
    """Tune every workload of `plan` in one worker per slot (a CUDA_VISIBLE_DEVICES value; None leaves it
    as it is), calling `on_result(index, TuneResult or why it failed)` as each ends (module docstring).
    Each worker answers on a pipe of its own, written at once, so the group a worker took is known
    even if it dies the moment after."""
    ctx = multiprocessing.get_context("spawn")
    tasks = ctx.Queue()
    for g in groups(plan):
        tasks.put(g)
    for _ in slots:
        tasks.put(None)
    build_workers = max(1, (os.cpu_count() or 2) // len(slots))
    procs, answers = [], {}
    with sigint_deferred():
        for n, slot in enumerate(slots):
            answers[n], writer = ctx.Pipe(duplex=False)
            procs.append(ctx.Process(target=_worker, args=(plan, target, db_path, options, build_workers, tasks,
                                                           writer)))
            _start_seeing(procs[-1], slot)
            writer.close()  # (the worker's copy is its own: its end, or its death, closes the pipe)
    left = set(range(len(plan)))
    held: dict[int, list[int]] = {}  # worker -> the group it tunes
    try:
        while left and answers:
            ready = wait(list(answers.values()))
            for n, conn in [(n, c) for n, c in answers.items() if c in ready]:
                try:
                    msg = conn.recv()
                except EOFError:  # the worker ended: what it had not finished of its group is lost
                    del answers[n]
                    procs[n].join()
                    for i in held.pop(n, []):
                        if i in left:
                            left.discard(i)
                            on_result(i, f"its worker ({_seen(slots[n])}) died with exit code {procs[n].exitcode}")
                    continue
                if msg[0] == "start":
                    held[n] = msg[1]
                else:
                    left.discard(msg[1])
                    on_result(msg[1], msg[2])
        for i in sorted(left):
            on_result(i, "not tuned: no worker was left to take it")
    finally:
        for p in procs:
            if p.is_alive() and left:
                p.kill()
            p.join()


def _start_seeing(proc: Any, slot: str | None) -> None:
    """Start `proc` with CUDA_VISIBLE_DEVICES=`slot` (a spawned child takes the environment at its start)."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    if slot is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = slot
    try:
        proc.start()
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def _seen(slot: str | None) -> str:
    return f"GPU {slot}" if slot is not None else "a CPU worker"
