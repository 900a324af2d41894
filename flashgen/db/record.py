"""One tuning measurement: what ran (workload, schedule, target), how it went, and when."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from datetime import datetime, timezone
from typing import Any

from flashgen.errors import FlashgenError

# Every outcome is kept: failures stop the search from measuring the same schedule again.
STATUSES = ("ok", "wrong_result", "compile_error", "timeout", "crash")

_REQUIRED = ("workload_key", "workload", "target_key", "schedule", "status", "flashgen_version",
             "device", "created_at")
_OPTIONAL = ("latency_us", "spread_us", "extra")
# How a latency was measured (`extra["timing"]`): the call by itself, or right behind a producer kernel
# that writes its input (`extra["behind"]`, that workload's JSON), as a decode step runs it.
ALONE, BEHIND = "alone", "behind"


def canonical_json(obj: Any) -> str:
    """Sorted keys, no spaces, no NaN: the same value always gives the same text (and hash)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def schedule_key(schedule: dict) -> str:
    """Identifies a schedule across records and searches, so nothing is measured twice."""
    return _sha256(canonical_json(schedule))[:16]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def _current_version() -> str:
    from flashgen import __version__

    return __version__


@dataclasses.dataclass(frozen=True, kw_only=True)
class Record:
    """An immutable row of the tuning log; the database only ever appends these."""

    workload_key: str
    workload: dict
    target_key: str
    schedule: dict
    status: str
    latency_us: float | None = None  # median
    spread_us: float | None = None  # interquartile range
    flashgen_version: str = dataclasses.field(default_factory=_current_version)
    device: str
    created_at: str = dataclasses.field(default_factory=_now)  # UTC ISO-8601
    extra: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("workload_key", "target_key", "flashgen_version", "device", "created_at"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise FlashgenError(f"Record field {name!r} must be a non-empty string, got {value!r}.")
        for name in ("workload", "schedule", "extra"):
            value = getattr(self, name)
            if not isinstance(value, dict):
                raise FlashgenError(f"Record field {name!r} must be a JSON object, got {value!r}.")
            try:
                canonical_json(value)
            except (TypeError, ValueError) as exc:
                raise FlashgenError(f"Record field {name!r} is not plain JSON: {exc}.") from None
        if self.status not in STATUSES:
            raise FlashgenError(f"Record field 'status' must be one of {', '.join(STATUSES)}, "
                                f"got {self.status!r}.")
        for name in ("latency_us", "spread_us"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise FlashgenError(f"Record field {name!r} must be a finite number >= 0 or null, "
                                    f"got {value!r}.")
            object.__setattr__(self, name, float(value))
        if self.status == "ok" and not (self.latency_us or 0) > 0:  # 0 us measured nothing; it would rank first
            raise FlashgenError(f"Record field 'latency_us' must be a latency above 0 us when status is 'ok', "
                                f"got {self.latency_us!r}.")
        try:
            datetime.fromisoformat(self.created_at)
        except ValueError:
            raise FlashgenError(f"Record field 'created_at' must be an ISO-8601 time, "
                                f"got {self.created_at!r}.") from None

    @property
    def schedule_key(self) -> str:
        """Identifies the schedule across records, so the search can skip what it already measured."""
        return schedule_key(self.schedule)

    @property
    def timing(self) -> str:
        """ALONE or BEHIND: latencies of the two are not comparable (a call behind its producer overlaps
        it), so every ranking of records stays within one."""
        return self.extra.get("timing", ALONE)

    @property
    def content_hash(self) -> str:
        """Identifies the whole record, so re-importing the same log adds nothing."""
        return _sha256(canonical_json(self.to_json()))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Any) -> Record:
        """Strict: a missing or unknown field is an error, so no measurement is silently dropped, and so is
        a string that is not text (a database could not store it)."""
        if not isinstance(d, dict):
            raise FlashgenError(f"a record must be a JSON object, got {type(d).__name__}.")
        missing = [name for name in _REQUIRED if name not in d]
        if missing:
            raise FlashgenError(f"record is missing field {missing[0]!r}.")
        unknown = sorted(set(d) - set(_REQUIRED) - set(_OPTIONAL))
        if unknown:
            raise FlashgenError(f"record has unknown field {unknown[0]!r} "
                                "(written by a newer flashgen?).")
        try:  # JSON's escapes can spell a lone surrogate ("\\ud800"), which no UTF-8 database can store
            json.dumps(d, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise FlashgenError(f"record holds {e.object[e.start]!r}, a lone surrogate, which is not text.") from None
        return cls(**d)
