"""Triton code generation for the rowwise and pointwise kernel classes.

The generated module is plain, readable Triton: one program per tile of `block_r` rows x `block_c`
columns of the op's domain; every float computes in fp32 and is cast where it is stored. A rowwise op
whose row fits one tile reads it once; a longer row is walked in tiles, one pass per reduction and a
last pass for the stores that need every reduction, each store placed in the earliest pass that can
make it. Dims other than the row count are compile-time constants, so tails and masks fold away when a
tile divides the row.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from flashgen.ir import dtypes
from flashgen.ir import expr as E
from flashgen.ir.op import Let, Reduce, Stmt, Store, depends_on_cols, refs
from flashgen.schedules.space import Schedule, domain
from flashgen.workload import Workload

RINT_MAGIC = 12582912.0  # 1.5 * 2**23: (x + m) - m rounds an fp32 |x| < 2**22 half-to-even, on any backend
UNARY = {"exp": "tl.exp({})", "log": "tl.log({})", "sqrt": "tl.sqrt({})", "rsqrt": "tl.rsqrt({})",
         "abs": "tl.abs({})", "sigmoid": "tl.sigmoid({})", "erf": "tl.erf({})", "cos": "tl.cos({})",
         "sin": "tl.sin({})", "neg": "(-{})", "tanh": "(2.0 * tl.sigmoid(2.0 * {}) - 1.0)",
         "rint": f"(({{}} + {RINT_MAGIC}) - {RINT_MAGIC})"}
IDENTITY = {"sum": "0.0", "max": 'float("-inf")'}
BINARY = {"add": "({} + {})", "sub": "({} - {})", "mul": "({} * {})", "div": "({} / {})",
          "floordiv": "({} // {})", "mod": "({} % {})", "max": "tl.maximum({}, {})",
          "min": "tl.minimum({}, {})", "lt": "({} < {})", "le": "({} <= {})", "gt": "({} > {})",
          "ge": "({} >= {})", "eq": "({} == {})"}


@dataclass(frozen=True)
class Arg:
    """One kernel parameter: a tensor pointer, a tensor stride, a runtime dim, a param or a constexpr."""
    name: str
    kind: str  # "ptr" | "stride" | "dim" | "param" | "constexpr"
    tensor: str = ""
    axis: int = 0
    value: int = 0


@dataclass
class KernelSource:
    name: str
    source: str
    args: list[Arg]
    grid_tiles: tuple[int, int]  # (block_r, block_c): tiles of the domain; pointwise tiles columns too
    pointwise: bool


@dataclass
class _Scope:
    """Emitted values visible at one nesting level (CSE cache) and the lines being written."""
    lines: list[str]
    indent: str
    cache: dict = field(default_factory=dict)

    def child(self, indent: str) -> "_Scope":
        return _Scope(self.lines, indent, dict(self.cache))


class _Gen:
    def __init__(self, wl: Workload, schedule: Schedule):
        self.wl, self.op, self.s = wl, wl.op, schedule
        self.attrs = wl.attr
        self.body: tuple[Stmt, ...] = self.op.body(self.attrs)
        self.lets = {st.name: st.value for st in self.body if isinstance(st, Let)}
        self.reduces = [st for st in self.body if isinstance(st, Reduce)]
        self.rows, self.cols = domain(wl)
        self.looped = self.op.kclass == "rowwise" and schedule["block_c"] < self.cols
        self.need_rmask = schedule["block_r"] > 1
        self.need_cmask = self.cols % schedule["block_c"] != 0
        self.ntemp = 0
        self.red_vars: dict[str, str] = {}

    # ---- expressions -------------------------------------------------------------------------
    def temp(self, scope: _Scope, code: str) -> str:
        name = f"t{self.ntemp}"
        self.ntemp += 1
        scope.lines.append(f"{scope.indent}{name} = {code}")
        return name

    def emit(self, e: E.Expr, scope: _Scope) -> str:
        if e in scope.cache:
            return scope.cache[e]
        if isinstance(e, E.Const):
            return repr(e.value) if e.is_int else repr(float(e.value))
        if isinstance(e, E.Dim):
            return e.name
        if isinstance(e, E.Param):
            return e.name
        if isinstance(e, E.Index):
            return e.axis
        if isinstance(e, E.Ref):
            if e.name in self.red_vars:
                return self.red_vars[e.name]
            v = self.emit(self.lets[e.name], scope)
        elif isinstance(e, E.Load):
            v = self.temp(scope, self.load(e, scope))
        elif isinstance(e, E.Unary):
            v = self.temp(scope, UNARY[e.fn].format(self.emit(e.x, scope)))
        elif isinstance(e, E.Binary):
            v = self.temp(scope, BINARY[e.op].format(self.emit(e.a, scope), self.emit(e.b, scope)))
        elif isinstance(e, E.Where):
            v = self.temp(scope, "tl.where({}, {}, {})".format(
                self.emit(e.cond, scope), self.emit(e.a, scope), self.emit(e.b, scope)))
        else:
            raise TypeError(f"cannot emit {e!r}")
        scope.cache[e] = v
        return v

    def address(self, tensor: str, indices: tuple[E.Expr, ...], scope: _Scope) -> str:
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

    def mask(self, indices: tuple[E.Expr, ...], extra: E.Expr | None, scope: _Scope) -> str | None:
        axes = {n.axis for ix in indices for n in E.walk(ix) if isinstance(n, E.Index)}
        parts = []
        if "r" in axes and self.need_rmask:
            parts.append("rmask")
        if "c" in axes and self.need_cmask:
            parts.append("cmask")
        if extra is not None:
            parts.append(self.emit(extra, scope))
        return " & ".join(parts) if parts else None

    def load(self, e: E.Load, scope: _Scope) -> str:
        addr = self.address(e.tensor, e.indices, scope)
        m = self.mask(e.indices, e.mask, scope)
        code = f"tl.load({addr}, mask={m}, other=0)" if m else f"tl.load({addr})"
        if dtypes.is_float(self.op.dtype_of(e.tensor, self.attrs)):
            code += ".to(tl.float32)"
        return code

    # ---- statements --------------------------------------------------------------------------
    def store(self, st: Store, scope: _Scope) -> None:
        v = self.emit(st.value, scope)
        addr = self.address(st.tensor, st.indices, scope)
        m = self.mask(st.indices, st.mask, scope)
        dt = dtypes.TL[self.op.dtype_of(st.tensor, self.attrs)]
        mask = f", mask={m}" if m else ""
        scope.lines.append(f"{scope.indent}tl.store({addr}, {v}.to({dt}){mask})")

    def reduce_tile(self, st: Reduce, scope: _Scope) -> str:
        v = self.emit(st.value, scope)
        if self.need_cmask:
            v = f"tl.where(cmask, {v}, {IDENTITY[st.kind]})"
        return v

    def deps(self, e: E.Expr) -> set[str]:
        """Reductions a value needs, through the Lets it names."""
        out: set[str] = set()
        for name in refs(e):
            if name in self.lets:
                out |= self.deps(self.lets[name])
            else:
                out.add(name)
        return out

    def is_vector(self, e: E.Expr) -> bool:
        return depends_on_cols(e, self.lets)

    def column_setup(self, scope: _Scope, start: str) -> None:
        scope.lines.append(f"{scope.indent}c = {start}tl.arange(0, BLOCK_C)[None, :]")
        if self.need_cmask:
            scope.lines.append(f"{scope.indent}cmask = c < {self.emit(self.op.domain[1], scope)}")

    def single_tile(self, scope: _Scope) -> None:
        start = "pid_c * BLOCK_C + " if self.op.kclass == "pointwise" else ""
        self.column_setup(scope, start)
        for st in self.body:
            if isinstance(st, Reduce):
                fn = "tl.sum" if st.kind == "sum" else "tl.max"
                v = self.temp(scope, f"{fn}({self.reduce_tile(st, scope)}, axis=1)[:, None]")
                self.red_vars[st.name] = v
            elif isinstance(st, Store):
                self.store(st, scope)

    def multi_tile(self, scope: _Scope) -> None:
        stores = [st for st in self.body if isinstance(st, Store)]
        done: set[str] = set()
        pending = list(stores)

        def ready(st: Store) -> bool:
            return self.deps(st.value) | (self.deps(st.mask) if st.mask is not None else set()) <= done

        def row_level_ready() -> None:
            for name, value in self.lets.items():
                if not self.is_vector(value) and self.deps(value) <= done:
                    self.emit(E.Ref(name), scope)
            for st in [s for s in pending if not self.is_vector(s.value) and ready(s)]:
                self.store(st, scope)
                pending.remove(st)

        for red in self.reduces + [None]:
            vec_now = [s for s in pending if self.is_vector(s.value) and ready(s)]
            if red is None and not vec_now:
                break
            acc = None
            if red is not None:
                acc = self.temp(scope, f"tl.full([BLOCK_R, BLOCK_C], {IDENTITY[red.kind]}, tl.float32)")
            scope.lines.append(f"{scope.indent}for c0 in range(0, {self.emit(self.op.domain[1], scope)}, BLOCK_C):")
            inner = scope.child(scope.indent + "    ")
            self.column_setup(inner, "c0 + ")
            for st in vec_now:
                self.store(st, inner)
                pending.remove(st)
            if red is not None:
                v = self.reduce_tile(red, inner)
                op = f"{acc} + {v}" if red.kind == "sum" else f"tl.maximum({acc}, {v})"
                inner.lines.append(f"{inner.indent}{acc} = {op}")
                fn = "tl.sum" if red.kind == "sum" else "tl.max"
                self.red_vars[red.name] = self.temp(scope, f"{fn}({acc}, axis=1)[:, None]")
                done.add(red.name)
                row_level_ready()
        assert not pending, f"stores never became ready: {pending}"

    # ---- module ------------------------------------------------------------------------------
    def args(self) -> list[Arg]:
        op = self.op
        tensors = op.inputs + op.outputs
        out = [Arg(f"{t.name}_ptr", "ptr", t.name) for t in tensors]
        out += [Arg(f"{t.name}_s{k}", "stride", t.name, k) for t in tensors for k in range(len(t.shape) - 1)]
        out += [Arg(d, "dim") for d in op.row_dims]
        out += [Arg(p, "param") for p in op.params]
        out += [Arg(d, "constexpr", value=self.wl.dim[d]) for d in op.dims if d not in op.row_dims]
        out += [Arg("BLOCK_R", "constexpr", value=self.s["block_r"]),
                Arg("BLOCK_C", "constexpr", value=self.s["block_c"])]
        return out

    def generate(self) -> KernelSource:
        name = f"{self.op.name}_kernel"
        args = self.args()
        sig = ", ".join(a.name + (": tl.constexpr" if a.kind == "constexpr" else "") for a in args)
        lines = [f"# flashgen: {self.op.name} ({self.op.kclass}) - {self.op.doc}",
                 f"# workload: {self.wl.canonical()}",
                 f"# schedule: {json.dumps(self.s, sort_keys=True)}",
                 "import triton", "import triton.language as tl", "", "",
                 "@triton.jit", f"def {name}({sig}):"]
        scope = _Scope(lines, "    ")
        lines.append("    pid_r = tl.program_id(0)")
        if self.op.kclass == "pointwise":
            lines.append("    pid_c = tl.program_id(1)")
        lines.append("    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]")
        if self.need_rmask:
            lines.append(f"    rmask = r < {self.emit(self.op.domain[0], scope)}")
        if self.looped:
            self.multi_tile(scope)
        else:
            self.single_tile(scope)
        return KernelSource(name, "\n".join(lines) + "\n", args,
                            (self.s["block_r"], self.s["block_c"]), self.op.kclass == "pointwise")


def generate(wl: Workload, schedule: Schedule) -> KernelSource:
    if wl.op.kclass not in ("rowwise", "pointwise"):
        raise NotImplementedError(f"the triton backend does not generate {wl.op.kclass} kernels yet")
    return _Gen(wl, schedule).generate()


def grid(ks: KernelSource, wl: Workload, rows: int | None = None) -> tuple[int, int, int]:
    """Programs to launch for `rows` rows of the domain (the workload's own row count by default)."""
    r, c = domain(wl)
    rows = r if rows is None else rows
    br, bc = ks.grid_tiles
    return (-(-rows // br), -(-c // bc) if ks.pointwise else 1, 1)
