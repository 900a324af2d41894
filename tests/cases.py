"""Workload cases shared by the numerics tests (interpreter, cpu, gpu): odd shapes, every op."""
from __future__ import annotations

from flashgen.schedules.space import ScheduleSpace
from flashgen.workload import Schedule, Workload, workload

ROW_OPS = ("rmsnorm", "layernorm", "add_rmsnorm", "softmax", "silu_mul")
QUANT_OPS = ("dynamic_quant", "rmsnorm_quant")


def numerics_cases(Ms=(1, 3, 17), Ns=(1, 127, 5120, 11008), dtypes=("fp32", "fp16", "bf16"),
                   quant_out=("int8", "fp8e4m3")) -> list[Workload]:
    """Each op over the shapes; dtypes vary across shapes rather than multiply them (keeps runs short)."""
    out = []
    for i, (m, n) in enumerate((m, n) for m in Ms for n in Ns):
        dt = dtypes[i % len(dtypes)]
        for op in ROW_OPS:
            out.append(workload(op, M=m, N=n, dtype=dt))
        for op in QUANT_OPS:
            out.append(workload(op, M=m, N=n, dtype=dt, out_dtype=quant_out[i % len(quant_out)]))
    for i, (m, d, hq, hkv) in enumerate([(1, 64, 4, 1), (3, 128, 8, 2), (17, 64, 5, 5)]):
        for style in ("neox", "gptj"):
            out.append(workload("rope", M=m, Hq=hq, Hkv=hkv, D=d, L=97, style=style,
                                dtype=dtypes[i % len(dtypes)]))
    # the decoder's rope: keys and values land at M of NS cache slots, the other slots left alone
    for i, (m, d, hq, hkv, ns) in enumerate([(1, 64, 4, 1, 33), (3, 128, 8, 2, 3), (17, 64, 5, 5, 50)]):
        out.append(workload("rope_cache", M=m, Hq=hq, Hkv=hkv, D=d, L=97, NS=ns,
                            style=("neox", "gptj")[i % 2], dtype=dtypes[(i + 1) % len(dtypes)]))
    # partial rotary: Phi-2 (D=80, R=32), GPT-J (D=256, R=64, gptj), GPT-NeoX (D=128, R=32)
    for i, (m, d, rd, hq, hkv, style) in enumerate([(3, 80, 32, 4, 2, "neox"), (1, 256, 64, 2, 2, "gptj"),
                                                    (5, 128, 32, 3, 1, "neox"), (6, 64, 64, 2, 1, "gptj")]):
        out.append(workload("rope_partial", M=m, Hq=hq, Hkv=hkv, D=d, R=rd, L=61, style=style,
                            dtype=dtypes[i % len(dtypes)]))
    for i, (m, d, rd, ns, style) in enumerate([(3, 80, 32, 7, "neox"), (4, 64, 16, 4, "gptj")]):
        out.append(workload("rope_cache_partial", M=m, Hq=4, Hkv=2, D=d, R=rd, L=61, NS=ns, style=style,
                            dtype=dtypes[(i + 1) % len(dtypes)]))
    # MoE routing: E=8 (Mixtral), 60 (Qwen1.5-MoE), 128 (Qwen3-MoE); bf16 logits tie often (lowest index wins)
    for i, (m, e) in enumerate((m, e) for m in Ms for e in (8, 60, 128)):
        for topk in ("2", "8"):
            out.append(workload("moe_route", M=m, E=e, topk=topk, renorm=("yes", "no")[(i + int(topk)) % 2],
                                dtype=dtypes[i % len(dtypes)]))
        # DeepSeek-V3's scoring: sigmoid plus a bias that steers the choice
        out.append(workload("moe_route", M=m, E=e, topk=("8", "6")[i % 2], scoring="sigmoid_bias",
                            renorm=("yes", "no")[i % 2], dtype=dtypes[(i + 1) % len(dtypes)]))
    return out


def case_id(wl: Workload) -> str:
    return str(wl).replace(" ", ",")


# The int4 ops of a decoder linear whose K is no multiple of 128 (SmolLM2's hidden size, 576 = 4.5 x 128),
# with the groups the decoder gives it (runtime/decoder/quant_modes.py `_group`).
INT4_K576_OPS = (("gemm_w4a16", {}), ("gemm_w4a16", {"zp": "asym"}), ("gemm_w4a8", {"pack": "k128"}),
                 ("gemm_w4a8", {"pack": "lanes"}), ("rmsnorm_gemm_w4a16", {}), ("silu_mul_gemm_w4a16", {}))


def form_schedules(space: ScheduleSpace) -> dict[str, Schedule]:
    """One valid schedule of each generator form `space` offers: its default moved to the form, else
    (where that breaks a rule) the form's first valid point."""
    out = {}
    for form in space.forms():
        s = space.with_knob(space.default(), "variant", form)
        out[form] = s if space.is_valid(s) else next(p for p in space if p["variant"] == form)
    return out
