"""Triton code generation for the attention class: paged decode and packed-sequence prefill.

Decode: one program per (sequence, KV head) serves every query head of that KV head's GQA group at once: the
group's queries form a [G, D] tile (G padded to the 16 rows a matrix instruction takes), so each key
and value is read from the cache once for the whole group. The program walks the sequence's context
`pages` cache blocks at a time through its block table, computes the logits with tl.dot, applies the
op's score and mask expressions (emitted from the IR), and keeps an online softmax (running max and
sum) so that the context is read exactly once. Masked-out keys, and the padded rows, never reach a max:
a fully masked tile leaves the running state unchanged. With `splits` > 1 (flash-decoding, for
batches too small to fill the GPU) each sequence's context is shared among that many programs, and
the last to finish merges their partial results in the same launch.

Prefill: one program per (block_m queries of one sequence, query head); the query tiles of all
sequences are numbered one after another (at most T / block_m + B of them, so no host-side lengths are
needed), and each program finds its sequence from the cumulative lengths (`_sequence_of_tile`). Key
tiles stop at the diagonal (causal), and the same score and mask expressions apply.

Keys and values outside a sequence (cache slots past its context, entries past its block table, the
next sequence's rows of a packed batch, padding) may hold anything, NaN and inf included: they are
masked by selection (masked loads with zeros, tl.where on what a TMA box copied), never by a zero
weight alone, since 0 x NaN is NaN.

Head dims: tile shapes must be powers of two, so a head dim D that is not one (80, 96, 112, 192) gets
tiles of D_PAD (the next power of two) columns, the columns past D read as zeros (they add nothing to
q·k, and the output's are never stored). A power-of-two D generates no D_PAD and no column mask.
"""
from __future__ import annotations

from flashgen.ir import dtypes
from flashgen.ir import expr as E
from flashgen.ir.op import Attend
from flashgen.targets.triton.emit import (Emitter, KernelSource, Scope, Scratch, grid_dependency, kernel_args,
                                          module_header)
from flashgen.workload import Schedule, Workload


LOG2E = 1.4426950408889634
CAUSAL = E.Binary("ge", E.Index("qpos"), E.Index("kpos"))  # the plain causal mask, as the ops write it
SEQ_CHUNK = 64  # sequence starts a prefill program reads at once to find its sequence


def _rescale(body: Scope, new_max: str, factor: str, finite: bool) -> None:
    """The running max `m_new`, the old terms' rescaling `alpha` and the new weights `p` of one online
    softmax step (`logit` in scope, in log2 units once multiplied by `factor`). A factor is applied
    inside the exponent's argument, where it and the max's subtraction are one FMA. `finite`: every
    logit is finite, so the running max needs no guard."""
    body.line(f"m_new = tl.maximum(m_i, {new_max})")
    m = "m_new"
    if not finite:
        body.line("m_safe = tl.where(m_new == float(\"-inf\"), 0.0, m_new)")
        m = "m_safe"
    body.line(f"alpha = tl.math.exp2(m_i - {m})")
    body.line(f"p = tl.math.exp2(logit{factor} - {m})")


def _online_softmax(body: Scope, dt: str, finite: bool = False, factor: str = "") -> None:
    """One key tile's update of the running max, sum and weighted values (`_rescale`; `v` in scope).
    The factor also scales the tile's row maxima (a positive factor keeps their order)."""
    _rescale(body, f"tl.max(logit, axis=1)[:, None]{factor}", factor, finite)
    body.line("l_i = l_i * alpha + tl.sum(p, axis=1)[:, None]")
    # The rescaled accumulator is the dot's own accumulator: no second [rows, D] fp32 tile in registers.
    body.line(f"acc = tl.dot(p.to({dt}), v, acc * alpha)")
    body.line("m_i = m_new")


def _logit(em: Emitter, att: Attend, body: Scope, dot: str, mask: str | None) -> str:
    """`logit`: the op's score expression of the scaled dot product, masked by `mask` and the op's mask
    expression. Returns the factor that puts it in log2 units (exp2 is the hardware's exponential): a
    plain score is the raw dot product, whose scale the softmax applies (`_online_softmax`)."""
    plain = att.score == E.Ref("s")
    if plain:
        score, factor = dot, f" * (scale * {LOG2E!r})"
    else:
        body.line(f"s = {dot} * scale")
        em.named["s"] = "s"
        score, factor = f"{em.emit(att.score, body)} * {LOG2E!r}", ""
    if mask is None:
        body.line(f"logit = {score}")
    else:
        seen = em.emit(att.mask, body)
        body.line(f"logit = tl.where({mask} & ({seen}), {score}, float(\"-inf\"))")
    return factor


def _scores(em: Emitter, att: Attend, body: Scope, dt: str, masked: bool = True) -> None:
    """Logits of the key tile `kt` (masked by jmask, imask and the op's mask expression unless the tile
    needs no mask), then the online-softmax update with the value tile `v`."""
    factor = _logit(em, att, body, "tl.dot(q, kt)", "jmask & imask" if masked else None)
    _online_softmax(body, dt, finite=not masked, factor=factor)


def _padding(d: int) -> dict[str, int]:
    """The D_PAD constexpr of a head dim that is not a power of two; none for one that is."""
    pad = 1 << (d - 1).bit_length()
    return {"D_PAD": pad} if pad != d else {}


def _head_cols(top: Scope, pad: bool) -> None:
    """`dd`, the tiles' head-dim columns, and with padding `dmask`, those below D."""
    top.line(f"dd = tl.arange(0, {'D_PAD' if pad else 'D'})")
    if pad:
        top.line("dmask = dd < D")


def _cols(mask: str | None, pad: bool, axis: str) -> str | None:
    """`mask` and, with padding, the head-dim mask along `axis` ("[None, :]" for columns of a row tile,
    "[:, None]" for rows of a transposed key tile)."""
    if not pad:
        return mask
    if mask is None:
        return f"dmask{axis}"
    return f"({mask}) & dmask{axis}" if " " in mask else f"{mask} & dmask{axis}"


def _load_mask(mask: str | None, pad: bool, axis: str, other: str = ", other=0") -> str:
    """The mask arguments of a tile load (none for an unmasked tile of a power-of-two D)."""
    full = _cols(mask, pad, axis)
    return "" if full is None else f", mask={full}{other}"


def generate_attention(wl: Workload, s: Schedule) -> KernelSource:
    [att] = [st for st in wl.op.body(wl.attr) if isinstance(st, Attend)]
    return (_prefill if att.kind == "prefill" else _decode)(wl, s, att)


def _prefill(wl: Workload, s: Schedule, att: Attend) -> KernelSource:
    op, attrs, dim = wl.op, wl.attr, wl.dim
    group = dim["Hq"] // dim["Hkv"]
    em = Emitter(op, attrs, {})
    name = f"{op.name}_kernel"
    padding = _padding(dim["D"])
    pad, cols = bool(padding), "D_PAD" if padding else "D"
    args = kernel_args(wl, {"BLOCK_M": s["block_m"], "BLOCK_N": s["block_n"], **padding})
    lines = module_header(wl, s, name, args)
    dt = dtypes.TL[attrs["dtype"]]
    top = Scope(lines, "    ", {})
    grid_dependency(top)
    top.line("h = tl.program_id(1)")
    top.line(f"kvh = h // {group}")
    tma = s.get("tma", 0)
    if tma:  # [T, Hkv, D] key and value tensors, one [block_n, 1, D_PAD] box per tile: zero-filled past T and D
        for t in ("k", "v"):
            top.line(f"{t}_desc = tl.make_tensor_descriptor({t}_ptr, shape=[T, Hkv, D], strides=[{t}_s0, {t}_s1, 1], "
                     f"block_shape=[BLOCK_N, 1, {cols}])")
    _sequence_of_tile(top)
    top.line("pid_m = tl.cdiv(n, BLOCK_M) - 1 - nth  # each sequence's longest (causal) tiles first")
    paged = "prefix_lens" in op.tensors
    top.line("pre = tl.load(prefix_lens_ptr + b)" if paged else "pre = 0")
    top.line("if pid_m >= 0:")
    blk = top.child(top.indent + "    ")
    blk.line("i = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]")
    blk.line("imask = i < n")
    blk.line("qpos = pre + i")
    _head_cols(blk, pad)
    blk.line(f"q = tl.load(q_ptr + (s0 + i).to(tl.int64) * q_s0 + h * q_s1 + dd[None, :]{_load_mask('imask', pad, '[None, :]')})")
    blk.line("m_i = tl.full([BLOCK_M, 1], float(\"-inf\"), tl.float32)")
    blk.line("l_i = tl.zeros([BLOCK_M, 1], tl.float32)")
    blk.line(f"acc = tl.zeros([BLOCK_M, {cols}], tl.float32)")
    blk.line("scale = 1.0 / tl.sqrt(D * 1.0)")
    axes = {"h": ("h", None), "qpos": ("qpos", "imask"), "kpos": ("kpos", "jmask")}
    if paged:  # the cached prefix: every query sees all of it (masks permitting), read through the block table
        blk.line("for p0 in range(0, pre, BLOCK_N):")
        body = blk.child(blk.indent + "    ", axes, fresh=True)
        body.line("kpos = p0 + tl.arange(0, BLOCK_N)[None, :]")
        body.line("jmask = kpos < pre")
        body.line("kc = p0 + tl.arange(0, BLOCK_N)[:, None]")
        body.line("pg_r = tl.load(block_tables_ptr + b.to(tl.int64) * block_tables_s0 + kpos // BS, mask=jmask, other=0)")
        body.line("pg_c = tl.load(block_tables_ptr + b.to(tl.int64) * block_tables_s0 + kc // BS, mask=kc < pre, other=0)")
        body.line("kt = tl.load(k_cache_ptr + pg_r.to(tl.int64) * k_cache_s0 + (kpos % BS) * k_cache_s1 + "
                  f"kvh * k_cache_s2 + dd[:, None]{_load_mask('jmask', pad, '[:, None]')})")
        body.line("v = tl.load(v_cache_ptr + pg_c.to(tl.int64) * v_cache_s0 + (kc % BS) * v_cache_s1 + "
                  f"kvh * v_cache_s2 + dd[None, :]{_load_mask('kc < pre', pad, '[None, :]')})")
        _scores(em, att, body, dt)
    if att.mask == CAUSAL:
        # Key tiles wholly before the query tile's first row need no mask: keys < n, and causal holds.
        blk.line("full = (pid_m * BLOCK_M) // BLOCK_N * BLOCK_N")
        blk.line("for n0 in range(0, full, BLOCK_N):")
        body = blk.child(blk.indent + "    ", axes, fresh=True)
        body.line("j = n0 + tl.arange(0, BLOCK_N)[None, :]")
        body.line("kpos = pre + j")
        if tma:
            _tma_tiles(body, cols)
        else:
            _packed_tiles(body, pad, None, None)
        _scores(em, att, body, dt, masked=False)
    else:
        blk.line("full = 0")
    blk.line("for n0 in range(full, tl.minimum(n, (pid_m + 1) * BLOCK_M), BLOCK_N):")
    body = blk.child(blk.indent + "    ", axes, fresh=True)
    body.line("j = n0 + tl.arange(0, BLOCK_N)[None, :]")
    body.line("jmask = j < n")
    body.line("kpos = pre + j")
    if tma:  # rows past the sequence (the next one's, or TMA's zeros) are masked out of the logits and values
        _tma_tiles(body, cols, "jc < n")
    else:
        _packed_tiles(body, pad, "jmask", "jc < n")
    _scores(em, att, body, dt)
    blk.line("out = acc / tl.where(l_i == 0.0, 1.0, l_i)")
    blk.line(f"tl.store(out_ptr + (s0 + i).to(tl.int64) * out_s0 + h * out_s1 + dd[None, :], out.to({dt}), "
             f"mask={_cols('imask', pad, '[None, :]')})")
    return KernelSource(name, em.finish(lines), args, (s["block_m"], 1), tile_cols=True, seq_tiles="B")


def _packed_tiles(body: Scope, pad: bool, kmask: str | None, vmask: str | None) -> None:
    """`kt` [D, block_n] and `v` [block_n, D] of the packed keys and values at n0, loaded under the
    key and value masks (None: the whole tile is in the sequence)."""
    body.line("jc = n0 + tl.arange(0, BLOCK_N)[:, None]")
    body.line("kt = tl.load(k_ptr + (s0 + j).to(tl.int64) * k_s0 + kvh * k_s1 + dd[:, None]"
              f"{_load_mask(kmask, pad, '[:, None]')})")
    body.line("v = tl.load(v_ptr + (s0 + jc).to(tl.int64) * v_s0 + kvh * v_s1 + dd[None, :]"
              f"{_load_mask(vmask, pad, '[None, :]')})")


def _sequence_of_tile(top: Scope, layout: str = "", tile: str = "tl.program_id(0)") -> None:
    """`b`, the sequence of query tile number `tile` (the program's own by default), and `nth`, the
    tile's place in it. Sequence b's
    tiles are numbered from cu_seqlens[b] // block_m + b on: a range at least cdiv(n, block_m) long
    (the floors of its two ends differ by at least n // block_m), so at most T // block_m + B programs
    cover every tile of any lengths, and a program finds its sequence by counting the starts at or
    before its own number, SEQ_CHUNK sequences at a time. The few programs numbered past a sequence's
    tiles do nothing. `layout`: the chunk's layout argument, where the language asks for one (Gluon)."""
    top.line(f"t = {tile}")
    top.line("b = t * 0 - 1")
    top.line(f"for b0 in range(0, B, {SEQ_CHUNK}):")
    body = top.child(top.indent + "    ")
    body.line(f"idx = b0 + tl.arange(0, {SEQ_CHUNK}{', layout=' + layout if layout else ''})")
    body.line("tile0 = tl.load(cu_seqlens_ptr + idx, mask=idx < B, other=0) // BLOCK_M + idx")
    body.line("b += tl.sum(((tile0 <= t) & (idx < B)).to(tl.int32))")
    top.line("s0 = tl.load(cu_seqlens_ptr + b)")
    top.line("n = tl.load(cu_seqlens_ptr + b + 1) - s0")
    top.line("nth = t - (s0 // BLOCK_M + b)")


def _tma_tiles(body: Scope, cols: str, vmask: str | None = None) -> None:
    """`kt` [cols, block_n] and `v` [block_n, cols] of the key tile at n0, copied by the TMA descriptors
    (`cols`: D or D_PAD, whose columns past D the copy fills with zeros). A box copies whole rows, the
    next sequence's too: value rows outside `vmask` (None: the tile is in the sequence) are replaced by
    zeros, since a zero probability times a NaN or inf value there would still be NaN."""
    body.line(f"kt = tl.trans(tl.reshape(k_desc.load([s0 + n0, kvh, 0]), [BLOCK_N, {cols}]))")
    body.line(f"v = tl.reshape(v_desc.load([s0 + n0, kvh, 0]), [BLOCK_N, {cols}])")
    if vmask is not None:
        body.line("jc = n0 + tl.arange(0, BLOCK_N)[:, None]")
        body.line(f"v = tl.where({vmask}, v, 0.0)")


def _split_scratch(g_pad: int, splits: int, d: int) -> tuple[Scratch, ...]:
    """Per (sequence, KV head, split): the unnormalised output rows and their running max and sum;
    and per (sequence, KV head) a counter of finished splits."""
    rows = lambda dims: dims["B"] * dims["Hkv"] * splits * g_pad  # noqa: E731
    return (Scratch("part_acc", "fp32", lambda dims: rows(dims) * d),
            Scratch("part_ml", "fp32", lambda dims: rows(dims) * 2),
            Scratch("done", "int32", lambda dims: dims["B"] * dims["Hkv"], zeroed=True))


def _combine(top: Scope, dt: str, fp8: bool, group: int, splits: int, d: int, num_warps: int, pad: bool) -> None:
    """Split-KV epilogue: the split that finishes last for its (sequence, KV head) merges every split's
    partial result and resets the counter, so one launch does flash-decoding with no combine kernel.
    Only the group's real rows and the splits that had keys (split * span < ctx) are stored and read:
    a context much shorter than L leaves most splits empty. The merge reads [group, splits, D] tiles
    (as many splits at a time as about 64 registers per thread hold) in one layout, so that all its loads
    are in flight together; a loop over splits with [group, 1] weights would convert layouts through
    shared memory and wait for each split's loads in turn. `d`: the tiles' (padded) head dim."""
    rows = 1 << (group - 1).bit_length()
    chunk = max(1, min(splits, 64 * 32 * num_warps // (rows * d)))
    chunk = 1 << (chunk.bit_length() - 1)
    top.line("tile = ((b * Hkv + kvh) * SPLITS + split) * G_PAD + g")
    top.line("keep = gmask & (lo < ctx)")
    top.line(f"tl.store(part_acc_ptr + tile.to(tl.int64) * D + dd[None, :], acc, mask={_cols('keep', pad, '[None, :]')})")
    top.line("tl.store(part_ml_ptr + tile * 2, m_i, mask=keep)")
    top.line("tl.store(part_ml_ptr + tile * 2 + 1, l_i, mask=keep)")
    top.line("tl.debug_barrier()")
    top.line("finished = tl.atomic_add(done_ptr + b * Hkv + kvh, 1)  # acq_rel at gpu scope")
    top.line("if finished == SPLITS - 1:")
    last = top.child(top.indent + "    ")
    last.line("tl.debug_barrier()")  # after the acquiring atomic, L2 (.cg) loads see every split's stores
    last.line(f"gi = tl.arange(0, {rows})[:, None, None]")
    last.line(f"di = tl.arange(0, {'D_PAD' if pad else 'D'})[None, None, :]")
    last.line("first = (b * Hkv + kvh) * SPLITS * G_PAD + gi")

    def split_rows(c0: int, n: int) -> None:
        last.line(f"si = {c0} + tl.arange(0, {n})[None, :, None]")
        last.line("rows3 = first + si * G_PAD")
        last.line(f"live3 = (gi < {group}) & (si * span < ctx)")
        last.line("m3 = tl.load(part_ml_ptr + rows3 * 2, mask=live3, other=float(\"-inf\"), cache_modifier=\".cg\")")

    split_rows(0, splits)
    last.line("l3 = tl.load(part_ml_ptr + rows3 * 2 + 1, mask=live3, other=0.0, cache_modifier=\".cg\")")
    last.line("m_top = tl.max(m3, axis=1, keep_dims=True)")
    last.line("m_top = tl.where(m_top == float(\"-inf\"), 0.0, m_top)")
    last.line("l_sum = tl.sum(l3 * tl.math.exp2(m3 - m_top), axis=1)")
    for c0 in range(0, splits, chunk):
        if chunk < splits:
            split_rows(c0, chunk)
        live = "live3 & (di < D)" if pad else "live3"
        part = (f"tl.sum(tl.load(part_acc_ptr + rows3.to(tl.int64) * D + di, mask={live}, other=0.0, "
                "cache_modifier=\".cg\") * tl.math.exp2(m3 - m_top), axis=1)")
        last.line(f"merged = {part}" if c0 == 0 else f"merged += {part}")
    last.line("out = merged / tl.where(l_sum == 0.0, 1.0, l_sum)" + (" * v_scale" if fp8 else ""))
    last.line(f"go = tl.arange(0, {rows})[:, None]")
    last.line(f"tl.store(out_ptr + b.to(tl.int64) * out_s0 + (kvh * {group} + go) * out_s1 + dd[None, :], out.to({dt}), "
              f"mask={_cols(f'go < {group}', pad, '[None, :]')})")
    last.line("tl.atomic_xchg(done_ptr + b * Hkv + kvh, 0)")


def _kv_tiles(body: Scope, fp8: bool, dt: str, end: str, pad: bool) -> None:
    """The key tile `kt` [D, BS * pages] and value tile `v` at `start`, through the block table: keys
    at or past `end` (and the padded head-dim columns) are masked out."""
    body.line("kpos = start + tl.arange(0, BS * PAGES)[None, :]")
    body.line(f"kmask = kpos < {end}")
    body.line("kcol = start + tl.arange(0, BS * PAGES)[:, None]")
    body.line("page_r = tl.load(block_tables_ptr + b.to(tl.int64) * block_tables_s0 + kpos // BS, mask=kmask, other=0)")
    body.line(f"page_c = tl.load(block_tables_ptr + b.to(tl.int64) * block_tables_s0 + kcol // BS, mask=kcol < {end}, other=0)")
    other = "" if fp8 else ", other=0"  # Triton has no fp8 literal: fp8 lanes are zeroed after conversion
    kmask, vmask = _cols("kmask", pad, "[:, None]"), _cols(f"kcol < {end}", pad, "[None, :]")
    body.line("kt = tl.load(k_cache_ptr + page_r.to(tl.int64) * k_cache_s0 + (kpos % BS) * k_cache_s1 + "
              f"kvh * k_cache_s2 + dd[:, None], mask={kmask}{other})")
    body.line("v = tl.load(v_cache_ptr + page_c.to(tl.int64) * v_cache_s0 + (kcol % BS) * v_cache_s1 + "
              f"kvh * v_cache_s2 + dd[None, :], mask={vmask}{other})")
    if fp8:
        body.line(f"kt = tl.where({kmask}, kt.to({dt}), 0.0).to({dt})")
        body.line(f"v = tl.where({vmask}, v.to({dt}), 0.0).to({dt})")


def _newest_key(top: Scope, fp8: bool, pad: bool) -> None:
    """With `early_kv`: the key and value at the query's own position (which the kernel before this one
    may have just written) read after the wait, and their column added to the online softmax by the
    split whose range holds it. A single column needs no matrix instruction: the score is a sum of
    products over D."""
    top.line("own = (lo <= qpos) & (qpos < hi)")
    other = "" if fp8 else ", other=0"
    mask = _cols("own", pad, "[None, :]")
    for t in ("k", "v"):
        top.line(f"{t}n = tl.load({t}_cache_ptr + page_n.to(tl.int64) * {t}_cache_s0 + (qpos % BS) * {t}_cache_s1 + "
                 f"kvh * {t}_cache_s2 + dd[None, :], mask={mask}{other}).to(tl.float32)")
        if fp8:
            top.line(f"{t}n = tl.where({mask}, {t}n, 0.0)")


def _newest_column(em: Emitter, att: Attend, top: Scope, fp8: bool) -> None:
    """The newest key's column of the online softmax (`_newest_key`), after every other key."""
    scope = top.child(top.indent, {"h": ("h", "gmask"), "qpos": ("qpos", None), "kpos": ("qpos", "own")}, fresh=True)
    dot = "tl.sum(q.to(tl.float32) * kn, axis=1)[:, None]" + (" * k_scale" if fp8 else "")
    factor = _logit(em, att, scope, dot, "own & gmask")
    _rescale(scope, f"logit{factor}", factor, finite=False)
    scope.line("l_i = l_i * alpha + p")
    scope.line("acc = acc * alpha + p * vn")
    scope.line("m_i = m_new")


def _decode(wl: Workload, s: Schedule, att: Attend) -> KernelSource:
    """With `early_kv` (targets with programmatic dependent launch), the keys before each query's own
    position are read without waiting for the previous kernel: the first loop step's block-table
    entries and key/value tiles load before the wait, the query and the newest key after it. This holds
    where the kernel launched just before writes no cache position but the query's own (a decode step's
    `rope_cache` writes exactly that one), and every earlier kernel has finished by then (each waits
    for its own predecessor before the next may launch)."""
    op, attrs, dim = wl.op, wl.attr, wl.dim
    group = dim["Hq"] // dim["Hkv"]
    g_pad = max(16, 1 << (group - 1).bit_length())
    splits = s["splits"]
    early = s.get("early_kv", 0)
    scratch = _split_scratch(g_pad, splits, dim["D"]) if splits > 1 else ()
    padding = _padding(dim["D"])
    pad, cols = bool(padding), "D_PAD" if padding else "D"
    em = Emitter(op, attrs, {})
    name = f"{op.name}_kernel"
    args = kernel_args(wl, {"G_PAD": g_pad, "PAGES": s["pages"], "SPLITS": splits, **padding}, scratch)
    lines = module_header(wl, s, name, args)
    top = Scope(lines, "    ", {"h": ("h", "gmask"), "qpos": ("qpos", None)})
    if not early:
        grid_dependency(top)
    dt = dtypes.TL[attrs["dtype"]]
    fp8 = op.dtype_of("k_cache", attrs) in dtypes.FP8
    q_load = f"q = tl.load(q_ptr + b.to(tl.int64) * q_s0 + h * q_s1 + dd[None, :]{_load_mask('gmask', pad, '[None, :]')})"
    top.line("b = tl.program_id(0)")
    top.line("kvh = tl.program_id(1)")
    top.line("g = tl.arange(0, G_PAD)[:, None]")
    top.line(f"gmask = g < {group}")
    top.line(f"h = kvh * {group} + g")
    _head_cols(top, pad)
    if not early:
        top.line(q_load)
    top.line("ctx = tl.load(context_lens_ptr + b)")
    top.line("qpos = ctx - 1")
    top.line("m_i = tl.full([G_PAD, 1], float(\"-inf\"), tl.float32)")
    top.line("l_i = tl.zeros([G_PAD, 1], tl.float32)")
    top.line(f"acc = tl.zeros([G_PAD, {cols}], tl.float32)")
    top.line("scale = 1.0 / tl.sqrt(D * 1.0)")
    if splits > 1:  # this program's share of the context: whole loop steps, the last share shorter
        top.line("split = tl.program_id(2)")
        top.line("span = tl.cdiv(tl.cdiv(ctx, SPLITS), BS * PAGES) * BS * PAGES")
        top.line("lo = split * span")
        top.line("hi = tl.minimum(ctx, lo + span)")
    else:
        top.line("lo = 0")
        top.line("hi = ctx")
    axes = {"h": ("h", "gmask"), "qpos": ("qpos", None), "kpos": ("kpos", "kmask")}
    end, first = "hi", "lo"
    if early:  # the first step's tiles before the wait; the newest key (at qpos) after it
        top.line("last = tl.minimum(hi, qpos)  # keys before the query's own: written by earlier steps")
        top.line("page_n = tl.load(block_tables_ptr + b.to(tl.int64) * block_tables_s0 + tl.maximum(qpos, 0) // BS)")
        end, first = "last", "lo + BS * PAGES"
        step = top.child(top.indent, axes, fresh=True)
        step.line("start = lo")
        _kv_tiles(step, fp8, dt, end, pad)
        grid_dependency(top)
        top.line(q_load)
        _newest_key(top, fp8, pad)
        factor = _logit(em, att, step, "tl.dot(q, kt)" + (" * k_scale" if fp8 else ""), "kmask & gmask")
        _online_softmax(step, dt, factor=factor)
    top.line(f"for start in range({first}, {end}, BS * PAGES):")
    body = top.child(top.indent + "    ", axes, fresh=True)
    _kv_tiles(body, fp8, dt, end, pad)
    factor = _logit(em, att, body, "tl.dot(q, kt)" + (" * k_scale" if fp8 else ""), "kmask & gmask")
    _online_softmax(body, dt, factor=factor)
    if early:
        _newest_column(em, att, top, fp8)
    if splits > 1:
        _combine(top, dt, fp8, group, splits, padding.get("D_PAD", dim["D"]), s["num_warps"], pad)
    else:
        top.line("out = acc / tl.where(l_i == 0.0, 1.0, l_i)" + (" * v_scale" if fp8 else ""))
        top.line(f"tl.store(out_ptr + b.to(tl.int64) * out_s0 + h * out_s1 + dd[None, :], out.to({dt}), "
                 f"mask={_cols('gmask', pad, '[None, :]')})")
    return KernelSource(name, em.finish(lines), args, (1, 1), tile_cols=True, grid_z=splits,
                        scratch=scratch)
