"""ScheduleSpace: the knobs of one workload's kernel class on one target, with their validity rules.

The rules are the class's own (flashgen/kernel_classes.py names the module: row_space.py for rowwise
and pointwise, contraction_space.py, attention_space.py); this class adds what every space shares:
knobs pinned on purpose (`fixed`), records written before a knob existed (`complete`), the check that
every knob holds one of its values, iteration over the valid points and the analytic default.

A class whose generator takes several forms (contraction: `variants(wl, target)`) has one set of knobs
per form: a schedule names its form in `variant` and holds that form's knobs alone, and the space is
the union of the forms' products. Such a class also reads older records (`current`), spells a schedule
out flat (`flat_of`) and says what a form stands for where it reads no knob (`implied`).
"""
from __future__ import annotations

import functools
import itertools
import math
import random
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Iterator

from flashgen.errors import FlashgenError
from flashgen.kernel_classes import kernel_class
from flashgen.targets.descriptor import Target
from flashgen.workload import Schedule, Workload

VARIANT = "variant"  # the knob naming a schedule's form, in spaces of several


@dataclass(frozen=True)
class ScheduleSpace:
    """The knobs of one kernel class for one workload on one target, with their validity rules.

    `fixed` pins knobs to one value each ((name, value) pairs), so that a tune can study one knob on
    purpose (`flashgen tune --fix tma=1`) instead of waiting for the search to try it."""
    workload: Workload
    target: Target
    fixed: tuple[tuple[str, int | str], ...] = ()

    @property
    def kclass(self) -> str:
        return self.workload.op.kclass

    @property
    def rules(self) -> ModuleType:
        return kernel_class(self.kclass).space_rules()

    @property
    def has_variants(self) -> bool:
        return hasattr(self.rules, "variants")

    def knobs(self) -> dict[str, tuple]:
        """Each knob's values: in a space of several forms, `variant` and the union over the forms."""
        forms = self._forms
        if not self.has_variants:
            return dict(forms[None])
        union: dict[str, set] = {}
        for knobs in forms.values():
            for name, values in knobs.items():
                union.setdefault(name, set()).update(values)
        return {VARIANT: tuple(forms), **{name: tuple(sorted(v)) for name, v in union.items()}}

    def forms(self) -> dict[str | None, dict[str, tuple[int, ...]]]:
        """The knobs and values of each form (one, None, where the class has no variants)."""
        return {f: dict(k) for f, k in self._forms.items()}

    def form_knobs(self, s: Schedule) -> dict[str, tuple]:
        """The knobs of `s`'s form with their values (and `variant` with every form), {} if it has none."""
        if not self.has_variants:
            return dict(self._forms[None])
        knobs = self._forms.get(s.get(VARIANT))
        return {VARIANT: tuple(self._forms), **knobs} if knobs is not None else {}

    def values(self, name: str) -> tuple:
        """The values knob `name` takes over the space: in a space of several forms, by its flat name too
        (`values("tma") == (0, 1)` where some form copies by TMA)."""
        if not self.has_variants or name == VARIANT:
            return self.knobs()[name]
        out = set()
        for form, knobs in self._forms.items():
            out.update(knobs.get(name, ()))
            out.update(v for k, v in self.rules.implied(self.workload, form).items() if k == name)
        return tuple(sorted(out))

    def raw_size(self) -> int:
        """Points before the rules: the product of the knobs' value counts, summed over the forms."""
        return sum(math.prod(len(v) for v in knobs.values()) for knobs in self._forms.values())

    def names(self) -> set[str]:
        """Every knob name a record of this space may hold, today's and those of older forms."""
        old = set(getattr(self.rules, "FLAT_KNOBS", ()))
        return set(self.knobs()) | set(self.added_knobs()) | old

    @functools.cached_property
    def _forms(self) -> dict[str | None, dict[str, tuple[int, ...]]]:
        """Computed once per space: every validity check reads them, and a search checks hundreds of
        thousands of random draws."""
        if self.has_variants:
            forms = dict(self.rules.variants(self.workload, self.target))
        else:
            forms = {None: dict(self.rules.knobs(self.workload, self.target))}
        for name, value in self.fixed:
            forms = self._pin(forms, name, value)
        return forms

    def _pin(self, forms: dict, name: str, value: int | str) -> dict:
        """The forms that hold knob `name` at `value`: those reading it (with that one value), and those
        that stand for it (`implied`: `tma=1` keeps the forms with TMA copies)."""
        out, values, known = {}, set(), name == VARIANT and self.has_variants
        for form, knobs in forms.items():
            if name == VARIANT and self.has_variants:
                values.add(form)
                if form == value:
                    out[form] = knobs
            elif name in knobs:
                known = True
                values.update(knobs[name])
                if value in knobs[name]:
                    out[form] = {**knobs, name: (value,)}
            elif self.has_variants and name in (stands := self.rules.implied(self.workload, form)):
                known = True
                values.add(stands[name])
                if stands[name] == value:
                    out[form] = knobs
            elif self.has_variants and name in getattr(self.rules, "FLAT_KNOBS", ()):
                known = True  # a count this form reads but that changes nothing here (group_m, one row of tiles)
                out[form] = knobs
        if not known:
            names = list(dict.fromkeys([VARIANT] * self.has_variants + [n for knobs in forms.values() for n in knobs]))
            raise FlashgenError(f"fixed knob {name}: the {self.kclass} space has no such knob (knobs: {', '.join(names)})")
        if not out:
            raise FlashgenError(f"fixed knob {name}={value}: not one of {tuple(sorted(values, key=str))} for "
                                f"{self.workload} on {self.target.id}")
        return out

    def is_valid(self, s: Schedule) -> bool:
        return self.why_invalid(s) is None

    def why_other_regime(self, s: Schedule) -> str | None:
        """Why `s`, a valid schedule tuned at another row count, belongs to another kernel regime than
        this workload's rows (a one-row GEMV tile would read the weight once per row for 16 rows), or
        None where it serves them as it served its own: the class's rule (`why_other_regime` of its
        rules module), else every schedule serves. Dispatch's buckets and the mixed mode's estimates
        read it, so that a record's time speaks only for calls its schedule serves alike."""
        rule = getattr(self.rules, "why_other_regime", None)
        return rule(self.workload, self.complete(s)) if rule is not None else None

    def why_not_bucket(self, s: Schedule) -> str | None:
        """Why a record of `s` tuned at another row count should not serve this workload's rows in
        dispatch: another regime, or the class's own rule (`why_not_bucket` of its rules module: a
        contraction tile reading the weight more often than the default's)."""
        rule = getattr(self.rules, "why_not_bucket", None)
        return rule(self.workload, self.target, self.complete(s)) if rule is not None else self.why_other_regime(s)

    def added_knobs(self) -> dict[str, int]:
        """Knobs added after records were written, with the value their absence stands for."""
        return self.rules.added_knobs(self.workload)

    def complete(self, s: Schedule) -> Schedule:
        """`s` in today's form: with every added knob it predates set to the value its absence stands
        for, or, in a space of several forms, read as its form (`current`)."""
        if self.has_variants:
            return self.rules.current(self.workload, s)
        return {**{k: v for k, v in self.added_knobs().items() if k not in s}, **s}

    def flat(self, s: Schedule) -> Schedule:
        """`s` with every knob of every form spelled out (the space's own form where it has one)."""
        s = self.complete(s)
        return self.rules.flat_of(self.workload, s) if VARIANT in s else s

    def why_invalid(self, s: Schedule) -> str | None:
        s = self.complete(s)
        if self.has_variants and VARIANT not in s:  # a flat schedule no form has: the rules say why
            flat = set(self.rules.FLAT_KNOBS)
            if not flat <= set(s) | set(self.added_knobs()) or not set(s) <= flat:
                return f"schedule knobs must be {VARIANT} and its form's, got {sorted(s)}"
            return self.rules.why_invalid(self.workload, self.target, s) or f"no {VARIANT} has the options of {s}"
        if self.has_variants and s[VARIANT] not in self._forms:
            return self._rule(s) or f"{VARIANT} {s[VARIANT]!r} is not one of {tuple(self._forms)}"
        knobs = self.form_knobs(s)
        if set(s) != set(knobs):
            return f"schedule knobs must be {sorted(knobs)}, got {sorted(s)}"
        for k, v in s.items():
            if v not in knobs[k]:
                return self._rule(s) or f"{k}={v} is not one of {knobs[k]}"
        return self.rules.why_invalid(self.workload, self.target, s)

    def _rule(self, s: Schedule) -> str | None:
        """Where a space of several forms leaves out a form or a value as its rules refuse it: their
        reason, for a schedule of a known form holding values the space knows, else None."""
        union = self.knobs()
        if not self.has_variants or s[VARIANT] not in self.rules.VARIANTS or not all(
                n in union and x in union[n] for n, x in s.items() if n != VARIANT):
            return None
        return self.rules.why_invalid(self.workload, self.target, s)

    def with_knob(self, s: Schedule, name: str, value: int | str) -> Schedule:
        """`s` with knob `name` at `value`. In a space of several forms, `variant` moves `s` to that form
        (each knob it shares kept where the form takes its value, else its nearest), and a knob the form
        does not read (a flat name: `backend=1`) moves it to the form standing for it, if any."""
        if not self.has_variants:
            return {**s, name: value}
        if name == VARIANT:
            knobs = self._forms.get(value)
            if knobs is None:
                return {**s, VARIANT: value}
            return {VARIANT: value, **{k: _nearest(vals, s.get(k, self.rules.COUNT_DEFAULTS.get(k, vals[0])))
                                       for k, vals in knobs.items()}}
        if name in self.form_knobs(s):
            return {**s, name: value}
        return self.complete({**self.flat(s), name: value})

    def pinned_default(self) -> Schedule | None:
        """The default with the fixed knobs set, or None when that combination is not valid."""
        s = self.default()
        for name, value in self.fixed:
            s = self.with_knob(s, name, value)
        return s if self.is_valid(s) else None

    def sample(self, rng: random.Random) -> Schedule:
        """A point of the space before the rules, uniformly at random."""
        if not self.has_variants:
            return {name: rng.choice(vals) for name, vals in self._forms[None].items()}
        forms = list(self._forms)
        form = rng.choices(forms, weights=[math.prod(len(v) for v in self._forms[f].values()) for f in forms])[0]
        return {VARIANT: form, **{name: rng.choice(vals) for name, vals in self._forms[form].items()}}

    def __iter__(self) -> Iterator[Schedule]:
        for form, knobs in self._forms.items():
            head = {VARIANT: form} if self.has_variants else {}
            for values in itertools.product(*knobs.values()):
                s = {**head, **dict(zip(knobs, values))}
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


def _nearest(values: tuple, value: int) -> int:
    """`value` where `values` has it, else the value nearest to it."""
    return value if value in values else min(values, key=lambda v: (abs(v - value), v))
