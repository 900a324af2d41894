"""Kernel factories for runner tests: each schedule's block_c picks a behaviour."""
from __future__ import annotations

import itertools
import os
import time


BEHAVIOUR = {16: "ok", 32: "raise", 64: "hang", 128: "wrong", 256: "die", 512: "no_build", 1024: "partial",
             2048: "meet"}
HANG_S = 3600  # how long a "hang" kernel sleeps
MEET_WITH = 2  # a "meet" kernel's first call returns once this many worker processes have called one


class FakeKernel:
    """Computes the op's float64 reference in the outputs' dtypes, then misbehaves as told."""

    def __init__(self, wl, behaviour: str):
        self.wl, self.behaviour = wl, behaviour

    def run(self, inputs, outputs=None):
        if outputs is None:  # a producer's first call: it allocates its outputs
            from flashgen.check import poisoned
            outputs = poisoned(self.wl, self.wl.dim, "cpu")
        if self.behaviour == "raise":
            raise RuntimeError("candidate kernel failed at launch")
        if self.behaviour == "hang":
            time.sleep(HANG_S)
        if self.behaviour == "die":
            os._exit(3)
        if self.behaviour == "meet":
            _meet()
        ref = self.wl.op.reference(inputs, self.wl.op.params, self.wl.dim, self.wl.attr)
        for name, out in outputs.items():
            val = ref[name].to(out.dtype)
            if self.behaviour == "wrong":
                val = val * 1.5 + 0.25
            if self.behaviour == "partial":
                out[..., : out.shape[-1] // 2] = val[..., : out.shape[-1] // 2]
            else:
                out.copy_(val)
        return outputs


def _meet() -> None:
    """Waits until MEET_WITH worker processes have been here (each leaves its pid in the folder
    FLASHGEN_TEST_MEETDIR names): only workers measuring at the same time get past. Workers measuring
    one after another never do, and the runner reads the candidate as hung."""
    from pathlib import Path
    folder = Path(os.environ["FLASHGEN_TEST_MEETDIR"])
    (folder / str(os.getpid())).touch()
    while len(list(folder.iterdir())) < MEET_WITH:
        time.sleep(0.01)


def factory(wl, schedule, target):
    behaviour = BEHAVIOUR[schedule["block_c"]]
    if behaviour == "no_build":
        raise ValueError("unsupported tile")
    return FakeKernel(wl, behaviour)


def _timed_as(medians_us):
    """Make every CPU timing in this worker read the next of `medians_us`: a machine under load."""
    from flashgen.schedules import timing
    values = iter(medians_us)
    timing.cpu_time = lambda fn, runs=20, min_run_s=0.0: timing.Timing(next(values), 0.0, runs)


def zero_timing_factory(wl, schedule, target):
    """Every call and its producer time alike: each difference behind the producer is 0 us."""
    _timed_as(itertools.repeat(5.0))
    return FakeKernel(wl, "ok")


def negative_timing_factory(wl, schedule, target):
    """Each timing longer than the one before: the call behind its producer reads faster than the producer."""
    _timed_as(itertools.count(5.0))
    return FakeKernel(wl, "ok")


_CALLS = itertools.count()


def _note_pid() -> None:
    """Writes this worker's pid where the test said (FLASHGEN_TEST_PIDFILE), for it to watch."""
    path = os.environ.get("FLASHGEN_TEST_PIDFILE")
    if path:
        with open(path, "w") as f:
            f.write(str(os.getpid()))


def hang_after_two_factory(wl, schedule, target):
    """Two good kernels, then one that hangs: a tune to kill mid-measurement."""
    _note_pid()
    return FakeKernel(wl, "ok" if next(_CALLS) < 2 else "hang")


def slow_factory(wl, schedule, target):
    """A good kernel that takes half a second to make: two tunes at once overlap for a while."""
    time.sleep(0.5)
    return FakeKernel(wl, "ok")
