"""What an imported tuning Record must be before it is stored: a record that cannot be served would
break every later reader (a string knob crashes the cost model's features; a workload without dims
crashes dispatch)."""
from __future__ import annotations

import hashlib
import json

from flashgen.db.record import Record
from flashgen.errors import FlashgenError
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets.descriptor import get_target, load_targets
from flashgen.workload import Workload


def _stored_key(workload_json: dict) -> str:
    """The key the writer computed: the op name and a hash of the workload JSON as it is stored (a
    record of an older layout keeps its own key; today's defaults are not added)."""
    canonical = json.dumps(workload_json, sort_keys=True, separators=(",", ":"))
    return f"{workload_json.get('op')}-{hashlib.sha256(canonical.encode()).hexdigest()[:16]}"


def record_problem(rec: Record) -> str | None:
    """Why `rec` cannot be stored, or None: a known op with dims a mapping of positive integers in the
    op's limits, a workload key that is the workload's, integer knobs, and for a target this install
    knows, its id (an alias such as "h200" keys records no reader looks up) and only knobs of the class's
    space there. (Record itself refuses an ok record without a latency above 0.) A schedule that today's
    rules refuse is stored: it was measured under older ones (`stale_schedule`), and dispatch skips it."""
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
    bad = {k: v for k, v in rec.schedule.items() if isinstance(v, bool) or not isinstance(v, str if k == "variant" else int)}
    if bad:
        return f"schedule knobs must be integers (a variant a name), got {bad}"
    targets = load_targets()
    target = targets.get(rec.target_key)
    if target is None:
        try:  # an id in other letter case, or a name `--target` takes
            named = next((t for t in targets.values() if t.id.lower() == rec.target_key.lower()), None) \
                or get_target(rec.target_key)
        except FlashgenError:  # a target this install does not know (another's descriptor): kept as it is
            return None
        return (f"target_key {rec.target_key!r} is a name, not a target id: records are keyed by the id "
                f"(this name reaches {named.id}; `flashgen targets` lists the ids)")
    unknown = sorted(set(rec.schedule) - ScheduleSpace(wl, target).names())
    if unknown:
        return f"schedule names knobs the {wl.op.kclass} space on {target.id} does not have: {', '.join(unknown)}"
    return None


def stale_schedule(rec: Record) -> str | None:
    """Why today's space refuses a stored record's schedule (a knob's values or a rule changed since it
    was measured), or None: such a record stays a measurement for replays and is never served. Call it
    on records `record_problem` passed."""
    target = load_targets().get(rec.target_key)
    if target is None:
        return None
    return ScheduleSpace(Workload.from_json(rec.workload), target).why_invalid(rec.schedule)


def unservable(rec: Record) -> str | None:
    """Why dispatch never serves a stored record, or None: its schedule is stale, or its workload is one
    today's flashgen refuses (its op changed since). `db best` and the bucket reads pass such records
    over to the workload's next, as the exact lookup does."""
    try:
        return stale_schedule(rec)
    except FlashgenError as e:
        return f"workload: {e}"
