"""Runner: measures candidate kernels in an isolated worker process per device, with a timeout.

Each candidate is first checked against the op's float64 reference on random inputs drawn fresh for
the tuning run (outputs poisoned, so an unwritten element fails), then timed. A candidate that fails
to build, gives a wrong result, raises, kills its worker or outlasts the timeout is reported with that
status; a dead or hung worker is replaced and measurement goes on. With several devices, one worker
per device measures in parallel.

Given a producer (`behind`: a workload and its schedule), each candidate is timed right behind that
kernel, its first input being the producer's first output (`schedules.timing.behind_cost`): how a decode
step runs a GEMV behind the kernel before it, where the tuner's ranking of candidates timed alone has
disagreed with the decoder's (`benchmarks/results/in_graph_bf16_b1.md`).
"""
from __future__ import annotations

import importlib
import math
import multiprocessing
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from flashgen.errors import FlashgenError
from flashgen.processes import ignore_sigint, sigint_deferred
from flashgen.schedules.space import Schedule
from flashgen.targets.descriptor import Target
from flashgen.workload import Workload

DEFAULT_FACTORY = "flashgen.schedules.measure:build_kernel"


@dataclass(frozen=True)
class MeasureResult:
    schedule: Schedule
    status: str  # one of flashgen.db.STATUSES
    latency_us: float | None = None
    spread_us: float | None = None
    error: str = ""
    runs: int = 0


def feed_error(producer: Workload, consumer: Workload) -> str | None:
    """Why the producer's first output cannot be the consumer's first input (element count, dtype), or None.
    A producer that only updates an input in place (a MoE down projection adding into its accumulator)
    has no output to hand on."""
    if not producer.outputs:
        return f"{producer.op_name} writes no output of its own (it updates an input in place): nothing to feed {consumer.op_name}"
    out, inp = producer.outputs[0].name, consumer.inputs[0].name
    have, want = producer.shape(out), consumer.shape(inp)
    if math.prod(have) != math.prod(want) or producer.tensor_dtype(out) != consumer.tensor_dtype(inp):
        return (f"{producer.op_name} writes {out} {list(have)} {producer.tensor_dtype(out)}, but {consumer.op_name} "
                f"reads {inp} {list(want)} {consumer.tensor_dtype(inp)}: a producer's first output must be "
                "the first input of the workload timed behind it")
    return None


def build_kernel(wl: Workload, schedule: Schedule, target: Target) -> Any:
    """The default kernel factory: the compile driver (the builder has filled the artifact cache)."""
    from flashgen.compiler import compile as compile_kernel

    return compile_kernel(wl, target, schedule=schedule)


def _resolve(path: str) -> Callable[..., Any]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class _WorkloadState:
    """Inputs and float64 reference of one workload on the worker's device, made once per run."""

    def __init__(self, wl: Workload, device: Any, seed: int):
        import torch

        gen = torch.Generator().manual_seed(seed)
        host = wl.op.make_inputs(wl.dim, wl.attr, gen)
        self.inputs = {k: v.to(device) for k, v in host.items()}
        ref_in = {k: v.to(device) for k, v in host.items()}
        self.ref = wl.op.reference(ref_in, wl.op.params, wl.dim, wl.attr)
        # inputs a kernel updates in place, as drawn: restored before each check, so that a candidate
        # is never judged on what an earlier one wrote
        self.pristine = {t.name: ref_in[t.name].clone() for t in wl.inputs if t.written}

    def restore(self) -> None:
        for name, v in self.pristine.items():
            self.inputs[name].copy_(v)


class _Producer:
    """The kernel a candidate is timed behind, on its own inputs, and the output that feeds the candidate."""

    def __init__(self, wl: Workload, schedule: Schedule, target: Target, factory: Callable[..., Any], device: Any,
                 seed: int):
        import torch

        gen = torch.Generator().manual_seed(seed + 1)
        self.inputs = {k: v.to(device) for k, v in wl.op.make_inputs(wl.dim, wl.attr, gen).items()}
        self.kernel = factory(wl, schedule, target)
        self.outputs = self.kernel.run(self.inputs)
        self.fed = self.outputs[wl.outputs[0].name]

    def run(self) -> None:
        self.kernel.run(self.inputs, self.outputs)

    def feed(self, wl: Workload, inputs: dict[str, Any]) -> dict[str, Any]:
        """The candidate's inputs with its first one the producer's output, in its shape."""
        name = wl.inputs[0].name
        return {**inputs, name: self.fed.view(inputs[name].shape)}


def _exit_with(parent: int) -> None:
    """Ends the worker within a second of its tuning parent's death, even mid-measurement (a hung
    candidate would otherwise hold the CPU, or the GPU, for good)."""
    while os.getppid() == parent:
        time.sleep(0.25)
    os._exit(1)


def _worker(conn: Any, device_name: str, target_id: str, factory_path: str, runs: int,
            behind: tuple[dict, Schedule] | None, parent: int) -> None:
    """Worker loop: receive (workload JSON, schedule, seed), answer a result dict."""
    ignore_sigint()
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    import torch

    from flashgen.check import compare, judged, poisoned
    from flashgen.roofline import bytes_moved
    from flashgen.schedules.timing import behind_cost, cpu_time, gpu_time
    from flashgen.targets.descriptor import get_target

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    target = get_target(target_id)
    factory = _resolve(factory_path)
    states: dict[tuple[str, int], _WorkloadState] = {}
    producer: _Producer | None = None
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        wl_json, schedule, seed = msg
        wl = Workload.from_json(wl_json)
        try:
            kernel = factory(wl, schedule, target)
        except Exception as e:  # noqa: BLE001
            conn.send({"status": "compile_error", "error": f"{type(e).__name__}: {e}"})
            continue
        try:
            if (wl.key, seed) not in states:
                states.clear()
                states[(wl.key, seed)] = _WorkloadState(wl, device, seed)
            st = states[(wl.key, seed)]
            outs = poisoned(wl, wl.dim, device)
            st.restore()
            kernel.run(st.inputs, outs)
            bad = [c for c in compare(wl, judged(wl, outs, st.inputs), st.ref) if not c.ok]
            if bad:
                conn.send({"status": "wrong_result", "error": "; ".join(
                    f"{c.tensor}: error {c.error:.3g} > {c.tolerance:g} {c.detail}".strip() for c in bad)})
                continue
            if behind is not None:
                if producer is None:
                    producer = _Producer(Workload.from_json(behind[0]), behind[1], target, factory, device, seed)
                fed = producer.feed(wl, st.inputs)
                t = behind_cost(lambda: kernel.run(fed, outs), producer.run, device,
                                target.get("l2_bytes", 1 << 26), runs=runs)
            elif device.type == "cuda":
                flush = bytes_moved(wl) > target.get("l2_bytes", 0) // 2
                t = gpu_time(lambda: kernel.run(st.inputs, outs), device, flush, target.get("l2_bytes", 1 << 26),
                             runs=runs)
            else:
                t = cpu_time(lambda: kernel.run(st.inputs, outs), runs=runs)
            conn.send({"status": "ok", "latency_us": t.median_us, "spread_us": t.spread_us, "runs": t.runs})
        except Exception as e:  # noqa: BLE001
            conn.send({"status": "crash", "error": f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"})


def _result(schedule: Schedule, reply: dict[str, Any]) -> MeasureResult:
    """A worker's answer. A latency of 0 us or less measured nothing (a difference of medians under the
    noise): it is a failure, which can never be a best, whatever path timed it."""
    lat = reply.get("latency_us")
    if reply["status"] == "ok" and not (lat is not None and lat > 0):
        return MeasureResult(schedule, "crash", error=f"timed at {lat} us, under the noise: no measurement",
                             runs=reply.get("runs", 0))
    return MeasureResult(schedule, reply["status"], lat, reply.get("spread_us"), reply.get("error", ""),
                         reply.get("runs", 0))


class _Worker:
    def __init__(self, device: str, target: Target, factory: str, runs: int, behind: tuple[dict, Schedule] | None):
        self.args = (device, target.id, factory, runs, behind)
        self.proc: Any = None
        self.conn: Any = None
        self.closed = False  # set by Runner.close: a worker that died is not started again
        self.answered = False  # whether this process has answered yet (it starts up before its first answer)

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, *self.args, os.getpid()), daemon=True)
        self.answered = False
        with sigint_deferred():
            self.proc.start()
        child.close()

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(5)
            self.proc = None

    def measure(self, wl: Workload, schedule: Schedule, seed: int, timeout_s: float,
                start_timeout_s: float) -> MeasureResult:
        if self.proc is None or not self.proc.is_alive():
            if self.closed:  # its runner closed while this candidate was in flight
                return MeasureResult(schedule, "crash", error="the runner was closed")
            self.start()
        try:
            self.conn.send((wl.to_json(), schedule, seed))
            # Before its first answer, a worker (started here or by Runner.measure) imports torch and sets
            # up the device.
            if not self.conn.poll(timeout_s + (0 if self.answered else start_timeout_s)):
                self.stop()
                return MeasureResult(schedule, "timeout", error=f"no answer within {timeout_s:g} s")
            reply = self.conn.recv()
            self.answered = True
        except (EOFError, OSError, BrokenPipeError):
            self.proc.join(5)
            code = self.proc.exitcode
            self.stop()
            return MeasureResult(schedule, "crash", error=f"worker died (exit code {code})")
        return _result(schedule, reply)


MEASURE_TIMEOUT_S = 30.0  # a candidate's build-to-answer bound
START_TIMEOUT_S = 120.0  # and the more a fresh worker gets for its first (torch and the toolchain load)


class Runner:
    """`measure(workload, schedules)` in order; one worker per device (e.g. ["cuda:0", "cuda:1"]). With
    `behind` (a producer workload and its schedule), every candidate is timed behind that kernel."""

    def __init__(self, target: Target, devices: list[str] | None = None, timeout_s: float = MEASURE_TIMEOUT_S,
                 runs: int = 30, seed: int = 0, factory: str = DEFAULT_FACTORY,
                 start_timeout_s: float = START_TIMEOUT_S,
                 behind: tuple[Workload, Schedule] | None = None):
        if devices is None:
            devices = ["cpu"] if target.backend == "tvm" else _cuda_devices()
        self.target, self.timeout_s, self.seed, self.start_timeout_s = target, timeout_s, seed, start_timeout_s
        self.behind = behind
        spec = (behind[0].to_json(), behind[1]) if behind is not None else None
        self.workers = [_Worker(d, target, factory, runs, spec) for d in devices]

    def measure(self, wl: Workload, schedules: list[Schedule],
                on_result: Callable[[MeasureResult], None] | None = None) -> list[MeasureResult]:
        """The results in the schedules' order; `on_result` is called on this thread with each result as
        it arrives, so that a caller can record every measurement the moment it ends."""
        if self.behind is not None and (why := feed_error(self.behind[0], wl)):
            raise FlashgenError(why)
        results: list[MeasureResult | None] = [None] * len(schedules)
        todo = list(enumerate(schedules))
        lock = threading.Lock()
        done: queue.Queue = queue.Queue()

        def drain(worker: _Worker) -> None:
            while True:
                with lock:
                    if not todo:
                        return
                    i, s = todo.pop(0)
                try:
                    done.put((i, worker.measure(wl, s, self.seed, self.timeout_s, self.start_timeout_s)))
                except BaseException as e:  # noqa: BLE001 (handed to the caller's thread)
                    done.put((i, e))
                    return

        for w in self.workers[:len(schedules)]:  # started here, on the main thread (sigint_deferred)
            if not w.closed and (w.proc is None or not w.proc.is_alive()):
                w.start()
        threads = [threading.Thread(target=drain, args=(w,), daemon=True) for w in self.workers]
        for t in threads:
            t.start()
        try:
            for _ in schedules:
                i, r = done.get()
                if isinstance(r, BaseException):
                    raise r
                results[i] = r
                if on_result is not None:
                    on_result(r)
        finally:  # interrupted (Ctrl-C, a failed record): no worker takes another candidate, nor starts
            with lock:
                todo.clear()
        for t in threads:
            t.join()
        return [r for r in results if r is not None]

    def close(self) -> None:
        for w in self.workers:
            w.closed = True
            if w.proc is not None and w.proc.is_alive():
                try:
                    w.conn.send(None)
                except OSError:
                    pass
            w.stop()


def _cuda_devices() -> list[str]:
    import torch

    n = torch.cuda.device_count()
    if n == 0:
        raise FlashgenError("measuring a GPU target needs that GPU; this machine has none "
                            "(compile ahead of time with `flashgen compile`, or tune the cpu target)")
    return [f"cuda:{i}" for i in range(n)]
