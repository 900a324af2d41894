"""Whole-model decode on Llama-3-8B-shaped random weights: flashgen's decoder in each quant mode
against transformers' generate (eager, and static cache with torch.compile), and the bandwidth limit.

    python benchmarks/model.py [--batch 1,16,64] [--prompt-len 2000] [--new-tokens 300] [--quant bf16,w4a16]
                               [--no-cuda-graphs] [--peer-batch 1,64] [--fused-rows 1,0]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, copy_gbs, environment, print_table, write_results  # noqa: E402

from flashgen.runtime import bench, linear  # noqa: E402
from flashgen.runtime.dispatch import describe_sources  # noqa: E402


def transformers_tps(batch: int, prompt_len: int, new_tokens: int, static: bool) -> float:
    import transformers

    c = bench.CONFIGS["llama3-8b"]
    cfg = transformers.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                   intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
                                   num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                                   max_position_embeddings=8192, rope_theta=c.rope_theta)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, c.vocab_size, (batch, prompt_len), device="cuda")
    kw = {"cache_implementation": "static"} if static else {}
    with torch.no_grad():
        # Warm-up (and compilation): with a static cache, at the timed length, or the cache's new size recompiles.
        warm = new_tokens if static else 8
        model.generate(ids, max_new_tokens=warm, min_new_tokens=warm, do_sample=False, **kw)
        spent = []
        for n in (1, new_tokens):  # decode time = whole generate - a generate that only prefills
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)
            torch.cuda.synchronize()
            spent.append(time.perf_counter() - t0)
    del model
    torch.cuda.empty_cache()
    return batch * (new_tokens - 1) / (spent[1] - spent[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--new-tokens", type=int, default=300)
    ap.add_argument("--quant", default="bf16,w4a16")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="flashgen decode steps run eagerly")
    ap.add_argument("--peer-batch", default=None,
                    help="batches for the transformers peers (default: --batch; 'none': no peers)")
    ap.add_argument("--fused-rows", default=str(linear.FUSED_MAX_ROWS),
                    help="comma-separated row limits for norms and SiLU·mul fused into the linears they feed "
                         "(runtime/linear.py), one run of each (0: their own kernels)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default="model", help="result files: <out-dir>/<name>.json and .md")
    args = ap.parse_args()
    bw = copy_gbs()
    batches = [int(b) for b in args.batch.split(",")]
    rows: list[list] = []

    def save() -> None:  # after every row: a run cut short keeps what it measured
        write_results(args.name, ("system", "batch", "ttft_s", "tokens_per_s", "limit_tokens_per_s", "of_limit",
                                "decode_gemm_schedules"), rows,
                      {**environment(), "copy_gbs": bw}, args.out_dir,
                      f"Llama-3-8B-shaped random weights, prompt {args.prompt_len}, {args.new_tokens} new tokens. "
                      "Decode tokens/s; for transformers, the time of a generate call minus that of a one-token "
                      "call (its prefill). decode_gemm_schedules: how many of the decode step's GEMM workloads ran "
                      "a record of the tuning database (exact, or a bucket) and how many the analytic default.")

    for quant, fused_rows in ((q, int(f)) for q in args.quant.split(",") for f in args.fused_rows.split(",")):
        linear.FUSED_MAX_ROWS = fused_rows
        for r in bench.run("llama3-8b", batches, args.prompt_len, args.new_tokens, quant, bw,
                           cuda_graphs=not args.no_cuda_graphs):
            name = ("flashgen " + quant + ("" if r["cuda_graphs"] else " eager")
                    + ("" if fused_rows >= r["batch"] and quant in linear.FUSED_MODES else " (unfused)"))
            rows.append([name, r["batch"], r["ttft_s"], r["decode_tokens_per_s"], r["bandwidth_limit_tokens_per_s"],
                         r["of_limit"], describe_sources(r["decode_gemm_schedules"])])
            print(rows[-1], flush=True)
            save()
    for static in (False, True):
        for b in [] if args.peer_batch == "none" else [int(b) for b in (args.peer_batch or args.batch).split(",")]:
            tps = transformers_tps(b, args.prompt_len, args.new_tokens, static)
            rows.append(["transformers " + ("static+compile" if static else "eager"), b, float("nan"), tps,
                         float("nan"), float("nan"), ""])
            print(rows[-1], flush=True)
            save()
    print_table(("system", "batch", "tok/s", "of_limit"), [(r[0], r[1], r[3], r[5]) for r in rows])


if __name__ == "__main__":
    main()
