"""Features of workload x schedule x target for the cost model, and the analytic latency estimate.

Each kernel class has a features module of its own (flashgen/kernel_classes.py names it:
row_features.py, contraction_features.py, attention_features.py) giving `FEATURE_NAMES` and
`columns(wl, schedules, target)`: every feature, and the analytic latency "_latency_us", as float64
arrays over the schedules. This module looks the class up and shapes what the cost model consumes.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Iterable, Mapping

import numpy as np

from flashgen.kernel_classes import kernel_class
from flashgen.targets.descriptor import Target
from flashgen.workload import Workload


def _module(kclass: str) -> ModuleType:
    return kernel_class(kclass).feature_module()


def feature_names(kclass: str) -> tuple[str, ...]:
    return _module(kclass).FEATURE_NAMES


def feature_matrix(wl: Workload, schedules: Iterable[Mapping[str, Any]], target: Target) -> np.ndarray:
    """float32 array of shape (len(schedules), len(feature_names(class)))."""
    mod = _module(wl.op.kclass)
    cols = mod.columns(wl, list(schedules), target)
    return np.stack([cols[name] for name in mod.FEATURE_NAMES], axis=1).astype(np.float32)


def features(wl: Workload, schedule: Mapping[str, Any], target: Target) -> np.ndarray:
    """The feature vector of one schedule (float32, len(feature_names(class)))."""
    return feature_matrix(wl, [schedule], target)[0]


def analytic_latency_us(wl: Workload, schedules: Iterable[Mapping[str, Any]], target: Target) -> np.ndarray:
    """The analytic latency estimate (us) of each schedule: what the prior ranks by."""
    return _module(wl.op.kclass).columns(wl, list(schedules), target)["_latency_us"]
