"""Expression and statement emission shared by the Triton generators of every kernel class.

A Scope is one nesting level of the kernel being written: its lines' indent, the values emitted so far
(common-subexpression cache, keyed by expression node) and what each domain axis is called there,
with its bounds mask when the tile can run past the domain.
"""
from __future__ import annotations

import builtins
import json
import keyword
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

from flashgen.ir import dtypes
from flashgen.ir import expr as E
from flashgen.ir.op import Op, Store
from flashgen.workload import Workload

PDL = "PDL"  # the constexpr that turns on programmatic dependent launch: 0 as generated, set per target by the build
RINT_MAGIC = 12582912.0  # 1.5 * 2**23: (x + m) - m rounds an fp32 |x| < 2**22 half-to-even, on any backend
UNARY = {"exp": "tl.exp({})", "log": "tl.log({})", "sqrt": "tl.sqrt({})", "rsqrt": "tl.rsqrt({})",
         "abs": "tl.abs({})", "sigmoid": "tl.sigmoid({})", "erf": "tl.erf({})", "cos": "tl.cos({})",
         "sin": "tl.sin({})", "neg": "(-{})", "tanh": "(2.0 * tl.sigmoid(2.0 * {}) - 1.0)",
         "rint": f"(({{}} + {RINT_MAGIC}) - {RINT_MAGIC})"}
IDENTITY = {"sum": "0.0", "max": 'float("-inf")', "min": 'float("inf")'}
REDUCE_FN = {"sum": "tl.sum", "max": "tl.max", "min": "tl.min"}
COMBINE = {"sum": "{} + {}", "max": "tl.maximum({}, {})", "min": "tl.minimum({}, {})"}  # folds a tile into an accumulator
BINARY = {"add": "({} + {})", "sub": "({} - {})", "mul": "({} * {})", "div": "({} / {})",
          "floordiv": "({} // {})", "mod": "({} % {})", "max": "tl.maximum({}, {})",
          "min": "tl.minimum({}, {})", "lt": "({} < {})", "le": "({} <= {})", "gt": "({} > {})",
          "ge": "({} >= {})", "eq": "({} == {})", "shr": "({} >> {})", "and": "({} & {})"}


@dataclass(frozen=True)
class Arg:
    """One kernel parameter: a tensor pointer, a tensor stride, a runtime dim, a param or a constexpr."""
    name: str
    kind: str  # "ptr" | "scratch" | "stride" | "dim" | "param" | "constexpr"
    tensor: str = ""
    axis: int = 0
    value: int = 0


@dataclass(frozen=True)
class Scratch:
    """Device memory a kernel needs besides the op's tensors (split partial results, counters): the
    launcher keeps one per device, grown on demand; `zeroed` buffers start at zero and the kernel
    leaves them at zero."""
    name: str
    dtype: str
    elements: Callable[[Mapping[str, int]], int]
    zeroed: bool = False


@dataclass
class KernelSource:
    """Generated module text, its parameters, and how its programs tile the (rows, cols) domain:
    `tiles` rows x cols per program; cols tiled only when `tile_cols`; `flat` numbers every tile
    along one grid axis (the kernel maps program ids to tiles itself); `grid_z` programs more along
    the third grid axis (splits of one tile's work); a `persistent` kernel launches at most that many
    programs per SM, each walking tiles until none are left. Both dialects build and launch alike."""
    name: str
    source: str
    args: list[Arg]
    tiles: tuple[int, int]
    tile_cols: bool
    flat: bool = False
    grid_z: int = 1
    scratch: tuple[Scratch, ...] = ()
    persistent: int = 0  # programs per SM when the kernel walks the tiles itself (0: one program per tile)
    seq_tiles: str = ""  # packed sequences: one more row tile per sequence of this dim (each may end in a part tile)
    slots: str = ""  # the row tiles repeated for each of min(this dim, rows) slots (moe's ids routing)
    dialect: str = "triton"  # the source's language: "triton" (@triton.jit) or "gluon" (@gluon.jit, targets/gluon)


@dataclass
class Scope:
    lines: list[str]
    indent: str
    axes: dict[str, tuple[str, str | None]]  # IR axis -> (variable, bounds mask or None)
    cache: dict = field(default_factory=dict)

    def child(self, indent: str | None = None, axes: Mapping[str, tuple[str, str | None]] | None = None,
              fresh: bool = False) -> "Scope":
        return Scope(self.lines, self.indent if indent is None else indent,
                     dict(self.axes if axes is None else axes), {} if fresh else dict(self.cache))

    def line(self, text: str) -> None:
        self.lines.append(self.indent + text)


class Emitter:
    """Writes IR expressions as Triton: every non-trivial node becomes a temporary, emitted once. A
    temporary that holds a named IR value (a Let, a reduction) takes that name in the finished source
    (`finish`), so the generated kernel reads like the op's description. `unary` is the form of each
    elementwise function (a dialect lacking one of Triton's writes it out)."""

    unary: Mapping[str, str] = UNARY

    def __init__(self, op: Op, attrs: Mapping[str, str], lets: Mapping[str, E.Expr]):
        self.op, self.attrs, self.lets = op, attrs, lets
        self.named: dict[str, str] = {}  # values computed outside expressions (reductions, accumulators)
        self.row_pass: tuple = ()  # a contraction's statements before its Contract (evaluated per row)
        self.row_factors: tuple = ()  # row-pass values a GEMV tile took out of the A prologue (see contraction.py)
        self.ntemp = 0
        self.labels: dict[str, str] = {}  # temporary -> the IR name of the value it holds

    def temp(self, scope: Scope, code: str, label: str | None = None) -> str:
        name = f"t{self.ntemp}"
        self.ntemp += 1
        scope.line(f"{name} = {code}")
        if label:
            self.labels[name] = label
        return name

    def finish(self, lines: list[str]) -> str:
        """The module text with each labelled temporary renamed to its IR name (made unique against every
        identifier the text already has: a second value of one name becomes name_1, ...)."""
        text = "\n".join(lines) + "\n"
        code = "\n".join(line.split("#")[0] for line in lines)  # names in comments and after a dot are free
        taken = set(re.findall(r"(?<![.\w])[A-Za-z_]\w*", code)) | set(dir(builtins))
        rename: dict[str, str] = {}
        for temp in sorted(self.labels, key=lambda t: int(t[1:])):
            base = self.labels[temp] if self.labels[temp].isidentifier() and not keyword.iskeyword(self.labels[temp]) else "v"
            name, i = base, 0
            while name in taken:
                i += 1
                name = f"{base}_{i}"
            taken.add(name)
            rename[temp] = name
        if not rename:
            return text
        return re.sub(r"\bt\d+\b", lambda m: rename.get(m.group(0), m.group(0)), text)

    def emit(self, e: E.Expr, scope: Scope, raw: bool = False) -> str:
        """The variable or literal holding `e`; `raw` loads keep the tensor's dtype (no fp32 upcast)."""
        key = (e, raw) if raw else e
        if key in scope.cache:
            return scope.cache[key]
        if isinstance(e, E.Const):
            return repr(e.value) if e.is_int or math.isfinite(e.value) else f'float("{e.value}")'
        if isinstance(e, (E.Dim, E.Param)):
            return e.name
        if isinstance(e, E.Index):
            return scope.axes[e.axis][0]
        if isinstance(e, E.Ref):
            if e.name in self.named:
                return self.named[e.name]
            v = self.emit(self.lets[e.name], scope, raw)
            if re.fullmatch(r"t\d+", v) and v not in self.labels:
                self.labels[v] = e.name
        elif isinstance(e, E.Load):
            v = self.temp(scope, self.load(e, scope, raw))
        elif isinstance(e, E.Unary):
            v = self.temp(scope, self.unary[e.fn].format(self.emit(e.x, scope)))
        elif isinstance(e, E.Binary):
            v = self.temp(scope, BINARY[e.op].format(self.emit(e.a, scope), self.emit(e.b, scope)))
        elif isinstance(e, E.Where):
            v = self.temp(scope, "tl.where({}, {}, {})".format(
                self.emit(e.cond, scope), self.emit(e.a, scope), self.emit(e.b, scope)))
        else:
            raise TypeError(f"cannot emit {e!r}")
        scope.cache[key] = v
        return v

    def address(self, tensor: str, indices: tuple[E.Expr, ...], scope: Scope) -> str:
        terms = []
        last = len(indices) - 1
        for axis, ix in enumerate(indices):
            v = self.emit(ix, scope)
            if axis == last:
                terms.append(v)
            else:
                v = f"{v}.to(tl.int64)" if axis == 0 else v
                terms.append(f"{v} * {tensor}_s{axis}")
        return f"{tensor}_ptr + " + " + ".join(terms)

    def mask(self, indices: tuple[E.Expr, ...], extra: E.Expr | None, scope: Scope) -> str | None:
        axes = {n.axis for ix in indices for n in E.walk(ix) if isinstance(n, E.Index)}
        parts = [scope.axes[a][1] for a in sorted(axes) if scope.axes[a][1]]
        if extra is not None:
            parts.append(self.emit(extra, scope))
        return " & ".join(parts) if parts else None

    def load(self, e: E.Load, scope: Scope, raw: bool = False) -> str:
        addr = self.address(e.tensor, e.indices, scope)
        m = self.mask(e.indices, e.mask, scope)
        dt = self.op.dtype_of(e.tensor, self.attrs)
        if m and dt in dtypes.FP8:  # Triton cannot cast a literal 0 to fp8: zero-fill the bytes, then reinterpret
            code = f"tl.load(({addr}).to(tl.pointer_type(tl.int8)), mask={m}, other=0).to({dtypes.TL[dt]}, bitcast=True)"
        else:
            code = f"tl.load({addr}, mask={m}, other=0)" if m else f"tl.load({addr})"
        if not raw and dtypes.is_float(self.op.dtype_of(e.tensor, self.attrs)):
            code += ".to(tl.float32)"
        return code

    def store(self, st: Store, scope: Scope) -> None:
        v = self.emit(st.value, scope)
        addr = self.address(st.tensor, st.indices, scope)
        m = self.mask(st.indices, st.mask, scope)
        dt = dtypes.TL[self.op.dtype_of(st.tensor, self.attrs)]
        mask = f", mask={m}" if m else ""
        if st.combine == "add":
            scope.line(f"tl.atomic_add({addr}, {v}.to({dt}){mask}, sem=\"relaxed\")")
        else:
            scope.line(f"tl.store({addr}, {v}.to({dt}){mask})")

    def operand(self, e: E.Expr, scope: Scope, operand: str) -> str:
        """A matrix instruction's operand tile of `e`, in the `operand` dtype: a plain load of a tensor
        stored in it is loaded as is, anything else is computed (in fp32) and cast."""
        load = e
        while isinstance(load, E.Ref) and load.name in self.lets:
            load = self.lets[load.name]
        raw = isinstance(load, E.Load) and self.op.dtype_of(load.tensor, self.attrs) == operand
        v = self.emit(e, scope, raw=raw)
        return v if raw else self.temp(scope, f"{v}.to({dtypes.TL[operand]})")


def kernel_args(wl: Workload, constexprs: Mapping[str, int], scratch: tuple[Scratch, ...] = ()) -> list[Arg]:
    """Pointers (the op's tensors, then scratch), strides (all but the last, contiguous, axis), run-time
    dims, params, then constants: every dim but the row dims, and the schedule's tile sizes."""
    op = wl.op
    tensors = wl.inputs + wl.outputs
    out = [Arg(f"{t.name}_ptr", "ptr", t.name) for t in tensors]
    out += [Arg(f"{sc.name}_ptr", "scratch", sc.name) for sc in scratch]
    out += [Arg(f"{t.name}_s{k}", "stride", t.name, k) for t in tensors for k in range(len(t.shape) - 1)]
    out += [Arg(d, "dim") for d in op.row_dims]
    out += [Arg(p, "param") for p in op.params]
    out += [Arg(d, "constexpr", value=wl.dim[d]) for d in op.dims if d not in op.row_dims]
    out += [Arg(k, "constexpr", value=v) for k, v in constexprs.items()]
    out.append(Arg(PDL, "constexpr", value=0))
    return out


def grid_dependency(scope: Scope) -> None:
    """Programmatic dependent launch (NVIDIA sm_90+, when the build sets PDL): a kernel launched while
    the previous one still runs waits here, before its first memory access, until that one has finished
    and its writes are visible, then lets the next kernel launch. The programs of at most two kernels
    are resident at once, and the launch latency between them is hidden."""
    scope.line("if PDL:")
    scope.line("    tl.extra.cuda.gdc_wait()")
    scope.line("    tl.extra.cuda.gdc_launch_dependents()")


def module_header(wl: Workload, schedule: Mapping[str, int], name: str, args: list[Arg]) -> list[str]:
    sig = ", ".join(a.name + (": tl.constexpr" if a.kind == "constexpr" else "") for a in args)
    fixed = {k: v for k, v in wl.dim.items() if k not in wl.op.row_dims}
    runtime = ", ".join(wl.op.row_dims)
    return [f"# flashgen: {wl.op.name} ({wl.op.kclass}) - {wl.op.doc}",
            f"# dims: {json.dumps(fixed, sort_keys=True)} (run time: {runtime}); attrs: {json.dumps(wl.attr, sort_keys=True)}",
            f"# schedule: {json.dumps(dict(schedule), sort_keys=True)}",
            "import triton", "import triton.language as tl", "", "",
            "@triton.jit", f"def {name}({sig}):"]
