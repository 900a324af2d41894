"""`flashgen tune --model`: every kernel a model's decode steps launch, for the quant modes and batches
asked, tuned in order of what each is worth to the steps, within a wall-time budget.

The workloads are traced off the decoder's code (runtime/decoder/step_workloads.py), each with the kernel
it runs behind in the step: a plan of (workload, producer) lines, as `--workloads FILE` gives one, so
the plan's paths (one GPU, `--gpus`, `--ray`) tune it. A step's time is the sum of its launches'
estimates as dispatch would serve them from the database (runtime/decoder/mixed.py `estimate`: records,
else the roofline). A line's share is its launches' part of each step's time, averaged over the steps
(every mode and batch asked counts alike); lines go in order of share, so a budget that runs out has
spent itself where the steps stood to gain most. A line the database holds `trials` records of, timed
as the line times (alone or behind its producer), is tuned already and skipped: a stopped run resumes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
import torch

from flashgen.compiler import check_supported
from flashgen.db import Database
from flashgen.errors import FlashgenError
from flashgen.runtime.checkpoints.model_config import ModelConfig
from flashgen.runtime.decoder.mixed import ModePlan, estimate
from flashgen.runtime.decoder.step_workloads import Launch, decode_step
from flashgen.schedules.measure import feed_error
from flashgen.schedules.tuner import in_context
from flashgen.targets.descriptor import Target
from flashgen.workload import Workload

DTYPE = torch.bfloat16  # the activations a GPU decoder runs in


@dataclass(frozen=True)
class Step:
    """One decode step: its mode, batch and launches."""
    mode: str
    batch: int
    launches: list[Launch]


@dataclass(frozen=True)
class Line:
    """A plan line: a workload, the producer it is timed behind (None: alone), its launches per step
    summed over the steps, and its share of the steps' time (module docstring)."""
    workload: Workload
    producer: Workload | None
    count: int
    share: float


class Estimates:
    """Each workload's estimate in microseconds from one state of the database, computed once."""

    def __init__(self, target: Target, db_path: str | os.PathLike | None):
        self.target, self.db_path, self.us = target, db_path, {}

    def __call__(self, wl: Workload) -> float:
        if wl.key not in self.us:
            self.us[wl.key] = estimate(wl, self.target, self.db_path).us
        return self.us[wl.key]


def steps(c: ModelConfig, modes: list[str], batches: list[int], target: Target,
          db_path: str | os.PathLike | None, context: int | None = None) -> list[Step]:
    """The decode steps asked for, traced, with their longest context `context` (default: the model's
    window); the mixed mode's calls in the modes its plan picks from the database as it is now."""
    return [Step(mode, b, decode_step(c, mode, b, ModePlan(target, db_path, DTYPE), DTYPE, context))
            for mode in modes for b in batches]


def step_us(step: Step, est: Estimates) -> float:
    """The step's estimated time: the sum of its launches' estimates."""
    return sum(est(wl) for wl, _ in step.launches)


def plan_lines(all_steps: list[Step], target: Target, est: Estimates) -> tuple[list[Line], list[str]]:
    """The plan, by share (largest first), and a note per workload the target cannot build (not tuned).
    A producer the target cannot build, or whose output the workload does not read, leaves its line
    timed alone."""
    shares: dict[tuple[str, str | None], float] = {}
    counts: dict[tuple[str, str | None], int] = {}
    lines: dict[tuple[str, str | None], tuple[Workload, Workload | None]] = {}
    skipped: dict[str, str] = {}
    for step in all_steps:
        total = step_us(step, est)
        for wl, producer in step.launches:
            if wl.key in skipped or (why := _unsupported(wl, target)):
                skipped.setdefault(wl.key, f"{wl}: not tuned: {why or skipped.get(wl.key)}")
                continue
            if producer is not None and (_unsupported(producer, target) or feed_error(producer, wl)):
                producer = None
            key = (wl.key, producer.key if producer is not None else None)
            lines[key] = (wl, producer)
            counts[key] = counts.get(key, 0) + 1
            shares[key] = shares.get(key, 0.0) + est(wl) / total / len(all_steps)
    out = [Line(*lines[k], counts[k], shares[k]) for k in lines]
    return sorted(out, key=lambda ln: -ln.share), list(skipped.values())


def _unsupported(wl: Workload, target: Target) -> str | None:
    try:
        check_supported(wl, target)
    except FlashgenError as e:
        return str(e)
    return None


def recorded(db: Database, line: Line, target: Target) -> int:
    """Records of the line's workload on the target timed as the line times it."""
    behind = (line.producer, {}) if line.producer is not None else None
    return sum(in_context(r, behind) for r in db.records(line.workload.key, target.id))


def table(before: list[Step], after: list[Step], est_before: Estimates, est_after: Estimates) -> list[list[str]]:
    """Rows of mode, batch, the step's estimate before and after, and their ratio."""
    rows = []
    for b, a in zip(before, after):
        t0, t1 = step_us(b, est_before), step_us(a, est_after)
        rows.append([b.mode, str(b.batch), f"{t0:.1f}", f"{t1:.1f}", f"{t0 / t1:.2f}x"])
    return rows

