"""ScheduleSpace: the knobs of one workload's kernel class on one target, with their validity rules.

The rules are the class's own (flashgen/kernel_classes.py names the module: row_space.py for rowwise
and pointwise, contraction_space.py, attention_space.py); this class adds what every space shares:
knobs pinned on purpose (`fixed`), records written before a knob existed (`complete`), the check that
every knob holds one of its values, iteration over the valid points and the analytic default.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Iterator

from flashgen.errors import FlashgenError
from flashgen.kernel_classes import kernel_class
from flashgen.targets.descriptor import Target
from flashgen.workload import Schedule, Workload


@dataclass(frozen=True)
class ScheduleSpace:
    """The knobs of one kernel class for one workload on one target, with their validity rules.

    `fixed` pins knobs to one value each ((name, value) pairs), so that a tune can study one knob on
    purpose (`flashgen tune --fix tma=1`) instead of waiting for the search to try it."""
    workload: Workload
    target: Target
    fixed: tuple[tuple[str, int], ...] = ()

    @property
    def kclass(self) -> str:
        return self.workload.op.kclass

    @property
    def rules(self) -> ModuleType:
        return kernel_class(self.kclass).space_rules()

    def knobs(self) -> dict[str, tuple[int, ...]]:
        return dict(self._knobs)

    @functools.cached_property
    def _knobs(self) -> dict[str, tuple[int, ...]]:
        """Computed once per space: every validity check reads them, and a search checks hundreds of
        thousands of random draws."""
        knobs = dict(self.rules.knobs(self.workload, self.target))
        for name, value in self.fixed:
            if name not in knobs:
                raise FlashgenError(f"fixed knob {name}: the {self.kclass} space has no such knob (knobs: {', '.join(knobs)})")
            if value not in knobs[name]:
                raise FlashgenError(f"fixed knob {name}={value}: not one of {knobs[name]} for {self.workload} on {self.target.id}")
            knobs[name] = (value,)
        return knobs

    def is_valid(self, s: Schedule) -> bool:
        return self.why_invalid(s) is None

    def added_knobs(self) -> dict[str, int]:
        """Knobs added after records were written, with the value their absence stands for."""
        return self.rules.added_knobs(self.workload)

    def complete(self, s: Schedule) -> Schedule:
        """`s` with every added knob it predates set to the value its absence stands for."""
        return {**{k: v for k, v in self.added_knobs().items() if k not in s}, **s}

    def why_invalid(self, s: Schedule) -> str | None:
        knobs = self.knobs()
        s = self.complete(s)
        if set(s) != set(knobs):
            return f"schedule knobs must be {sorted(knobs)}, got {sorted(s)}"
        for k, v in s.items():
            if v not in knobs[k]:
                return f"{k}={v} is not one of {knobs[k]}"
        return self.rules.why_invalid(self.workload, self.target, s)

    def pinned_default(self) -> Schedule | None:
        """The default with the fixed knobs set, or None when that combination is not valid."""
        s = {**self.default(), **dict(self.fixed)}
        return s if self.is_valid(s) else None

    def __iter__(self) -> Iterator[Schedule]:
        knobs = self.knobs()
        for values in itertools.product(*knobs.values()):
            s = dict(zip(knobs, values))
            if self.is_valid(s):
                yield s

    def default(self) -> Schedule:
        """The class's analytic choice, checked against the space. Fixed knobs do not change it: it is
        the unrestricted space's default (`pinned_default` applies them)."""
        if self.fixed:
            return replace(self, fixed=()).default()
        s = self.rules.default(self.workload, self.target)
        why = self.why_invalid(s)
        if why:
            raise FlashgenError(f"the {self.kclass} default {s} for {self.workload} on {self.target.id} is not valid: {why}")
        return s
