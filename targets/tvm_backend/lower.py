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
  buffer that is folded by halving at the end of the pass (one vector statement a step); a last pass
  makes the stores that need every reduction, and each store goes into the earliest pass that can make
  it (the row plan of flashgen/ir/row_plan.py, which the Triton backend walks too). Rows of LLM ops fit
  in L1/L2, so the repeated reads are cache hits. A value of the row that several passes need (a Let;
  a router's score, which a top-k ranks in 2k passes) is computed by the first and kept in a local row
  buffer for the others, where the row is at most KEEP_MAX_COLS long.
- Every float computes in fp32. bf16 tensors are `uint16` buffers converted by hand (shift to load;
  round to nearest even, NaN kept, to store) because TVM's own bf16 legalization miscompiles values
  bound by `T.let` (it converts the integer bits as numbers). "rint" is `T.round`, which TVM lowers to
  llvm.nearbyint: half to even, vectorized (vroundps/vrndscaleps on x86). exp (and sigmoid through it)
  is expanded inline into a polynomial that vectorizes; LLVM would call libm's scalar expf per lane.
- Named values in a column loop are `T.let` bindings, never plain assignments: in TIRX `x = e` declares
  a mutable local scalar, which the vectorizer turns into garbage; integers there are written inline
  (`_Gen.temp`). A row's own values (reductions' results and what is computed from them) are elements
  of local buffers (`_Slots`), computed where first needed. With the partial results folded in vector
  statements and values kept for later passes, the build's time grows with the kernel's size, not
  faster: a top-8 router over 128 experts builds in about 2.5 s, not 8-26 s. A masked load reads a
  clamped (always valid) address and selects 0 where the mask is false, so it stays vectorizable.
  TVM's vectorizer cannot scalarize a loop that holds `T.let`s (the build fails with "variables ...
  are used, but are not passed in as API arguments"), and it scalarizes for an `if` on a lane-varying
  condition and for some calls (see UNARY); such column loops are emitted serial.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from flashgen.ir import dtypes
from flashgen.ir import expr as E
from flashgen.ir.op import Let, Reduce, Stmt, Store, depends_on_cols, eval_int, refs
from flashgen.ir.row_plan import RowLevel, RowPlan, row_plan
from flashgen.workload import Schedule, Workload, domain

PARALLEL_MIN_ELEMENTS = 1 << 16  # smaller domains run serially (a parallel launch costs ~5 us)
KEEP_MAX_COLS = 4096  # rows up to this long keep a value later passes need (a local row of it: 16 KiB)
KEEP_CALLS = ("exp", "sigmoid", "log", "tanh", "erf", "sin", "cos")  # functions of tens of instructions a lane
KEEP_DTYPE = {"f32": "float32", "i32": "int32", "i64": "int64"}  # kinds of value kept (booleans: recomputed)
# Names the generated function uses for itself; tensors or params that collide are renamed.
RESERVED = {"T", "r", "rb", "ri", "c0", "ci", "row_f32", "row_i32", "row_i64", "row_u32"}
SLOTS = {"f32": ("row_f32", "float32"), "i32": ("row_i32", "int32"), "i64": ("row_i64", "int64"),
         "u32": ("row_u32", "uint32")}  # a value kind's buffer of row values (`_Slots`) and its type
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
class _Slots:
    """Where a row's own values live: one element each of a buffer per type (`SLOTS`), written once a
    row. A `T.let` is in scope to the end of its block, so a row-level one would be in scope for every
    later pass, and TVM's passes (its simplifiers, CSE, HoistIfThenElse) take time in the bindings in
    scope at each statement: a top-8 sigmoid router's 24 passes took 9 s of them with row lets, 3.7 s
    with slots. LLVM keeps the elements in registers (`_stack_buffer`)."""
    used: dict[str, int] = field(default_factory=dict)

    def take(self, kind: str) -> str:
        n = self.used.get(kind, 0)
        self.used[kind] = n + 1
        return f"{SLOTS[kind][0]}[{n}]"

    def allocs(self) -> list[str]:
        return [_stack_buffer(SLOTS[kind][0], n, SLOTS[kind][1], "row values")
                for kind, n in self.used.items()]


@dataclass
class _Scope:
    """Values visible at one nesting level (the CSE cache) and the lines being written; `slots` where
    the level is a row's (its values go into slots, not T.lets), `column` inside a column loop."""
    lines: list[str]
    indent: str
    cache: dict = field(default_factory=dict)
    slots: _Slots | None = None
    column: bool = False

    def child(self, indent: str) -> "_Scope":
        return _Scope(self.lines, indent, dict(self.cache), self.slots, self.column)

    def columns(self, indent: str) -> "_Scope":
        """The level of a loop over the row's columns."""
        return _Scope(self.lines, indent, dict(self.cache), None, True)

    def add(self, line: str) -> None:
        self.lines.append(self.indent + line)


def _float(v: float) -> str:
    if math.isnan(v):
        return 'T.float32("nan")'
    if math.isinf(v):
        return 'T.float32("inf")' if v > 0 else 'T.float32("-inf")'
    return f"T.float32({float(v)!r})"


def _stack_buffer(name: str, n: int, dtype: str, note: str) -> str:
    """A task's buffer of `n` elements in the "global" scope: TVM places one under 1 KiB on the stack,
    where LLVM keeps elements read at constant indices in registers, and takes a larger one from its
    workspace. (A T.alloc_local buffer, of the "local" scope, is a workspace allocation of any size:
    two calls a task, and memory that LLVM cannot promote to registers.)"""
    return f'{name} = T.alloc_buffer(({n},), "{dtype}", scope="global")  # {note}'


def _lanes(start: int, width: int) -> str:
    """The index of `width` consecutive elements from `start`: a statement on a vector of them is
    what a T.vectorized loop of one statement becomes, without the loop (TVM's FlattenBuffer takes
    time in the count of loops before each access: 24 reductions' loops were 0.4 s of it)."""
    return f"T.Ramp({start}, 1, {width})" if width > 1 else str(start)


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
        self.kept: dict[str, tuple[str, int]] = {}  # Let name -> (its row buffer, the pass computing it)

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
        """Bind `code` to a new T.let name, or at row level to a slot (`_Slots`). Booleans stay inline
        (a T.let of a bool fails to vectorize: "IntImm can only take scalar, but boolx32 was
        supplied"), and so do integers in a column loop: TVM's CompactBufferAllocation keeps every
        integer T.let of the function in a map that it copies at each buffer access after it, so their
        count times the accesses' (a top-8 moe_route: 172 lets, 4.8 s of that pass against 0.15 s
        inline); LLVM computes a repeated integer once all the same."""
        if kind == "bool" or scope.column and kind in ("i32", "i64"):
            return code if code.startswith("(") else f"({code})"
        if scope.slots is not None:
            slot = scope.slots.take(kind)
            scope.add(f"{slot} = {code}")
            return slot
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

    def hoist(self, e: E.Expr | None, scope: _Scope, npass: int) -> None:
        """Emit the row-level parts (those that do not vary along the row) of `e` at row scope, for
        pass `npass` (a Let an earlier pass kept is loaded whole: none of its parts is needed)."""
        if e is None or isinstance(e, (E.Const, E.Dim, E.Param, E.Index)):
            return
        if isinstance(e, E.Ref) and e.name in self.kept and self.kept[e.name][1] < npass:
            return
        if not self.is_vector(e):
            if not (isinstance(e, E.Ref) and e.name in self.red_vars):
                self.emit(e, scope)
            return
        if isinstance(e, E.Ref):
            self.hoist(self.lets.get(e.name), scope, npass)
            return
        for ch in E.children(e):
            self.hoist(ch, scope, npass)

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

    def column_pass(self, scope: _Scope, npass: int, stores: tuple[Store, ...], red: Reduce | None,
                    acc: str | None) -> None:
        """Walk `npass` over the row: full tiles of block_c, then the ragged end, both vectorized. It
        stores the kept Lets (`keep`) it is the first to compute and loads those of earlier passes."""
        bc, cols = self.bc, self.cols
        full, tail = divmod(cols, bc)
        for st in stores:
            for e in (st.value, st.mask, *st.indices):
                self.hoist(e, scope, npass)
        if red is not None:
            self.hoist(red.value, scope, npass)
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
                s = s.columns(s.indent + "    ")
            s.add(f"for ci in {loop}({width}):")
            inner = s.columns(s.indent + "    ")
            inner.cache[E.Index("c")] = c = col if col == "ci" else f"({col})"
            for name, (buf, first) in self.kept.items():
                if first < npass:
                    inner.cache[E.Ref(name)] = f"{buf}[{c}]"
            for st in stores:
                self.store(st, inner)
            if red is not None:
                v = self.emit_as(red.value, inner, "f32")
                inner.add(f"{acc}[ci] = {FOLD[red.kind].format(f'{acc}[ci]', v)}")
            for name, (buf, first) in self.kept.items():
                if first == npass:
                    inner.add(f"{buf}[{c}] = {self.emit(E.Ref(name), inner)}")

    def fold(self, scope: _Scope, red: Reduce, acc: str) -> str:
        """Fold the block_c partial results of a pass by halving, one vector statement a step;
        returns the row's value."""
        width = self.bc
        while width > 2:
            width //= 2
            lo, hi = f"{acc}[{_lanes(0, width)}]", f"{acc}[{_lanes(width, width)}]"
            scope.add(f"{lo} = {FOLD[red.kind].format(lo, hi)}")
        code = FOLD[red.kind].format(f"{acc}[0]", f"{acc}[1]") if width == 2 else f"{acc}[0]"
        return self.temp(scope, code, "f32")

    def row_level(self, step: RowLevel, scope: _Scope) -> None:
        """A step's row-level stores, at row scope between the passes. Its Lets are computed where a
        store or pass first needs them (`emit`), as TVM placed them when they were T.lets (it
        substitutes a let's value into its uses) and cannot now that they are slots it does not see
        through: a top-k's k weights then compute together at its end, where LLVM vectorizes them,
        not one between each two passes (10% of a top-8 router's time over 60 experts)."""
        for st in step.stores:
            self.store(st, scope)

    def keep(self, plan: RowPlan) -> dict[str, int]:
        """The column-varying Lets that more than one pass needs, each with the first pass needing it,
        which stores its row in a local buffer for the later ones to load. Computed again in every
        pass, a value would be as many copies of its code (a top-8 sigmoid router's score: 24, each
        with its exp) for TVM and LLVM to compile and for the CPU to run; kept, later passes agree
        with the first on it by construction. A Let that two passes need is kept where it applies a
        function of KEEP_CALLS, one that more need where it is more than a tensor's element: else
        computing it again costs no more than keeping it (a row over 1 KiB is a workspace allocation
        a task). A Let needed only through a kept one is not kept."""
        if self.cols > KEEP_MAX_COLS:
            return {}
        need: dict[str, set[int]] = {name: set() for name in self.lets}
        for n, p in enumerate(plan.passes):
            values = [x for st in p.stores for x in (st.value, st.mask, *st.indices) if x is not None]
            for x in values + ([p.reduce.value] if p.reduce is not None else []):
                for name in refs(x) & need.keys():
                    need[name].add(n)
        kept: dict[str, int] = {}
        for name in reversed(self.lets):  # a Let names only Lets before it: each is done before those
            value = self.lets[name]
            element = isinstance(value, (E.Load, E.Ref))
            costly = self.calls(value, KEEP_CALLS) or len(need[name]) > 2 and not element
            if len(need[name]) > 1 and costly and self.is_vector(value) and self.kind(value) in KEEP_DTYPE:
                kept[name] = min(need[name])
            for inner in refs(value) & need.keys():
                need[inner] |= {kept[name]} if name in kept else need[name]
        return kept

    def row(self, scope: _Scope, accs: dict[str, str]) -> None:
        """The body for one row r: the row plan's passes over its columns (flashgen/ir/row_plan.py),
        row-level values and stores between them."""
        plan = row_plan(self.body)
        self.kept = {name: (f"kept{i}", first) for i, (name, first) in enumerate(self.keep(plan).items())}
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
                init = f"T.Broadcast({IDENTITY[red.kind]}, {self.bc})" if self.bc > 1 else IDENTITY[red.kind]
                scope.add(f"{acc}[{_lanes(0, self.bc)}] = {init}")
            self.column_pass(scope, n, p.stores, red, acc)
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
        slots = _Slots()
        task = _Scope(task_lines, "", dict(scope.cache), slots)
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
        task_lines[:0] = slots.allocs() + [
            _stack_buffer(buf, self.cols, KEEP_DTYPE[self.kind(E.Ref(name))], f"the row of {name}")
            for name, (buf, _) in self.kept.items()]

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
