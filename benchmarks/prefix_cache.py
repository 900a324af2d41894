"""Automatic prefix caching under a shared system prompt: the engine with and without its prefix cache,
side by side, on requests whose prompts all start with one system prompt.

--requests requests (64), each prompt the --system-len-token system prompt (2000) and a distinct user
part of --user-len tokens (32-64, uniform), greedy, exactly --output-len new tokens (64), on random
weights of --config (runtime/decoder/bench.py), served by benchmarks/serving.py's loop (requests join
the engine's batch at step boundaries). By default they arrive together (--rate 0): every request then
asks for the system prompt at once, the case where an engine must not compute it 64 times, and the
throughput is the engine's own, not the arrival rate's (under a light Poisson load both engines keep
up, and the output rate is the arrival rate). Without the cache all 64 prompts prefill in one step;
with it the first request computes the system prompt, the others wait that step and then prefill only
their user parts over the cached blocks (runtime/decoder/engine.py). --rate R > 0 draws Poisson
arrivals instead (exponential gaps, seeded).

Each engine first serves the same kind of load untimed (another system prompt: no hit carries over), so
that its kernels are loaded and its decode graphs captured. Per engine: TTFT (first token - arrival)
median and p90 over the requests after the first, the first's own, output tokens/s from the start to
the last finish, and the prompt tokens taken from the cache; then the ratios (TTFT without / with,
throughput with / without) and how many requests got the same tokens both ways (on a GPU, bf16 rounding
of a prompt computed in two parts may turn a near-tie; on the CPU they are identical).

    python benchmarks/prefix_cache.py [--config llama3-8b] [--quant bf16] [--requests 64] [--system-len 2000]
                                      [--user-len 32-64] [--output-len 64] [--rate 0]
    python benchmarks/prefix_cache.py --device cpu  (the tiny config, short prompts: a smoke run)
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, environment, print_table, write_results  # noqa: E402
from serving import Arrival, Timeline, serve  # noqa: E402

from flashgen.errors import FlashgenError  # noqa: E402
from flashgen.runtime.decoder import bench  # noqa: E402
from flashgen.runtime.decoder.engine import Engine, Request  # noqa: E402
from flashgen.runtime.decoder.model import Decoder  # noqa: E402
from flashgen.runtime.decoder.quant_modes import quant_mode  # noqa: E402

DEFAULTS = {"cuda": dict(config="llama3-8b", requests=64, system_len=2000, user_len="32-64", output_len=64),
            "cpu": dict(config="tiny", requests=8, system_len=40, user_len="4-8", output_len=4)}
HEADER = ("prefix_cache", "requests", "ttft_first_ms", "ttft_later_median_ms", "ttft_later_p90_ms", "duration_s",
          "output_tokens", "throughput_tok_s", "prompt_tokens", "cached_prompt_tokens")


def user_lengths(text: str) -> tuple[int, int]:
    """--user-len: N or LO-HI, at least 1."""
    lo, _, hi = text.partition("-")
    try:
        bounds = int(lo), int(hi or lo)
    except ValueError:
        raise FlashgenError(f"--user-len takes N or LO-HI, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise FlashgenError(f"--user-len must be 1 <= LO <= HI, got {text!r}")
    return bounds


def load(requests: int, system_len: int, user: tuple[int, int], output_len: int, rate: float, vocab: int,
         seed: int) -> list[Arrival]:
    """`requests` prompts of one random system prompt and each its own random user part, arriving at 0
    (rate 0) or as a Poisson process of `rate` requests/s; the same for the same arguments."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, vocab, (system_len,), generator=g).tolist()
    at, out = 0.0, []
    for _ in range(requests):
        out.append(Arrival(at, system + torch.randint(0, vocab, (rng.randint(*user),), generator=g).tolist(),
                           output_len))
        at += rng.expovariate(rate) if rate > 0 else 0.0
    return out


def served(engine: Engine, arrivals: list[Arrival], label: str) -> tuple[list[Timeline], list[Request]]:
    """`serve`'s timelines, and the requests as they finished, in arrival order (request ids are
    consecutive from the first arrival's)."""
    finished: list[Request] = []
    pop = engine.pop_finished

    def keep() -> list[Request]:
        done = pop()
        finished.extend(done)
        return done

    engine.pop_finished = keep
    try:
        times = serve(engine, arrivals, label)
    finally:
        del engine.pop_finished  # (the method again, and no cycle through the engine)
    if failed := next((t.error for t in times if t.error), None):
        raise FlashgenError(f"{label}: a request failed: {failed}")
    return times, sorted(finished, key=lambda r: r.id)


def metrics(times: list[Timeline], reqs: list[Request]) -> dict[str, float | int]:
    """TTFT of the first arrival and median/p90 of the others (ms), throughput over the time from the
    start to the last finish, prompt tokens and those the cache gave."""
    ttft = [1e3 * (t.first_token - t.arrival) for t in times]
    later = ttft[1:] or ttft
    duration = max(t.finish for t in times)
    tokens = sum(t.output_tokens for t in times)
    return {"requests": len(times), "ttft_first_ms": ttft[0], "ttft_later_median_ms": float(np.percentile(later, 50)),
            "ttft_later_p90_ms": float(np.percentile(later, 90)), "duration_s": duration, "output_tokens": tokens,
            "throughput_tok_s": tokens / duration, "prompt_tokens": sum(t.prompt_len for t in times),
            "cached_prompt_tokens": sum(r.cached_tokens for r in reqs)}


def run_engine(model: Decoder, args: argparse.Namespace,
               prefix_cache: bool) -> tuple[dict, list[Timeline], list[Request]]:
    """One engine's untimed warm-up load, then its timed one: metrics, timelines, requests."""
    lo, hi = user_lengths(args.user_len)
    blocks = args.requests * -(-(args.system_len + hi + args.output_len) // 16) + 4
    engine = Engine(model, num_blocks=blocks, prefix_cache=prefix_cache)
    label = "prefix cache" if prefix_cache else "no cache"
    vocab = model.c.vocab_size
    warm = load(args.requests, args.system_len, (lo, hi), args.output_len, args.rate, vocab, args.seed + 1)
    print(f"{label}: warm-up, {len(warm)} requests", file=sys.stderr, flush=True)
    served(engine, warm, f"{label} (warm-up)")
    timed = load(args.requests, args.system_len, (lo, hi), args.output_len, args.rate, vocab, args.seed)
    times, reqs = served(engine, timed, label)
    m = metrics(times, reqs)
    print(f"{label}: TTFT of the later requests median {m['ttft_later_median_ms']:.1f} ms, "
          f"{m['throughput_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    return m, times, reqs


def check_args(args: argparse.Namespace) -> None:
    """Every setting checked before a model is built or a file written: one line naming the bad one."""
    quant_mode(args.quant)
    if args.config not in bench.CONFIGS:
        raise FlashgenError(f"unknown config {args.config!r}; valid: {', '.join(bench.CONFIGS)}")
    for flag in ("requests", "system_len", "output_len"):
        if getattr(args, flag) < 1:
            raise FlashgenError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    user_lengths(args.user_len)
    if not 0 <= args.rate < float("inf"):
        raise FlashgenError(f"--rate must be 0 (together) or positive requests/s, got {args.rate}")


def run(args: argparse.Namespace) -> tuple[list[list], dict]:
    """Both engines on one model; the rows, and the ratios."""
    dev = torch.device(args.device)
    _, hi = user_lengths(args.user_len)
    model = bench.build(args.config, args.quant, args.requests, args.system_len + hi, args.output_len, args.device)
    meta = {**environment("cpu" if dev.type == "cpu" else None), "settings": {
        k: getattr(args, k) for k in ("config", "quant", "requests", "system_len", "user_len", "output_len", "rate",
                                      "seed")}, "requests": {}}
    rows, outputs = [], {}
    try:
        for on in (False, True):
            m, times, reqs = run_engine(model, args, on)
            rows.append([on] + [m[h] for h in HEADER[1:]])
            meta["requests"]["prefix cache" if on else "no cache"] = [
                [t.arrival, t.submitted, t.first_token, t.finish, t.prompt_len, r.cached_tokens, t.output_tokens]
                for t, r in zip(times, reqs)]
            outputs[on] = [r.output for r in reqs]
            bench.release(dev)  # (the first engine's cache and graphs, before the second's are allocated)
    finally:
        model = None
        bench.release(dev)
    off, on = (dict(zip(HEADER, r)) for r in rows)
    meta["ratios"] = {"ttft_later_median": off["ttft_later_median_ms"] / on["ttft_later_median_ms"],
                      "ttft_later_p90": off["ttft_later_p90_ms"] / on["ttft_later_p90_ms"],
                      "throughput": on["throughput_tok_s"] / off["throughput_tok_s"],
                      "same_tokens": sum(a == b for a, b in zip(outputs[False], outputs[True])) / len(outputs[True])}
    arrive = "together" if args.rate == 0 else f"as a Poisson process of {args.rate:g} requests/s"
    notes = (f"{args.config}-shaped random weights (quant mode {args.quant}) on {meta['device']}; "
             f"{args.requests} requests arriving {arrive} (seed {args.seed}), each a {args.system_len}-token system "
             f"prompt shared by all and its own {args.user_len}-token user part, greedy, {args.output_len} new "
             "tokens; each engine served a "
             "warm-up load of another system prompt first. TTFT: first token - arrival, of the first request and "
             "median/p90 over the others; throughput: output tokens over the time from the start to the last "
             "finish. Ratios: TTFT of the later requests without / with the cache {ttft_later_median:.2f}x (median), "
             "{ttft_later_p90:.2f}x (p90); throughput with / without {throughput:.2f}x; requests with the same "
             "tokens both ways: {same_tokens:.0%}. "
             "Each request's times are in the JSON's meta.requests ([arrival, submitted, first token, finish, "
             "prompt, cached prompt tokens, output] per request).").format(**meta["ratios"])
    write_results(args.name, HEADER, rows, meta, args.out_dir, notes)
    return rows, meta["ratios"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--config", default=None, help=f"a bench config ({', '.join(bench.CONFIGS)}); "
                                                   "default llama3-8b (cpu: tiny)")
    ap.add_argument("--quant", default="bf16", help="the quant mode (default bf16)")
    ap.add_argument("--requests", type=int, default=None, help="requests (default 64; cpu: 8)")
    ap.add_argument("--system-len", type=int, default=None, help="system prompt tokens (default 2000; cpu: 40)")
    ap.add_argument("--user-len", default=None, help="user part tokens, N or LO-HI (default 32-64; cpu: 4-8)")
    ap.add_argument("--output-len", type=int, default=None, help="new tokens per request (default 64; cpu: 4)")
    ap.add_argument("--rate", type=float, default=0.0, help="0: all arrive together (default); else Poisson "
                                                            "arrivals of this many requests/s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default=None, help="result files <out-dir>/<name>.json and .md "
                                                 "(default prefix_cache; cpu: prefix_cache_cpu)")
    args = ap.parse_args(argv)
    for flag, value in DEFAULTS[args.device].items():
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    args.name = args.name or ("prefix_cache" if args.device == "cuda" else "prefix_cache_cpu")
    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise FlashgenError("no GPU here: run with --device cpu")
        check_args(args)
        rows, ratios = run(args)
    except FlashgenError as e:
        print(f"prefix_cache.py: {e}", file=sys.stderr)
        return 2
    print_table(("prefix cache", "TTFT first ms", "TTFT later med ms", "TTFT later p90 ms", "tok/s", "cached tokens"),
                [(r[0], r[2], r[3], r[4], r[7], r[9]) for r in rows])
    print(f"TTFT of the later requests without / with the cache: {ratios['ttft_later_median']:.2f}x (median), "
          f"{ratios['ttft_later_p90']:.2f}x (p90); throughput with / without: {ratios['throughput']:.2f}x; same "
          f"tokens in {ratios['same_tokens']:.0%} of the requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
