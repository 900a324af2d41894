"""What Gluon sources share: the module header and its assembly, the IR's expressions in Gluon's
names, the wait for the previous kernel (programmatic dependent launch) written as the instructions
Triton emits, and the registers of warp-specialized partitions."""
from __future__ import annotations

import json
import re
from typing import Mapping

from flashgen.targets.triton.emit import UNARY, Arg, Emitter, Scope
from flashgen.workload import Workload

NS = "gl"  # Gluon's language module in the generated source
HOPPER = ("fence_async_shared", "mbarrier", "tma", "warpgroup_mma", "warpgroup_mma_wait")
PRODUCER_REGS = 40  # registers per thread of the copy warp (it holds only addresses and loop state)
CONSUMER_REGS = 224  # and of a second consumer warpgroup: with the default one's 256 and the copy warp's 40, in 64K


class GluonEmitter(Emitter):
    """The shared Emitter, writing what Gluon's language module lacks (sigmoid) out of what it has.
    Every other name the Emitter writes (load, store, where, maximum, float32, ...) Gluon has under
    the same name: `to_gluon` renames the module at the end."""

    unary = {**UNARY, "sigmoid": "(1.0 / (1.0 + tl.exp(-{})))",
             "tanh": "(2.0 / (1.0 + tl.exp(-2.0 * {})) - 1.0)"}


def to_gluon(text: str) -> str:
    """A source written with the Emitter's `tl.` names, in Gluon's."""
    return re.sub(r"(?<![\w.])tl\.", f"{NS}.", text)


def def_params(args: list[Arg]) -> list[str]:
    """The kernel's parameters as its `def` line declares them (constexprs marked): a warp partition's
    function declares them too, since it takes every kernel argument."""
    return [a.name + (f": {NS}.constexpr" if a.kind == "constexpr" else "") for a in args]


def module_header(wl: Workload, schedule: Mapping[str, int], name: str, args: list[Arg]) -> list[str]:
    """The module's description comments and imports, up to the kernel's `def` line (helpers are put
    before the kernel)."""
    sig = ", ".join(def_params(args))
    fixed = {k: v for k, v in wl.dim.items() if k not in wl.op.row_dims}
    return [f"# flashgen: {wl.op.name} ({wl.op.kclass}, Gluon) - {wl.op.doc}",
            f"# dims: {json.dumps(fixed, sort_keys=True)} (run time: {', '.join(wl.op.row_dims)}); "
            f"attrs: {json.dumps(wl.attr, sort_keys=True)}",
            f"# schedule: {json.dumps(dict(schedule), sort_keys=True)}",
            "from triton.experimental import gluon",
            f"from triton.experimental.gluon import language as {NS}",
            f"from triton.experimental.gluon.language.nvidia.hopper import {', '.join(HOPPER)}", "", "",
            "@gluon.jit", f"def {name}({sig}):"]


def grid_dependency(scope: Scope) -> None:
    """Programmatic dependent launch, as targets/triton/emit.py's `grid_dependency` (Gluon has no
    call for it): wait for the previous kernel's writes, then let the next kernel launch."""
    scope.line("if PDL:")
    for op in ("wait", "launch_dependents"):
        scope.line(f'    {NS}.inline_asm_elementwise("griddepcontrol.{op}; // $0", "=r", [], dtype={NS}.int32, '
                   "is_pure=False, pack=1)")


def module_text(em: Emitter, lines: list[str], helpers: list[str]) -> str:
    """The finished module: the helper functions (warp partitions, unpacking) before the kernel that
    calls them, every IR value named, in Gluon's names."""
    head = lines.index("@gluon.jit")
    lines[head:head] = helpers
    return to_gluon(em.finish(lines))
