"""Bytes a workload must move and the time that takes at a target's bandwidth: the memory roofline
that rowwise and pointwise kernels are judged against; for a GEMM, the larger of that and its matrix
rate's time (the mixed mode's estimate where no record decides)."""
from __future__ import annotations

from flashgen.ir import dtypes
from flashgen.ir.contraction import extents, operand_dtype
from flashgen.ir.op import TensorSpec, eval_int
from flashgen.targets.descriptor import Target
from flashgen.workload import Workload


def tensor_bytes(wl: Workload, t: TensorSpec) -> int:
    """Bytes of one tensor a kernel touches: all of it, or the touched part of a gathered table."""
    n = 1
    for e in t.shape:
        n *= eval_int(e, wl.dim)
    if t.touched is not None:
        n = min(n, eval_int(t.touched, wl.dim))
    return n * dtypes.BYTES[wl.tensor_dtype(t.name)]


def bytes_moved(wl: Workload) -> int:
    """Each input read once and each output written once."""
    return sum(tensor_bytes(wl, t) for t in wl.inputs + wl.outputs)


def roofline_us(wl: Workload, target: Target, copy_gbs: float | None = None) -> float:
    """Microseconds to move the workload's bytes at `copy_gbs` (default: the target's copy bandwidth)."""
    return bytes_moved(wl) / ((copy_gbs or target.copy_gbs) * 1e3)


def contraction_us(wl: Workload, target: Target) -> float:
    """A GEMM's lower bound on `target`: the larger of its memory roofline and its products at the
    matrix rate of its operand dtype (flashgen/ir/contraction.py `operand_dtype`: an int4 weight times
    16-bit activations runs at the 16-bit rate, times int8 ones at the int8 rate; a target that states
    no such rate, the CPU, at its fp32 rate)."""
    m, n, k, _ = extents(wl)
    peak = target.peak_tflops.get(operand_dtype(wl), target.peak_tflops["fp32"])
    return max(roofline_us(wl, target), 2.0 * m * n * k / (peak * 1e6))
