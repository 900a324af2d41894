"""benchmarks/studies/decode_workloads.py and benchmarks/workloads/decode_rows.jsonl: the GEMMs a decode
step launches in each mode, read off the decoder's code (runtime/decoder/calls.py), as lines `flashgen
tune --workloads` takes."""
import dataclasses
import json
import sys
from pathlib import Path

import pytest

from flashgen.runtime.decoder.bench import CONFIGS
from flashgen.workload import read_workload_lines

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "studies"))
import decode_workloads  # noqa: E402

LLAMA = CONFIGS["llama3-8b"]
# Llama-3-8B's layer in miniature: the same head size, groups of 128 along every K
SMALL = dataclasses.replace(LLAMA, hidden_size=256, intermediate_size=384, num_heads=2, num_kv_heads=1)
W4 = {"act": "none", "dtype": "bf16", "group": "group", "out": "none", "pack": "k128", "with_bias": "no", "zp": "sym"}
DENSE = {"act": "none", "dtype": "bf16", "out": "none", "with_bias": "no"}


def _read(tmp_path, text: str) -> list[tuple[dict, dict]]:
    path = tmp_path / "w.jsonl"
    path.write_text(text)
    return [(wl.to_json(), behind.to_json()) for wl, behind in read_workload_lines(str(path))]


def _summary(pairs: list[tuple[dict, dict]]) -> set[tuple]:
    return {(w["op"], w["dims"]["M"], json.dumps(w["attrs"], sort_keys=True), b["op"], json.dumps(b["attrs"], sort_keys=True))
            for w, b in pairs}


def test_linears_pick_a_layers_gemms_by_name(tmp_path):
    """`--linears qkv,gate_up` writes the two GEMMs behind the norm and leaves o and down (the residual
    ones) out, at every row count and mode; an unknown name is refused with the known ones."""
    pairs = _read(tmp_path, "\n".join(decode_workloads.lines(SMALL, ("w4a8", "bf16"), (1, 16), ("qkv", "gate_up"))) + "\n")
    assert {(w["op"], w["dims"]["M"], w["dims"]["N"]) for w, _ in pairs} == {
        (op, m, n) for m in (1, 16) for n in (512, 768)
        for op in ("gemm_w4a8", "rmsnorm_gemm" if m == 1 else "gemm")}
    assert all(w["attrs"]["with_residual"] == "no" for w, _ in pairs)
    with pytest.raises(SystemExit, match="unknown linears \\['up'\\]: a dense layer's are qkv, o, gate_up, down"):
        decode_workloads.lines(SMALL, ("w4a8",), (16,), ("qkv", "up"))


def test_lines_name_the_ops_and_attrs_the_decoder_dispatches(tmp_path):
    """Each mode's four GEMMs per row count, behind the kernel before each in a decode step: bf16 fuses
    norm and gate at one row (FUSED_MAX_ROWS) behind the last GEMM, else runs them first; w4a16 packs
    groups of 128; the int8 modes run behind rmsnorm_quant or dynamic_quant. Every line parses."""
    pairs = _read(tmp_path, "\n".join(decode_workloads.lines(SMALL, rows=(1, 16))) + "\n")
    got = {(w["op"], w["dims"]["M"], w["dims"]["N"], w["dims"]["K"], w["attrs"].get("with_residual"), b["op"])
           for w, b in pairs}
    expect = set()
    for m in (1, 16):
        fused = m == 1
        expect |= {("rmsnorm_gemm" if fused else "gemm", m, 512, 256, "no", "silu_mul_gemm" if fused else "rmsnorm"),
                   ("gemm", m, 256, 256, "yes", "paged_decode_attention"),
                   ("rmsnorm_gemm" if fused else "gemm", m, 768, 256, "no", "gemm" if fused else "rmsnorm"),
                   ("silu_mul_gemm" if fused else "gemm", m, 256, 384, "yes", "rmsnorm_gemm" if fused else "silu_mul")}
        expect |= {("gemm_w4a16", m, 512, 256, "no", "rmsnorm"), ("gemm_w4a16", m, 256, 256, "yes", "paged_decode_attention"),
                   ("gemm_w4a16", m, 768, 256, "no", "rmsnorm"), ("gemm_w4a16", m, 256, 384, "yes", "silu_mul")}
        for op in ("gemm_w8a8", "gemm_w4a8"):
            expect |= {(op, m, 512, 256, "no", "rmsnorm_quant"), (op, m, 256, 256, "yes", "dynamic_quant"),
                       (op, m, 768, 256, "no", "rmsnorm_quant"), (op, m, 256, 384, "yes", "dynamic_quant")}
    assert got == expect and len(pairs) == len(expect)
    for w, b in pairs:
        residual = {"with_residual": w["attrs"]["with_residual"]}
        if w["op"] == "gemm_w4a16":
            assert w["attrs"] == {**W4, **residual} and w["dims"]["G"] == 128
        elif w["op"] == "gemm_w4a8":
            assert {k: v for k, v in w["attrs"].items() if k != "zp"} == {
                **{k: v for k, v in W4.items() if k != "zp"}, "pack": "lanes", **residual}  # (packed at load)
        elif w["op"] != "gemm_w8a8":
            assert w["attrs"] == {**DENSE, **residual}
        if b["op"] in ("rmsnorm_quant", "dynamic_quant"):
            assert b["attrs"]["out_dtype"] == "int8" and b["dims"] == {"M": w["dims"]["M"], "N": w["dims"]["K"]}
        if b["op"] == "paged_decode_attention":
            assert b["dims"]["B"] == w["dims"]["M"] and b["dims"]["Hq"] * b["dims"]["D"] == w["dims"]["K"]


def test_the_committed_file_is_what_the_script_writes(tmp_path):
    """benchmarks/workloads/decode_rows.jsonl: Llama-3-8B's layer at rows 16-256, the same ops, attrs and
    producers as the script gives for the layer in miniature (the full weights take a minute to quantize)."""
    path = ROOT / "benchmarks" / "workloads" / "decode_rows.jsonl"
    pairs = _read(tmp_path, path.read_text())
    assert len(pairs) == len(set(map(json.dumps, pairs))) == 80
    shapes = {(w["dims"]["N"], w["dims"]["K"]) for w, _ in pairs}
    assert shapes == {(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)}
    assert {w["dims"]["M"] for w, _ in pairs} == set(decode_workloads.ROWS)
    small = _read(tmp_path, "\n".join(decode_workloads.lines(SMALL)) + "\n")
    assert _summary(pairs) == _summary(small)


def test_rows_records_ab_plans_a_tune_then_alternating_runs(tmp_path, capsys, monkeypatch):
    """benchmarks/studies/rows_records_ab.py --dry-run writes the rows' GEMM lines (four per mode and row
    count), then prints the tune, the export and the decoder runs with and without the records,
    alternating per round; its summary averages each side over the rounds."""
    import rows_records_ab
    monkeypatch.setattr(sys, "argv", ["rows_records_ab.py", "--rows", "4,8", "--modes", "w4a8,w8a8", "--target", "h100",
                                      "--out-dir", str(tmp_path), "--name", "ab", "--dry-run"])
    rows_records_ab.main()
    work = tmp_path / "ab_workloads.jsonl"
    got = _read(tmp_path, work.read_text())
    assert {(w["op"], w["dims"]["M"]) for w, _ in got} == {(op, m) for op in ("gemm_w4a8", "gemm_w8a8") for m in (4, 8)}
    assert len(got) == 2 * 2 * 4
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("$ ")]
    assert "tune --workloads " + str(work) in printed[0] and "--trials 2" in printed[0] and "db export" in printed[1]
    runs = printed[2:]
    assert [("FLASHGEN_DB=" + str(tmp_path / "ab.db")) in r for r in runs] == [True, False, True, False]
    assert all("--batch 4,8" in r and "--quant w4a8,w8a8" in r for r in runs)
    assert not (tmp_path / "ab.db").exists()  # nothing ran
    for side, r, tps in (("new", 1, 110.0), ("new", 2, 130.0), ("ship", 1, 100.0), ("ship", 2, 100.0)):
        (tmp_path / f"ab_{side}_{r}.json").write_text(json.dumps({"rows": [["flashgen w4a8", 4, 0.1, tps]]}))
    assert rows_records_ab.summary(tmp_path, "ab", 2) == [["flashgen w4a8", 4, 120.0, 100.0, 1.2]]
