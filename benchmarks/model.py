"""Whole-model decode on Llama-3-8B-shaped random weights (or another bench config: --config
mixtral-2l, two Mixtral-8x7B layers): flashgen's decoder in each quant mode against transformers'
generate (eager, and static cache with torch.compile) on a model of the same shape, and the bandwidth
limit.
With --device cpu: SmolLM2-135M-shaped random weights in float32, the decoder and engine against
transformers' eager generate on the same weights, interleaved in rounds (the best round of each counts).

    python benchmarks/model.py [--config llama3-8b] [--batch 1,16,64] [--prompt-len 2000] [--new-tokens 300] [--quant bf16,w4a16]
                               [--no-cuda-graphs] [--peer-batch 1,64] [--fused-rows 1,0] [--tp 1,2,4,8]
    python benchmarks/model.py --device cpu [--batch 1,8] [--prompt-len 64] [--new-tokens 32] [--rounds 2] [--threads 0]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, copy_gbs, environment, print_table, write_results  # noqa: E402

from flashgen.errors import FlashgenError  # noqa: E402
from flashgen.runtime.decoder import bench, linear  # noqa: E402
from flashgen.runtime.serving.dispatch import describe_sources  # noqa: E402
from flashgen.runtime.decoder.quant_modes import quant_mode  # noqa: E402


def hf_model(config: str, device: str, dtype: torch.dtype, weights: dict[str, torch.Tensor] | None = None):
    """transformers' model of a bench config (Llama, or Mixtral with its experts), with `weights`
    (Hugging Face names) if given."""
    import transformers

    c = bench.CONFIGS[config]
    common = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                  num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                  head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, rope_theta=c.rope_theta,
                  rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings)
    if c.model_type == "mixtral":
        cfg, cls = transformers.MixtralConfig(**common, num_local_experts=c.num_experts,
                                              num_experts_per_tok=c.experts_per_tok), transformers.MixtralForCausalLM
    else:
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    with torch.device(device):
        model = cls(cfg).to(dtype).eval()
    if weights is not None:
        model.load_state_dict(weights, strict=False)
    return model


def generate_tps(model, batch: int, prompt_len: int, new_tokens: int, static: bool = False) -> float:
    """Decode tokens/s of transformers' greedy generate: the time of a generate call minus that of a
    one-token call (its prefill)."""
    dev = model.device
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device=dev)
    kw = {"cache_implementation": "static"} if static else {}
    kw.update(attention_mask=torch.ones_like(ids), pad_token_id=0)  # no padding: every prompt is as long
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    with torch.no_grad():
        # Warm-up (and compilation): with a static cache, at the timed length, or the cache's new size recompiles.
        warm = new_tokens if static else 8
        model.generate(ids, max_new_tokens=warm, min_new_tokens=warm, do_sample=False, **kw)
        spent = []
        for n in (1, new_tokens):  # decode time = whole generate - a generate that only prefills
            sync()
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)
            sync()
            spent.append(time.perf_counter() - t0)
    return batch * (new_tokens - 1) / (spent[1] - spent[0])


def transformers_tps(config: str, batch: int, prompt_len: int, new_tokens: int, static: bool) -> float:
    model = hf_model(config, "cuda", torch.bfloat16)
    tps = generate_tps(model, batch, prompt_len, new_tokens, static)
    del model
    torch.cuda.empty_cache()
    return tps


def load() -> str:
    """The 1-, 5- and 15-minute load averages, as text (other processes share the CPU cores)."""
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_main(args: argparse.Namespace) -> None:
    """The decoder and engine against transformers' eager generate on the CPU, same weights, prompt
    length and new tokens, greedy, float32; both sides alternate in each round."""
    from dataclasses import replace

    from flashgen.runtime.decoder.model import Decoder

    if args.threads:
        torch.set_num_threads(args.threads)
    config = "smollm2-135m"
    c = replace(bench.CONFIGS[config], max_position_embeddings=max(bench.CONFIGS[config].max_position_embeddings,
                                                                  args.prompt_len + args.new_tokens + 16))
    weights = bench.random_weights(c, torch.float32, torch.device("cpu"))
    ours = Decoder(c, weights, "cpu", torch.float32)
    peer = hf_model(config, "cpu", torch.float32, weights)
    batches = [int(b) for b in args.batch.split(",")]
    runs: dict[tuple[str, int], list[float]] = {}
    loads = [load()]
    for _ in range(args.rounds):
        for b in batches:
            runs.setdefault(("flashgen", b), []).append(
                bench.decode(ours, b, args.prompt_len, args.new_tokens)["decode_tokens_per_s"])
            runs.setdefault(("transformers eager", b), []).append(
                generate_tps(peer, b, args.prompt_len, args.new_tokens))
            print(b, {k: v[-1] for k, v in runs.items() if k[1] == b}, flush=True)
        loads.append(load())
    rows = []
    for b in batches:
        f, t = max(runs[("flashgen", b)]), max(runs[("transformers eager", b)])
        rows.append([b, f, t, f / t, ", ".join(f"{x:.2f}" for x in runs[("flashgen", b)]),
                     ", ".join(f"{x:.2f}" for x in runs[("transformers eager", b)])])
    meta = {**environment("cpu"), "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "load_avg_1_5_15_per_round": loads}
    write_results(args.name, ("batch", "flashgen_tokens_per_s", "transformers_eager_tokens_per_s", "ratio",
                              "flashgen_rounds", "transformers_rounds"), rows, meta, args.out_dir,
                  f"SmolLM2-135M-shaped random weights (hidden {c.hidden_size}, {c.num_layers} layers, "
                  f"{c.num_heads} heads, {c.num_kv_heads} KV heads, vocab {c.vocab_size}, tied embeddings), float32 "
                  f"on the CPU, {torch.get_num_threads()} torch threads, prompt {args.prompt_len}, "
                  f"{args.new_tokens} new tokens, greedy. Decode tokens/s, the best of {args.rounds} interleaved "
                  "rounds (each round's value in the last columns); transformers: the time of a generate call "
                  "minus that of a one-token call. Load averages (1/5/15 min) before and after each round: "
                  + "; ".join(loads) + ".")
    print_table(("batch", "flashgen tok/s", "transformers tok/s", "ratio"), [r[:4] for r in rows])
    print("command: " + meta["command"])


def tp_degrees(text: str, config: str) -> list[int]:
    """--tp's degrees, each checked against the model's heads and this machine's GPUs before anything runs."""
    from flashgen.runtime.decoder.tensor_parallel import check_gpus, check_tp

    try:
        degrees = [int(t) for t in text.split(",")]
    except ValueError:
        raise SystemExit(f"model.py: --tp takes integers separated by commas, got {text!r}") from None
    try:
        for tp in degrees:
            check_tp(bench.CONFIGS[config], tp)
            if tp > 1:
                check_gpus(tp, torch.cuda.device_count())
    except FlashgenError as e:
        raise SystemExit(f"model.py: {e}") from None
    return degrees


def _split_rank(device: torch.device, tp: int, run_args: tuple, fused_rows: int, cuda_graphs: bool, out: Path) -> None:
    """One rank of a split run: `bench.run` on this rank's GPU, the bandwidth of every rank's together;
    rank 0 keeps the rows."""
    import torch.distributed as dist

    linear.FUSED_MAX_ROWS = fused_rows
    config, batches, prompt_len, new_tokens, quant, bw = run_args
    rows = bench.run(config, batches, prompt_len, new_tokens, quant, bw * tp, device=str(device),
                     cuda_graphs=cuda_graphs, tp=tp)
    if dist.get_rank() == 0:
        torch.save(rows, out)


def split_run(tp: int, run_args: tuple, fused_rows: int, cuda_graphs: bool) -> list[dict]:
    """`bench.run`'s rows of the model split over `tp` spawned ranks, one per GPU."""
    import tempfile

    from flashgen.runtime.decoder.ranks import launch

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.pt"
        launch(tp, _split_rank, (tp, run_args, fused_rows, cuda_graphs, out))
        return torch.load(out, weights_only=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="llama3-8b", choices=("llama3-8b", "mixtral-2l"),
                    help="the model's shape (random weights), GPU runs")
    ap.add_argument("--batch", default=None, help="default: 1,16,64 (cpu: 1,8)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default: 2000 (cpu: 64)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default: 300 (cpu: 32)")
    ap.add_argument("--quant", default="bf16,w4a16")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="flashgen decode steps run eagerly")
    ap.add_argument("--peer-batch", default=None,
                    help="batches for the transformers peers (default: --batch; 'none': no peers)")
    ap.add_argument("--fused-rows", default=str(linear.FUSED_MAX_ROWS),
                    help="comma-separated row limits for norms and SiLU·mul fused into the linears they feed "
                         "(runtime/decoder/linear.py), one run of each (0: their own kernels)")
    ap.add_argument("--tp", default="1",
                    help="tensor-parallel degrees, comma-separated, one run of each (GPU runs; a degree needs as "
                         "many GPUs): the model split over that many ranks (runtime/decoder/tensor_parallel.py)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default=None, help="result files: <out-dir>/<name>.json and .md "
                                                 "(default: model, model_cpu with --device cpu)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of both sides (--device cpu)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads of both sides (--device cpu; 0: torch's)")
    args = ap.parse_args()
    cpu = args.device == "cpu"
    for flag, gpu_default, cpu_default in (("batch", "1,16,64", "1,8"), ("prompt_len", 2000, 64),
                                           ("new_tokens", 300, 32)):
        if getattr(args, flag) is None:
            setattr(args, flag, cpu_default if cpu else gpu_default)
    if cpu:
        if args.tp != "1":
            raise SystemExit("model.py: --tp splits the model over GPUs; --device cpu runs one process")
        args.name = args.name or "model_cpu"
        return cpu_main(args)
    args.name = args.name or ("model" if args.config == "llama3-8b" else f"model_{args.config}")
    shape = {"llama3-8b": "Llama-3-8B-shaped", "mixtral-2l": "Mixtral-8x7B-shaped (2 layers, 8 experts, top-2)"}
    degrees = tp_degrees(args.tp, args.config)
    bw = copy_gbs()
    batches = [int(b) for b in args.batch.split(",")]
    rows: list[list] = []

    def save() -> None:  # after every row: a run cut short keeps what it measured
        write_results(args.name, ("system", "batch", "ttft_s", "tokens_per_s", "limit_tokens_per_s", "of_limit",
                                "free_gb_before", "decode_gemm_schedules"), rows,
                      {**environment(), "copy_gbs": bw}, args.out_dir,
                      f"{shape[args.config]} random weights, prompt {args.prompt_len}, {args.new_tokens} new tokens. "
                      "Decode tokens/s; for transformers, the time of a generate call minus that of a one-token "
                      "call (its prefill). free_gb_before: the GPU's free memory as the row's run began (each mode's "
                      "weights, caches and graphs are released before the next). "
                      "decode_gemm_schedules: how many of the decode step's GEMM workloads ran "
                      "a record of the tuning database (exact, or a bucket; other-device record: tuned on another GPU "
                      "of the architecture) and how many the analytic default. "
                      "A tp=N row: the model split over N GPUs (runtime/decoder/tensor_parallel.py), its limit at the "
                      "bandwidth of the N together.")

    for tp, quant, fused_rows in ((t, q, int(f)) for t in degrees for q in args.quant.split(",")
                                  for f in args.fused_rows.split(",")):
        linear.FUSED_MAX_ROWS = fused_rows
        run_args = (args.config, batches, args.prompt_len, args.new_tokens, quant, bw)
        for r in (bench.run(*run_args, cuda_graphs=not args.no_cuda_graphs) if tp == 1 else
                  split_run(tp, run_args, fused_rows, not args.no_cuda_graphs)):
            name = ("flashgen " + quant + (f" tp={tp}" if tp > 1 else "") + ("" if r["cuda_graphs"] else " eager")
                    + ("" if fused_rows >= r["batch"] and quant_mode(quant).fused else " (unfused)"))
            rows.append([name, r["batch"], r["ttft_s"], r["decode_tokens_per_s"], r["bandwidth_limit_tokens_per_s"],
                         r["of_limit"], r["free_gb_before"], describe_sources(r["decode_gemm_schedules"])])
            print(rows[-1], flush=True)
            save()
    for static in (False, True):
        for b in [] if args.peer_batch == "none" else [int(b) for b in (args.peer_batch or args.batch).split(",")]:
            try:
                tps, why = transformers_tps(args.config, b, args.prompt_len, args.new_tokens, static), ""
            except Exception as e:  # a peer that does not run is a row saying why, not a lost run
                tps, why = float("nan"), f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                torch.cuda.empty_cache()
            rows.append(["transformers " + ("static+compile" if static else "eager"), b, float("nan"), tps,
                         float("nan"), float("nan"), float("nan"), why])
            print(rows[-1], flush=True)
            save()
    print_table(("system", "batch", "tok/s", "of_limit"), [(r[0], r[1], r[3], r[5]) for r in rows])


if __name__ == "__main__":
    main()
