"""The `flashgen` command: ops, targets, compile, db.

User mistakes (bad op, dims, dtypes, targets, paths) end in one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

from flashgen.errors import FlashgenError
from flashgen.extras import require

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from flashgen.runtime.decoder.outcome import Outcome
    from flashgen.runtime.decoder.sampling import SamplingParams
    from flashgen.workload import Workload

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + message
        raise FlashgenError(message)


def _pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got '{text}'")
    return name.strip(), value.strip()


def cmd_ops(args: argparse.Namespace) -> int:
    from flashgen.oplib import OPS
    from flashgen.table import print_table

    rows = []
    for op in OPS.values():
        attrs = " ".join(f"{k}={'|'.join(v)}" for k, v in op.attrs.items())
        params = " ".join(f"{k}={v:g}" for k, v in op.params.items()) or "-"
        rows.append((op.name, op.kclass, ",".join(op.dims), attrs, params, op.doc))
    print_table(("op", "class", "dims", "attrs (first is default)", "params", "description"), rows)
    return 0


def cmd_targets(args: argparse.Namespace) -> int:
    from flashgen.table import print_table
    from flashgen.targets import load_targets

    rows = [(t.id, ",".join(t.aliases), t.vendor, t.backend, str(t.sm_count or "-"),
             f"{t.mem_bandwidth_gbs:g}", ",".join(t.dtypes), "; ".join(t.derived) or "-")
            for t in load_targets([args.targets_dir] if args.targets_dir else []).values()]
    print_table(("target", "names", "vendor", "backend", "SMs/CUs", "GB/s", "dtypes", "derived peak rates"), rows)
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    import flashgen
    from flashgen.compiler import check_supported, choose_schedule, resolve_target
    from flashgen.paths import out_folder

    wl = _workload(args)
    target = resolve_target(args.target, args.targets_dir)
    check_supported(wl, target)
    out = out_folder(args.out)
    _check_named_db(args.db)
    schedule = None if args.schedule is None else \
        _json_object(_json(args.schedule, "--schedule"), "--schedule", "{knob: value, ...}")
    choose_schedule(wl, target, args.db, schedule)  # (a bad --schedule refused before the status line)
    _status(f"building {wl.op_name} for {target.id}...")
    kernel = flashgen.compile(wl, target, schedule=schedule, db=args.db, targets_dir=args.targets_dir)
    files = kernel.save(out)
    print(f"{wl}  ->  {target.id}")
    print(f"workload key: {wl.key}")
    print(f"schedule: {json.dumps(kernel.schedule, sort_keys=True)}  [{kernel.metadata['schedule_source']}]")
    for f in files:
        print(f"wrote {f} ({f.stat().st_size} bytes)")
    return 0


def _check_named_db(path: str | None) -> None:
    """A database named with --db must be one (as `db list` says of it): a missing path would read as
    no records, and the schedule shown would silently pass over the user's."""
    from flashgen.db import Database

    if path is not None:
        Database(path, readonly=True).close()


def _workload(args: argparse.Namespace) -> Workload:
    """The workload named on the command line: an op, its --dim and --attr pairs and --dtype (given once:
    --dtype and --attr dtype= together are refused, not ranked)."""
    import flashgen

    if not args.op:
        raise FlashgenError("name an op (see `flashgen ops`) or pass --workloads FILE.jsonl")
    names = [n for n, _ in args.dim + args.attr]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise FlashgenError(f"--dim/--attr {', '.join(repeated)} given more than once")
    kw: dict[str, object] = {**dict(args.dim), **dict(args.attr)}
    if args.dtype is not None:
        if "dtype" in kw:
            raise FlashgenError(f"--dtype {args.dtype} and --attr dtype={kw['dtype']} both set the dtype; give one")
        kw["dtype"] = args.dtype
    return flashgen.workload(args.op, **kw)


def _json(text: str, where: str) -> Any:
    """`where`'s JSON text as a value, or one line saying why it is not JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # (numbers past int's digit limit are ValueErrors too)
        raise FlashgenError(f"{where}: not JSON ({e})") from None


def _json_object(value: Any, where: str, shape: str) -> dict:
    """`value` where it is a JSON object: JSON null would otherwise read as "not given", and a list or a
    number fail far from the option that carried it."""
    if not isinstance(value, dict):
        raise FlashgenError(f"{where}: must be a JSON object {shape}, got {json.dumps(value)[:40]}")
    return value


def _fixed_knobs(pairs: list[tuple[str, str]]) -> dict[str, int | str]:
    """--fix NAME=VALUE pairs as knob values (integers; a contraction `variant` is a name)."""
    out: dict[str, int | str] = {}
    for name, value in pairs:
        try:
            out[name] = value if name == "variant" else int(value)
        except ValueError:
            raise FlashgenError(f"--fix {name}={value}: knob values are integers") from None
    return out


def _tune_plan(args: argparse.Namespace) -> list[tuple]:
    """(workload, the producer it is timed behind or None) per workload: --behind JSON for all of them,
    or a "behind" of each line of --workloads FILE."""
    from flashgen.workload import parse_workload, read_workload_lines

    if args.workloads is not None:
        if args.op or args.dim or args.attr or args.dtype is not None:
            raise FlashgenError("give an op (with --dim, --dtype, --attr) or --workloads, not both")
        plan = read_workload_lines(args.workloads)
        if args.behind is not None and any(p is not None for _, p in plan):
            raise FlashgenError(f"{args.workloads} names producers (\"behind\"): give --behind or those, not both")
    else:
        plan = [(_workload(args), None)]
    if args.behind is None:
        return plan
    producer = parse_workload(_json(args.behind, "--behind"), "--behind")
    return [(wl, producer) for wl, _ in plan]


def _check_model_args(args: argparse.Namespace) -> None:
    """--model with its options, or the options without --model, refused in one line before any import."""
    if args.model is None:
        given = [o for o, v in (("--budget", args.budget), ("--context", args.context),
                                ("--quant", args.quant != ["bf16"]), ("--batches", args.batches != [1, 16, 64, 256])) if v]
        if given:
            raise FlashgenError(f"{given[0]} goes with --model")
        return
    if args.workloads is not None or args.op or args.dim or args.attr or args.dtype is not None or args.behind:
        raise FlashgenError("give --model, --workloads or an op, not more than one (--model finds each workload's producer)")
    if args.fix:
        raise FlashgenError("--fix pins a knob of one kernel class; --model tunes every class its steps launch")
    if args.budget is not None and (args.gpus or args.ray):
        raise FlashgenError("--budget times the tunes of this process; with --gpus or --ray leave it out")
    if args.model not in BENCH_CONFIGS:
        _check_model_folder(args.model, f", nor one of {', '.join(BENCH_CONFIGS)}")


def _check_model_folder(path: str, nor: str = "") -> None:
    """--model names a folder with a config.json, checked before torch loads (`nor`: what else it may
    name)."""
    from pathlib import Path

    if not Path(path).is_dir():
        raise FlashgenError(f"--model {path}: no such folder{nor}")
    if not (Path(path) / "config.json").is_file():
        raise FlashgenError(f"--model {path}: the folder holds no config.json")


def _model_config(name: str):
    """A bench config by name, or a model folder's config.json (checked as the decoder loads it)."""
    from flashgen.runtime.checkpoints.model_config import ModelConfig
    from flashgen.runtime.decoder.bench import CONFIGS

    return CONFIGS[name] if name in BENCH_CONFIGS else ModelConfig.from_folder(name)


def cmd_tune(args: argparse.Namespace) -> int:
    from flashgen.compiler import check_supported, resolve_target
    from flashgen.schedules.measure import feed_error
    from flashgen.schedules.space import ScheduleSpace

    if args.plot:  # before tuning: a missing extra or a bad path must not waste the tune
        require("matplotlib", "--plot")
        _check_plot_path(args.plot)
    _check_model_args(args)
    target = resolve_target(args.target, args.targets_dir)
    if args.gpus and args.ray:
        raise FlashgenError("give --gpus (this machine's GPUs) or --ray (a cluster's), not both")
    if (args.gpus or args.ray) and target.backend == "tvm":
        raise FlashgenError(f"--{'gpus' if args.gpus else 'ray'} spreads a GPU target's tuning over GPUs; "
                            f"{target.id} measures on this CPU: leave it out")
    model = _ModelPlan(args, target) if args.model else None
    plan = model.plan if model else _tune_plan(args)
    fixed = _fixed_knobs(args.fix)
    for wl, producer in plan:  # every check before any tuning
        check_supported(wl, target)
        ScheduleSpace(wl, target, tuple(sorted(fixed.items()))).knobs()  # unknown knob or value
        if producer is not None:
            check_supported(producer, target)
            if why := feed_error(producer, wl):
                raise FlashgenError(why)
    from flashgen.db import Database  # (the tuner's imports load numpy, XGBoost, torch: after every check)
    from flashgen.schedules.fanout import TuneOptions, fan_out
    from flashgen.schedules.ray_fanout import fan_out_ray
    from flashgen.schedules.tuner import plot_history, tune, with_schedule

    slots = _gpu_slots(args.gpus) if args.gpus else None
    results, failed = {}, []

    def report(i: int, outcome) -> None:
        wl, producer = plan[i]
        if isinstance(outcome, str):
            failed.append(f"{wl}: {outcome}")
            print(f"{wl}: not tuned: {outcome}")
            return
        results[i] = res = outcome
        where = f" behind {producer}" if producer is not None else ""
        if res.best is None:
            print(f"{wl}: no schedule ran correctly{where} ({res.measured} measured)")
            return
        gain = f", {res.default_us / res.best.latency_us:.2f}x the default" if res.default_us else ""
        print(f"{wl}: best {res.best.latency_us:.2f} us{where}{gain}; {res.measured} measured in "
              f"{res.wall_s:.0f} s; schedule {json.dumps(res.best.schedule, sort_keys=True)}", flush=True)

    options = TuneOptions(args.trials, args.strategy, args.seed, fixed, args.retry_failed,
                          served=_served(plan, target, args.db))
    try:
        if args.ray:
            fan_out_ray(plan, target, args.db, options, args.ray, report)
        elif slots is not None:
            fan_out(plan, target, args.db, options, slots, report)
        else:
            with Database(args.db) as db:
                for i, (wl, producer) in enumerate(plan):
                    if model and not model.start(i):
                        break
                    task = replace(options, trials=model.trials[i]) if model else options
                    # the producer's schedule as the database has it now: earlier lines may have tuned it
                    report(i, tune(task.task(wl, target, with_schedule(producer, target, db)), db, progress=sys.stderr))
    except KeyboardInterrupt:  # (the tunes record as they measure: say where to resume)
        if model:
            print(model.interrupted(), file=sys.stderr)
        raise
    if model:
        model.finish()
    if args.plot:
        plot_history([results[i] for i in sorted(results)], args.plot)
        print(f"wrote {args.plot}")
    if failed:
        raise FlashgenError(f"{len(failed)} of {len(plan)} workloads were not tuned; the first: {failed[0]}")
    return 0


def _served(plan: list[tuple], target, db: str | None) -> dict[str, dict]:
    """The schedule dispatch serves each planned workload with before the run, where a record gives it
    (not the default): each tune measures it right after the default (schedules/tuner.py)."""
    from flashgen.runtime.serving.dispatch import Dispatcher

    dispatcher = Dispatcher(target, db)
    out = {}
    for wl, _ in plan:
        d = dispatcher.choose(wl, target)
        if d.kind != "default":
            out[wl.key] = d.schedule
    return out


class _ModelPlan:
    """`tune --model`: the traced plan less the lines tuned already, each line's trials left, its
    progress line and the budget, and the steps' estimates before and after
    (runtime/decoder/model_tune.py)."""
    clock = staticmethod(time.monotonic)

    def __init__(self, args: argparse.Namespace, target) -> None:
        from flashgen.db import Database
        from flashgen.runtime.decoder.model_tune import Estimates, plan_lines, recorded, steps

        self.args, self.target, self.t0 = args, target, self.clock()
        config = _model_config(args.model)
        with Database(args.db) as db:
            self.db_path = db.path
            self.before = steps(config, args.quant, args.batches, target, self.db_path, args.context)
            self.estimates = Estimates(target, self.db_path)
            lines, skipped = plan_lines(self.before, target, self.estimates)
            for note in skipped:
                print(note)
            self.lines, self.trials = [], []
            for line in lines:
                have = recorded(db, line, target)
                if have >= args.trials:
                    print(f"{_line_name(line)}: {line.share:.1%} of the steps' time; tuned already ({have} records)")
                else:
                    self.lines.append(line)
                    self.trials.append(args.trials - have)
        self.plan = [(line.workload, line.producer) for line in self.lines]
        self.started = 0
        print(f"{args.model}: {len(lines)} workloads over {len(self.before)} decode steps; {len(self.plan)} to tune",
              flush=True)

    def start(self, i: int) -> bool:
        """Whether line i may start (the budget); prints its progress line."""
        spent = self.clock() - self.t0
        if self.args.budget is not None and spent >= self.args.budget * 60:
            left = self.lines[i:]
            print(f"budget of {self.args.budget:g} min spent: {len(left)} workloads left untuned "
                  f"({sum(ln.share for ln in left):.1%} of the steps' time); run again to go on", flush=True)
            return False
        self.started = i + 1
        line = self.lines[i]
        print(f"[{i + 1}/{len(self.lines)}] {_line_name(line)}: {line.share:.1%} of the steps' time, "
              f"{line.count} launches", flush=True)
        return True

    def finish(self) -> None:
        """The table of each step's estimate before and after, from the database's records."""
        from flashgen.runtime.decoder.model_tune import Estimates, steps, table
        from flashgen.table import print_table

        after = steps(_model_config(self.args.model), self.args.quant, self.args.batches, self.target, self.db_path,
                      self.args.context)
        print_table(["mode", "batch", "step us before", "after", "speedup"],
                    table(self.before, after, self.estimates, Estimates(self.target, self.db_path)))

    def interrupted(self) -> str:
        return (f"stopped during line {self.started} of {len(self.lines)}: every measurement so far is recorded in "
                f"{self.db_path}; run the same command again to resume")


def _line_name(line) -> str:
    return f"{line.workload}" + (f" behind {line.producer.op_name}" if line.producer is not None else "")


def _gpu_slots(spec: str) -> list[str]:
    """--gpus as one CUDA_VISIBLE_DEVICES value per worker (schedules/fanout.py)."""
    import torch

    from flashgen.schedules.fanout import gpu_slots

    return gpu_slots(spec, torch.cuda.device_count())


def _check_plot_path(path: str) -> None:
    """A PNG file path in a writable folder (matplotlib would add .png to a name without it, and a
    folder given would end in DIR.png beside it)."""
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        raise FlashgenError(f"--plot {path} is a folder; give a file path ending in .png")
    if p.suffix.lower() != ".png":
        raise FlashgenError(f"--plot {path}: the plot is a PNG; give a path ending in .png")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise FlashgenError(f"--plot {path}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise FlashgenError(f"--plot {path}: the folder {parent} is not writable")


def cmd_explain(args: argparse.Namespace) -> int:
    """Which schedule the runtime would dispatch for this workload, and why."""
    from flashgen.compiler import check_supported, resolve_target

    wl = _workload(args)
    target = resolve_target(args.target, args.targets_dir)
    check_supported(wl, target)
    _check_named_db(args.db)
    from flashgen.runtime.serving.dispatch import Dispatcher  # (torch: after the checks)

    d = Dispatcher(target, args.db).choose(wl, target)
    print(f"{wl}  on {target.id}")
    print(f"workload key: {wl.key}")
    print(f"schedule: {json.dumps(d.schedule, sort_keys=True)}  [{d.source}]")
    return 0


def _checked(kind: Callable[[str], Any], ok: Callable[[Any], bool], must: str) -> Callable[[str], Any]:
    """An argparse type: `kind(text)` where `ok` holds for it, else a one-line "must be ..." error before
    any work (NaN fails every comparison, so a range refuses it)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {must}, got {text!r}")
        return value
    return parse


# Bounds of integer options, checked as they are parsed (a huge value otherwise fails deep inside a library).
MAX_TRIALS = 1_000_000  # past the valid points of any space (the largest hold about 10^5): more is a typo
_SEED = _checked(int, lambda v: 0 <= v < 2**63, "an integer in 0..2**63-1")  # torch's generators take 64 bits
# (named here, not imported: a mistake is refused before torch loads; tests check them against the
# decoder's MODES and bench CONFIGS)
QUANT_MODES = ("bf16", "w8a16", "w4a16", "w8a8", "w4a8", "fp8", "w4fp8", "mixed")
BENCH_CONFIGS = ("llama3-8b", "mixtral-2l", "smollm2-135m", "tiny")


def _quant_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",")]
    bad = [m for m in modes if m not in QUANT_MODES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown quant mode {bad[0]!r}; valid: {', '.join(QUANT_MODES)}")
    return list(dict.fromkeys(modes))


def _batches(text: str) -> list[int]:
    parts = [b.strip() for b in text.split(",")]
    if not all(b.isdigit() and int(b) >= 1 for b in parts):
        raise argparse.ArgumentTypeError(f"expected batch sizes of at least 1, comma-separated, got {text!r}")
    return sorted({int(b) for b in parts})


_NONEMPTY = _checked(str, lambda v: bool(v.strip()), "a non-empty value")  # "" would read as "not given"


def _read_utf8(option: str, path: str) -> str:
    """The text of `option`'s file ('-': standard input), which must be UTF-8, or one line saying why not."""
    from pathlib import Path

    name = "standard input" if path == "-" else path
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as e:
        raise FlashgenError(f"{option}: cannot read {name}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FlashgenError(f"{option}: {name} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                            f"{e.start})") from None


def _read_prompt(path: str) -> str:
    """--prompt-file's text, byte for byte: a prompt built by a chat template ends in the newline its
    answer starts after, and a stripped one would make the model write that newline itself."""
    return _read_utf8("--prompt-file", path)


def _prompt_argument(text: str, option: str = "--prompt") -> str:
    """`option`'s text, which must be UTF-8: Python hands bytes of another encoding over as lone
    surrogates (0xff as '\\udcff'), which the tokenizer cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        byte = f"byte 0x{code - 0xdc00:02x}" if 0xdc80 <= code <= 0xdcff else f"character U+{code:04X}"
        raise FlashgenError(f"{option} is not UTF-8 text ({byte} at character {e.start})") from None
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate from a Hugging Face model folder, printing text as tokens arrive; with --tp N, in N ranks
    (spawned here, or this process being one of torchrun's)."""
    from pathlib import Path

    _check_model_folder(args.model)
    prompt_text = _prompt_argument(args.prompt) if args.prompt_file is None else _read_prompt(args.prompt_file)
    if args.system is not None and not args.chat:
        raise FlashgenError("--system is the chat's system turn: give it with --chat")
    system = None if args.system is None else _prompt_argument(args.system, "--system")

    import torch

    from flashgen.runtime.checkpoints.model_config import ModelConfig
    from flashgen.runtime.decoder.ranks import launch, start_rank, stop_rank, under_torchrun
    from flashgen.runtime.decoder.tensor_parallel import check_gpus, check_tp

    check_tp(ModelConfig.from_folder(Path(args.model)), args.tp)
    params, cap = _sampling(args, Path(args.model))
    if args.chat:  # (rendered once here: every rank then encodes the same text)
        prompt_text = _chat_prompt(Path(args.model), prompt_text, system)
    if args.tp > 1 and torch.cuda.is_available():
        check_gpus(args.tp, torch.cuda.device_count())
    if args.tp == 1:
        _generate(torch.device("cuda" if torch.cuda.is_available() else "cpu"), args, prompt_text, params, cap)
    elif under_torchrun():
        _generate(start_rank(args.tp), args, prompt_text, params, cap)
        stop_rank()
    else:
        launch(args.tp, _generate, (args, prompt_text, params, cap))
    return 0


def _chat_prompt(folder: Path, prompt: str, system: str | None) -> str:
    """The prompt as a user turn (after the system turn) in the folder's chat template, ready for the
    assistant's answer (runtime/checkpoints/chat_template.py)."""
    from flashgen.runtime.checkpoints.chat_template import ChatTemplate, chat_messages

    template = ChatTemplate.from_folder(folder)
    if template is None:
        raise FlashgenError(f"--chat: {folder} has no chat template (no chat_template.jinja, no chat_template in "
                            "tokenizer_config.json); give the prompt as the model expects it, without --chat")
    return template.render(chat_messages(prompt, system))


SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
DEFAULT_NEW_TOKENS = 64  # (named here for the help, before torch loads: generation_config's, tests check)


def _sampling(args: argparse.Namespace, folder: Path) -> tuple[SamplingParams, int | None]:
    """The request's decoding: each flag where given, else the model folder's generation_config.json
    setting (runtime/checkpoints/generation_config.py), else SamplingParams' default; and the file's max_length, the
    cap on prompt + new tokens where neither --max-new-tokens nor the file's max_new_tokens says how
    many (None: no cap). The file is checked even where every flag is given: a broken one is never
    half-read."""
    from flashgen.runtime.checkpoints.generation_config import generation_defaults, sampling_params

    given = {k: v for k in SAMPLING_FLAGS if (v := getattr(args, k)) is not None}
    return sampling_params(generation_defaults(folder), given, args.max_new_tokens, args.seed)


BLOCK_TOKENS = 16  # tokens a KV cache block holds


def add_prefix_cache_flag(parser: argparse.ArgumentParser) -> None:
    """`--no-prefix-cache`, for every command that runs an engine (`Engine(prefix_cache=...)`)."""
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="compute every prompt whole, sharing no KV cache blocks of earlier prompts "
                             "(automatic prefix caching is on by default)")


def _check_cache_blocks(blocks: int, prompt_len: int, new: int) -> None:
    """--cache-blocks must hold the request's prompt and new tokens (the engine keeps its CUDA graphs'
    padding block beside them: `Engine`); checked before the weights load."""
    need = -(-(prompt_len + new) // BLOCK_TOKENS)
    if need > blocks:
        raise FlashgenError(f"--cache-blocks {blocks} is too few: the prompt's {prompt_len} tokens and {new} new "
                            f"ones need {need} blocks of {BLOCK_TOKENS} tokens; pass --cache-blocks {need} or more")


def _generate(device: torch.device, args: argparse.Namespace, prompt_text: str, params: SamplingParams,
              cap: int | None) -> None:
    """`flashgen generate` on `device`: the whole model, or this rank's part of it (only rank 0 prints);
    `cap`: generation_config.json's max_length where it bounds the new tokens (`_sampling`)."""
    from pathlib import Path

    import torch

    from flashgen.runtime.decoder.outcome import Outcome
    from flashgen.runtime.checkpoints.generation_config import within_max_length
    from flashgen.runtime.checkpoints.model_config import ModelConfig
    from flashgen.runtime.checkpoints.tokenizer import load_tokenizer
    from flashgen.runtime.decoder.loading import load_engine

    folder = Path(args.model)
    config = ModelConfig.from_folder(folder)
    tok = load_tokenizer(folder, config.vocab_size)
    # (before the weights load: a request refused costs no loading; a chat template writes its own BOS)
    prompt = tok.encode(prompt_text, add_special_tokens=not args.chat).ids
    if not prompt:
        option = "--prompt" if args.prompt_file is None else f"--prompt-file {args.prompt_file}"
        what = "is empty" if not prompt_text else f"{prompt_text!r:.40} encodes to no tokens"
        raise FlashgenError(f"{option}: the prompt {what}; give the text to continue from")
    n = within_max_length(params.max_new_tokens, cap, len(prompt), folder / "generation_config.json")
    _check_cache_blocks(args.cache_blocks, len(prompt), n)
    engine = load_engine(folder, config, device, args.cache_blocks, BLOCK_TOKENS, args.tp, args.quant,
                         prefix_cache=not args.no_prefix_cache,
                         status=_status if args.tp == 1 or torch.distributed.get_rank() == 0 else None)
    model = engine.model
    start = time.perf_counter()
    rid = engine.add(prompt, replace(params, max_new_tokens=n))
    if rid in engine.finished:
        raise FlashgenError(engine.finished[rid].error)
    stream = model.rank == 0 and args.output == "text"
    shown, first = "", None
    while engine.waiting or engine.running:
        engine.step()
        req = engine.finished.get(rid) or next(r for r in engine.running if r.id == rid)
        if first is None and req.output:
            first = time.perf_counter() - start
        text = tok.decode(req.output)
        if stream:
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
        shown = text
    total = time.perf_counter() - start
    if stream:
        sys.stdout.write("\n")
        sys.stdout.flush()
    if engine.finished[rid].error:  # a step that failed (the engine does not raise it)
        raise FlashgenError(engine.finished[rid].error)
    if model.rank == 0:
        _report(Outcome.of(engine.finished[rid], config.eos_token_ids, first, total), shown, args)


def _report(outcome: Outcome, text: str, args: argparse.Namespace) -> None:
    """After the text, how it ended (stderr); with --output json, everything as one object (stdout). An
    instruct model given a raw prompt often ends at once (EOS first): where the folder has a chat template,
    say so."""
    if args.output == "json":
        print(json.dumps(outcome.to_json(text)), flush=True)
        return
    from pathlib import Path

    from flashgen.runtime.checkpoints.chat_template import has_template

    at_once = outcome.reason == "eos" and len(outcome.token_ids) == 1
    hint = "; the folder has a chat template: --chat puts the prompt in it" \
        if at_once and not args.chat and has_template(Path(args.model)) else ""
    print(outcome.line() + hint, file=sys.stderr, flush=True)


def _status(line: str) -> None:
    """A one-line status on stderr before a step that takes seconds (stdout stays the results)."""
    print(line, file=sys.stderr, flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a model folder over OpenAI's HTTP API (runtime/server/); with --tp N, in N ranks (spawned
    here, or this process being one of torchrun's), rank 0 serving."""
    from pathlib import Path

    folder = Path(args.model)
    if not (folder / "config.json").is_file():
        raise FlashgenError(f"--model {args.model}: " + ("the folder holds no config.json" if folder.is_dir()
                                                         else "no such folder"))

    import torch

    from flashgen.runtime.checkpoints.model_config import ModelConfig
    from flashgen.runtime.decoder.ranks import launch, start_rank, stop_rank, under_torchrun
    from flashgen.runtime.decoder.tensor_parallel import check_gpus, check_tp
    from flashgen.runtime.server.main import ServeOptions, listen, serve

    check_tp(ModelConfig.from_folder(folder), args.tp)
    options = ServeOptions(folder, args.host, args.port, args.served_model_name or folder.resolve().name, args.quant,
                           args.tp, args.cache_blocks, BLOCK_TOKENS, args.max_queue, not args.no_prefix_cache)
    if args.tp > 1 and torch.cuda.is_available():
        check_gpus(args.tp, torch.cuda.device_count())
    if args.tp == 1:
        serve(torch.device("cuda" if torch.cuda.is_available() else "cpu"), options)
    elif under_torchrun():
        serve(start_rank(args.tp), options)
        stop_rank()
    else:
        listen(args.host, args.port).close()  # (a port in use is one line before any rank starts)
        launch(args.tp, serve, (options,))
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    """Quantize a float model folder's linears by GPTQ or AWQ on calibration text (or round them to
    nearest on the same grid: --method rtn) into a GPTQ (AWQ) checkpoint folder
    (runtime/checkpoints/gptq_quantize.py), which the decoder then loads as it is."""
    from pathlib import Path

    folder, out = Path(args.model), Path(args.out)
    if not (folder / "config.json").is_file():
        raise FlashgenError(f"{args.model}: " + ("the folder holds no config.json" if folder.is_dir()
                                                 else "no such folder"))
    if out.exists():
        raise FlashgenError(f"{args.out} exists: give a new folder to write the checkpoint in")
    if (args.calib is None) != (args.method == "rtn"):
        raise FlashgenError(f"--method {args.method} takes --calib TEXTFILE" if args.calib is None else
                            "--method rtn takes no --calib: it rounds to nearest without calibration")
    try:
        text = Path(args.calib).read_text(encoding="utf-8") if args.calib is not None else None
    except (OSError, UnicodeDecodeError) as e:
        raise FlashgenError(f"--calib {args.calib}: cannot read it as UTF-8 text ({type(e).__name__})") from None

    from flashgen.runtime.checkpoints.gptq_quantize import GptqOptions, calibration_tokens, check, quantize_folder

    options = GptqOptions(args.bits, args.group, not args.asym, args.damp, method=args.method)
    config = check(folder, out, options)  # (before the calibration text is tokenized and the model loads)
    tokens = calibration_tokens(folder, config, text, args.samples, args.seq_len) if text is not None else None
    _status(f"{args.method.upper()} {args.bits}-bit, group {args.group}, {'asymmetric' if args.asym else 'symmetric'}"
            + (f": {args.samples} samples of {args.seq_len} tokens from {args.calib}" if text is not None else "")
            + f", {config.num_layers} layers")
    quantize_folder(folder, out, tokens, options, progress=_status)
    print(out)
    return 0


def cmd_bench_model(args: argparse.Namespace) -> int:
    """Decode throughput on random weights of a known architecture, against the bandwidth limit."""
    from flashgen.runtime.decoder.bench import defaults, run
    from flashgen.table import print_table
    from flashgen.targets import device_target

    for name, value in defaults().items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        raise FlashgenError(f"--batch takes integers separated by commas, got {args.batch!r}") from None
    if any(b < 1 for b in batches):
        raise FlashgenError("--batch sizes must be at least 1")
    target = device_target()
    rows = run(args.config, batches, args.prompt_len, args.new_tokens, args.quant, target.copy_gbs,
               cuda_graphs=not args.no_cuda_graphs, progress=_status)
    graphs = "on" if rows and rows[0]["cuda_graphs"] else "off"
    print(f"{args.config} quant={args.quant} prompt={args.prompt_len} new={args.new_tokens} on {target.id} "
          f"({target.copy_gbs:g} GB/s), CUDA graphs {graphs}")
    print_table(("batch", "TTFT s", "decode tok/s", "limit tok/s", "of limit"),  # (one new token: no decode step)
                [(str(r["batch"]), f"{r['ttft_s']:.3f}", f"{r['decode_tokens_per_s']:.1f}" if r["steps"] else "-",
                  f"{r['bandwidth_limit_tokens_per_s']:.1f}", f"{r['of_limit']:.1%}" if r["steps"] else "-")
                 for r in rows])
    if rows and rows[0]["fallbacks"]:
        print("torch fallbacks: " + "; ".join(rows[0]["fallbacks"]))
    from flashgen.runtime.serving.dispatch import describe_sources
    for r in rows:
        if r["decode_gemm_schedules"]:
            print(f"batch {r['batch']} decode GEMM schedules: {describe_sources(r['decode_gemm_schedules'])}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from flashgen import __version__
    from flashgen.db import cli as db_cli

    p = _Parser(prog="flashgen", description="Generated, tuned kernels for LLM inference operators.")
    p.add_argument("--version", action="version", version=f"flashgen {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    ops = sub.add_parser("ops", help="list every op with its dims, attrs and description")
    ops.set_defaults(func=cmd_ops)

    tg = sub.add_parser("targets", help="list the target descriptors")
    tg.add_argument("--targets-dir", help="a folder of extra descriptor files (also $FLASHGEN_TARGETS_PATH)")
    tg.set_defaults(func=cmd_targets)

    c = sub.add_parser("compile", help="generate and build one kernel ahead of time (no GPU needed)")
    c.add_argument("op")
    c.add_argument("--dim", type=_pair, action="append", default=[], metavar="NAME=VALUE")
    c.add_argument("--dtype", type=_NONEMPTY, help="activation dtype (bf16, fp16, fp32; or --attr dtype=)")
    c.add_argument("--attr", type=_pair, action="append", default=[], metavar="NAME=VALUE",
                   help="another workload attribute, e.g. out_dtype=int8 or style=gptj")
    c.add_argument("--target", required=True, help="target id, architecture or device (see `flashgen targets`)")
    c.add_argument("--out", required=True, type=_NONEMPTY, help="folder for source, binary, assembly and metadata")
    c.add_argument("--schedule", help="a schedule as a JSON object, instead of the database's best or the default")
    c.add_argument("--db", help="tuning database (default: $FLASHGEN_DB or the user cache folder)")
    c.add_argument("--targets-dir", help="a folder of extra descriptor files")
    c.set_defaults(func=cmd_compile)

    t = sub.add_parser("tune", help="search schedules, measuring on the target, and record them in the database")
    t.add_argument("op", nargs="?")
    t.add_argument("--dim", type=_pair, action="append", default=[], metavar="NAME=VALUE")
    t.add_argument("--dtype", type=_NONEMPTY)
    t.add_argument("--attr", type=_pair, action="append", default=[], metavar="NAME=VALUE")
    t.add_argument("--workloads", type=_NONEMPTY,
                   help="a JSON-lines file of workloads ({op, dims, attrs} per line, no other key; a line's "
                        "\"behind\": {op, dims, attrs} times it behind that producer, as --behind)")
    t.add_argument("--model", metavar="FOLDER|CONFIG",
                   help="tune every kernel the decoder's decode steps launch for this model (a folder with "
                        "config.json, or " + ", ".join(BENCH_CONFIGS) + "), in order of its share of the steps' time")
    t.add_argument("--quant", type=_quant_modes, default=["bf16"], metavar="MODES",
                   help=f"with --model: quant modes, comma-separated ({', '.join(QUANT_MODES)}; default bf16)")
    t.add_argument("--batches", type=_batches, default=[1, 16, 64, 256], metavar="B,B,...",
                   help="with --model: decode batch sizes, comma-separated (default 1,16,64,256)")
    t.add_argument("--context", type=_checked(int, lambda v: v >= 1, "a positive number of tokens"), metavar="TOKENS",
                   help="with --model: the decode steps' longest context, which picks the attention's context "
                        "bucket (a power of two from 512; default: the model's whole window)")
    t.add_argument("--budget", type=_checked(float, lambda v: 0 < v < math.inf, "a positive number of minutes"),
                   metavar="MINUTES", help="with --model: start no workload's tune after this much wall time "
                                           "(default: tune them all)")
    t.add_argument("--target", required=True)
    t.add_argument("--trials", type=_checked(int, lambda v: 1 <= v <= MAX_TRIALS, f"an integer in 1..{MAX_TRIALS}"),
                   default=64, help=f"new measurements per workload (default 64, at most {MAX_TRIALS})")
    t.add_argument("--strategy", default="evolutionary", choices=("evolutionary", "random", "exhaustive"))
    t.add_argument("--seed", type=_SEED, default=0)
    t.add_argument("--fix", type=_pair, action="append", default=[], metavar="KNOB=VALUE",
                   help="propose only schedules with this knob value, e.g. --fix tma=1 (repeatable)")
    t.add_argument("--behind", metavar="JSON",
                   help="time each candidate right behind this producer workload ({op, dims, attrs}; its "
                        "first output is the tuned workload's first input, its schedule the database's best), "
                        "as a decode step runs it; dispatch prefers such records")
    t.add_argument("--gpus", metavar="all|N",
                   help="tune on every local GPU (or the first N) at once: one worker per GPU, each workload "
                        "tuned by one of them, all recorded in the one database")
    t.add_argument("--ray", metavar="ADDRESS",
                   help="tune on every GPU of the Ray cluster at ADDRESS ('auto': the one this host is part of), "
                        "one actor per GPU, every record brought back into the one database "
                        "(needs flashgen[ray])")
    t.add_argument("--retry-failed", action="store_true",
                   help="measure again the schedules recorded as timeout or crash (a loaded machine's verdicts)")
    t.add_argument("--db", help="tuning database (default: $FLASHGEN_DB or the user cache folder)")
    t.add_argument("--plot", help="write best-so-far against trials to this PNG")
    t.add_argument("--targets-dir", help="a folder of extra descriptor files")
    t.set_defaults(func=cmd_tune)

    e = sub.add_parser("explain", help="say which schedule the runtime dispatches for a workload, and why")
    e.add_argument("op")
    e.add_argument("--dim", type=_pair, action="append", default=[], metavar="NAME=VALUE")
    e.add_argument("--dtype", type=_NONEMPTY)
    e.add_argument("--attr", type=_pair, action="append", default=[], metavar="NAME=VALUE")
    e.add_argument("--target", required=True)
    e.add_argument("--db", help="tuning database (default: $FLASHGEN_DB or the user cache folder)")
    e.add_argument("--targets-dir", help="a folder of extra descriptor files")
    e.set_defaults(func=cmd_explain)

    g = sub.add_parser("generate", help="generate text from a Hugging Face Llama/Mistral/Qwen2 folder")
    g.add_argument("--model", required=True, help="folder with config.json, safetensors and tokenizer.json")
    source = g.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument("--prompt-file", metavar="PATH",
                        help="read the prompt from this UTF-8 file ('-': standard input), byte for byte (a final "
                             "newline is part of it), for prompts longer than an argument can carry")
    g.add_argument("--chat", action="store_true",
                   help="put the prompt in the model's chat template as the user's turn, ready for the answer "
                        "(tokenizer_config.json's chat_template, or chat_template.jinja)")
    g.add_argument("--system", metavar="TEXT", help="with --chat: the system turn before the user's")
    at_least = lambda low: lambda v: v >= low  # noqa: E731
    g.add_argument("--max-new-tokens", type=_checked(int, at_least(1), "an integer of at least 1"),
                   help=f"(default: the model's generation_config.json max_new_tokens, else {DEFAULT_NEW_TOKENS} "
                        "within its max_length)")
    g.add_argument("--temperature", type=_checked(float, lambda v: 0 <= v < math.inf, "a finite number of at least 0"),
                   help="0: greedy (default: the model's generation_config.json if it sets do_sample, else 0)")
    g.add_argument("--top-k", type=_checked(int, at_least(0), "an integer of at least 0"),
                   help="sample from the k likeliest tokens, 0: all (default: the model's generation_config.json, "
                        "else 50, as transformers)")
    g.add_argument("--top-p", type=_checked(float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
                   help="sample from the likeliest tokens of this total probability (default: the model's "
                        "generation_config.json, else 1: all)")
    g.add_argument("--min-p", type=_checked(float, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
                   help="drop tokens less likely than this times the likeliest (default: the model's "
                        "generation_config.json, else 0: none)")
    g.add_argument("--repetition-penalty", type=_checked(float, lambda v: 0 < v < math.inf, "a finite number above 0"),
                   help="divide the positive logits of tokens already in the prompt or output by this, multiply "
                        "the negative ones, greedy or sampling (default: the model's generation_config.json, "
                        "else 1: none)")
    g.add_argument("--seed", type=_SEED, default=0)
    g.add_argument("--output", choices=("text", "json"), default="text",
                   help="text: stream the text, then on stderr why it stopped, the tokens generated, the time to the "
                        "first token and the decode rate; json: print all that and the token ids as one JSON object "
                        "when done, for scripts")
    g.add_argument("--cache-blocks", type=_checked(int, at_least(1), "an integer of at least 1"), default=1024,
                   help=f"KV cache size in blocks of {BLOCK_TOKENS} tokens")
    g.add_argument("--tp", type=_checked(int, at_least(1), "an integer of at least 1"), default=1,
                   help="tensor-parallel ranks, one per GPU (default 1); spawned here, or started by torchrun "
                        "--nproc-per-node N")
    g.add_argument("--quant", default="bf16", choices=QUANT_MODES,
                   help="the linears' quant mode (default bf16; a GPTQ/AWQ/compressed-tensors folder computes in "
                        "its own)")
    add_prefix_cache_flag(g)
    g.set_defaults(func=cmd_generate)

    sv = sub.add_parser("serve", help="serve a Hugging Face model folder over OpenAI's HTTP API",
                        description="Serve a model folder over OpenAI's HTTP API: /v1/completions, "
                                    "/v1/chat/completions (streamed with stream: true), /v1/models and /health, "
                                    "requests batched continuously (docs/serving.md).")
    sv.add_argument("--model", required=True, help="folder with config.json, safetensors and tokenizer.json")
    sv.add_argument("--host", type=_NONEMPTY, default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument("--port", type=_checked(int, lambda v: 0 <= v <= 65535, "a port in 0..65535"), default=8000,
                    help="port to listen on (default 8000; 0: a free one, printed)")
    sv.add_argument("--quant", default="bf16", choices=QUANT_MODES, help="the linears' quant mode (default bf16)")
    sv.add_argument("--tp", type=_checked(int, at_least(1), "an integer of at least 1"), default=1,
                    help="tensor-parallel ranks, one per GPU (default 1); spawned here, or started by torchrun")
    sv.add_argument("--cache-blocks", type=_checked(int, at_least(1), "an integer of at least 1"), default=1024,
                    help=f"KV cache size in blocks of {BLOCK_TOKENS} tokens, shared by the running requests")
    sv.add_argument("--max-queue", type=_checked(int, at_least(1), "an integer of at least 1"), default=256,
                    help="requests that may wait for room in the batch; more are answered 429 (default 256)")
    sv.add_argument("--served-model-name", type=_NONEMPTY, metavar="NAME",
                    help="the model's name in requests and /v1/models (default: the folder's name)")
    add_prefix_cache_flag(sv)
    sv.set_defaults(func=cmd_serve)

    qz = sub.add_parser("quantize", help="quantize a float model folder into a GPTQ or AWQ checkpoint (CPU)",
                        description="Quantize a Hugging Face Llama-family folder's decoder linears by GPTQ or AWQ "
                                    "on calibration text, layer by layer on the CPU, into a GPTQ (AWQ) checkpoint "
                                    "folder that generate and serve load (docs/usage.md).")
    qz.add_argument("model", metavar="MODEL_FOLDER", help="a float model folder (config.json, safetensors, tokenizer)")
    qz.add_argument("out", metavar="OUT_FOLDER", help="the checkpoint folder to write (must not exist)")
    qz.add_argument("--method", choices=("gptq", "awq", "rtn"), default="gptq",
                    help="gptq (default); awq: activation-aware input scales, then round to nearest, in AWQ's "
                         "format (4 bits); rtn: round to nearest on GPTQ's grid, stored alike (no calibration)")
    qz.add_argument("--bits", type=int, choices=(4, 8), default=4,
                    help="4 (default), or 8 (per channel and symmetric: --group -1)")
    qz.add_argument("--group", type=int, default=128,
                    help="inputs per scale, dividing every linear's inputs; -1: one per output channel (default 128)")
    qz.add_argument("--asym", action="store_true",
                    help="a zero point per group (default: symmetric, the grid of the decoder's RTN modes)")
    qz.add_argument("--calib", metavar="TEXTFILE", help="calibration text, UTF-8 (gptq, awq)")
    qz.add_argument("--samples", type=_checked(int, at_least(1), "an integer of at least 1"), default=64,
                    help="calibration sequences, spread over the text (default 64)")
    qz.add_argument("--seq-len", type=_checked(int, at_least(2), "an integer of at least 2"), default=512,
                    help="tokens per calibration sequence (default 512)")
    qz.add_argument("--damp", type=_checked(float, lambda v: 0 <= v < 1, "a fraction in [0, 1)"), default=0.01,
                    help="added to the Hessian's diagonal, as a fraction of its mean (default 0.01)")
    qz.set_defaults(func=cmd_quantize)

    bm = sub.add_parser("bench-model", help="decode tokens/s on random weights of an architecture (no download)",
                        description="Decode tokens/s on random weights of an architecture, against the bandwidth "
                                    "limit. Defaults follow the device: on a GPU llama3-8b, batches 1,16,64, a "
                                    "2000-token prompt and 300 new tokens; on a machine without one smollm2-135m, "
                                    "batches 1,8, a 64-token prompt and 32 new tokens (the 8B model's float32 "
                                    "weights alone are 32 GB). A run that would not fit in free memory is refused "
                                    "first, with its estimate.")
    bm.add_argument("--config", choices=BENCH_CONFIGS,  # (a typo refused before torch loads)
                    help=f"{', '.join(BENCH_CONFIGS)} (default: llama3-8b on a GPU, else smollm2-135m)")
    bm.add_argument("--batch", help="batch sizes, comma-separated (default: 1,16,64 on a GPU, else 1,8)")
    bm.add_argument("--quant", default="bf16", choices=QUANT_MODES)
    bm.add_argument("--prompt-len", type=_checked(int, at_least(1), "an integer of at least 1"),
                    help="prompt tokens (default: 2000 on a GPU, else 64)")
    bm.add_argument("--new-tokens", type=_checked(int, at_least(1), "an integer of at least 1"),
                    help="tokens generated per sequence (default: 300 on a GPU, else 32)")
    bm.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly (graphs apply on a GPU only)")
    bm.set_defaults(func=cmd_bench_model)

    db_cli.register(sub)
    return p


_interrupted = False


def _on_sigint(signum: int, frame: object) -> None:
    """Ctrl-C, remembered: one that lands inside a library's import can surface as another error (a
    half-imported module), which is then an interrupt all the same."""
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    global _interrupted
    _interrupted = False
    previous = signal.getsignal(signal.SIGINT)
    own = previous is signal.default_int_handler and threading.current_thread() is threading.main_thread()
    if own:
        signal.signal(signal.SIGINT, _on_sigint)
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except FlashgenError as e:
        print(f"flashgen: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("flashgen: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, as other shell tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception:
        if not _interrupted:
            raise
        print("flashgen: interrupted", file=sys.stderr)
        return 130
    finally:
        if own:
            signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    sys.exit(main())
