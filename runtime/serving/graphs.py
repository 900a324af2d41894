"""CUDA graph capture, for every part that replays kernels from graphs: the decoder's decode steps
(runtime/decoder/decode_graphs.py) and the tuner's timing of short kernels (schedules/timing.py)."""
from __future__ import annotations

from typing import Any, Callable

import torch

_CAPTURE: dict[torch.device, torch.cuda.Stream] = {}  # one side stream per device for every capture


def cuda_graph(fn: Callable[[], Any], device: torch.device, pool: Any = None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """`fn()` captured into a CUDA graph (in memory pool `pool`, when given) on a side stream, as capture
    requires, after one call there that loads its modules and fills caches, which capture would refuse.
    Returns the graph and what the captured call returned: its outputs, rewritten by each replay. Every
    capture on a device shares one side stream: torch keeps a cuBLAS workspace (32 MiB on sm_90) for
    each stream that ran a matmul, for the life of the process, so a new stream per capture would hold
    one more each time an engine captures its graphs."""
    device = torch.device(device)
    device = torch.device("cuda", torch.cuda.current_device()) if device.index is None else device
    if device not in _CAPTURE:
        _CAPTURE[device] = torch.cuda.Stream(device)
    stream = _CAPTURE[device]
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            out = fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph, out
