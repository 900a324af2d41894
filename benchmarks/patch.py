"""Decode tokens/s of a transformers Llama model, unpatched and `flashgen.patch`ed, side by side.

The model is built by transformers from a bench config's shapes (runtime/decoder/bench.py CONFIGS; random
weights, bf16 on a GPU, float32 on the CPU, initialized on the device). For each compile setting, each
batch is decoded by `generate` with a static KV cache (greedy, exactly --new-tokens tokens after a random
--prompt-len prompt): "on" lets generate compile the decode step (torch.compile, as transformers does for
a static cache on a GPU), "off" runs it eagerly. Decode tokens/s is batch x (new tokens - 1) over the time
from the first token to the last, read off a logits processor that stamps each step (after a device
sync), after a warm-up generate of the same shapes (the compiles). The model is then patched in --quant
and measured the same way; the ratio is patched over unpatched.

    python benchmarks/patch.py [--config llama3-8b] [--batch 1,16] [--prompt-len 512] [--new-tokens 128]
                               [--quant bf16] [--compile off,on] [--out-dir benchmarks/results]
    python benchmarks/patch.py --config tiny  (on a CPU: float32, eager only; a smoke run)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, environment, print_table, write_results  # noqa: E402

import flashgen  # noqa: E402
from flashgen.errors import FlashgenError  # noqa: E402
from flashgen.runtime.checkpoints.weights import ModelConfig  # noqa: E402
from flashgen.runtime.decoder.bench import CONFIGS  # noqa: E402

HEADER = ("config", "quant", "compile", "batch", "prompt_len", "new_tokens", "unpatched_tok_s", "patched_tok_s",
          "ratio")


def hf_config(c: ModelConfig) -> Any:
    """A transformers LlamaConfig of `c`'s shapes (no EOS: every run decodes its full length)."""
    import transformers

    if c.model_type != "llama" or c.num_experts:
        raise FlashgenError(f"benchmarks/patch.py builds dense Llama models; this config is {c.model_type}")
    return transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=c.tie_word_embeddings, eos_token_id=None, pad_token_id=0)


def build(c: ModelConfig, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The transformers model of `c` with random weights, initialized where it will run."""
    import transformers

    torch.manual_seed(0)
    with device:
        return transformers.AutoModelForCausalLM.from_config(hf_config(c), dtype=dtype).eval()


class _Stamps:
    """A logits processor that records when each decode step's logits are ready (after a device sync)."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        return scores


def decode_tok_s(model: torch.nn.Module, batch: int, prompt_len: int, new_tokens: int, compiled: bool) -> float:
    """Decode tokens/s of greedy `generate` with a static cache, after a warm-up run of the same shapes."""
    dev = model.device
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt_len), device=dev,
                        generator=torch.Generator(dev).manual_seed(batch))
    kw = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, cache_implementation="static",
              disable_compile=not compiled, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, **kw)
        stamps = _Stamps(dev)
        model.generate(ids, logits_processor=[stamps], **kw)
    return batch * (new_tokens - 1) / (stamps.times[-1] - stamps.times[0])


def measure(c: ModelConfig, name: str, batches: list[int], prompt_len: int, new_tokens: int, quant: str,
            modes: list[str], device: torch.device) -> list[list[Any]]:
    """One row per (compile setting, batch): the unpatched and the patched model's decode tokens/s."""
    if prompt_len + new_tokens > c.max_position_embeddings:
        raise FlashgenError(f"--prompt-len + --new-tokens = {prompt_len + new_tokens} is past the model's "
                            f"{c.max_position_embeddings} positions")
    model = build(c, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    tok_s: dict[tuple[str, int], list[float]] = {}
    for patched in (False, True):
        handle = flashgen.patch(model, quant=quant) if patched else None
        for mode in modes:
            torch._dynamo.reset()  # (each setting compiles its own graphs, within dynamo's recompile limit)
            for b in batches:
                tok_s.setdefault((mode, b), []).append(decode_tok_s(model, b, prompt_len, new_tokens, mode == "on"))
        if handle is not None:
            handle.unpatch()
    return [[name, quant, mode, b, prompt_len, new_tokens, plain, ours, ours / plain]
            for (mode, b), (plain, ours) in tok_s.items()]


def main(argv: list[str] | None = None) -> int:
    gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="llama3-8b" if gpu else "tiny", help=f"one of {', '.join(CONFIGS)}")
    ap.add_argument("--batch", default="1,16", help="batch sizes, comma-separated")
    ap.add_argument("--prompt-len", type=int, default=512 if gpu else 16)
    ap.add_argument("--new-tokens", type=int, default=128 if gpu else 8)
    ap.add_argument("--quant", default="bf16", help="the patch's quant mode (bf16: the weights as they are)")
    ap.add_argument("--compile", default="off,on" if gpu else "off", help="off, on or both (generate's compile)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default=None, help="result files <out-dir>/<name>.json and .md (default patch_<config>)")
    args = ap.parse_args(argv)
    try:
        if args.config not in CONFIGS:
            raise FlashgenError(f"unknown config {args.config!r}; valid: {', '.join(CONFIGS)}")
        modes = args.compile.split(",")
        if not set(modes) <= {"off", "on"} or not modes:
            raise FlashgenError(f"--compile takes off, on or off,on; got {args.compile!r}")
        batches = [int(b) for b in args.batch.split(",")]
        if min(batches) < 1 or args.prompt_len < 1 or args.new_tokens < 2:
            raise FlashgenError("batches and --prompt-len must be at least 1, --new-tokens at least 2")
        device = torch.device("cuda" if gpu else "cpu")
        rows = measure(CONFIGS[args.config], args.config, batches, args.prompt_len, args.new_tokens, args.quant,
                       modes, device)
    except (FlashgenError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_table(HEADER, rows)
    name = args.name or f"patch_{args.config}"
    js, md = write_results(name, HEADER, rows, environment(None if gpu else "cpu"), args.out_dir,
                           notes="Decode tokens/s of transformers `generate` (static cache), the model unpatched "
                                 f"and `flashgen.patch(model, quant={args.quant!r})`ed; ratio = patched / unpatched.")
    print(f"wrote {js} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
