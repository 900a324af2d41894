"""The compile driver: workload + target -> Kernel, with the schedule the database says is best.

Schedule choice, in order: one given by the caller; the fastest `ok` record of this workload on this
target in the user's database, else in the records shipped with flashgen (flashgen/db/shipped.py); the
same on another device of the target's architecture (an H100 takes the H200's: same binaries, valid
schedules); the kernel class's analytic default. The choice and why are kept in the
kernel's metadata (`schedule_source`), and the CLI prints them.
"""
from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from flashgen import __version__
from flashgen.db import Database, default_db_path
from flashgen.db.shipped import TunedRecords
from flashgen.errors import FlashgenError
from flashgen.kernel_classes import kernel_class, supported
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets.descriptor import Target, get_target
from flashgen.workload import Schedule, Workload

if TYPE_CHECKING:  # (its module loads torch: a workload or target refused here must not wait for it)
    from flashgen.targets.kernel import Kernel


def resolve_target(target: str | Target, targets_dir: str | os.PathLike | None = None) -> Target:
    if isinstance(target, Target):
        return target
    return get_target(target, [targets_dir] if targets_dir else [])


def check_supported(wl: Workload, target: Target) -> None:
    """Every tensor dtype of the workload must be one the target computes with, and the target's backend
    must have a generator for the workload's kernel class."""
    for t in wl.inputs + wl.outputs:
        dt = wl.tensor_dtype(t.name)
        if dt not in target.dtypes:
            raise FlashgenError(f"target {target.id} does not support {dt} ({wl.op_name} tensor '{t.name}'); "
                                f"it supports {', '.join(target.dtypes)}")
    if target.backend not in kernel_class(wl.op.kclass).generators:
        raise FlashgenError(f"{wl.op.kclass} kernels are not generated for {target.id} yet "
                            f"(its {target.backend} backend generates {', '.join(supported(target.backend))})")


def choose_schedule(wl: Workload, target: Target, db: Database | str | os.PathLike | None,
                    schedule: Schedule | None) -> tuple[Schedule, str]:
    space = ScheduleSpace(wl, target)
    if schedule is not None:
        if not isinstance(schedule, dict):
            raise FlashgenError(f"a schedule is a JSON object of knob values, got {schedule!r}")
        bad = {k: v for k, v in schedule.items() if isinstance(v, bool) or not isinstance(v, str if k == "variant" else int)}
        if bad:
            raise FlashgenError(f"invalid schedule for {wl.op_name} on {target.id}: knob values are integers "
                                f"(a variant a name), got {json.dumps(bad)}")
        why = space.why_invalid(schedule)
        if why:
            raise FlashgenError(f"invalid schedule for {wl.op_name} on {target.id}: {why}")
        return space.complete(schedule), "given"
    path = db.path if isinstance(db, Database) else Path(db) if db is not None else default_db_path()
    database = db if isinstance(db, Database) else Database(path, readonly=True) if path.exists() else None
    try:
        found = TunedRecords(database).served(wl.key, target, lambda rec: space.is_valid(rec.schedule))
    finally:
        if database is not None and database is not db:
            database.close()
    if found is None:
        return space.default(), "analytic default"
    rec, origin = found
    tuned_on = "" if rec.target_key == target.id else f", tuned on {rec.target_key}"
    return space.complete(rec.schedule), f"database best ({rec.latency_us:.2f} us on {rec.device}, {origin}{tuned_on})"


def compile(wl: Workload, target: str | Target = "h200", *, schedule: Schedule | None = None,
            db: Database | str | os.PathLike | None = None,
            targets_dir: str | os.PathLike | None = None) -> Kernel:
    """Generate and build `wl` for `target` (a target id, architecture or device name)."""
    t = resolve_target(target, targets_dir)
    check_supported(wl, t)
    sched, source = choose_schedule(wl, t, db, schedule)
    if t.backend == "triton":
        from flashgen.targets.triton import build
    else:
        from flashgen.targets.tvm_backend import build
    kernel = build(wl, sched, t)
    kernel.metadata.update({
        "workload": wl.to_json(), "workload_key": wl.key, "target": t.id, "arch": t.arch,
        "schedule": sched, "schedule_source": source,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    })
    kernel.metadata.setdefault("tools", {})["flashgen"] = __version__
    return kernel
