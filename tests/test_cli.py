"""The flashgen command: listings, AOT compile and its outputs, and every bad-input case."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

import flashgen
from flashgen.cli import main
from flashgen.db import Database, Record


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_ops_and_targets_listings(capsys):
    code, out, _ = run_cli(capsys, "ops")
    assert code == 0
    for op in flashgen.OPS:
        assert op in out
    code, out, _ = run_cli(capsys, "targets")
    assert code == 0 and "cuda:sm_90/h200" in out and "rocm:gfx942/mi300x" in out and "cpu/host" in out


def test_compile_writes_source_binary_asm_metadata(capsys, tmp_path):
    out_dir = tmp_path / "k"
    code, out, err = run_cli(capsys, "compile", "rmsnorm", "--dim", "M=4000", "--dim", "N=8192",
                             "--dtype", "bf16", "--target", "h200", "--out", str(out_dir))
    assert code == 0, err
    assert err == "building rmsnorm for cuda:sm_90/h200...\n"  # (a status line before the seconds of a build)
    assert "analytic default" in out  # no record of M=4000, in the user's database or shipped
    meta = json.loads((out_dir / "rmsnorm_kernel.json").read_text())
    assert meta["workload"] == {"op": "rmsnorm", "dims": {"M": 4000, "N": 8192}, "attrs": {"dtype": "bf16"}}
    assert meta["target"] == "cuda:sm_90/h200" and meta["schedule_source"] == "analytic default"
    assert {"flashgen", "triton", "torch"} <= set(meta["tools"])
    cubin = (out_dir / "rmsnorm_kernel.cubin").read_bytes()
    assert meta["sha256"]["rmsnorm_kernel.cubin"] == hashlib.sha256(cubin).hexdigest()
    assert "@triton.jit" in (out_dir / "rmsnorm_kernel.py").read_text()
    assert ".visible .entry rmsnorm_kernel" in (out_dir / "rmsnorm_kernel.ptx").read_text()
    assert not [p for p in out_dir.iterdir() if p.name.startswith(".")]


def test_compile_rocm_with_attrs(capsys, tmp_path):
    code, out, err = run_cli(capsys, "compile", "rope", "--dim", "M=16", "--dim", "Hq=32", "--dim", "Hkv=8",
                             "--dim", "D=128", "--dim", "L=4096", "--attr", "style=gptj", "--dtype", "fp16",
                             "--target", "mi300x", "--out", str(tmp_path))
    assert code == 0, err
    assert (tmp_path / "rope_kernel.hsaco").read_bytes()[:4] == b"\x7fELF"
    assert "v_" in (tmp_path / "rope_kernel.amdgcn").read_text()


def test_compile_uses_database_best(capsys, tmp_path):
    wl = flashgen.workload("silu_mul", M=64, N=4096, dtype="bf16")
    db_path = tmp_path / "t.db"
    fast = {"block_r": 2, "block_c": 512, "num_warps": 4}
    with Database(db_path) as db:
        for sched, lat, status in ((fast, 3.0, "ok"), ({"block_r": 1, "block_c": 256, "num_warps": 1}, 9.0, "ok"),
                                   ({"block_r": 1, "block_c": 64, "num_warps": 1}, 1.0, "wrong_result")):
            db.add(Record(workload_key=wl.key, workload=wl.to_json(), target_key="cuda:sm_90/h200",
                          schedule=sched, status=status, latency_us=lat, device="NVIDIA H200"))
    code, out, err = run_cli(capsys, "compile", "silu_mul", "--dim", "M=64", "--dim", "N=4096", "--target",
                             "h200", "--db", str(db_path), "--out", str(tmp_path / "o"))
    assert code == 0, err
    assert "database best (3.00 us" in out
    meta = json.loads((tmp_path / "o" / "silu_mul_kernel.json").read_text())
    assert meta["schedule"] == fast
    # Another device of the same architecture, with no records of its own, takes the H200's, and says so;
    # another architecture does not.
    code, out, _ = run_cli(capsys, "compile", "silu_mul", "--dim", "M=64", "--dim", "N=4096", "--target",
                           "h100", "--db", str(db_path), "--out", str(tmp_path / "p"))
    assert code == 0 and "database best (3.00 us on NVIDIA H200" in out and "tuned on cuda:sm_90/h200" in out
    assert json.loads((tmp_path / "p" / "silu_mul_kernel.json").read_text())["schedule"] == fast
    code, out, _ = run_cli(capsys, "compile", "silu_mul", "--dim", "M=64", "--dim", "N=4096", "--target",
                           "a100", "--db", str(db_path), "--out", str(tmp_path / "q"))
    assert code == 0 and "analytic default" in out


BAD = [
    (["compile", "nosuchop", "--dim", "M=1", "--target", "h200"], "unknown op 'nosuchop'; valid ops: add_rmsnorm"),
    (["compile", "rmsnorm", "--dim", "M=1", "--target", "h200"], "missing dim N"),
    (["compile", "rmsnorm", "--dim", "M=1", "--dim", "N=2", "--dim", "Q=3", "--target", "h200"], "unknown dim or attribute 'Q'"),
    (["compile", "rmsnorm", "--dim", "M=0", "--dim", "N=2", "--target", "h200"], "dim M must be positive"),
    (["compile", "rmsnorm", "--dim", "M=1", "--dim", "N=99999999999", "--target", "h200"], "absurd"),
    (["compile", "rmsnorm", "--dim", "M=1", "--dim", "N=2", "--dtype", "fp64", "--target", "h200"], "dtype=fp64 is not supported; valid: bf16, fp16, fp32"),
    (["compile", "dynamic_quant", "--dim", "M=1", "--dim", "N=2", "--attr", "out_dtype=fp8e4m3", "--target", "mi300x"], "does not support fp8e4m3"),
    (["compile", "rmsnorm", "--dim", "M=1", "--dim", "N=2", "--target", "tpu"], "unknown target 'tpu'; valid targets:"),
    (["compile", "rmsnorm", "--dim", "M", "--target", "h200"], "expected NAME=VALUE"),
    (["compile", "rmsnorm", "--dim", "M=1", "--dim", "N=2", "--target", "h200", "--schedule", "{\"block_r\": 3}"], "invalid schedule"),
]


@pytest.mark.parametrize("argv, message", BAD, ids=[b[1][:30] for b in BAD])
def test_bad_input_is_one_clear_line(capsys, tmp_path, argv, message):
    out_dir = tmp_path / "out"
    code, out, err = run_cli(capsys, *argv, "--out", str(out_dir))
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("flashgen: error: ") and message in err, err
    assert "Traceback" not in err
    assert not out_dir.exists() or not any(out_dir.iterdir())


def test_unwritable_out(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for target in (blocker, blocker / "sub"):
        code, _, err = run_cli(capsys, "compile", "rmsnorm", "--dim", "M=1", "--dim", "N=8", "--target", "h200",
                               "--out", str(target))
        assert code == 2 and err.count("\n") == 1 and str(blocker) in err
    assert blocker.read_text() == "x"


@pytest.mark.parametrize("where", ["out", "parent"])
def test_a_read_only_out_is_refused_before_the_compile(capsys, tmp_path, monkeypatch, where):
    """A folder that cannot be written (a read-only mount; root passes mode bits, so access(2) is
    stubbed) is one line before any compile, not an OSError after it."""
    import flashgen.paths
    locked = tmp_path / "ro"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(flashgen.paths.os, "access", lambda p, mode: False if str(p) == str(locked) else real(p, mode))
    monkeypatch.setattr(flashgen, "compile", lambda *a, **k: pytest.fail("compiled into a folder it cannot write"))
    out = locked if where == "out" else locked / "sub" / "o"
    code, _, err = run_cli(capsys, "compile", "rmsnorm", "--dim", "M=1", "--dim", "N=8", "--target", "h200",
                           "--out", str(out))
    assert code == 2 and err == f"flashgen: error: --out {out}: the folder {locked} is not writable\n"


def test_console_script_exit_code(tmp_path):
    """The installed entry point: a real process, exit code 2, no traceback."""
    env = {**os.environ, "FLASHGEN_CACHE_DIR": str(tmp_path)}
    p = subprocess.run([sys.executable, "-m", "flashgen.cli", "compile", "rmsnorm", "--dim", "M=1",
                        "--target", "h200", "--out", str(tmp_path / "o")], capture_output=True, text=True, env=env)
    assert p.returncode == 2 and "missing dim N" in p.stderr and "Traceback" not in p.stderr


def test_missing_optional_extra_is_one_line_before_any_tuning(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what a plain install without [plot] has
    db = tmp_path / "t.db"
    code, out, err = run_cli(capsys, "tune", "rmsnorm", "--dim", "M=3", "--dim", "N=64", "--dtype", "fp32",
                             "--target", "cpu", "--trials", "1", "--db", str(db), "--plot", str(tmp_path / "p.png"))
    assert code == 2 and out == ""
    assert err.strip().count("\n") == 0 and "flashgen[plot]" in err and "--plot" in err
    assert not db.exists()  # nothing was tuned


@pytest.mark.parametrize("schedule", ['[1, 2]', '{"block_r": 1, "block_c": 8192.0, "num_warps": 8}',
                                      '{"block_r": true, "block_c": 8192, "num_warps": 8}',
                                      '{"block_r": [1], "block_c": 8192, "num_warps": 8}'])
def test_schedule_values_are_integers_of_the_space(capsys, tmp_path, schedule):
    code, _, err = run_cli(capsys, "compile", "rmsnorm", "--dim", "M=4", "--dim", "N=8192", "--dtype", "bf16",
                           "--target", "h200", "--schedule", schedule, "--out", str(tmp_path))
    assert code == 2 and err.strip().count("\n") == 0 and ("integers" in err or "JSON object" in err)
    assert not list(tmp_path.iterdir())


def test_a_repeated_dim_is_an_error(capsys, tmp_path):
    code, _, err = run_cli(capsys, "compile", "rmsnorm", "--dim", "M=4", "--dim", "N=64", "--dim", "M=8",
                           "--target", "h200", "--out", str(tmp_path))
    assert code == 2 and "M given more than once" in err


# Faults a probe found: each is one line naming what is wrong, before anything is tuned or written.
WL = {"op": "rmsnorm", "dims": {"M": 3, "N": 64}, "attrs": {"dtype": "fp32"}}
W = json.dumps(WL)
TUNE = ["tune", "--target", "cpu", "--trials", "1"]
ONE = ["rmsnorm", "--dim", "M=3", "--dim", "N=64"]
PROBED = [  # (argv, the --workloads file's bytes or None, message); {w} is the file's path
    ([*TUNE, *ONE, "--trials", "99999999999999999999"], None, "argument --trials: must be an integer in 1..1000000"),
    ([*TUNE, *ONE, "--trials", "0"], None, "argument --trials: must be an integer in 1..1000000, got '0'"),
    ([*TUNE, *ONE, "--seed", str(2**70)], None, "argument --seed: must be an integer in 0..2**63-1"),
    ([*TUNE, "--workloads", "{w}"], W.encode() + b"\n\xff\xfe\n", "is not UTF-8 text (byte 0xff at offset"),
    ([*TUNE, "--workloads", "{w}"], W.replace('"attrs"', '"attr"').encode(),
     "w.jsonl:1: unknown key 'attr' (a workload has op, dims, attrs, behind)"),
    ([*TUNE, "--workloads", "{w}"], json.dumps({**WL, "behind": {"op": "rmsnorm", "dim": {"M": 3, "N": 64}}}).encode(),
     "w.jsonl:1: behind: unknown key 'dim' (a workload has op, dims, attrs)"),
    ([*TUNE, "--workloads", "{w}"], W.encode() + b"\n[1, 2]\n", "w.jsonl:2: must be a JSON object"),
    ([*TUNE, "--workloads", "{w}"], b"", "holds no workload; give one {op, dims, attrs} per line"),
    ([*TUNE, "--workloads", "{w}"], b"\n  \n", "holds no workload"),
    ([*TUNE, "--workloads", "{w}", "--dim", "M=4"], W.encode(),
     "give an op (with --dim, --dtype, --attr) or --workloads, not both"),
    ([*TUNE, *ONE, "--behind", W.replace('"attrs"', '"attr"')], None, "--behind: unknown key 'attr'"),
    ([*TUNE, *ONE, "--attr", "dtype=fp16", "--dtype", "fp32"], None,
     "--dtype fp32 and --attr dtype=fp16 both set the dtype; give one"),
    (["compile", *ONE, "--target", "cpu", "--dtype", "", "--out", "{w}.out"], None,
     "argument --dtype: must be a non-empty value, got ''"),
    (["compile", *ONE, "--target", "cpu", "--schedule", "null", "--out", "{w}.out"], None,
     "--schedule: must be a JSON object {knob: value, ...}, got null"),
    (["compile", *ONE, "--target", "cpu", "--schedule", "", "--out", "{w}.out"], None, "--schedule: not JSON"),
    (["compile", *ONE, "--target", "cpu", "--out", ""], None, "argument --out: must be a non-empty value, got ''"),
    (["db", "list", "--limit", "²", "--db", "{w}.db"], None, "argument --limit: must be a whole number of at least 1"),
    (["targets", "--targets-dir", "{w}"], W.encode(), "w.jsonl is a file, not a folder"),
    (["compile", *ONE, "--target", "cpu", "--targets-dir", "{w}", "--out", "{w}.out"], W.encode(),
     "w.jsonl is a file, not a folder"),
    # a database named with --db that is not there read as none: explain said [default], exit 0
    (["explain", *ONE, "--target", "h200", "--db", "{w}.db"], None, "no tuning database at"),
    (["compile", *ONE, "--target", "h200", "--db", "{w}.db", "--out", "{w}.out"], None, "no tuning database at"),
]


@pytest.mark.parametrize("argv, file, message", PROBED, ids=[m[:40] for _, _, m in PROBED])
def test_probed_bad_input_is_one_clear_line_before_any_work(capsys, tmp_path, argv, file, message):
    w = tmp_path / "w.jsonl"
    if file is not None:
        w.write_bytes(file)
    argv = [a.replace("{w}", str(w)) for a in argv]
    code, out, err = run_cli(capsys, *argv, *(["--db", str(tmp_path / "t.db")] if argv[0] == "tune" else []))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("flashgen: error: ") and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == (["w.jsonl"] if file is not None else [])  # no db, no out
