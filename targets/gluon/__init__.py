"""Gluon code generator: Hopper (sm_90) kernels written with explicit layouts, shared-memory rings,
mbarriers and warp specialization, through Triton's Gluon language (`triton.experimental.gluon`).

It is a second generator of the Triton build, not a build of its own: its sources are KernelSources
of dialect "gluon", compiled ahead of time by the same `triton.compile` (targets/triton/build.py),
kept in the same artifact cache and launched by the same launcher. The schedule chooses it
(`backend` = 1 in a contraction or packed-prefill schedule, schedules/contraction_space.py and
attention_space.py), and every record keeps
which generator it measured.
"""
from flashgen.targets.gluon.attention import generate_attention
from flashgen.targets.gluon.contraction import generate_contraction

__all__ = ["generate_attention", "generate_contraction"]
