"""The kernel classes, each registered once: where its schedule-space rules, its cost-model features and
its code generator for each backend live.

A class is one `KernelClass` record in `CLASSES`. ScheduleSpace (schedules/space.py), the cost model's
features (schedules/features.py), each backend's code generation and the compiler's "is this supported"
look the class up here; nothing else branches on a class name. Adding a class is one module per layer
(its space rules, its features, a generator per backend that can build it) and one line in `CLASSES`.

The record names its modules by dotted path and imports them when first asked, not when this module
loads. Layering runs one way (ir -> workload -> descriptor -> spaces -> backends -> compiler -> tuner
and runtime), and this table is read from every layer, the IR included (`reduces`), so it may import
none of them: a record holding the modules themselves would make the IR import the spaces and the
backends, and a registration call in each class's own modules would leave the table empty until
someone imported them all. Names resolve lazily, so each layer pays only for what it uses (the CPU
never imports Triton's generators) and the table stays one readable list.

Interfaces a record's modules provide (see docs/adding-a-kernel-class.md):
- space: `knobs(wl, target) -> {name: values}`, `added_knobs(wl) -> {name: value its absence stands
  for}`, `why_invalid(wl, target, schedule) -> str | None` (the class's rules, after ScheduleSpace has
  checked every knob is one of its values) and `default(wl, target) -> Schedule` (the analytic default);
  a class whose generator takes several forms gives `variants(wl, target) -> {form: {name: values}}`
  instead of `knobs`, with `current`, `flat_of`, `implied` and `FLAT_KNOBS` (schedules/space.py);
- features: `FEATURE_NAMES` and `columns(wl, schedules, target) -> {name: array}`, including
  "_latency_us", the analytic latency estimate the search ranks by before any data exists;
- generators: backend name ("triton", "tvm") -> "module:function", `function(wl, schedule)` returning
  that backend's kernel source. A build may have more than one generator: the Triton build also
  compiles Gluon sources, and a schedule's `backend` knob (SCHEDULE_BACKENDS), or its `variant`, picks
  which writes it.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Mapping

from flashgen.errors import FlashgenError


# A schedule's `backend` knob: the generator of the Triton build that writes its kernel, by index.
SCHEDULE_BACKENDS = ("triton", "gluon")


def schedule_backend(schedule: Mapping[str, Any]) -> str:
    """The generator a schedule asks for: by its `backend` knob, or its `variant`'s (flashgen/ir/variants.py);
    "triton" where it has neither."""
    if "variant" in schedule:
        from flashgen.ir.variants import variant  # (read lazily, as the table's modules are)

        return SCHEDULE_BACKENDS[variant(schedule).option("backend")]
    return SCHEDULE_BACKENDS[int(schedule.get("backend", 0))]


@dataclass(frozen=True)
class KernelClass:
    name: str
    space: str                       # module of the schedule-space rules
    features: str                    # module of the cost-model features
    generators: Mapping[str, str] = field(default_factory=dict)  # backend -> "module:function"
    reduces: bool = True             # its ops may hold Reduce statements (per-row reductions)
    # Row-domain classes: programs tile the columns as well as the rows (pointwise), so no program
    # sees a whole row; otherwise a program owns whole rows and walks a long one in tiles (rowwise).
    tiles_cols: bool = False

    def space_rules(self) -> ModuleType:
        return importlib.import_module(self.space)

    def feature_module(self) -> ModuleType:
        return importlib.import_module(self.features)

    def generator(self, backend: str) -> Callable[..., Any] | None:
        """The class's code generator for `backend`, or None when that backend cannot build it."""
        ref = self.generators.get(backend)
        if ref is None:
            return None
        module, function = ref.split(":")
        return getattr(importlib.import_module(module), function)


_ROW_GENERATORS = {"triton": "flashgen.targets.triton.codegen:generate_rows",
                   "tvm": "flashgen.targets.tvm_backend.lower:generate"}

CLASSES: dict[str, KernelClass] = {k.name: k for k in (
    KernelClass("rowwise", "flashgen.schedules.row_space", "flashgen.schedules.row_features", _ROW_GENERATORS),
    KernelClass("pointwise", "flashgen.schedules.row_space", "flashgen.schedules.row_features", _ROW_GENERATORS,
                reduces=False, tiles_cols=True),
    KernelClass("contraction", "flashgen.schedules.contraction_space", "flashgen.schedules.contraction_features",
                {"triton": "flashgen.targets.triton.contraction:generate_contraction",
                 "gluon": "flashgen.targets.gluon.contraction:generate_contraction"}),
    KernelClass("attention", "flashgen.schedules.attention_space", "flashgen.schedules.attention_features",
                {"triton": "flashgen.targets.triton.attention:generate_attention",
                 "gluon": "flashgen.targets.gluon.attention:generate_attention"}),
    KernelClass("moe", "flashgen.schedules.moe_space", "flashgen.schedules.moe_features",
                {"triton": "flashgen.targets.triton.moe:generate_moe"}),
)}


def current_schedule(wl: Any, schedule: Mapping[str, Any]) -> dict[str, Any]:
    """`schedule` in its class's form of today (a contraction record's flat knobs as its variant, the
    space rules' `current`), for the readers of a schedule given outside a space: the interpreter, the
    standalone harness."""
    rules = kernel_class(wl.op.kclass).space_rules()
    return rules.current(wl, dict(schedule)) if hasattr(rules, "current") else dict(schedule)


def kernel_class(name: str) -> KernelClass:
    try:
        return CLASSES[name]
    except KeyError:
        raise FlashgenError(f"unknown kernel class '{name}'; known classes: {', '.join(CLASSES)}") from None


def generator(kclass: str, backend: str) -> Callable[..., Any]:
    """The generator of `kclass` for `backend`; a clear error where that backend cannot build the class."""
    gen = kernel_class(kclass).generator(backend)
    if gen is None:
        raise FlashgenError(f"{kclass} kernels are not generated by the {backend} backend "
                            f"(it generates {', '.join(supported(backend))})")
    return gen


def supported(backend: str) -> list[str]:
    """The classes `backend` has a generator for."""
    return [k.name for k in CLASSES.values() if backend in k.generators]
