"""Buffers a launcher keeps across calls (split-K partials and counters, a staged weight), allocated
outside any CUDA-graph memory pool the calling thread is routed to.

torch.compile's CUDA-graph trees (mode="reduce-overhead") run a graph's first calls with every allocation
of the thread sent to the graph's private pool, and require that whatever stays alive there is one of
the graph's outputs: a buffer kept by a launcher would be reported ("tensors in the cudagraph pool not
tracked as outputs") or handed to another graph. The pool routing is per thread, so a kept buffer is
allocated by a worker thread, in the device's ordinary pool. Inside a stream capture (the decoder's own
CUDA graphs) no other allocation may happen, and the buffer comes from the capture's pool as before."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

_worker: ThreadPoolExecutor | None = None


def _allocate(numel: int, dtype: torch.dtype, device: torch.device, zeroed: bool) -> torch.Tensor:
    buf = (torch.zeros if zeroed else torch.empty)(numel, dtype=dtype, device=device)
    if zeroed and device.type == "cuda":
        torch.cuda.synchronize(device)  # (the zeros are written on this thread's stream, not the caller's)
    return buf


def kept_buffer(numel: int, dtype: torch.dtype, device: torch.device | str, zeroed: bool = False) -> torch.Tensor:
    """A flat buffer of `numel` elements that lives as long as its holder keeps it, zero-filled where
    `zeroed` (the kernels that use it leave it zeroed again)."""
    global _worker
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return _allocate(numel, dtype, device, zeroed)
    if _worker is None:
        _worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashgen-buffers")
    return _worker.submit(_allocate, numel, dtype, device, zeroed).result()
