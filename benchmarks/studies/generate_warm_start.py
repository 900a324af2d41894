"""`flashgen generate` start-up on the CPU: time to the first generated token with an empty kernel cache
(every CPU kernel built, as every run did before CPU kernels were cached) and with the cache a first
run left (kernels loaded from it), alternated over rounds on one tiny random Llama folder.

    python benchmarks/studies/generate_warm_start.py --rounds 3
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from common import environment, print_table, write_results  # noqa: E402

PROMPT = "w1 w5 w9 w20 w33"


def tiny_folder(path: Path) -> Path:
    """A Llama of vocab 128, hidden 64, 2 layers, whose tokenizer reads w0..w127 as tokens 0..127."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      eos_token_id=None)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.save(str(path / "tokenizer.json"))
    return path


def first_token_s(folder: Path, cache: Path) -> float:
    """Seconds from launch to the first byte `flashgen generate` prints."""
    env = {**os.environ, "FLASHGEN_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "flashgen.cli", "generate", "--model", str(folder), "--prompt", PROMPT,
                          "--max-new-tokens", "8"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                         cwd=tempfile.gettempdir())
    p.stdout.read(1)
    first = time.perf_counter() - t0
    p.communicate()
    if p.returncode != 0:
        raise SystemExit(f"flashgen generate failed (exit {p.returncode})")
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_folder(Path(tmp) / "tiny")
        cold, warm = [], []
        for r in range(args.rounds):
            cache = Path(tmp) / f"cache{r}"
            cold.append(first_token_s(folder, cache))  # empty cache: every kernel built
            warm.append(first_token_s(folder, cache))  # the cache the run before left
            shutil.rmtree(cache)
    rows = [("empty cache (kernels built)", *(round(t, 2) for t in cold), round(statistics.median(cold), 2)),
            ("warm cache (kernels loaded)", *(round(t, 2) for t in warm), round(statistics.median(warm), 2))]
    header = ("run", *(f"round {i + 1} s" for i in range(args.rounds)), "median s")
    print_table(header, rows)
    write_results("generate_warm_start", header, rows, environment("cpu"),
                  notes="Time from launch to the first generated token of `flashgen generate` on a tiny random "
                        f"Llama folder, prompt {PROMPT!r}, 8 new tokens; cold and warm runs alternated per round.")


if __name__ == "__main__":
    main()
