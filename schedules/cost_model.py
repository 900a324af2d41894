"""CostModel: ranks schedules before they are measured, so the search measures the promising ones first.

- `AnalyticPrior` needs no data: it ranks by the analytic latency estimate of `features.py`.
- `XGBCostModel` learns from measurements. One model serves every shape of a kernel class and every
  target: sizes enter as log2, the target through its descriptor's numbers, and the labels are
  normalised per (workload, target), so what it learns on one shape or GPU carries to another.
  Objective "rank" (XGBoost `rank:pairwise`, one query group per (workload, target)) learns only the
  order within a group, which is all the search needs; "regression" predicts the speed relative to the
  roofline (roofline_us / latency_us, in (0, ~1]) with squared error.
- `CostModel` is what the search uses: `CostModel.for_database(db, kclass)` keeps a trained model next to
  the tuning database and retrains it when the database has grown enough, and uses the prior until
  there is enough data.
- `compare_objectives` evaluates the objectives on workloads held out of training; the default
  objective is the one that ranked better there (see DEFAULT_OBJECTIVE).

Every `score(wl, schedules, target)` returns one float per schedule, higher = expected faster; scores
are comparable within one (workload, target) only.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import random
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import xgboost as xgb

from flashgen.db.record import ALONE, canonical_json, schedule_key
from flashgen.errors import FlashgenError
from flashgen.kernel_classes import CLASSES
from flashgen.roofline import roofline_us
from flashgen.schedules.features import analytic_latency_us, feature_matrix, feature_names
from flashgen.targets.descriptor import Target
from flashgen.workload import Schedule, Workload, recorded_workload

Sample = tuple[Workload, Schedule, Target, float]   # an ok measurement and its latency_us

OBJECTIVES = ("rank", "regression")
# Chosen by measurement: compare_objectives on the synthetic tables of tests/test_cost_model.py (24
# workloads x {h200, mi300x}, 4626 schedules; 4 folds x 3 repeats, 150 rounds) gave top-1 / top-5 of
# rank 0.961 / 0.993, regression 0.951 / 0.980 (the prior: 0.918 / 0.991); with 3 folds x 2 repeats,
# 80 rounds (the test): rank 0.953 / 0.984, regression 0.939 / 0.980. Re-run on real measurements with
# `compare_objectives(samples_from_database(db_path, kclass))` before trusting this choice on a GPU.
DEFAULT_OBJECTIVE = "rank"
MIN_RECORDS = 32            # fewer ok records of a kernel class than this: use the analytic prior
RETRAIN_GROWTH = 0.2        # retrain when the ok records grew by this fraction ...
RETRAIN_RECORDS = 64        # ... or by this many, whichever comes first
SIDE_FORMAT = "flashgen-costmodel"
SIDE_VERSION = 3  # the features' meaning: a model saved by another version is retrained (2: GEMM traffic and estimate
#                   count L2-resident operands once and the unpacking of coded weights; 3: a transposed int4
#                   tile's instruction rows are its weight rows)

XGB_PARAMS: dict[str, Any] = {
    "max_depth": 6, "eta": 0.1, "min_child_weight": 2, "subsample": 0.8, "colsample_bytree": 0.8,
    "lambda": 1.0, "tree_method": "hist",
    # Training sets are small (thousands of rows): extra threads gain little, and oversubscribing a
    # machine that also compiles and measures candidates costs far more.
    "nthread": max(1, min(4, (os.cpu_count() or 2) // 2)),
}
NUM_ROUNDS = 150
ONLINE_ROUNDS = 30


class AnalyticPrior:
    """Scores by the analytic latency estimate: no data needed."""
    kind = "prior"

    def score(self, wl: Workload, schedules: Sequence[Schedule], target: Target) -> np.ndarray:
        if not schedules:
            return np.zeros(0)
        return -np.log(analytic_latency_us(wl, schedules, target))


def _group_samples(samples: Iterable[Sample]) -> dict[tuple[str, str], tuple[Workload, Target, list, list]]:
    """(workload key, target id) -> (workload, target, schedules, median latency each); ok samples only,
    one row per distinct schedule (repeated measurements are merged by their median)."""
    raw: dict[tuple[str, str], tuple[Workload, Target, dict[str, tuple[Schedule, list[float]]]]] = {}
    for wl, s, target, lat in samples:
        if lat is None or not math.isfinite(lat) or lat <= 0:
            continue
        g = raw.setdefault((wl.key, target.id), (wl, target, {}))
        g[2].setdefault(schedule_key(dict(s)), (s, []))[1].append(float(lat))
    out = {}
    for key in sorted(raw):
        wl, target, by_s = raw[key]
        scheds = [s for s, _ in by_s.values()]
        lats = [float(np.median(v)) for _, v in by_s.values()]
        out[key] = (wl, target, scheds, lats)
    return out


def _dmatrix(groups: Mapping[tuple[str, str], tuple[Workload, Target, list, list]], objective: str,
             ) -> xgb.DMatrix | None:
    xs, ys, qids = [], [], []
    for q, (wl, target, scheds, lats) in enumerate(groups.values()):
        if objective == "rank" and len(scheds) < 2:
            continue  # a group of one orders nothing
        lat = np.asarray(lats)
        xs.append(feature_matrix(wl, scheds, target))
        if objective == "rank":
            ys.append(lat.min() / lat)          # within a group only the order matters
        else:
            ys.append(roofline_us(wl, target) / lat)
        qids.append(np.full(len(scheds), q, dtype=np.int64))
    if not xs:
        return None
    kclass = next(iter(groups.values()))[0].op.kclass
    d = xgb.DMatrix(np.concatenate(xs), label=np.concatenate(ys), feature_names=list(feature_names(kclass)),
                    qid=np.concatenate(qids) if objective == "rank" else None)
    return d


def _params(objective: str, seed: int) -> dict[str, Any]:
    if objective not in OBJECTIVES:
        raise FlashgenError(f"unknown cost model objective {objective!r}; use one of {', '.join(OBJECTIVES)}")
    p = dict(XGB_PARAMS, seed=seed)
    if objective == "rank":
        p.update(objective="rank:pairwise", lambdarank_pair_method="mean", lambdarank_num_pair_per_sample=8)
    else:
        p.update(objective="reg:squarederror")
    return p


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def sidecar_path(path: str | os.PathLike) -> Path:
    """`model.json` -> `model.meta.json`: the objective, feature names and record count of a saved model."""
    p = Path(path)
    return p.with_name((p.name[:-5] if p.name.endswith(".json") else p.name) + ".meta.json")


class XGBCostModel:
    """An XGBoost model over FEATURE_NAMES with the "rank" or "regression" objective."""
    kind = "xgb"

    def __init__(self, objective: str = DEFAULT_OBJECTIVE, num_rounds: int = NUM_ROUNDS, seed: int = 0,
                 online_rounds: int = ONLINE_ROUNDS) -> None:
        _params(objective, seed)  # validates the objective
        self.objective = objective
        self.num_rounds = num_rounds
        self.online_rounds = online_rounds
        self.seed = seed
        self.n_records = 0
        self.booster: xgb.Booster | None = None
        self._base: xgb.Booster | None = None   # the booster before any online refit

    def fit(self, samples: Iterable[Sample], n_records: int | None = None) -> XGBCostModel:
        """Train from scratch on ok measurements; `n_records` (default: the sample count) is stored."""
        samples = list(samples)
        d = _dmatrix(_group_samples(samples), self.objective)
        if d is None:
            raise FlashgenError("the cost model needs measurements of at least two schedules to train")
        self.booster = xgb.train(_params(self.objective, self.seed), d, self.num_rounds)
        self._base = self.booster
        self.n_records = len(samples) if n_records is None else n_records
        return self

    def refit(self, samples: Iterable[Sample]) -> XGBCostModel:
        """Online fit during a search: `online_rounds` more trees on top of the trained model, fitted to
        the measurements of this search (replacing any earlier online fit; the trained model's trees
        carry what it learned from its training data). Untrained: a plain fit."""
        samples = list(samples)
        if self._base is None:
            return self.fit(samples)
        d = _dmatrix(_group_samples(samples), self.objective)
        if d is not None:
            self.booster = xgb.train(_params(self.objective, self.seed), d, self.online_rounds,
                                     xgb_model=self._base)
        return self

    def score(self, wl: Workload, schedules: Sequence[Schedule], target: Target) -> np.ndarray:
        if self.booster is None:
            raise FlashgenError("the cost model is not trained; fit() or load() it first")
        if not schedules:
            return np.zeros(0)
        d = xgb.DMatrix(feature_matrix(wl, schedules, target), feature_names=list(feature_names(wl.op.kclass)))
        return self.booster.predict(d).astype(np.float64)

    def save(self, path: str | os.PathLike) -> None:
        """Writes xgboost's JSON model to `path` and the sidecar next to it, each atomically."""
        if self._base is None:
            raise FlashgenError("cannot save an untrained cost model")
        path = Path(path)
        raw = bytes(self._base.save_raw("json"))
        names = self._base.feature_names or []
        side = {"format": SIDE_FORMAT, "version": SIDE_VERSION, "objective": self.objective,
                "feature_names": list(names), "n_records": self.n_records,
                "num_rounds": self.num_rounds, "model_sha256": hashlib.sha256(raw).hexdigest()}
        _write_atomic(path, raw)
        _write_atomic(sidecar_path(path), (canonical_json(side) + "\n").encode())

    @classmethod
    def load(cls, path: str | os.PathLike) -> XGBCostModel:
        """Raises FlashgenError when the files are missing, unreadable, mismatched (a concurrent save
        replaced one of them) or from a different feature set."""
        path = Path(path)
        try:
            raw = path.read_bytes()
            side = json.loads(sidecar_path(path).read_text())
        except (OSError, ValueError) as e:
            raise FlashgenError(f"cannot read cost model {path}: {e}") from None
        if not isinstance(side, dict) or side.get("format") != SIDE_FORMAT:
            raise FlashgenError(f"{sidecar_path(path)} is not a flashgen cost model sidecar")
        if side.get("model_sha256") != hashlib.sha256(raw).hexdigest():
            raise FlashgenError(f"cost model {path} does not match its sidecar (saved concurrently?)")
        if tuple(side.get("feature_names", ())) not in {feature_names(k) for k in CLASSES} \
                or side.get("version") != SIDE_VERSION:
            raise FlashgenError(f"cost model {path} was trained on other features; retrain it")
        m = cls(objective=side["objective"], num_rounds=int(side.get("num_rounds", NUM_ROUNDS)))
        booster = xgb.Booster()
        try:
            booster.load_model(bytearray(raw))
        except xgb.core.XGBoostError as e:
            raise FlashgenError(f"cannot load cost model {path}: {e}") from None
        booster.set_param({"nthread": XGB_PARAMS["nthread"]})
        m.booster = m._base = booster
        m.n_records = int(side["n_records"])
        return m


# ---- training data from the database ----------------------------------------------------------------

def samples_from_records(records: Iterable[Any], kclass: str | None = None) -> list[Sample]:
    """(Workload, schedule, Target, latency_us) of the ok records timed alone, of one kernel class if
    given (the model predicts the tuner's timing alone; a call timed behind its producer overlaps it).
    Records of ops or targets this flashgen does not know are skipped, and so are records whose workload
    has another key today (its op gained an attribute, such as a new weight layout, since: they measured
    another kernel)."""
    from flashgen.targets.descriptor import load_targets

    targets = load_targets()
    by_id = {t.id: t for t in targets.values()}
    workloads: dict[str, Workload | None] = {}
    out: list[Sample] = []
    for r in records:
        if r.status != "ok" or r.latency_us is None or r.latency_us <= 0 or r.timing != ALONE:
            continue
        target = by_id.get(r.target_key)
        if target is None:
            continue
        text = canonical_json(r.workload) + r.workload_key
        if text not in workloads:
            workloads[text] = recorded_workload(r.workload, r.workload_key)
        wl = workloads[text]
        if wl is None or (kclass is not None and wl.op.kclass != kclass):
            continue
        out.append((wl, r.schedule, target, r.latency_us))
    return out


def samples_from_database(db_path: str | os.PathLike, kclass: str | None = None) -> list[Sample]:
    from flashgen.db import Database

    if not Path(db_path).exists():
        return []
    with Database(db_path) as db:
        return samples_from_records(db.records(status="ok"), kclass)


def model_path(db_path: str | os.PathLike, kclass: str) -> Path:
    """Where the cost model of a kernel class trained on a database lives: next to it."""
    p = Path(db_path)
    return p.with_name(f"{p.name}.costmodel-{kclass}.json")


def needs_retrain(n_trained: int, n_now: int) -> bool:
    """Grown by RETRAIN_GROWTH or RETRAIN_RECORDS since training; or shrunk (another database now)."""
    if n_now < n_trained:
        return True
    return n_now - n_trained >= min(RETRAIN_RECORDS, max(1, math.ceil(RETRAIN_GROWTH * n_trained)))


class CostModel:
    """What the search ranks with: a trained XGBCostModel, or the AnalyticPrior while data is scarce."""

    def __init__(self, model: AnalyticPrior | XGBCostModel | None = None, samples: Sequence[Sample] = (),
                 objective: str = DEFAULT_OBJECTIVE, min_records: int = MIN_RECORDS) -> None:
        self.model = model if model is not None else AnalyticPrior()
        self.samples = list(samples)     # training data, for online refits of a prior-backed model
        self.objective = objective
        self.min_records = min_records
        self.retrained = False           # whether for_database trained (rather than loaded) the model
        self.path: Path | None = None

    @property
    def kind(self) -> str:
        return self.model.kind

    @classmethod
    def for_database(cls, db_path: str | os.PathLike, kclass: str, objective: str = DEFAULT_OBJECTIVE,
                     min_records: int = MIN_RECORDS, save: bool = True) -> CostModel:
        """Load the model saved next to the database; retrain it from the database's ok records of
        `kclass` when there is none, it does not load, its objective differs, or the records grew by
        RETRAIN_GROWTH or RETRAIN_RECORDS since it was trained. Fewer than `min_records`: the prior."""
        samples = samples_from_database(db_path, kclass)
        n = len(samples)
        if n < min_records:
            return cls(AnalyticPrior(), samples, objective, min_records)
        path = model_path(db_path, kclass)
        model: XGBCostModel | None = None
        if path.exists():
            try:
                model = XGBCostModel.load(path)
            except FlashgenError:
                model = None
            if model is not None and (model.objective != objective or needs_retrain(model.n_records, n)):
                model = None
        out = cls(None, samples, objective, min_records)
        if model is None:
            try:
                model = XGBCostModel(objective).fit(samples, n_records=n)
            except FlashgenError:     # every record is a lone schedule of its workload: nothing to rank
                return cls(AnalyticPrior(), samples, objective, min_records)
            out.retrained = True
            if save:
                try:
                    model.save(path)
                except OSError:
                    pass  # a read-only folder: the model still serves this process
        out.model = model
        out.path = path
        return out

    def score(self, wl: Workload, schedules: Sequence[Schedule], target: Target) -> np.ndarray:
        return self.model.score(wl, schedules, target)

    def __copy__(self) -> CostModel:
        """A copy whose online refits leave this one alone (what a search with refit=True takes)."""
        out = CostModel.__new__(CostModel)
        out.__dict__.update(self.__dict__)
        out.model = copy.copy(self.model)
        out.samples = list(self.samples)
        return out

    def refit(self, samples: Iterable[Sample]) -> CostModel:
        """Online fit on a search's measurements (not saved: they reach the saved model through the
        database). A prior-backed model switches to XGBoost once database + search hold enough data."""
        samples = list(samples)
        if isinstance(self.model, XGBCostModel):
            self.model.refit(samples)
        elif len(self.samples) + len(samples) >= self.min_records:
            try:
                self.model = XGBCostModel(self.objective).fit(self.samples + samples)
            except FlashgenError:
                pass
        return self


# ---- choosing the objective ---------------------------------------------------------------------------

def _topk_score(scores: np.ndarray, lats: np.ndarray, k: int) -> float:
    order = np.argsort(-scores, kind="stable")
    return float(lats.min() / lats[order[:k]].min())


def compare_objectives(samples: Sequence[Sample], objectives: Sequence[str] = OBJECTIVES, folds: int = 4,
                       ks: Sequence[int] = (1, 5), seed: int = 0, repeats: int = 1,
                       include_prior: bool = True,
                       num_rounds: int = NUM_ROUNDS) -> dict[str, dict[str, float]]:
    """Leave-some-workloads-out evaluation: the workloads (by key, all their targets together) are split
    into `folds` parts; each part is scored by models trained on the others. For every held-out
    (workload, target) the top-k score is best latency / best latency among the model's k top-ranked
    schedules (1.0 = it found the best). `repeats` > 1 repeats this over other random splits.
    Returns {name: {"top1": mean, "top5": mean, ..., "groups": held-out groups scored}} for each
    objective, plus "prior" for the AnalyticPrior when include_prior."""
    groups = _group_samples(samples)
    keys = sorted({k[0] for k in groups})
    if len(keys) < 2:
        raise FlashgenError("compare_objectives needs measurements of at least two workloads")
    folds = max(2, min(folds, len(keys)))
    names = list(objectives) + (["prior"] if include_prior else [])
    acc: dict[str, dict[int, list[float]]] = {n: defaultdict(list) for n in names}
    for rep in range(repeats):
        wl_keys = list(keys)
        random.Random(seed + rep).shuffle(wl_keys)
        for held in (set(wl_keys[i::folds]) for i in range(folds)):
            train = [s for s in samples if s[0].key not in held]
            models: dict[str, Any] = {o: XGBCostModel(o, num_rounds=num_rounds, seed=seed + rep).fit(train)
                                      for o in objectives}
            if include_prior:
                models["prior"] = AnalyticPrior()
            for (wkey, _), (wl, target, scheds, lats) in groups.items():
                if wkey not in held:
                    continue
                lat = np.asarray(lats)
                for name, m in models.items():
                    sc = m.score(wl, scheds, target)
                    for k in ks:
                        acc[name][k].append(_topk_score(sc, lat, k))
    return {n: {**{f"top{k}": float(np.mean(acc[n][k])) for k in ks}, "groups": len(acc[n][ks[0]])}
            for n in names}
