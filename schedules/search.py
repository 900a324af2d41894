"""Search strategies: which schedules of a ScheduleSpace to measure next.

Every strategy has the same two calls, so the tuner (or `replay.replay`) drives them all alike:
- `propose(n)` returns up to n valid schedules never proposed or measured before (fewer, or none, when
  the space is exhausted);
- `observe(results)` reports measurements: (schedule, latency_us), latency None for a failed candidate
  (compile error, wrong result, timeout, crash).
A strategy starts from the measurements the database already holds for its (workload, target)
(`measured=`), so resumed tuning never measures a schedule twice.

- `Exhaustive`: every valid schedule once, in the cost model's order (the prior's by default), so an
  interrupted run has measured the likely-best first.
- `RandomSearch`: uniformly random valid schedules; the baseline the others must beat.
- `Evolutionary`: the first batch is the top of the cost model's ranking; afterwards the best measured
  schedules are parents, children come from mutation (one knob to its nearest valid neighbour) and
  crossover (each knob from one of two parents), the cost model ranks them, and each batch is the top
  (1 - epsilon) of that ranking plus epsilon random schedules, which keeps a wrong model from trapping
  the search. With `refit=True` the model (a search-local copy) is refitted on the search's
  measurements after each batch. It is off by default: on the synthetic tables of the tests it never
  helped, and with a weak model (trained on two workloads of one GPU) it made the search slower (mean
  measurements to within 3% of the best 5.2 -> 7.3; probably because trees fitted to a few
  measurements favour the region already measured). Re-check on real measurements before turning it on.
"""
from __future__ import annotations

import copy
import math
import random
from typing import Any, Iterable, Mapping, Protocol, Sequence

import numpy as np

from flashgen.db.record import schedule_key
from flashgen.errors import FlashgenError
from flashgen.schedules.cost_model import AnalyticPrior
from flashgen.schedules.space import Schedule, ScheduleSpace

ENUMERATE_LIMIT = 50_000    # knob combinations up to which a space is enumerated rather than sampled
RANK_ALL_LIMIT = 4096       # valid schedules up to which the first batch ranks the whole space


class Scorer(Protocol):
    def score(self, wl: Any, schedules: Sequence[Schedule], target: Any) -> np.ndarray: ...


class SearchStrategy:
    """Bookkeeping shared by all strategies: what was proposed and measured, never proposed twice."""
    name = "base"

    def __init__(self, space: ScheduleSpace, seed: int = 0,
                 measured: Iterable[tuple[Mapping[str, Any], float | None]] = ()) -> None:
        self.space = space
        self.rng = random.Random(seed)
        self.measured: dict[str, tuple[Schedule, float | None]] = {}
        self._seen: set[str] = set()          # proposed or measured
        self._valid: list[Schedule] | None = None
        for s, lat in measured:
            self._record(dict(s), lat)

    # ---- the interface ----------------------------------------------------------------------
    def propose(self, n: int) -> list[Schedule]:
        out: list[Schedule] = []
        if n <= 0:
            return out
        for s in self._propose(n):
            k = schedule_key(s)
            if k in self._seen or not self.space.is_valid(s):
                continue  # subclasses filter already; this makes the guarantee local
            self._seen.add(k)
            out.append(dict(s))
            if len(out) == n:
                break
        return out

    def observe(self, results: Iterable[tuple[Mapping[str, Any], float | None]]) -> None:
        results = [(dict(s), lat) for s, lat in results]
        for s, lat in results:
            self._record(s, lat)
        self._observed(results)

    # ---- helpers ----------------------------------------------------------------------------
    def _propose(self, n: int) -> Iterable[Schedule]:
        raise NotImplementedError

    def _observed(self, results: list[tuple[Schedule, float | None]]) -> None:
        pass

    def _record(self, s: Schedule, lat: float | None) -> None:
        if lat is not None and (not math.isfinite(lat) or lat <= 0):
            lat = None
        s = self.space.complete(s)  # a record older than a knob is the schedule with its neutral value
        k = schedule_key(s)
        self._seen.add(k)
        self.measured[k] = (s, lat)

    def seen(self, s: Mapping[str, Any]) -> bool:
        return schedule_key(self.space.complete(dict(s))) in self._seen

    def best(self) -> tuple[Schedule, float] | None:
        ok = [(s, lat) for s, lat in self.measured.values() if lat is not None]
        return min(ok, key=lambda x: x[1]) if ok else None

    def ok_results(self) -> list[tuple[Schedule, float]]:
        """Successful measurements, fastest first."""
        return sorted(((s, lat) for s, lat in self.measured.values() if lat is not None), key=lambda x: x[1])

    def _space_size(self) -> int:
        return self.space.raw_size()

    def valid_schedules(self) -> list[Schedule]:
        """Every valid schedule, in the space's order (only for spaces small enough to enumerate)."""
        if self._valid is None:
            self._valid = list(self.space)
        return self._valid

    def random_unseen(self, k: int, exclude: set[str] = frozenset()) -> list[Schedule]:
        """Up to k distinct valid schedules, not seen and not in `exclude`, uniformly at random."""
        if k <= 0:
            return []
        if self._space_size() <= ENUMERATE_LIMIT:
            pool = [s for s in self.valid_schedules()
                    if (key := schedule_key(s)) not in self._seen and key not in exclude]
            return self.rng.sample(pool, min(k, len(pool)))
        out: dict[str, Schedule] = {}
        for _ in range(64 * k):   # rejection sampling: large spaces are mostly valid or mostly explored
            s = self.space.sample(self.rng)
            key = schedule_key(s)
            if key in self._seen or key in exclude or key in out or not self.space.is_valid(s):
                continue
            out[key] = s
            if len(out) == k:
                break
        return list(out.values())


def _rank(model: Scorer, space: ScheduleSpace, cands: list[Schedule]) -> list[Schedule]:
    """Candidates best-first by the model; ties keep the candidates' order."""
    if not cands:
        return []
    scores = np.asarray(model.score(space.workload, cands, space.target), dtype=np.float64)
    order = np.argsort(-scores, kind="stable")
    return [cands[i] for i in order]


class Exhaustive(SearchStrategy):
    """Every valid schedule exactly once, best-first by the model (the analytic prior by default)."""
    name = "exhaustive"

    def __init__(self, space: ScheduleSpace, model: Scorer | None = None, seed: int = 0,
                 measured: Iterable[tuple[Mapping[str, Any], float | None]] = ()) -> None:
        super().__init__(space, seed, measured)
        self._order = _rank(model or AnalyticPrior(), space, self.valid_schedules())
        self._next = 0

    def _propose(self, n: int) -> Iterable[Schedule]:
        while self._next < len(self._order):
            s = self._order[self._next]
            self._next += 1
            if not self.seen(s):
                yield s


class RandomSearch(SearchStrategy):
    """Uniformly random valid schedules not measured yet."""
    name = "random"

    def _propose(self, n: int) -> Iterable[Schedule]:
        return self.random_unseen(n)


class Evolutionary(SearchStrategy):
    """Cost-model-guided evolutionary search (see the module docstring)."""
    name = "evolutionary"

    def __init__(self, space: ScheduleSpace, model: Scorer | None = None, seed: int = 0, population: int = 16,
                 epsilon: float = 0.1, measured: Iterable[tuple[Mapping[str, Any], float | None]] = (),
                 refit: bool = False, crossover_rate: float = 0.4, pool_factor: int = 8) -> None:
        if not 0.0 <= epsilon <= 1.0:
            raise FlashgenError(f"epsilon must be in [0, 1], got {epsilon}")
        super().__init__(space, seed, measured)
        # An online fit stays local to this search: it refits a shallow copy (boosters are not mutated).
        self.model = (copy.copy(model) if refit else model) if model is not None else AnalyticPrior()
        self.population = max(1, population)
        self.epsilon = epsilon
        self.refit = refit
        self.crossover_rate = crossover_rate
        self.pool_factor = max(1, pool_factor)
        self._started = False

    # ---- candidates -------------------------------------------------------------------------
    def _ranked_sample(self, k: int, exclude: set[str]) -> list[Schedule]:
        """The model's top k of the whole unseen space (of a random sample of it, in large spaces)."""
        if self._space_size() <= ENUMERATE_LIMIT and len(self.valid_schedules()) <= RANK_ALL_LIMIT:
            cands = [s for s in self.valid_schedules()
                     if (key := schedule_key(s)) not in self._seen and key not in exclude]
        else:
            cands = self.random_unseen(RANK_ALL_LIMIT, exclude)
        return _rank(self.model, self.space, cands)[:k]

    def mutate(self, parent: Schedule) -> Schedule | None:
        """Move one knob to its nearest value (up or down) that gives a valid schedule (`variant` to a
        neighbouring form, `ScheduleSpace.with_knob`)."""
        knobs = self.space.form_knobs(parent)
        names = list(knobs)
        self.rng.shuffle(names)
        for name in names:
            vals = knobs[name]
            if parent.get(name) not in vals:
                continue
            i = vals.index(parent[name])
            d = self.rng.choice((-1, 1))
            for step in (d, -d):
                j = i + step
                while 0 <= j < len(vals):
                    child = self.space.with_knob(parent, name, vals[j])
                    if self.space.is_valid(child):
                        return child
                    j += step
        return None

    def crossover(self, a: Schedule, b: Schedule) -> Schedule:
        """Each knob from one of the parents; in a space of several forms, the form of one of them, and a
        knob the other parent lacks or holds at a value that form does not take, from the first."""
        if not self.space.has_variants:
            return {name: (a if self.rng.random() < 0.5 else b).get(name, a.get(name)) for name in self.space.knobs()}
        if self.rng.random() >= 0.5:
            a, b = b, a
        knobs = self.space.form_knobs(a)
        return {name: v if name != "variant" and (v := (a if self.rng.random() < 0.5 else b).get(name, a[name])) in vals
                else a[name] for name, vals in knobs.items()}

    def _pick(self, parents: list[Schedule]) -> Schedule:
        """Tournament of two: biased towards the faster parents."""
        return parents[min(self.rng.randrange(len(parents)), self.rng.randrange(len(parents)))]

    def children(self, parents: list[Schedule], want: int) -> list[Schedule]:
        """Up to `want` distinct valid unseen children of the parents."""
        out: dict[str, Schedule] = {}
        for _ in range(8 * want):
            if len(parents) >= 2 and self.rng.random() < self.crossover_rate:
                a, b = self._pick(parents), self._pick(parents)
                child = self.mutate(self.crossover(a, b)) if a is b else self.crossover(a, b)
            else:
                child = self.mutate(self._pick(parents))
            if child is None:
                continue
            key = schedule_key(child)
            if key in self._seen or key in out or not self.space.is_valid(child):
                continue
            out[key] = child
            if len(out) >= want:
                break
        return list(out.values())

    # ---- the interface ----------------------------------------------------------------------
    def _propose(self, n: int) -> Iterable[Schedule]:
        if not self._started:
            self._started = True
            return self._ranked_sample(n, set())
        n_rand = int(self.epsilon * n)
        if self.rng.random() < self.epsilon * n - n_rand:
            n_rand += 1
        n_model = n - n_rand
        parents = [s for s, _ in self.ok_results()[: self.population]]
        picks: list[Schedule] = []
        if parents and n_model:
            pool = self.children(parents, self.pool_factor * n_model)
            picks = _rank(self.model, self.space, pool)[:n_model]
        taken = {schedule_key(s) for s in picks}
        if len(picks) < n_model:  # the neighbourhood is spent (or nothing succeeded): the model's next best
            more = self._ranked_sample(n_model - len(picks), taken)
            picks += more
            taken |= {schedule_key(s) for s in more}
        picks += self.random_unseen(n - len(picks), taken)
        return picks

    def _observed(self, results: list[tuple[Schedule, float | None]]) -> None:
        if not self.refit or not hasattr(self.model, "refit"):
            return
        ok = self.ok_results()
        if len(ok) < 2 or len({lat for _, lat in ok}) < 2:
            return
        wl, target = self.space.workload, self.space.target
        self.model.refit([(wl, s, target, lat) for s, lat in ok])


STRATEGIES = {"exhaustive": Exhaustive, "random": RandomSearch, "evolutionary": Evolutionary}


def make_strategy(name: str, space: ScheduleSpace, model: Scorer | None = None, seed: int = 0,
                  measured: Iterable[tuple[Mapping[str, Any], float | None]] = (),
                  **kw: Any) -> SearchStrategy:
    """A strategy by name ("exhaustive", "random", "evolutionary"). `model` orders Exhaustive and guides
    Evolutionary (default: the analytic prior); `measured` are the database's earlier results for this
    (workload, target), never proposed again; `kw` go to Evolutionary (population, epsilon, refit, ...)."""
    if name == "exhaustive":
        return Exhaustive(space, model, seed, measured)
    if name == "random":
        return RandomSearch(space, seed, measured)
    if name == "evolutionary":
        return Evolutionary(space, model, seed, measured=measured, **kw)
    raise FlashgenError(f"unknown search strategy {name!r}; use one of {', '.join(STRATEGIES)}")
