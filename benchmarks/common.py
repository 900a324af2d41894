"""Shared by the benchmark scripts: GPU timing, the copy-bandwidth ceiling, and result files.

Timing follows the field's habit: triton.testing.do_bench (CUDA events, warm-up, L2 flushed before
each run), median of the runs. Results go to benchmarks/results/<name>.json and .md together with the
command that produced them, the device and the tool versions.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

RESULTS = Path(__file__).with_name("results")


@contextlib.contextmanager
def replayed_records(records: str | Path) -> Iterator[tuple[Any, Path]]:
    """A scratch database holding the records of a JSON-lines export, and its path, for CPU replays."""
    from flashgen.db import Database

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "replay.db"
        with Database(path) as db:
            db.import_jsonl(records)
            yield db, path


@contextlib.contextmanager
def tuning_session(target: Any) -> Iterator[dict[str, Any]]:
    """One builder pool and one measuring worker for all of a benchmark's workloads, as `tune` keywords:
    starting them per workload would cost seconds of process start-up each time."""
    from flashgen.schedules.builder import Builder
    from flashgen.schedules.measure import Runner

    builder, runner = Builder(target), Runner(target)
    try:
        yield {"builder": builder, "runner": runner}
    finally:
        builder.close()
        runner.close()


def bench_side_by_side(fns: dict[str, Callable[[], Any]], nbytes: int, l2_bytes: int,
                       rounds: int = 3, flush: bool | None = None) -> dict[str, float]:
    """Median device time (us) of each version of one computation, timed as the tuner's runner times
    candidates (schedules/timing.py: L2 flushed when the data outgrows half the L2, else CUDA-graph
    replay; `flush` True or False overrides that rule), in interleaved rounds keeping each version's
    best median, so that clock drift or a neighbour's burst does not favour whichever ran first. The
    first round's long warm-up brings an idle GPU's clocks up (an H200 idles at 345 MHz)."""
    from flashgen.schedules.timing import gpu_time

    dev = torch.device("cuda")
    flush = nbytes > l2_bytes // 2 if flush is None else flush
    best = {k: float("inf") for k in fns}
    for i in range(rounds):
        for k, fn in fns.items():
            t = gpu_time(fn, dev, flush, l2_bytes, runs=30, warmup_ms=100.0 if i == 0 else 5.0)
            best[k] = min(best[k], t.median_us)
    return best


def same_outputs(a: dict, b: dict) -> bool:
    """Whether two kernels' outputs agree within 1% of the largest value (a variant checked against
    the best schedule, which the tuner checked against the float64 reference)."""
    return all((a[n].float() - b[n].float()).abs().max() <= 1e-2 * b[n].float().abs().max() for n in b)


def variant(wl: Any, target: Any, space: Any, schedule: dict, knob: str, value: int, ins: dict,
            out: dict) -> tuple[Any, dict] | None:
    """The kernel of `schedule` with `knob` set to `value` and that schedule, to time beside it; None
    (with a line saying why, unless the knob already holds the value) where the change is not a valid
    schedule or the kernel does not compute `out`, the outputs of `schedule`'s kernel on `ins`."""
    import flashgen

    base = space.complete(schedule)
    if knob not in space.names():
        print(f"  variant {knob}={value} of {schedule}: not a knob of {wl.op.name} (its knobs: {', '.join(base)}); "
              "not timed", flush=True)
        return None
    s = space.with_knob(base, knob, value)  # (a flat name, `early_load`, moves a contraction to its variant)
    if s == base:
        return None
    why = space.why_invalid(s)
    if why is None:
        vk = flashgen.compile(wl, target, schedule=s)
        if same_outputs(vk.run(ins), out):
            return vk, s
        why = "outputs differ from the kernel's"
    print(f"  variant {knob}={value} of {schedule}: {why}; not timed", flush=True)
    return None


def knob_values(pairs: Sequence[str]) -> dict[str, int]:
    """KNOB=VALUE command-line pairs as a schedule's knob values."""
    out = {}
    for pair in pairs:
        knob, sep, value = pair.partition("=")
        if not sep or not value.lstrip("-").isdigit():
            raise SystemExit(f"expected KNOB=VALUE with an integer value, got {pair!r}")
        out[knob] = int(value)
    return out


def copy_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy rate, counting bytes read plus written: the memory ceiling."""
    from flashgen.schedules.timing import gpu_time

    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = gpu_time(lambda: dst.copy_(src), torch.device("cuda"), True, 64 << 20, warmup_ms=200.0).median_us
    return 2 * nbytes / (us * 1e3)


def environment(device: str | None = None) -> dict[str, Any]:
    """The run's device (the current GPU's name unless given: CPU replays name the records' device),
    versions, command and date."""
    import triton

    return {"device": device or torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "command": " ".join(["python"] + sys.argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write_results(name: str, header: Sequence[str], rows: list[Sequence[Any]], meta: dict[str, Any],
                  out_dir: Path = RESULTS, notes: str = "", formats: dict[str, str] | None = None) -> tuple[Path, Path]:
    """<out_dir>/<name>.json (values as they are) and .md (a table: floats to 3 significant digits, or in
    the format spec `formats` gives their column)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / f"{name}.json"
    js.write_text(json.dumps({"meta": meta, "columns": list(header), "rows": [list(r) for r in rows]},
                             indent=1) + "\n")
    md = out_dir / f"{name}.md"
    lines = [f"# {name}", "", f"Command: `{meta['command']}`  ", f"Device: {meta['device']}, torch {meta['torch']}, "
             f"triton {meta['triton']}, {meta['date']}", ""]
    if notes:
        lines += [notes, ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    specs = [(formats or {}).get(h) for h in header]
    lines += ["| " + " | ".join(_fmt(v, f) for v, f in zip(r, specs)) + " |" for r in rows]
    md.write_text("\n".join(lines) + "\n")
    return js, md


def _fmt(v: Any, spec: str | None = None) -> str:
    if isinstance(v, float) and spec:
        return format(v, spec)
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def print_table(header: Sequence[str], rows: list[Sequence[Any]]) -> None:
    cells = [list(header)] + [[_fmt(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
