"""What an imported tuning Record must be before it is stored: a record that cannot be served would
break every later reader (a string knob crashes the cost model's features; a workload without dims
crashes dispatch)."""
from __future__ import annotations

import hashlib
import json

from flashgen.db.record import Record
from flashgen.errors import FlashgenError
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets.descriptor import load_targets
from flashgen.workload import Workload


def _stored_key(workload_json: dict) -> str:
    """The key the writer computed: the op name and a hash of the workload JSON as it is stored (a
    record of an older layout keeps its own key; today's defaults are not added)."""
    canonical = json.dumps(workload_json, sort_keys=True, separators=(",", ":"))
    return f"{workload_json.get('op')}-{hashlib.sha256(canonical.encode()).hexdigest()[:16]}"


def record_problem(rec: Record) -> str | None:
    """Why `rec` cannot be stored, or None: a known op with dims a mapping of positive integers in the
    op's limits, a workload key that is the workload's, knobs of the class's space with integer
    values (for a target this install knows), and an ok record's finite latency."""
    w = rec.workload
    if not isinstance(w.get("dims"), dict) or not isinstance(w.get("attrs", {}), dict):
        return "workload must hold dims and attrs objects"
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in w["dims"].values()):
        return f"workload dims must be integers, got {w['dims']}"
    try:
        wl = Workload.from_json(w)
    except FlashgenError as e:
        return f"workload: {e}"
    if rec.workload_key not in (_stored_key(w), wl.key):
        return f"workload_key {rec.workload_key} is not the key of its workload ({_stored_key(w)})"
    bad = {k: v for k, v in rec.schedule.items() if isinstance(v, bool) or not isinstance(v, int)}
    if bad:
        return f"schedule knobs must be integers, got {bad}"
    target = load_targets().get(rec.target_key)
    if target is not None:
        known = ScheduleSpace(wl, target).knobs()
        unknown = sorted(set(rec.schedule) - set(known))
        if unknown:
            return f"schedule names knobs the {wl.op.kclass} space does not have: {', '.join(unknown)}"
    if rec.status == "ok" and not (rec.latency_us or 0) > 0:
        return f"an ok record needs a latency above 0 us, got {rec.latency_us}"
    return None
