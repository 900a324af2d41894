"""benchmarks/serving.py on the CPU: its arrivals are a seeded Poisson process, the engine serves every
request to its full length, the metrics follow from the recorded timelines, an automatic sweep doubles
the rate until the throughput stops rising, and a run writes its JSON, Markdown and PNG."""
from __future__ import annotations

import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import serving  # noqa: E402

from flashgen.runtime.decoder import bench  # noqa: E402


def hand_percentile(xs: list[float], q: float) -> float:
    """The q-th percentile interpolated between the two nearest ranks (rank q/100 * (n - 1))."""
    xs = sorted(xs)
    at = q / 100 * (len(xs) - 1)
    lo = math.floor(at)
    return xs[lo] + (at - lo) * (xs[min(lo + 1, len(xs) - 1)] - xs[lo])


def hand_metrics(events: list[tuple[float, float, float, int]]) -> dict[str, float]:
    """A point's metrics from (arrival, first token, finish, output tokens) per request."""
    ttft = [1e3 * (first - arrival) for arrival, first, _, _ in events]
    tpot = [1e3 * (finish - first) / (n - 1) for _, first, finish, n in events if n > 1]
    end = max(finish for _, _, finish, _ in events)
    return {"requests": len(events), "duration_s": end, "output_tokens": sum(e[3] for e in events),
            "throughput_tok_s": sum(e[3] for e in events) / end, "requests_per_s": len(events) / end,
            "ttft_median_ms": statistics.median(ttft), "ttft_p99_ms": hand_percentile(ttft, 99),
            "tpot_median_ms": statistics.median(tpot), "tpot_p99_ms": hand_percentile(tpot, 99)}


def test_arrivals_are_a_seeded_poisson_process():
    rate, duration = 40.0, 250.0
    load = serving.arrivals(rate, duration, 10, 5, 0.2, 100, seed=7)
    again = serving.arrivals(rate, duration, 10, 5, 0.2, 100, seed=7)
    assert [(a.at, a.prompt, a.output_len) for a in load] == [(a.at, a.prompt, a.output_len) for a in again]
    other = serving.arrivals(rate, duration, 10, 5, 0.2, 100, seed=8)
    assert [a.at for a in other[:50]] != [a.at for a in load[:50]]
    times = [a.at for a in load]
    assert 0 < times[0] and all(a < b for a, b in zip(times, times[1:])) and times[-1] < duration
    n = len(times)
    assert abs(n - rate * duration) < 4 * math.sqrt(rate * duration)  # a Poisson count: sd sqrt(mean)
    # gaps exponential of mean 1/rate: Kolmogorov-Smirnov distance under the 1% critical value
    gaps = sorted([times[0]] + [b - a for a, b in zip(times, times[1:])])
    cdf = [1 - math.exp(-rate * g) for g in gaps]
    ks = max(max((i + 1) / n - f, f - i / n) for i, f in enumerate(cdf))
    assert ks < 1.63 / math.sqrt(n), ks
    assert abs(statistics.fmean(gaps) * rate - 1) < 4 / math.sqrt(n)
    # counts in one-second windows: a Poisson variable's variance is its mean (dispersion index 1)
    counts = [0] * int(duration)
    for t in times:
        counts[int(t)] += 1
    assert abs(statistics.variance(counts) / statistics.fmean(counts) - 1) < 0.35
    # lengths uniform in +-20% of their means, prompts ids of the vocabulary
    assert {len(a.prompt) for a in load} == set(range(8, 13)) and {a.output_len for a in load} == {4, 5, 6}
    assert all(0 <= t < 100 for a in load for t in a.prompt)
    assert serving.lengths(2000, 0.2) == (1600, 2400) and serving.lengths(1, 0.5) == (1, 2)


@pytest.fixture(scope="module")
def tiny() -> bench.Decoder:
    return bench.build("tiny", "bf16", 4, 12, 8, device="cpu")


class StepClock:
    """Time that moves only when the engine steps (`step_s` a step) or the server sleeps."""

    def __init__(self, engine, step_s: float):
        self.now, self.step_s = 0.0, step_s
        inner = engine.step

        def step() -> None:
            inner()
            self.now += step_s
        engine.step = step

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_requests_join_between_steps(tiny):
    """On a clock that moves 10 ms a step: a request arriving at an idle engine is submitted at its
    arrival (the server sleeps until then) and has its first token one step (its prefill) later; one
    arriving during a step joins at the step's end and prefills in the next step, beside the running
    request's decode, which goes on one token a step."""
    traffic = serving.Traffic(duration=5.0, prompt_len=10, output_len=6, spread=0.2, seed=1)
    engine = serving.engine_for(tiny, traffic, max_batch=4)
    load = [serving.Arrival(0.5, [3, 1, 4, 1, 5], 6), serving.Arrival(0.505, [9, 2], 3),
            serving.Arrival(3.0, [6], 7)]
    clock = StepClock(engine, 0.01)
    times = serving.serve(engine, load, clock=clock, sleep=clock.sleep)
    assert [(t.error, t.output_tokens, t.prompt_len) for t in times] == [("", 6, 5), ("", 3, 2), ("", 7, 1)]
    want = [(0.5, 0.51, 0.56), (0.51, 0.52, 0.54), (3.0, 3.01, 3.07)]  # submitted, first token, finish
    assert [(t.submitted, t.first_token, t.finish) for t in times] == [pytest.approx(w) for w in want]
    m = serving.summarize(times)
    assert m["ttft_median_ms"] == pytest.approx(10) and m["ttft_p99_ms"] == pytest.approx(10 + 0.98 * 5)
    assert m["tpot_median_ms"] == pytest.approx(10) and m["tpot_p99_ms"] == pytest.approx(10)
    assert m["throughput_tok_s"] == pytest.approx(16 / 3.07) and m["duration_s"] == pytest.approx(3.07)


@pytest.mark.parametrize("rate", [40.0, 150.0])
def test_every_request_is_served_in_full_and_metrics_follow_its_times(tiny, rate):
    """Real time, a light and an overloaded rate: every request ends with no error and all of its
    output tokens (no stop token can end one early), joins no earlier than it arrives, its times in
    order; the metrics are those computed by hand from the recorded times."""
    traffic = serving.Traffic(duration=0.3, prompt_len=10, output_len=6, spread=0.2, seed=3)
    engine = serving.engine_for(tiny, traffic, max_batch=4)
    load = serving.arrivals(rate, traffic.duration, 10, 6, 0.2, tiny.c.vocab_size, seed=3)
    assert len(load) >= 5
    times = serving.serve(engine, load)
    assert [(t.arrival, t.output_tokens, t.error) for t in times] == [(a.at, a.output_len, "") for a in load]
    assert all(t.arrival <= t.submitted <= t.first_token <= t.finish for t in times)
    m = serving.summarize(times)
    want = hand_metrics([(t.arrival, t.first_token, t.finish, t.output_tokens) for t in times])
    assert m.keys() == want.keys()
    for k, v in want.items():
        assert m[k] == pytest.approx(v, rel=1e-12), k
    assert not engine.waiting and not engine.running and not engine.finished


def test_automatic_sweep_doubles_until_throughput_stops_rising(monkeypatch):
    """From half the rate one request alone is served at (or the rate that brings 8 requests over the
    duration, if more), the rate doubles while the throughput rises by at least 10% over the best
    before; the first point that does not is the last. With given rates, exactly those."""
    served: list[float] = []

    def fake_point(engine, mode, rate, traffic):
        served.append(rate)
        return [], {"throughput_tok_s": min(rate * 10, 100.0)}  # saturating at 100 tokens/s

    monkeypatch.setattr(serving, "point", fake_point)
    monkeypatch.setattr(serving, "solo_latency", lambda engine, traffic: 0.25)
    got: list[tuple[float, float]] = []
    traffic = serving.Traffic(10.0, 10, 6, 0.2, 0)
    serving.sweep(None, "bf16", None, traffic, 8, lambda r, t, m: got.append((r, m["throughput_tok_s"])))
    # 2, 4, 8 req/s give 20, 40, 80 tok/s; 16 gives 100 (+25%), 32 gives 100: the last
    assert served == [2.0, 4.0, 8.0, 16.0, 32.0] and got[-1] == (32.0, 100.0)
    served.clear()
    serving.sweep(None, "bf16", None, traffic, 3, lambda r, t, m: None)
    assert served == [2.0, 4.0, 8.0]
    served.clear()
    serving.sweep(None, "bf16", None, serving.Traffic(2.0, 10, 6, 0.2, 0), 8, lambda r, t, m: None)
    assert served == [4.0, 8.0, 16.0, 32.0]  # (8 requests in 2 s)
    served.clear()
    serving.sweep(None, "bf16", [5.0, 1.0, 50.0, 60.0], traffic, 2, lambda r, t, m: None)
    assert served == [5.0, 1.0, 50.0, 60.0]


def test_a_run_writes_its_table_timelines_and_plot(tmp_path, capsys):
    plot = importlib.util.find_spec("matplotlib") is not None
    argv = ["--device", "cpu", "--config", "tiny", "--quant", "bf16,w8a8", "--rates", "20,100", "--duration", "0.25",
            "--prompt-len", "9", "--output-len", "5", "--max-batch", "3", "--seed", "5", "--out-dir", str(tmp_path),
            "--name", "load"] + ([] if plot else ["--plot", "none"])
    assert serving.main(argv) == 0
    data = json.loads((tmp_path / "load.json").read_text())
    assert data["columns"] == list(serving.HEADER) and data["meta"]["device"] == "cpu"
    rows = [dict(zip(data["columns"], r)) for r in data["rows"]]
    assert [(r["mode"], r["rate_req_s"]) for r in rows] == [("bf16", 20), ("bf16", 100), ("w8a8", 20), ("w8a8", 100)]
    for r in rows:
        events = data["meta"]["requests"][f"{r['mode']} {r['rate_req_s']:g}"]
        load = serving.arrivals(r["rate_req_s"], 0.25, 9, 5, 0.2, bench.CONFIGS["tiny"].vocab_size, 5)
        assert [(e[0], e[4], e[5]) for e in events] == [(a.at, len(a.prompt), a.output_len) for a in load]
        want = hand_metrics([(e[0], e[2], e[3], e[5]) for e in events])
        assert {k: r[k] for k in want} == pytest.approx(want, rel=1e-12)
    md = (tmp_path / "load.md").read_text()
    assert "Command: `python" in md and "Device: cpu" in md and md.count("| bf16 |") == 2
    assert (tmp_path / "load.png").exists() == plot
    if plot:
        assert (tmp_path / "load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--rates", "1,x"], "--rates takes 'auto' or numbers separated by commas, got '1,x'"),
    (["--rates", "0"], "--rates must be positive requests/s, got '0'"),
    (["--quant", "bf16,int3"], "unknown quantization mode 'int3'"),
    (["--config", "gpt5"], "unknown config 'gpt5'"),
    (["--spread", "1.5"], "--spread must be in [0, 1), got 1.5"),
    (["--duration", "0"], "--duration must be positive seconds, got 0.0"),
    (["--output-len", "0"], "--output-len must be at least 1, got 0"),
    (["--plot", "x.txt"], "the plot is a PNG"),
])
def test_bad_settings_are_one_line_and_exit_2(tmp_path, capsys, args, message):
    assert serving.main(["--device", "cpu", "--out-dir", str(tmp_path)] + args) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("serving.py: ") and err.count("\n") == 1
    assert not list(tmp_path.iterdir())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_serving_on_gpu_replays_graphs_and_gives_each_modes_memory_back(tmp_path):
    """On a GPU the warm-up captures a decode graph for every bucket the cache can fill, and decode
    steps replay them, chained ahead of the host (runtime/decoder/engine.py), so a token is recorded a
    step after it was computed: every request still ends with all its tokens, its times in order, and
    the metrics follow from them. After each mode its weights, cache and graphs are given back."""
    dev = torch.device("cuda")
    traffic = serving.Traffic(duration=0.5, prompt_len=40, output_len=24, spread=0.2, seed=2)
    model = bench.build("tiny", "bf16", 16, 48, 29, device="cuda")
    engine = serving.engine_for(model, traffic, max_batch=16)
    # 16 x 5 blocks + 4 (16 requests of 48 + 29 tokens) hold 21 of the shortest (32 + 19 tokens, 4 blocks)
    assert sorted(engine.graphs.graphs) == [1, 2, 4, 8, 16, 32]
    for rate in (50.0, 800.0):
        load = serving.arrivals(rate, traffic.duration, 40, 24, 0.2, model.c.vocab_size, seed=2)
        times = serving.serve(engine, load)
        assert [(t.output_tokens, t.error) for t in times] == [(a.output_len, "") for a in load]
        assert all(t.arrival <= t.submitted <= t.first_token <= t.finish for t in times)
        want = hand_metrics([(t.arrival, t.first_token, t.finish, t.output_tokens) for t in times])
        assert {k: serving.summarize(times)[k] for k in want} == pytest.approx(want, rel=1e-12)
    engine = model = None
    bench.release(dev)
    held = torch.cuda.memory_allocated(dev)
    # SmolLM2-135M's shape: 0.27 GB of bf16 weights, which a mode that kept them would still hold
    argv = ["--config", "smollm2-135m", "--quant", "bf16,w4a16,w8a8", "--rates", "50,400", "--duration", "0.5",
            "--prompt-len", "40", "--output-len", "24", "--max-batch", "16", "--out-dir", str(tmp_path), "--plot", "none"]
    assert serving.main(argv) == 0
    assert torch.cuda.memory_allocated(dev) - held < 32 << 20
    data = json.loads((tmp_path / "serving.json").read_text())
    assert [r[0] for r in data["rows"]] == ["bf16", "bf16", "w4a16", "w4a16", "w8a8", "w8a8"]
    assert data["meta"]["device"] == torch.cuda.get_device_name()


def test_http_mode_serves_the_same_arrivals_through_the_server(tmp_path, capsys):
    """--http: each point served by the engine directly, then through `flashgen serve`'s routes by a
    client process; every HTTP request ends with all its tokens, its times in order, and the table of
    the server's cost follows from the two rows."""
    argv = ["--device", "cpu", "--config", "tiny", "--quant", "bf16", "--rates", "40", "--duration", "0.2",
            "--prompt-len", "6", "--output-len", "4", "--max-batch", "3", "--seed", "2", "--out-dir", str(tmp_path),
            "--name", "http", "--plot", "none", "--http"]
    assert serving.main(argv) == 0
    data = json.loads((tmp_path / "http.json").read_text())
    rows = [dict(zip(data["columns"], r)) for r in data["rows"]]
    assert [r["mode"] for r in rows] == ["bf16", "bf16+http"]
    load = serving.arrivals(40.0, 0.2, 6, 4, 0.2, bench.CONFIGS["tiny"].vocab_size, 2)
    events = data["meta"]["requests"]["bf16+http 40"]
    assert [(e[0], e[4], e[5]) for e in events] == [(a.at, len(a.prompt), a.output_len) for a in load]
    assert all(e[0] <= e[1] <= e[2] <= e[3] for e in events)
    direct, http = rows
    cost = serving.overheads(data["rows"])
    assert cost == [("bf16", 40, f"{direct['throughput_tok_s']:.1f}", f"{http['throughput_tok_s']:.1f}",
                     f"{direct['throughput_tok_s'] / http['throughput_tok_s'] - 1:+.1%}",
                     f"{http['tpot_median_ms'] / direct['tpot_median_ms'] - 1:+.1%}")]
    assert "throughput cost" in capsys.readouterr().out
