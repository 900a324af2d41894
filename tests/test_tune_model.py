"""`flashgen tune --model`: the decode step's traced kernels (runtime/decoder/step_workloads.py), the plan
ordered by share (runtime/decoder/model_tune.py), the budget, resumption, Ctrl-C and the before/after
table (flashgen/cli.py), with the tune itself replaced by one that records a schedule per line."""
import collections
import dataclasses
import json

import pytest
import torch

from flashgen import cli
from flashgen.compiler import resolve_target
from flashgen.db import Database
from flashgen.oplib import OPS
from flashgen.runtime.decoder.bench import CONFIGS
from flashgen.runtime.decoder.calls import Recorder
from flashgen.runtime.decoder.model import context_bucket
from flashgen.runtime.decoder.model_tune import Estimates, plan_lines, step_us, steps
from flashgen.runtime.decoder.quant_modes import MODES, W4A16Linear
from flashgen.runtime.decoder.step_workloads import decode_step
from flashgen.schedules import tuner
from flashgen.schedules.measure import MeasureResult, feed_error
from flashgen.schedules.space import ScheduleSpace
from flashgen.workload import read_workload_lines

TINY = CONFIGS["tiny"]  # 2 dense layers
MOE = dataclasses.replace(CONFIGS["mixtral-2l"], hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
                          num_heads=2, num_kv_heads=1, max_position_embeddings=1024)


def test_cli_names_are_the_decoders():
    """The modes and configs the CLI checks before importing torch are the decoder's own."""
    assert cli.QUANT_MODES == tuple(MODES) and set(cli.BENCH_CONFIGS) == set(CONFIGS)


def test_recorded_moe_route_has_topk_columns():
    """moe_route's outputs are [M, K], K set by its topk attr, not by any input."""
    ids, weights = Recorder().moe_route(torch.empty(5, 8, device="meta"), topk="2", renorm="yes")
    assert ids.shape == weights.shape == (5, 2) and ids.dtype == torch.int32


def test_four_bit_linear_prepares_on_meta():
    """A w4a16 weight of meta codes packs (no values to check): the trace quantizes nothing."""
    q = W4A16Linear.prepare(torch.empty(256, 256, dtype=torch.bfloat16, device="meta"))
    assert q.w4.shape[0] == 256 and q.w4.is_meta


def _ops(c, mode, batch) -> collections.Counter:
    return collections.Counter(wl.op_name for wl, _ in decode_step(c, mode, batch))


@pytest.mark.parametrize("batch", [1, 3])
def test_tiny_llama_step_counts(batch):
    """Per layer: qkv, o, gate_up, down, one rope_cache and one decode attention; bf16 fuses the norms
    and the gate into the GEMMs at one row; the final norm once; int8 modes quantize each GEMM's input."""
    n = TINY.num_layers
    fused = batch == 1
    assert _ops(TINY, "bf16", batch) == (
        {"rmsnorm_gemm": 2 * n, "gemm": n, "silu_mul_gemm": n, "rope_cache": n, "paged_decode_attention": n,
         "rmsnorm": 1} if fused else
        {"gemm": 4 * n, "rmsnorm": 2 * n + 1, "silu_mul": n, "rope_cache": n, "paged_decode_attention": n})
    assert _ops(TINY, "w8a8", batch) == {"gemm_w8a8": 4 * n, "rmsnorm_quant": 2 * n, "dynamic_quant": 2 * n,
                                         "silu_mul": n, "rope_cache": n, "paged_decode_attention": n, "rmsnorm": 1}
    launches = decode_step(TINY, "w4a16", batch)
    assert launches[0][1] is None and all(p == launches[i][0] for i, (_, p) in enumerate(launches[1:]))
    attention = next(wl for wl, _ in launches if wl.op_name == "paged_decode_attention")
    assert attention.dim["B"] == batch and attention.dim["Hq"] == TINY.num_heads and attention.dim["Hkv"] == TINY.num_kv_heads
    assert {wl.dim["M"] for wl, _ in launches if wl.op.kclass == "contraction"} == {batch}


def _attention_context(**kw) -> int:
    return next(wl.dim["L"] for wl, _ in decode_step(TINY, "bf16", 4, **kw) if wl.op_name == "paged_decode_attention")


def test_a_steps_attention_dispatches_at_its_context_bucket():
    """The attention's L is the longest context rounded up to a power of two from 512, at most the
    window (tiny's 1024 positions), and the window when no context is given (`tune --model`'s default)."""
    assert [context_bucket(n, 8192) for n in (1, 288, 512, 513, 2300, 8192, 9000)] == \
        [512, 512, 512, 1024, 4096, 8192, 8192]
    assert context_bucket(5000, 2560) == 2560
    assert _attention_context() == TINY.max_position_embeddings == 1024
    assert [_attention_context(context=n) for n in (1, 300, 513, 10 ** 6)] == [512, 512, 1024, 1024]


@pytest.mark.parametrize("batch, routing", [(4, "ids"), (80, "aligned")])
def test_tiny_mixtral_step_counts(batch, routing):
    """Per MoE layer: the router's top-k and the two grouped GEMMs (ids routing up to 64 tokens), no
    dense MLP; w8a8 quantizes x once and each pair's h."""
    n = MOE.num_layers
    assert _ops(MOE, "bf16", batch) == {"gemm": 2 * n, "rmsnorm": 2 * n + 1, "rope_cache": n, "paged_decode_attention": n,
                                        "moe_route": n, "moe_gemm_gate_up": n, "moe_gemm_down": n}
    ops = _ops(MOE, "w8a8", batch)
    assert ops["dynamic_quant"] == 3 * n and ops["moe_gemm_down"] == n
    up = next(wl for wl, _ in decode_step(MOE, "bf16", batch) if wl.op_name == "moe_gemm_gate_up")
    assert up.dim["M"] == batch and up.attr["topk"] == str(MOE.experts_per_tok)
    assert (up.attr.get("routing") == "ids") == (routing == "ids")


@pytest.mark.parametrize("config, modes", [(TINY, ["bf16", "w4a16"]), (MOE, ["w4a16", "w8a16"])])
def test_plan_lines_parse_and_order_by_share(config, modes, tmp_path):
    """Every line parses as a --workloads line; lines come by share, each share its launches' part of
    each step's time averaged over the steps, all shares adding to the whole on a target that builds
    every op. (A MoE down projection adds into its accumulator in place: the norm after it is timed
    alone.)"""
    target = resolve_target("sm_90", None)
    db = str(tmp_path / "t.db")
    Database(db).close()
    st = steps(config, modes, [1, 16], target, db)
    est = Estimates(target, db)
    lines, skipped = plan_lines(st, target, est)
    assert not skipped and [ln.share for ln in lines] == sorted((ln.share for ln in lines), reverse=True)
    assert sum(ln.share for ln in lines) == pytest.approx(1.0)
    for ln in lines:
        # (a producer whose output the workload does not read leaves it timed alone)
        expect = sum(est(wl) / step_us(s, est) for s in st for wl, p in s.launches if wl == ln.workload and
                     (p == ln.producer or (ln.producer is None and feed_error(p, wl)))) / len(st)
        assert ln.share == pytest.approx(expect)
        assert ln.workload.op_name in OPS
    path = tmp_path / "plan.jsonl"
    path.write_text("".join(json.dumps({**ln.workload.to_json(), **({"behind": ln.producer.to_json()} if ln.producer
                                                                        else {})}) + "\n" for ln in lines))
    assert [(w.key, p.key if p else None) for w, p in read_workload_lines(str(path))] == \
        [(ln.workload.key, ln.producer.key if ln.producer else None) for ln in lines]


@pytest.mark.parametrize("argv, says", [
    (["--quant", "w3a3"], "unknown quant mode 'w3a3'"),
    (["--batches", "1,x"], "batch sizes"),
    (["--batches", "0"], "batch sizes"),
    (["--model", "no/such/folder"], "no such folder"),
    (["--model", "EMPTY"], "no config.json"),
    (["--budget", "1", "--workloads", "w.jsonl", "--model", None], "--budget goes with --model"),
    (["--context", "300", "--workloads", "w.jsonl", "--model", None], "--context goes with --model"),
    (["--context", "0"], "--context: must be a positive number of tokens"),
])
def test_bad_input_is_one_line(argv, says, tmp_path, capsys):
    argv = [str(tmp_path) if a == "EMPTY" else a for a in argv]
    if None in argv:
        argv = argv[:argv.index("--model")]
    if "--model" not in argv and "--workloads" not in argv:
        argv = ["--model", "tiny"] + argv
    assert cli.main(["tune", "--target", "cpu", *argv]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


class FakeTune:
    """Stands for `tuner.tune`: records one ok schedule per task at half its roofline, advancing a clock
    by a minute; raises KeyboardInterrupt at call `stop_at` after recording."""

    def __init__(self, stop_at: int | None = None):
        self.tasks, self.now, self.stop_at = [], 0.0, stop_at

    def clock(self) -> float:
        return self.now

    def __call__(self, task, db, progress=None):
        from flashgen.roofline import roofline_us

        self.tasks.append(task)
        self.now += 60.0
        s = ScheduleSpace(task.workload, task.target).default()
        rec = tuner._record(task.workload, task.target, "fake", MeasureResult(s, "ok", roofline_us(task.workload, task.target) / 2,
                                                                              0.0, runs=1), task.behind)
        db.add(rec)
        if len(self.tasks) == self.stop_at:
            raise KeyboardInterrupt
        return tuner.TuneResult(task.workload, rec, rec.latency_us, 1)


def _run(tmp_path, fake, monkeypatch, *more):
    monkeypatch.setattr(tuner, "tune", fake)
    monkeypatch.setattr(cli._ModelPlan, "clock", staticmethod(fake.clock))
    return cli.main(["tune", "--model", "tiny", "--target", "cpu", "--quant", "bf16", "--batches", "4", "--trials", "1",
                     "--db", str(tmp_path / "t.db"), *more])


def test_budget_stops_then_a_rerun_resumes_and_the_table_uses_records(tmp_path, monkeypatch, capsys):
    """A 2-minute budget tunes two lines (each fake tune takes a minute) and says what is left; a second
    run skips them and tunes the rest; its table's after is before less what the records saved."""
    first = FakeTune()
    assert _run(tmp_path, first, monkeypatch, "--budget", "2") == 0
    out = capsys.readouterr().out
    assert len(first.tasks) == 2 and "budget of 2 min spent: " in out and "run again to go on" in out
    second = FakeTune()
    assert _run(tmp_path, second, monkeypatch) == 0
    out = capsys.readouterr().out
    assert out.count("tuned already (1 records)") == 2
    tuned = [t.workload.key for t in first.tasks + second.tasks]
    assert len(tuned) == len(set(tuned)) and not {t.workload.key for t in first.tasks} & {t.workload.key for t in second.tasks}
    target = resolve_target("cpu", None)
    row = next(line.split() for line in out.splitlines() if line.startswith("bf16 "))
    empty = tmp_path / "empty.db"
    Database(str(empty)).close()
    st = steps(TINY, ["bf16"], [4], target, str(empty))
    roof = Estimates(target, str(empty))
    def saved(tasks) -> float:
        return sum(roof(wl) / 2 for wl, _ in st[0].launches if wl.key in {t.workload.key for t in tasks})

    assert saved(first.tasks) > 0 and saved(second.tasks) > 0
    assert float(row[2]) == pytest.approx(step_us(st[0], roof) - saved(first.tasks), abs=0.06)  # (the first run's)
    assert float(row[3]) == pytest.approx(step_us(st[0], roof) - saved(first.tasks + second.tasks), abs=0.06)


def test_ctrl_c_leaves_the_records_and_says_how_to_resume(tmp_path, monkeypatch, capsys):
    fake = FakeTune(stop_at=2)
    assert _run(tmp_path, fake, monkeypatch) == 130
    err = capsys.readouterr().err
    assert "stopped during line 2 of" in err and "run the same command again to resume" in err
    with Database(str(tmp_path / "t.db"), readonly=True) as db:
        assert {r.workload_key for t in fake.tasks for r in db.records(t.workload.key, resolve_target("cpu", None).id)} == \
            {t.workload.key for t in fake.tasks}
    again = FakeTune()
    assert _run(tmp_path, again, monkeypatch) == 0
    assert not {t.workload.key for t in fake.tasks} & {t.workload.key for t in again.tasks}
