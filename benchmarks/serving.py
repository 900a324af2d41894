"""The engine under load, per quant mode: time per output token (TPOT) against throughput as requests
arrive as a Poisson process, one line per mode. It shows where 4-bit weights stop paying (a light load's
decode steps are bound by the bytes they read) and int8 tensor cores take over (a heavy load's steps,
and the prefills between them, by their arithmetic), and whether `mixed`, which takes each GEMM's mode
by its row count, follows the better of them.

For each mode in --quant: one decoder on random weights of --config (runtime/decoder/bench.py) and one
engine (runtime/decoder/engine.py), then for each arrival rate: requests arrive for --duration seconds
(exponential gaps, seeded; prompt and output lengths uniform within +-spread of their means; greedy, no
stop token, so each request gets exactly its output length), join the engine's running batch at the
first step boundary after they arrive, and the run drains. The same rate draws the same requests in
every mode. Per request: arrival, submission, first token and finish times (seconds from the point's
start, as the host sees the tokens), prompt and output lengths; per point: output tokens/s over the
time from the start to the last finish, TTFT (first token - arrival) and TPOT ((finish - first token) /
(output tokens - 1)) median and p99 over requests. --rates auto starts at half the rate one request
alone could be served at (its warm-up latency; at least 8 requests over the duration) and doubles until
the throughput rises by less than 10%.

    python benchmarks/serving.py [--config llama3-8b] [--quant bf16,w4a16,w8a8,w4a8,mixed] [--rates auto|0.5,1,2]
                                 [--duration 30] [--prompt-len 2000] [--output-len 300] [--spread 0.2] [--max-batch 64]
    python benchmarks/serving.py --device cpu  (the tiny config, short requests: a smoke run)
    python benchmarks/serving.py --http [...]  (each point also through `flashgen serve`'s HTTP API)

With --http, each point is served twice by the same engine: called directly as above, then through
`flashgen serve`'s routes (runtime/server/) on loopback, the same arrivals posted by a client in a
process of its own (so that it takes no time from the server's) as streamed /v1/completions requests of
token ids (temperature 0, max_tokens the output length, no stop token), each token's time taken as its
chunk arrives. Its rows are the mode's name + "+http"; the overhead of the server at a rate is the
direct throughput over the HTTP one, and the HTTP TPOT over the direct one (goal: within 5% at
saturation, the sweep's last point).
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, environment, print_table, write_results  # noqa: E402

from flashgen.errors import FlashgenError  # noqa: E402
from flashgen.runtime.decoder import bench  # noqa: E402
from flashgen.runtime.decoder.decode_graphs import bucket_for  # noqa: E402
from flashgen.runtime.decoder.engine import Engine  # noqa: E402
from flashgen.runtime.decoder.model import Decoder  # noqa: E402
from flashgen.runtime.decoder.quant_modes import quant_mode  # noqa: E402
from flashgen.runtime.decoder.sampling import SamplingParams  # noqa: E402

# Settings per device when not given: on a GPU long prompts and answers of a few hundred tokens; on the
# CPU a smoke run of seconds. max_batch 64 at the GPU lengths passes bench.check_memory for Llama-3-8B on
# an 80 GB H100 (69 GB by its estimate; an H200 holds --max-batch 128, 105 GB).
DEFAULTS = {"cuda": dict(config="llama3-8b", prompt_len=2000, output_len=300, duration=30.0, max_batch=64),
            "cpu": dict(config="tiny", prompt_len=48, output_len=12, duration=5.0, max_batch=8)}
MODES = "bf16,w4a16,w8a8,w4a8,mixed"
RISE = 1.1  # an automatic sweep stops at the first rate whose throughput is under RISE x the best before it
FIRST_REQUESTS = 8  # requests an automatic sweep's first rate brings on average, at the least
HEADER = ("mode", "rate_req_s", "requests", "duration_s", "output_tokens", "throughput_tok_s", "requests_per_s",
          "ttft_median_ms", "ttft_p99_ms", "tpot_median_ms", "tpot_p99_ms")


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds from the point's start
    prompt: list[int]
    output_len: int


@dataclass
class Timeline:
    """One request as served, in seconds from the point's start (first_token and finish: when the
    host has the token)."""
    arrival: float
    submitted: float
    prompt_len: int
    first_token: float | None = None
    finish: float | None = None
    output_tokens: int = 0
    error: str = ""


def lengths(mean: int, spread: float) -> tuple[int, int]:
    """The smallest and largest length drawn around `mean` (both at least 1)."""
    return max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))


def arrivals(rate: float, duration: float, prompt_len: int, output_len: int, spread: float, vocab: int,
             seed: int) -> list[Arrival]:
    """A Poisson process of `rate` requests/s over [0, duration): exponential gaps, each request's lengths
    uniform integers in `lengths`, its prompt random ids; the same for the same arguments."""
    rng = random.Random(f"{seed} {rate!r}")
    lo_in, hi_in = lengths(prompt_len, spread)
    lo_out, hi_out = lengths(output_len, spread)
    out, t = [], rng.expovariate(rate)
    while t < duration:
        n = rng.randint(lo_in, hi_in)
        g = torch.Generator().manual_seed(rng.getrandbits(63))
        out.append(Arrival(t, torch.randint(0, vocab, (n,), generator=g).tolist(), rng.randint(lo_out, hi_out)))
        t += rng.expovariate(rate)
    return out


def serve(engine: Engine, load: list[Arrival], label: str = "", clock: Callable[[], float] = time.perf_counter,
          sleep: Callable[[float], None] = time.sleep, report_s: float = 10.0) -> list[Timeline]:
    """Submit each arrival to `engine` at the first step boundary at or after its time (a step in flight
    is not cut short, as in any server batching between steps), step until every request has finished,
    and return their timelines in arrival order; a progress line on stderr every `report_s` seconds."""
    params = [SamplingParams(max_new_tokens=a.output_len, stop_tokens=()) for a in load]
    live: dict[int, Timeline] = {}
    out: list[Timeline] = []
    nxt, t0 = 0, clock()
    last = 0.0

    def collect(now: float) -> None:
        for req in engine.running:
            if req.output and live[req.id].first_token is None:
                live[req.id].first_token = now
        for req in engine.pop_finished():
            t = live.pop(req.id)
            t.finish, t.output_tokens, t.error = now, len(req.output), req.error
            t.first_token = now if t.first_token is None else t.first_token

    while nxt < len(load) or live:
        now = clock() - t0
        while nxt < len(load) and load[nxt].at <= now:
            rid = engine.add(load[nxt].prompt, params[nxt])
            live[rid] = Timeline(load[nxt].at, now, len(load[nxt].prompt))
            out.append(live[rid])
            nxt += 1
        if engine.waiting or engine.running or engine.pending:
            engine.step()
        elif nxt < len(load):
            sleep(max(0.0, load[nxt].at - now))
        now = clock() - t0
        collect(now)
        if now - last >= report_s:
            last = now
            print(f"  {label}: {now:.0f} s, {nxt}/{len(load)} arrived, {len(engine.running)} running, "
                  f"{len(engine.waiting)} waiting, {len(out) - len(live)} finished", file=sys.stderr, flush=True)
    return out


def _post_stream(url: str, a: Arrival, t0: float) -> Timeline:
    """One arrival posted at its time (seconds after `t0`, on this process's clock) as a streamed
    completion; its timeline as the client sees the chunks."""
    import json
    import urllib.request

    time.sleep(max(0.0, t0 + a.at - time.perf_counter()))
    body = {"model": "bench", "prompt": a.prompt, "max_tokens": a.output_len, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t = Timeline(a.at, time.perf_counter() - t0, len(a.prompt))
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    t.error = chunk["error"]["message"]
                elif chunk["choices"] and chunk["choices"][0]["text"] and t.first_token is None:
                    t.first_token = time.perf_counter() - t0
                elif chunk.get("usage"):
                    t.output_tokens = chunk["usage"]["completion_tokens"]
    except OSError as e:
        t.error = str(e)
    t.finish = time.perf_counter() - t0
    t.first_token = t.finish if t.first_token is None else t.first_token
    return t


def _client(url: str, load: list[Arrival], out) -> None:
    """The HTTP load's client, in a process of its own: every arrival in a thread, their timelines put
    on `out`."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, len(load))) as pool:
        out.put(list(pool.map(lambda a: _post_stream(url, a, t0), load)))


def serve_http(engine: Engine, load: list[Arrival]) -> list[Timeline]:
    """`load` through `flashgen serve`'s routes over `engine` on a loopback port (its client in a process
    of its own); their timelines in arrival order. The engine is idle again after."""
    import multiprocessing
    import threading

    import uvicorn
    from tokenizers import Tokenizer, models

    from flashgen.runtime.server.app import Service, create_app
    from flashgen.runtime.server.engine_loop import EngineLoop
    from flashgen.runtime.server.main import listen

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(engine.model.c.vocab_size)}, unk_token="t0"))
    svc = Service(EngineLoop(engine, max_queue=len(load) + 1).start(), words, "bench", None, {}, None)
    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(svc), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        ctx = multiprocessing.get_context("spawn")
        out = ctx.SimpleQueue()
        client = ctx.Process(target=_client, args=(f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions", load,
                                                   out))
        client.start()
        times = out.get()
        client.join()
        return times
    finally:
        server.should_exit = True
        thread.join()
        svc.loop.stop()


def summarize(times: list[Timeline]) -> dict[str, float | int]:
    """A point's metrics from its requests' timelines: output tokens/s from the start to the last
    finish, TTFT and TPOT (requests of 2 tokens or more) median and p99 in ms (numpy's linear
    percentile)."""
    duration = max(t.finish for t in times)
    tokens = sum(t.output_tokens for t in times)
    ttft = [1e3 * (t.first_token - t.arrival) for t in times]
    tpot = [1e3 * (t.finish - t.first_token) / (t.output_tokens - 1) for t in times if t.output_tokens > 1]

    def stat(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q)) if xs else float("nan")

    return {"requests": len(times), "duration_s": duration, "output_tokens": tokens,
            "throughput_tok_s": tokens / duration, "requests_per_s": len(times) / duration,
            "ttft_median_ms": stat(ttft, 50), "ttft_p99_ms": stat(ttft, 99),
            "tpot_median_ms": stat(tpot, 50), "tpot_p99_ms": stat(tpot, 99)}


@dataclass
class Traffic:
    """What every point of a sweep draws its requests from."""
    duration: float
    prompt_len: int
    output_len: int
    spread: float
    seed: int


def engine_for(model: Decoder, traffic: Traffic, max_batch: int) -> Engine:
    """An engine whose KV cache holds `max_batch` requests of the longest lengths `traffic` draws (the
    engine reserves a request's prompt and output blocks as it admits it), warmed up so that the first
    point does not pay for what every later one finds ready: prefills of the shortest and longest
    prompts, alone and together, load their kernels, and on a GPU a decode graph is captured for every
    batch bucket up to the most requests of the shortest lengths the cache holds, at every attention
    context bucket up to the longest lengths'. (A prefill of a row
    count not seen here may still choose and load a kernel inside a point, as it would in a server.)"""
    (lo_in, hi_in), (lo_out, hi_out) = (lengths(traffic.prompt_len, traffic.spread),
                                        lengths(traffic.output_len, traffic.spread))
    blocks = max_batch * -(-(hi_in + hi_out) // 16) + 4
    engine = Engine(model, num_blocks=blocks)
    warm = SamplingParams(max_new_tokens=3, stop_tokens=())
    for prompts in ([[1] * lo_in], [[2] * hi_in], [[3] * lo_in, [4] * hi_in]):  # (no prefix shared: each computed)
        engine.generate(prompts, warm)
    if engine.graphs is not None:
        sizes = engine.graphs.sizes
        most = bucket_for(blocks // -(-(lo_in + lo_out) // 16), sizes) or sizes[-1]
        for b in sizes[:sizes.index(most) + 1]:
            engine.generate([[1] * 16] * b, warm)
            engine.graphs.prepare(b, hi_in + hi_out)
    return engine


def solo_latency(engine: Engine, traffic: Traffic) -> float:
    """Seconds one request of the mean lengths takes alone (after an untimed one)."""
    g = torch.Generator().manual_seed(traffic.seed)
    prompt = torch.randint(0, engine.model.c.vocab_size, (traffic.prompt_len,), generator=g).tolist()
    params = SamplingParams(max_new_tokens=traffic.output_len, stop_tokens=())
    engine.generate([prompt], params)
    t0 = time.perf_counter()
    engine.generate([prompt], params)
    return time.perf_counter() - t0


def point(engine: Engine, mode: str, rate: float, traffic: Traffic, http: bool = False) -> tuple[list[Timeline], dict]:
    """One rate's requests served (`http`: through the server, `serve_http`), and their metrics; a failed
    request raises with its reason."""
    label = f"{mode}{'+http' if http else ''} at {rate:.3g} req/s"
    load = arrivals(rate, traffic.duration, traffic.prompt_len, traffic.output_len, traffic.spread,
                    engine.model.c.vocab_size, traffic.seed)
    if not load:
        raise FlashgenError(f"{label}: no request arrives within --duration {traffic.duration:g} s; "
                            "give a longer --duration or a higher rate")
    print(f"{label}: {len(load)} requests over {traffic.duration:g} s", file=sys.stderr, flush=True)
    times = serve_http(engine, load) if http else serve(engine, load, label)
    if failed := next((t for t in times if t.error), None):
        raise FlashgenError(f"{label}: a request failed: {failed.error}")
    metrics = summarize(times)
    print(f"{label}: {metrics['throughput_tok_s']:.1f} tok/s, TPOT median {metrics['tpot_median_ms']:.2f} ms, "
          f"TTFT median {metrics['ttft_median_ms']:.1f} ms", file=sys.stderr, flush=True)
    return times, metrics


def sweep(engine: Engine, mode: str, rates: list[float] | None, traffic: Traffic, max_points: int,
          done: Callable[[float, list[Timeline], dict], None],
          done_http: Callable[[float, list[Timeline], dict], None] | None = None) -> None:
    """`point` at each rate of `rates`, or (None) from half the rate one request alone is served at
    (FIRST_REQUESTS over the duration if that is more), doubling until the throughput rises by less
    than RISE over the best before (at most `max_points` rates); `done` gets each point as it ends, and
    `done_http`, where given, the same point served through HTTP next."""
    todo = list(rates) if rates is not None else \
        [max(0.5 / solo_latency(engine, traffic), FIRST_REQUESTS / traffic.duration)]
    best, points = 0.0, 0
    while todo:
        rate = todo.pop(0)
        times, metrics = point(engine, mode, rate, traffic)
        done(rate, times, metrics)
        if done_http is not None:
            done_http(rate, *point(engine, mode, rate, traffic, http=True))
        points += 1
        throughput = metrics["throughput_tok_s"]
        if rates is None and throughput >= RISE * best and points < max_points:
            todo.append(2 * rate)
        best = max(best, throughput)


def plot(rows: list[list], path: Path, title: str) -> None:
    """Median TPOT against throughput, one line per mode, each point marked with its rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    col = {c: i for i, c in enumerate(HEADER)}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in dict.fromkeys(r[col["mode"]] for r in rows):
        pts = [r for r in rows if r[col["mode"]] == mode]
        xs, ys = [r[col["throughput_tok_s"]] for r in pts], [r[col["tpot_median_ms"]] for r in pts]
        ax.plot(xs, ys, marker="o", label=mode)
        for r, x, y in zip(pts, xs, ys):
            ax.annotate(f"{r[col['rate_req_s']]:.3g}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
    ax.set_xlabel("throughput (output tokens/s)")
    ax.set_ylabel("median TPOT (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(title="mode (points: req/s)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_rates(text: str) -> list[float] | None:
    """--rates: None for "auto", else positive requests/s."""
    if text == "auto":
        return None
    try:
        rates = [float(t) for t in text.split(",")]
    except ValueError:
        raise FlashgenError(f"--rates takes 'auto' or numbers separated by commas, got {text!r}") from None
    if not all(0 < r < float("inf") for r in rates):
        raise FlashgenError(f"--rates must be positive requests/s, got {text!r}")
    return rates


def check_args(args: argparse.Namespace) -> None:
    """Every setting checked before a model is built or a file written: one line naming the bad one."""
    for m in args.quant.split(","):
        quant_mode(m)
    if args.config not in bench.CONFIGS:
        raise FlashgenError(f"unknown config {args.config!r}; valid: {', '.join(bench.CONFIGS)}")
    for flag in ("prompt_len", "output_len", "max_batch", "max_points"):
        if getattr(args, flag) < 1:
            raise FlashgenError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if not 0 <= args.spread < 1:
        raise FlashgenError(f"--spread must be in [0, 1), got {args.spread}")
    if not 0 < args.duration < float("inf"):
        raise FlashgenError(f"--duration must be positive seconds, got {args.duration}")
    parse_rates(args.rates)
    args.out_dir.mkdir(parents=True, exist_ok=True)  # (the plot's default folder)
    if args.plot is not None:
        from flashgen.cli import _check_plot_path
        from flashgen.extras import require

        require("matplotlib", "--plot")
        _check_plot_path(str(args.plot))


def run(args: argparse.Namespace) -> list[list]:
    """Every mode's sweep, the result files rewritten after each point (a run cut short keeps what it
    measured); the rows."""
    rates = parse_rates(args.rates)
    dev = torch.device(args.device)
    meta = {**environment("cpu" if dev.type == "cpu" else None), "requests": {}}
    traffic = Traffic(args.duration, args.prompt_len, args.output_len, args.spread, args.seed)
    rows: list[list] = []
    (lo_in, hi_in), (lo_out, hi_out) = lengths(args.prompt_len, args.spread), lengths(args.output_len, args.spread)
    notes = (f"{args.config}-shaped random weights on {meta['device']}; requests arrive as a Poisson process "
             f"(seed {args.seed}) for {args.duration:g} s per rate, prompts of {lo_in}-{hi_in} and outputs of "
             f"{lo_out}-{hi_out} tokens (uniform), greedy without stop tokens; KV cache for {args.max_batch} "
             "requests of the longest lengths. Throughput: output tokens over the time from the start to the "
             "last finish (the drain included); TTFT: first token - arrival; TPOT: (finish - first token) / "
             "(output tokens - 1); median and p99 over requests. Each request's times are in the JSON's "
             "meta.requests ([arrival, submitted, first token, finish, prompt, output] per request).")
    title = f"{meta['device']}: {args.config}, in ~{args.prompt_len} / out ~{args.output_len} tokens"

    def done(mode: str, rate: float, times: list[Timeline], metrics: dict) -> None:
        rows.append([mode, rate] + [metrics[h] for h in HEADER[2:]])
        meta["requests"][f"{mode} {rate:g}"] = [[t.arrival, t.submitted, t.first_token, t.finish, t.prompt_len,
                                                  t.output_tokens] for t in times]
        write_results(args.name, HEADER, rows, meta, args.out_dir, notes)
        if args.plot is not None:
            plot(rows, args.plot, title)

    for mode in args.quant.split(","):
        model = bench.build(args.config, mode, args.max_batch, hi_in, hi_out, args.device)
        try:
            engine = engine_for(model, traffic, args.max_batch)
            sweep(engine, mode, rates, traffic, args.max_points, lambda r, t, m: done(mode, r, t, m),
                  (lambda r, t, m: done(f"{mode}+http", r, t, m)) if args.http else None)
        finally:
            engine = model = None
            bench.release(dev)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--config", default=None, help=f"a bench config ({', '.join(bench.CONFIGS)}); "
                                                   "default llama3-8b (cpu: tiny)")
    ap.add_argument("--quant", default=MODES, help=f"quant modes, comma-separated (default {MODES})")
    ap.add_argument("--rates", default="auto", help="arrival rates in requests/s, comma-separated, or auto")
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals per rate (default 30; cpu: 5)")
    ap.add_argument("--prompt-len", type=int, default=None, help="mean prompt tokens (default 2000; cpu: 48)")
    ap.add_argument("--output-len", type=int, default=None, help="mean output tokens (default 300; cpu: 12)")
    ap.add_argument("--spread", type=float, default=0.2, help="lengths uniform within +-spread of the mean")
    ap.add_argument("--max-batch", type=int, default=None,
                    help="requests the KV cache holds at the longest lengths (default 64; cpu: 8)")
    ap.add_argument("--max-points", type=int, default=8, help="most rates of an automatic sweep")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--http", action="store_true",
                    help="serve each point through `flashgen serve`'s HTTP API too, after the engine called directly")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default=None, help="result files <out-dir>/<name>.json and .md "
                                                 "(default serving; cpu: serving_cpu)")
    ap.add_argument("--plot", default=None, help="the PNG (default <out-dir>/<name>.png; 'none': no plot)")
    args = ap.parse_args(argv)
    for flag, value in DEFAULTS[args.device].items():
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    args.name = args.name or ("serving" if args.device == "cuda" else "serving_cpu")
    args.plot = None if args.plot == "none" else Path(args.plot or args.out_dir / f"{args.name}.png")
    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise FlashgenError("no GPU here: run with --device cpu")
        check_args(args)
        rows = run(args)
    except FlashgenError as e:
        print(f"serving.py: {e}", file=sys.stderr)
        return 2
    print_table(("mode", "req/s", "tok/s", "TPOT med ms", "TPOT p99 ms", "TTFT med ms"),
                [(r[0], r[1], r[5], r[9], r[10], r[7]) for r in rows])
    if args.http:
        print_table(("mode", "req/s", "direct tok/s", "http tok/s", "throughput cost", "TPOT cost"), overheads(rows))
    return 0


def overheads(rows: list[list]) -> list[tuple]:
    """Per mode and rate, the direct and HTTP throughputs and what the server costs: the direct
    throughput over the HTTP one and the HTTP median TPOT over the direct one, less 1."""
    col = {c: i for i, c in enumerate(HEADER)}
    direct = {(r[0], r[1]): r for r in rows if not r[0].endswith("+http")}
    out = []
    for r in rows:
        if r[0].endswith("+http"):
            d = direct[(r[0].removesuffix("+http"), r[1])]
            tput, tpot = col["throughput_tok_s"], col["tpot_median_ms"]
            out.append((d[0], r[1], f"{d[tput]:.1f}", f"{r[tput]:.1f}", f"{d[tput] / r[tput] - 1:+.1%}",
                        f"{r[tpot] / d[tpot] - 1:+.1%}"))
    return out


if __name__ == "__main__":
    sys.exit(main())
