"""The tuning loop: propose schedules, build them in parallel, measure them, record every result.

Schedules the database already holds for this workload and target are never measured again, so a
stopped tune resumes where it was; with `retry_failed`, those recorded as timeout or crash (a loaded
machine's verdicts) are measured again, first. The schedules the caller serves the workload with
before the tune (`TuneTask.served`: dispatch's choice, which the CLI looks up; a record of a
neighbouring row count, the other 16-bit dtype, the plain form or a sibling GPU) are measured next.
Without them, four trials of a fresh row count found only slower schedules, and dispatch, which
prefers an exact record, served one: the H100 W4A16 decoder at batch 4 fell from 1105 to 882 tokens/s
after its 4-row GEMMs were tuned (benchmarks/results/model_quant_load.md). Each measurement is recorded the moment it ends, so a
killed tune loses none, and a tune claims each schedule in the database before measuring it, so two
tunes of one workload at once measure different schedules. The analytic default is measured first, so a tune can only end with
a best at least as fast as what `flashgen compile` gives untuned. A workload whose weight can be
dequantized first then tries its dense form's fastest records on the dequantized weight: that GEMM
is the dense op's, whose records the model cannot map onto the quantized op's.

Tuned `behind` a producer (a decode step's kernel before this one), candidates are timed right after it
(`schedules.measure`), and such a tune keeps apart from the records timed alone: it measures again
schedules measured alone, its search learns from its own timings only, and the fastest schedules timed
alone (its plain form's where it has none) go first, after the default. Dispatch prefers a workload's records timed behind a producer
(`Database.best`).
"""
from __future__ import annotations

import itertools
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, TextIO

from flashgen import __version__
from flashgen.db import Database, Record
from flashgen.db.record import ALONE, BEHIND, schedule_key
from flashgen.errors import FlashgenError
from flashgen.ir.variants import DEQUANT
from flashgen.roofline import roofline_us
from flashgen.schedules.builder import Builder
from flashgen.schedules.cost_model import CostModel
from flashgen.schedules.measure import MEASURE_TIMEOUT_S, START_TIMEOUT_S, MeasureResult, Runner
from flashgen.schedules.search import make_strategy
from flashgen.schedules.space import Schedule, ScheduleSpace
from flashgen.targets.descriptor import Target
from flashgen.workload import Workload, dequant_forms, other_half, workload

RETRIED = ("timeout", "crash")  # verdicts a loaded machine can give a good schedule
DENSE_SEEDS = 3  # the dense form's fastest records tried on a weight dequantized first
ALONE_SEEDS = 6  # a tune behind a producer first times the fastest schedules timed alone
BATCH = 16  # schedules proposed, built and measured per round: the search learns between rounds only


@dataclass(frozen=True)
class TuneTask:
    """One workload's tuning job, as every path that tunes builds it (the CLI, the GPU fan-out, Ray,
    benchmarks): what is searched (the workload on the target, with knobs pinned by `fixed`: the
    `space`), how (`trials` new measurements, `strategy`, `seed`), timed alone or `behind` a producer
    (its workload and schedule), whether schedules recorded as timeout or crash are measured again, and
    the Runner's bounds: `timeout_s` per measurement, `start_timeout_s` more for a fresh worker's first
    (a loaded machine needs more of both); `served`: the schedules the workload runs with now, measured
    right after the default (dispatch sits above the tuner: its caller looks them up)."""
    workload: Workload
    target: Target
    trials: int
    strategy: str = "evolutionary"
    seed: int = 0
    fixed: tuple[tuple[str, int], ...] = ()  # (knob, value), sorted: `pinned` builds it from a mapping
    behind: tuple[Workload, Schedule] | None = None
    retry_failed: bool = False
    timeout_s: float = MEASURE_TIMEOUT_S
    start_timeout_s: float = START_TIMEOUT_S
    served: tuple[Schedule, ...] = ()

    @staticmethod
    def pinned(fixed: Mapping[str, int] | None) -> tuple[tuple[str, int], ...]:
        """`fixed` knobs in the form a task (and ScheduleSpace) holds them."""
        return tuple(sorted((fixed or {}).items()))

    @property
    def space(self) -> ScheduleSpace:
        return ScheduleSpace(self.workload, self.target, self.fixed)


@dataclass
class TuneResult:
    workload: Workload
    best: Record | None
    default_us: float | None
    measured: int                    # new measurements in this run
    history: list[float | None] = field(default_factory=list)  # latency per measurement, None = failed
    wall_s: float = 0.0


class Progress:
    """One status line: trials done, best latency so far and its fraction of the roofline."""

    def __init__(self, wl: Workload, total: int, roof_us: float, stream: TextIO | None):
        self.wl, self.total, self.roof, self.stream = wl, total, roof_us, stream
        self.done, self.best = 0, float("inf")
        self.t0 = time.perf_counter()

    def update(self, results: list[MeasureResult]) -> None:
        self.done += len(results)
        for r in results:
            if r.status == "ok" and r.latency_us is not None:
                self.best = min(self.best, r.latency_us)
        if self.stream is None:
            return
        width = 24
        fill = int(width * self.done / max(self.total, 1))
        best = f"best {self.best:.2f} us ({self.roof / self.best:.0%} of roofline)" if self.best < float("inf") else "best -"
        self.stream.write(f"\r{self.wl.op_name} [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
                          f"{best} {time.perf_counter() - self.t0:.0f}s")
        self.stream.flush()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()


def _record(wl: Workload, target: Target, device: str, r: MeasureResult,
            behind: tuple[Workload, Schedule] | None) -> Record:
    extra: dict = {"runs": r.runs}
    if behind is not None:
        extra.update(timing=BEHIND, behind=behind[0].to_json(), behind_schedule=behind[1])
    if r.error:
        extra["error"] = r.error[:2000]
    return Record(workload_key=wl.key, workload=wl.to_json(), target_key=target.id, schedule=r.schedule,
                  status=r.status, latency_us=r.latency_us if r.status == "ok" else None,
                  spread_us=r.spread_us if r.status == "ok" else None, flashgen_version=__version__,
                  device=device, extra=extra)


def _recorded(db: Database, wl: Workload, target: Target, space: ScheduleSpace,
              behind: tuple[Workload, Schedule] | None) -> dict[str, Record]:
    """The workload's records timed as this tune times, by complete schedule (a record older than a knob
    counts as its neutral value); of several records of one schedule, the latest."""
    return {schedule_key(space.complete(r.schedule)): r for r in db.records(wl.key, target.id) if in_context(r, behind)}


def in_context(r: Record, behind: tuple[Workload, Schedule] | None) -> bool:
    """Whether a record was timed as this tune times: alone, or behind the same producer workload."""
    if behind is None:
        return r.timing == ALONE
    return r.timing == BEHIND and r.extra.get("behind") == behind[0].to_json()


def alone_seeds(space: ScheduleSpace, db: Database) -> list[Schedule]:
    """The workload's fastest distinct valid schedules timed alone, fastest first; where it has none, its
    plain form's (`Op.plain_form`, whose records dispatch serves it: a residual epilogue's GEMM)."""
    wl = space.workload
    plain_op, plain_attrs = wl.op.plain_form(wl.attr)
    for key in (wl.key, workload(plain_op, **wl.dim, **plain_attrs).key):
        seeds: list[Schedule] = []
        recs = [r for r in db.records(key, space.target.id, status="ok") if r.timing == ALONE]
        for r in sorted(recs, key=lambda r: r.latency_us):
            s = space.complete(r.schedule)
            if space.is_valid(s) and s not in seeds:
                seeds.append(s)
        if seeds:
            return seeds[:ALONE_SEEDS]
    return []


def dense_seeds(space: ScheduleSpace, db: Database) -> list[Schedule]:
    """The fastest few records of the workload's dense form (in either 16-bit dtype) as schedules of
    this space that dequantize first; none where the space cannot."""
    forms = dequant_forms(space.workload)
    staged = [f for f in space.forms() if f and f.startswith(DEQUANT)]
    if forms is None or not staged:
        return []
    dense = forms[1]
    dense_space = ScheduleSpace(dense, space.target)
    other = other_half(dense.attr)
    keys = [dense.key] + ([workload(dense.op_name, **dense.dim, **other).key] if other else [])
    recs = sorted((r for key in keys for r in db.records(key, space.target.id) if r.status == "ok"),
                  key=lambda r: r.latency_us)
    seeds: list[Schedule] = []
    for r in recs:
        d = dense_space.complete(r.schedule)
        s = space.with_knob(d, "variant", DEQUANT + d.get("variant", ""))  # (its chunks: one, or the nearest)
        if space.is_valid(s) and s not in seeds:
            seeds.append(s)
    return seeds[:DENSE_SEEDS]


def with_schedule(producer: Workload | None, target: Target, db: Database) -> tuple[Workload, Schedule] | None:
    """(producer, its schedule: the database's best, else the default), or None without a producer."""
    if producer is None:
        return None
    best = db.best(producer.key, target.id)
    return producer, best.schedule if best is not None else ScheduleSpace(producer, target).default()


def tune(task: TuneTask, db: Database, *, batch: int = BATCH, builder: Builder | None = None,
         runner: Runner | None = None, device_name: str | None = None, progress: TextIO | None = None) -> TuneResult:
    """Measure up to `task.trials` new schedules of its workload on its target, recording each in `db`
    (`TuneTask` says what is searched and how); `builder` and `runner` may be shared between tunes, a
    `runner` timing as the task does (alone or behind its producer); `progress` takes a status line."""
    wl, target, behind, seed = task.workload, task.target, task.behind, task.seed
    if runner is not None and (runner.behind is None) != (behind is None):  # records would misname their timing
        raise FlashgenError(f"the runner given times {'alone' if runner.behind is None else 'behind a producer'}, "
                            f"this tune {'alone' if behind is None else 'behind a producer'}")
    t0 = time.perf_counter()
    space = task.space
    own_builder, own_runner = builder is None, runner is None
    builder = builder or Builder(target)
    if behind is not None and (why := builder.build(behind[0], [behind[1]])[0]):  # built here, not in the timed worker
        if own_builder:
            builder.close()
        raise FlashgenError(f"the producer {behind[0]} does not build: {why}")
    runner = runner or Runner(target, timeout_s=task.timeout_s, seed=seed, start_timeout_s=task.start_timeout_s,
                             behind=behind)
    device = device_name or _device_name(target)
    known = _recorded(db, wl, target, space, behind)
    retry = [r.schedule for r in known.values() if task.retry_failed and r.status in RETRIED and space.is_valid(r.schedule)]
    retried = {schedule_key(space.complete(s)) for s in retry}
    for k in retried:
        del known[k]
    context = ALONE if behind is None else f"{BEHIND} {behind[0].key}"
    # Only the evolutionary search is guided by the learned model; the others need no training.
    model = CostModel.for_database(db.path, wl.op.kclass) if task.strategy == "evolutionary" else None
    in_space = [r for r in known.values() if space.is_valid(r.schedule)]
    strat = make_strategy(task.strategy, space, model, seed,
                          measured=[(r.schedule, r.latency_us if r.status == "ok" else None) for r in in_space])
    default = space.pinned_default()
    seeds = alone_seeds(space, db) if behind is not None else []
    served = [c for c in map(space.complete, task.served) if space.is_valid(c)]
    pending = [c for c in ([default] if default is not None else []) + retry + served + seeds + dense_seeds(space, db)
               if schedule_key(space.complete(c)) not in known]
    # (counting valid schedules only as far as the tune could need: a whole space can hold 10^5; islice
    # takes no stop past sys.maxsize, which a count of trials given through the API may pass)
    stop = min(task.trials + len(in_space), sys.maxsize)
    total = min(task.trials, sum(1 for _ in itertools.islice(space, stop)) - len(in_space))
    bar = Progress(wl, total, roofline_us(wl, target), progress)
    history: list[float | None] = []
    taken: set[str] = set()  # proposed here but claimed by another tune

    def record(r: MeasureResult) -> None:  # each measurement is stored the moment it ends
        rec = _record(wl, target, device, r, behind)
        db.add(rec)
        known[schedule_key(space.complete(rec.schedule))] = rec
        strat.observe([(r.schedule, r.latency_us if r.status == "ok" else None)])
        history.append(r.latency_us if r.status == "ok" else None)
        bar.update([r])

    try:
        while len(history) < total:
            want = min(batch, total - len(history))
            keys = set(known) | taken
            fresh = lambda ss: [s for s in ss if (k := schedule_key(space.complete(s))) not in keys and not keys.add(k)]  # noqa: E731
            cands = fresh(pending)[:want]
            pending = []
            # (topped up until the batch is full: the strategy does not know the seeds, and may propose one)
            while len(cands) < want and (more := strat.propose(want - len(cands))):
                cands += fresh(more)
            if not cands:
                break
            granted = db.claim(wl.key, target.id, context, [schedule_key(space.complete(s)) for s in cands])
            others = {k: r for k, r in _recorded(db, wl, target, space, behind).items()
                      if k not in known and k not in retried}
            known.update(others)  # what another tune measured meanwhile is learned from, not measured again
            strat.observe([(r.schedule, r.latency_us if r.status == "ok" else None) for r in others.values()
                           if space.is_valid(r.schedule)])
            taken |= {k for s in cands if (k := schedule_key(space.complete(s))) not in granted}
            cands = [s for s in cands if (k := schedule_key(space.complete(s))) in granted and k not in known]
            errors = builder.build(wl, cands)
            for s, e in zip(cands, errors):
                if e:
                    record(MeasureResult(s, "compile_error", error=e))
            runner.measure(wl, [s for s, e in zip(cands, errors) if not e], on_result=record)
    finally:
        bar.close()
        db.release(wl.key, target.id, context)
        if own_builder:
            builder.close()
        if own_runner:
            runner.close()
    d = known.get(schedule_key(default)) if default is not None else None
    ok = [r for r in db.records(wl.key, target.id, status="ok") if in_context(r, behind)]
    best = min(ok, key=lambda r: r.latency_us) if ok else None  # the earliest of equals, as Database.best
    return TuneResult(wl, best, d.latency_us if d and d.status == "ok" else None,
                      len(history), history, time.perf_counter() - t0)


def _device_name(target: Target) -> str:
    if target.backend == "tvm":
        import platform
        return f"cpu ({platform.processor() or platform.machine()})"
    import torch
    return torch.cuda.get_device_name()


def plot_history(results: list[TuneResult], path: str | Path) -> None:
    """Best latency so far against trials, one line per workload."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for res in results:
        best, ys = float("inf"), []
        for lat in res.history:
            if lat is not None:
                best = min(best, lat)
            ys.append(best if best < float("inf") else None)
        ax.plot(range(1, len(ys) + 1), ys, label=str(res.workload))
    ax.set_xlabel("trials")
    ax.set_ylabel("best latency so far (us)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
