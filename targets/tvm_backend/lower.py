"""Lower the operator IR to TVMScript (TIR) for the CPU.

The generated text is plain TVMScript, readable and parseable as is:

- Every tensor is a `T.match_buffer`; dims in the op's `row_dims` (the token count M) are symbolic
  `T.int64()` variables that TVM binds from the tensors' shapes at each call, every other dim is a
  constant. Params are fp32 scalar arguments.
- Rows run in parallel: `T.parallel` over tasks of `block_r` rows (TVM's runtime splits the tasks evenly
  among its threads). A row is walked in column tiles of `block_c` elements, each an `T.vectorized`
  loop (LLVM splits a wide tile into several registers, so a tile of 64 fp32 is 4 AVX-512 or 8 AVX2
  operations); a ragged end is one more, narrower vectorized loop, so no lane is ever masked.
- A rowwise op walks the row once per reduction, each pass keeping `block_c` partial results in a local
  buffer that is folded by halving at the end of the pass; a last pass makes the stores that need every
  reduction, and each store goes into the earliest pass that can make it (the row plan of
  flashgen/ir/row_plan.py, which the Triton backend walks too). Rows of LLM ops fit in L1/L2, so the
  repeated reads are cache hits.
- Every float computes in fp32. bf16 tensors are `uint16` buffers converted by hand (shift to load;
  round to nearest even, NaN kept, to store) because TVM's own bf16 legalization miscompiles values
  bound by `T.let` (it converts the integer bits as numbers). "rint" is `T.round`, which TVM lowers to
  llvm.nearbyint: half to even, vectorized (vroundps/vrndscaleps on x86). exp (and sigmoid through it)
  is expanded inline into a polynomial that vectorizes; LLVM would call libm's scalar expf per lane.
- Named values are `T.let` bindings, never plain assignments: in TIRX `x = e` declares a mutable local
  scalar, which the vectorizer turns into garbage. A masked load reads a clamped (always valid) address
  and selects 0 where the mask is false, so it stays vectorizable. TVM's vectorizer cannot scalarize a
  loop that holds `T.let`s (the build fails with "variables ... are used, but are not passed in as API
  arguments"), and it scalarizes for an `if` on a lane-varying condition and for some calls (see
  UNARY); such column loops are emitted serial.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from flashgen.ir import dtypes
from flashgen.ir import expr as E
from flashgen.ir.op import Let, Reduce, Stmt, Store, depends_on_cols, eval_int
from flashgen.ir.row_plan import RowLevel, row_plan
from flashgen.workload import Schedule, Workload, domain

PARALLEL_MIN_ELEMENTS = 1 << 16  # smaller domains run serially (a parallel launch costs ~5 us)
# Names the generated function uses for itself; tensors or params that collide are renamed.
RESERVED = {"T", "r", "rb", "ri", "c", "c0", "ci"}
# Only calls TVM can vectorize: T.rsqrt, T.nearbyint, T.copysign, T.isnan and T.erf make its vectorizer
# scalarize the loop, which breaks the loop's T.let bindings. T.round lowers to llvm.nearbyint (half to
# even); the fp32 magic-number trick (x + 1.5*2**23) - 1.5*2**23 is simplified away by TVM.
UNARY = {"exp": "T.exp({})", "log": "T.log({})", "sqrt": "T.sqrt({})", "rsqrt": "(T.float32(1.0) / T.sqrt({}))",
         "abs": "T.fabs({})", "sigmoid": "T.sigmoid({})", "tanh": "T.tanh({})", "erf": "T.erf({})",
         "rint": "T.round({})", "cos": "T.cos({})", "sin": "T.sin({})", "neg": "(-{})"}
SCALAR_ONLY = ("erf",)  # a column loop computing one of these runs serially
BINARY = {"add": "({} + {})", "sub": "({} - {})", "mul": "({} * {})", "div": "({} / {})",
          "floordiv": "T.floordiv({}, {})", "mod": "T.floormod({}, {})", "max": "T.max({}, {})",
          "min": "T.min({}, {})", "lt": "({} < {})", "le": "({} <= {})", "gt": "({} > {})",
          "ge": "({} >= {})", "eq": "({} == {})", "shr": "({} >> {})", "and": "({} & {})"}
COMPARE = ("lt", "le", "gt", "ge", "eq")
IDENTITY = {"sum": 'T.float32(0.0)', "max": 'T.float32("-inf")', "min": 'T.float32("inf")'}
FOLD = {"sum": "{} + {}", "max": "T.max({}, {})", "min": "T.min({}, {})"}


@dataclass(frozen=True)
class TVMArg:
    """One argument of the generated function, in call order (a Triton kernel's parameter is
    targets/triton/emit.py's `Arg`)."""
    name: str          # the argument's name in the source
    kind: str          # "tensor" | "dim" | "param"
    tensor: str = ""   # for tensors: the op's tensor name
    dtype: str = ""    # flashgen dtype of a tensor ("bf16" travels as uint16 bits)

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind, "tensor": self.tensor, "dtype": self.dtype}


@dataclass
class TVMSource:
    """The TVMScript of one workload under one schedule and its arguments (a Triton or Gluon module is
    targets/triton/emit.py's `KernelSource`)."""
    name: str
    source: str        # the whole text, with a header and the import line
    script: str        # the part TVM parses (the decorated function)
    args: list[TVMArg]


@dataclass
class _Scope:
    """Values visible at one nesting level (the CSE cache) and the lines being written."""
    lines: list[str]
    indent: str
    cache: dict = field(default_factory=dict)

    def child(self, indent: str) -> "_Scope":
        return _Scope(self.lines, indent, dict(self.cache))

    def add(self, line: str) -> None:
        self.lines.append(self.indent + line)


def _float(v: float) -> str:
    if math.isnan(v):
        return 'T.float32("nan")'
    if math.isinf(v):
        return 'T.float32("inf")' if v > 0 else 'T.float32("-inf")'
    return f"T.float32({float(v)!r})"


class _Gen:
    def __init__(self, wl: Workload, schedule: Schedule):
        self.wl, self.op, self.s = wl, wl.op, schedule
        self.attrs = wl.attr
        self.body: tuple[Stmt, ...] = self.op.body(self.attrs)
        self.lets = {st.name: st.value for st in self.body if isinstance(st, Let)}
        self.reduces = [st for st in self.body if isinstance(st, Reduce)]
        self.rows, self.cols = domain(wl)
        self.br, self.bc = int(schedule["block_r"]), int(schedule["block_c"])
        if self.br < 1 or self.bc < 1 or self.bc & (self.bc - 1):
            raise ValueError(f"block_r must be >= 1 and block_c a power of two, got {schedule}")
        self.row_dims = set(self.op.row_dims)
        taken = set(RESERVED) | set(self.op.dims)
        self.buf: dict[str, str] = {}
        for t in self.wl.inputs + self.wl.outputs:  # the tensors present for the workload's attrs
            self.buf[t.name] = t.name if t.name not in taken else f"{t.name}_buf"
            taken.add(self.buf[t.name])
        self.param: dict[str, str] = {}
        for p in self.op.params:
            self.param[p] = p if p not in taken else f"{p}_param"
            taken.add(self.param[p])
        self.ntemp = 0
        self.red_vars: dict[str, str] = {}

    # ---- types -------------------------------------------------------------------------------
    def tdtype(self, tensor: str) -> str:
        return self.op.dtype_of(tensor, self.attrs)

    def kind(self, e: E.Expr) -> str:
        """"f32", "bool", "i32" or "i64" (index math: int64 once a row index or an int64 load is in)."""
        if isinstance(e, E.Const):
            return "i32" if e.is_int else "f32"
        if isinstance(e, E.Dim):
            return "i64" if e.name in self.row_dims else "i32"
        if isinstance(e, E.Param):
            return "f32"
        if isinstance(e, E.Index):
            return "i64" if e.axis == "r" else "i32"
        if isinstance(e, E.Load):
            dt = self.tdtype(e.tensor)
            return {"int32": "i32", "int64": "i64"}.get(dt, "f32")
        if isinstance(e, E.Ref):
            return self.kind(self.lets[e.name]) if e.name in self.lets else "f32"
        if isinstance(e, E.Unary):
            k = self.kind(e.x)
            return k if e.fn in ("neg", "abs") and k != "f32" else "f32"
        if isinstance(e, E.Binary):
            ka, kb = self.kind(e.a), self.kind(e.b)
            if e.op in COMPARE or (e.op == "and" and ka == kb == "bool"):  # and of two conditions: a condition
                return "bool"
            if e.op in ("floordiv", "mod") or (e.op != "div" and "f32" not in (ka, kb)):
                return "i64" if "i64" in (ka, kb) else "i32"
            return "f32"
        if isinstance(e, E.Where):
            ka, kb = self.kind(e.a), self.kind(e.b)
            if "f32" in (ka, kb):
                return "f32"
            return "i64" if "i64" in (ka, kb) else ka
        raise TypeError(f"cannot type {e!r}")

    # ---- expressions -------------------------------------------------------------------------
    def temp(self, scope: _Scope, code: str, kind: str) -> str:
        """Bind `code` to a new T.let name; booleans stay inline (a T.let of a bool fails to
        vectorize: "IntImm can only take scalar, but boolx32 was supplied")."""
        if kind == "bool":
            return code if code.startswith("(") else f"({code})"
        name = f"t{self.ntemp}"
        self.ntemp += 1
        ty = {"f32": "T.float32", "i32": "T.int32", "i64": "T.int64", "u32": "T.uint32"}[kind]
        scope.add(f"{name}: T.let[{ty}] = {code}")
        return name

    def emit_as(self, e: E.Expr, scope: _Scope, kind: str) -> str:
        """Emit `e` where a value of `kind` is wanted (integers become fp32 in float math)."""
        if kind == "f32" and self.kind(e) != "f32":
            if isinstance(e, E.Const):
                return _float(e.value)
            if isinstance(e, E.Dim) and e.name not in self.row_dims:
                return _float(self.wl.dim[e.name])
            if self.kind(e) == "bool":  # a T.let of Cast(float32, bool) fails to vectorize
                return f"T.Select({self.emit(e, scope)}, T.float32(1.0), T.float32(0.0))"
            return f'T.Cast("float32", {self.emit(e, scope)})'
        return self.emit(e, scope)

    def emit(self, e: E.Expr, scope: _Scope) -> str:
        if e in scope.cache:
            return scope.cache[e]
        if isinstance(e, E.Const):
            return str(e.value) if e.is_int else _float(e.value)
        if isinstance(e, E.Dim):
            return e.name if e.name in self.row_dims else str(self.wl.dim[e.name])
        if isinstance(e, E.Param):
            return self.param[e.name]
        if isinstance(e, E.Index):
            return e.axis
        kind = self.kind(e)
        if kind in ("i32", "i64") and self.static(e):
            return str(eval_int(e, self.wl.dim))
        if isinstance(e, E.Ref):
            if e.name in self.red_vars:
                return self.red_vars[e.name]
            v = self.emit(self.lets[e.name], scope)
        elif isinstance(e, E.Load):
            v = self.temp(scope, self.load(e, scope), kind)
        elif isinstance(e, E.Unary):
            x = self.emit_as(e.x, scope, kind)
            if e.fn == "exp":
                v = self.exp(scope, x)
            elif e.fn == "sigmoid":
                neg = self.exp(scope, self.temp(scope, f"(-{x})", "f32"))
                v = self.temp(scope, f"(T.float32(1.0) / (T.float32(1.0) + {neg}))", kind)
            elif e.fn == "abs" and kind != "f32":
                v = self.temp(scope, f"T.abs({x})", kind)
            else:
                v = self.temp(scope, UNARY[e.fn].format(x), kind)
        elif isinstance(e, E.Binary):
            if e.op in COMPARE:
                want = "f32" if "f32" in (self.kind(e.a), self.kind(e.b)) else None
            else:
                want = kind if kind == "f32" else None
            a = self.emit_as(e.a, scope, want) if want else self.emit(e.a, scope)
            b = self.emit_as(e.b, scope, want) if want else self.emit(e.b, scope)
            v = self.temp(scope, BINARY[e.op].format(a, b), kind)
        elif isinstance(e, E.Where):
            want = kind if kind == "f32" else None
            a = self.emit_as(e.a, scope, want) if want else self.emit(e.a, scope)
            b = self.emit_as(e.b, scope, want) if want else self.emit(e.b, scope)
            v = self.temp(scope, f"T.Select({self.emit(e.cond, scope)}, {a}, {b})", kind)
        else:
            raise TypeError(f"cannot emit {e!r}")
        scope.cache[e] = v
        return v

    def exp(self, scope: _Scope, x: str) -> str:
        """exp(x) in lines that vectorize (LLVM calls libm's scalar expf for each lane of T.exp):
        2**n * p(f) with n = round(x / ln2), f = x - n * ln2 in two parts (Cody-Waite), p Cephes'
        degree-7 polynomial (about 1 ulp); below -87.3 the result flushes to 0, NaN stays NaN."""
        scope.add(f"# exp({x}) = 2**n * p(f), n = round({x} / ln2)")
        xc = self.temp(scope, f"T.min(T.max({x}, T.float32(-87.33654)), T.float32(88.72284))", "f32")
        n = self.temp(scope, f"T.min(T.round({xc} * T.float32(1.4426950408889634)), T.float32(127.0))", "f32")
        f = self.temp(scope, f"{xc} - {n} * T.float32(0.693359375)", "f32")
        f = self.temp(scope, f"{f} + {n} * T.float32(2.12194440e-4)", "f32")
        p = f"T.float32(1.9875691500e-4) * {f} + T.float32(1.3981999507e-3)"
        for coef in ("8.3334519073e-3", "4.1665795894e-2", "1.6666665459e-1", "5.0000001201e-1"):
            p = f"({p}) * {f} + T.float32({coef})"
        p = self.temp(scope, f"({p}) * {f} * {f} + {f} + T.float32(1.0)", "f32")
        two_n = f'T.reinterpret("float32", T.shift_left(T.Cast("int32", {n}) + 127, 23))'
        bits = f'T.bitwise_and(T.reinterpret("uint32", {x}), T.uint32(0x7FFFFFFF))'
        return self.temp(scope, f"T.Select({bits} > T.uint32(0x7F800000), {x}, T.Select({x} < T.float32(-87.33654), "
                                f"T.float32(0.0), T.Select({x} > T.float32(88.72284), T.float32(\"inf\"), {p} * {two_n})))",
                         "f32")

    def calls(self, e: E.Expr, fns: tuple[str, ...]) -> bool:
        """Whether computing `e` (through the Lets it names) applies one of the unary `fns`."""
        for n in E.walk(e):
            if isinstance(n, E.Unary) and n.fn in fns:
                return True
            if isinstance(n, E.Ref) and n.name in self.lets and self.calls(self.lets[n.name], fns):
                return True
        return False

    def static(self, e: E.Expr) -> bool:
        """Integer math of constants and baked dims only: folded while generating."""
        if isinstance(e, E.Const):
            return e.is_int
        if isinstance(e, E.Dim):
            return e.name not in self.row_dims
        if isinstance(e, E.Binary) and e.op in ("add", "sub", "mul", "floordiv", "mod", "max", "min"):
            return self.static(e.a) and self.static(e.b)
        return False

    def hoist(self, e: E.Expr | None, scope: _Scope) -> None:
        """Emit the row-level parts (those that do not vary along the row) of `e` at row scope."""
        if e is None or isinstance(e, (E.Const, E.Dim, E.Param, E.Index)):
            return
        if not self.is_vector(e):
            if not (isinstance(e, E.Ref) and e.name in self.red_vars):
                self.emit(e, scope)
            return
        if isinstance(e, E.Ref):
            self.hoist(self.lets.get(e.name), scope)
            return
        for ch in E.children(e):
            self.hoist(ch, scope)

    def element(self, tensor: str, indices: tuple[E.Expr, ...], scope: _Scope, mask: str | None) -> str:
        """`buf[i, j]`; under a mask every index that could leave the tensor is clamped to 0."""
        idx = []
        for ix in indices:
            v = self.emit(ix, scope)
            if mask is not None and not isinstance(ix, (E.Const, E.Index)):
                v = f"T.Select({mask}, {v}, {'T.int64(0)' if self.kind(ix) == 'i64' else 0})"
            idx.append(v)
        return f"{self.buf[tensor]}[{', '.join(idx)}]"

    def load(self, e: E.Load, scope: _Scope) -> str:
        mask = self.emit(e.mask, scope) if e.mask is not None else None
        code = self.element(e.tensor, e.indices, scope, mask)
        dt = self.tdtype(e.tensor)
        if dt == "bf16":
            code = f'T.reinterpret("float32", T.shift_left(T.Cast("uint32", {code}), T.uint32(16)))'
        elif dt == "fp16" or self.kind(e) == "f32" and not dtypes.is_float(dt):  # int8 codes compute in fp32
            code = f'T.Cast("float32", {code})'
        elif dt != "fp32" and dtypes.is_float(dt):
            raise NotImplementedError(f"the cpu target does not read {dt} tensors")
        if mask is not None:
            zero = "T.float32(0.0)" if dtypes.is_float(dt) else f'T.{dtypes.TVM[dt]}(0)'
            code = f"T.Select({mask}, {code}, {zero})"
        return code

    # ---- statements --------------------------------------------------------------------------
    def store(self, st: Store, scope: _Scope) -> None:
        dt = self.tdtype(st.tensor)
        want = "f32" if dtypes.is_float(dt) else self.kind(st.value)
        v = self.emit_as(st.value, scope, want)
        inner = scope
        if st.mask is not None:
            scope.add(f"if {self.emit(st.mask, scope)}:")
            inner = scope.child(scope.indent + "    ")
        dst = self.element(st.tensor, st.indices, inner, None)
        if dt == "fp32":
            inner.add(f"{dst} = {v}")
        elif dt == "fp16":
            inner.add(f'{dst} = T.Cast("float16", {v})')
        elif dt == "bf16":  # round to nearest even on the bits; NaN stays a (quiet) NaN
            bits = self.temp(inner, f'T.reinterpret("uint32", {v})', "u32")
            nan = f"T.bitwise_and({bits}, T.uint32(0x7FFFFFFF)) > T.uint32(0x7F800000)"
            inner.add(f'{dst} = T.Cast("uint16", T.Select({nan}, T.uint32(0x7FC0), T.shift_right('
                      f'{bits} + T.uint32(0x7FFF) + T.bitwise_and(T.shift_right({bits}, T.uint32(16)), '
                      f'T.uint32(1)), T.uint32(16))))')
        elif dt in dtypes.TVM:
            inner.add(f'{dst} = T.Cast("{dtypes.TVM[dt]}", {v})')
        else:
            raise NotImplementedError(f"the cpu target does not write {dt} tensors")

    def is_vector(self, e: E.Expr | None) -> bool:
        """Whether a value varies along the row (emitted in the column loops, not hoisted)."""
        return e is not None and depends_on_cols(e, self.lets)

    def column_pass(self, scope: _Scope, stores: tuple[Store, ...], red: Reduce | None, acc: str | None) -> None:
        """One walk over the row: full tiles of block_c, then the ragged end, both vectorized."""
        bc, cols = self.bc, self.cols
        full, tail = divmod(cols, bc)
        for st in stores:
            for e in (st.value, st.mask, *st.indices):
                self.hoist(e, scope)
        if red is not None:
            self.hoist(red.value, scope)
        values = [st.value for st in stores] + ([red.value] if red is not None else [])
        serial = any(st.mask is not None for st in stores) or any(
            self.calls(v, SCALAR_ONLY) for v in values)
        loop = "T.serial" if serial else "T.vectorized"
        pieces = []
        if full == 1:
            pieces.append((None, bc, "ci"))
        elif full > 1:
            pieces.append((full, bc, f"c0 * {bc} + ci"))
        if tail:
            pieces.append((None, tail, f"{full * bc} + ci" if full else "ci"))
        for tiles, width, col in pieces:
            s = scope
            if tiles is not None:
                s.add(f"for c0 in T.serial({tiles}):")
                s = s.child(s.indent + "    ")
            s.add(f"for ci in {loop}({width}):")
            inner = s.child(s.indent + "    ")
            inner.add(f"c: T.let[T.int32] = {col}")
            for st in stores:
                self.store(st, inner)
            if red is not None:
                v = self.emit_as(red.value, inner, "f32")
                inner.add(f"{acc}[ci] = {FOLD[red.kind].format(f'{acc}[ci]', v)}")

    def fold(self, scope: _Scope, red: Reduce, acc: str) -> str:
        """Fold the block_c partial results of a pass by halving; returns the row's value."""
        width = self.bc
        while width > 2:
            width //= 2
            scope.add(f"for ci in T.vectorized({width}):")
            scope.add(f"    {acc}[ci] = {FOLD[red.kind].format(f'{acc}[ci]', f'{acc}[ci + {width}]')}")
        code = FOLD[red.kind].format(f"{acc}[0]", f"{acc}[1]") if width == 2 else f"{acc}[0]"
        return self.temp(scope, code, "f32")

    def row_level(self, step: RowLevel, scope: _Scope) -> None:
        """Row-level values and stores, at row scope between the passes."""
        for name in step.lets:
            self.emit(E.Ref(name), scope)
        for st in step.stores:
            self.store(st, scope)

    def row(self, scope: _Scope, accs: dict[str, str]) -> None:
        """The body for one row r: the row plan's passes over its columns (flashgen/ir/row_plan.py),
        row-level values and stores between them."""
        plan = row_plan(self.body)
        self.row_level(plan.before, scope)
        for n, p in enumerate(plan.passes):
            red = p.reduce
            acc = accs[red.name] if red is not None else None
            what = [f"{red.name} = {red.kind} over the row"] if red is not None else []
            what += [f"store {s.tensor}" for s in p.stores]
            scope.add(f"# pass {n + 1}: {', '.join(what)}")
            if red is not None:
                if not self.is_vector(red.value):
                    raise NotImplementedError(f"{self.op.name}: reduction {red.name} does not vary along the row")
                scope.add(f"for ci in T.vectorized({self.bc}):")
                scope.add(f"    {acc}[ci] = {IDENTITY[red.kind]}")
            self.column_pass(scope, p.stores, red, acc)
            if red is not None:
                self.red_vars[red.name] = self.fold(scope, red, acc)
            self.row_level(p.after, scope)

    # ---- function ----------------------------------------------------------------------------
    def args(self) -> list[TVMArg]:
        op = self.op
        present = self.wl.inputs + self.wl.outputs
        out = [TVMArg(f"{self.buf[t.name]}_h", "tensor", t.name, self.tdtype(t.name)) for t in present]
        bound = {e.name for t in present for e in t.shape if isinstance(e, E.Dim)}
        out += [TVMArg(d, "dim") for d in op.row_dims if d not in bound]
        out += [TVMArg(self.param[p], "param") for p in op.params]
        return out

    def generate(self) -> TVMSource:
        op = self.op
        name = f"{op.name}_kernel"
        args = self.args()
        sig = ", ".join(f"{a.name}: " + {"tensor": "T.handle", "dim": "T.int64", "param": "T.float32"}[a.kind]
                        for a in args)
        lines = ["@T.prim_func", f"def {name}({sig}):"]
        scope = _Scope(lines, "    ")
        scope.add(f'T.func_attr({{"global_symbol": "{name}", "tir.noalias": True}})')
        explicit = {a.name for a in args if a.kind == "dim"}
        for d in op.row_dims:
            if d not in explicit:
                scope.add(f"{d} = T.int64()")
        for a in args:
            if a.kind != "tensor":
                continue
            spec = op.tensors[a.tensor]
            shape = ", ".join(d.name if isinstance(d, E.Dim) and d.name in self.row_dims
                              else str(eval_int(d, self.wl.dim)) for d in spec.shape)
            if any(not isinstance(d, E.Dim) and any(isinstance(n, E.Dim) and n.name in self.row_dims
                                                    for n in E.walk(d)) for d in spec.shape):
                raise NotImplementedError(f"{op.name}: tensor {a.tensor} has a row dim inside an expression")
            shape += "," if len(spec.shape) == 1 else ""
            tvm_dt = "uint16" if a.dtype == "bf16" else dtypes.TVM[a.dtype]
            note = "  # bf16 bits" if a.dtype == "bf16" else ""
            scope.add(f'{self.buf[a.tensor]} = T.match_buffer({a.name}, ({shape}), "{tvm_dt}"){note}')
        rows = self.emit_as(op.domain[0], scope, "i64")
        var, extent = ("r", rows) if self.br == 1 else ("rb", f"({rows} + {self.br - 1}) // {self.br}")
        task_lines: list[str] = []  # the body of one parallel task, indented relative to its loop
        task = _Scope(task_lines, "", dict(scope.cache))
        body = task
        accs = {red.name: f"acc{i}" for i, red in enumerate(self.reduces)}
        for red in self.reduces:
            task.add(f'{accs[red.name]} = T.alloc_local(({self.bc},), "float32")  # partial {red.kind}s of {red.name}')
        if self.br != 1:
            task.add(f"for ri in T.serial({self.br}):")
            guard = task.child(task.indent + "    ")
            guard.add(f"r: T.let[T.int64] = rb * {self.br} + ri")
            guard.add(f"if r < {rows}:")
            body = guard.child(guard.indent + "    ")
        self.row(body, accs)

        def loop(kind: str, indent: str) -> None:
            lines.append(f"{indent}for {var} in {kind}({extent}):")
            lines.extend(f"{indent}    {line}" for line in task_lines)

        # A parallel launch costs about 5 us even on one thread: little work runs on the calling thread.
        min_rows = -(-PARALLEL_MIN_ELEMENTS // self.cols)
        if min_rows <= 1:
            loop("T.parallel", scope.indent)
        elif not any(isinstance(n, E.Dim) and n.name in self.row_dims for n in E.walk(op.domain[0])):
            loop("T.parallel" if self.rows >= min_rows else "T.serial", scope.indent)
        else:
            scope.add(f"if {rows} < {min_rows}:  # under {PARALLEL_MIN_ELEMENTS} elements: no thread pool")
            loop("T.serial", scope.indent + "    ")
            scope.add("else:")
            loop("T.parallel", scope.indent + "    ")
        script = "\n".join(lines) + "\n"
        header = [f"# flashgen: {op.name} ({op.kclass}) - {op.doc}",
                  f"# workload: {self.wl.canonical()}",
                  f"# schedule: {json.dumps(self.s, sort_keys=True)}",
                  "from tvm.script import tirx as T", "", ""]
        return TVMSource(name, "\n".join(header) + script, script, args)


def generate(wl: Workload, schedule: Schedule) -> TVMSource:
    """The rowwise and pointwise classes' generator (flashgen/kernel_classes.py)."""
    return _Gen(wl, schedule).generate()
