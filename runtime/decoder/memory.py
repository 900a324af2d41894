"""What a run will hold, checked before it is allocated: the device's free memory and the KV cache's size."""
from __future__ import annotations

from pathlib import Path

import torch

from flashgen.errors import FlashgenError
from flashgen.runtime.checkpoints.model_config import ModelConfig


def cache_bytes(c: ModelConfig, dtype_bytes: int, blocks: int, block_size: int) -> int:
    """The paged KV cache of `blocks` blocks: keys and values of every layer."""
    return 2 * c.num_layers * blocks * block_size * c.num_kv_heads * c.head_dim * dtype_bytes


def available_bytes(dev: torch.device) -> int | None:
    """Memory free for a run: the GPU's; on the CPU, Linux's MemAvailable within the cgroup's limit (a
    container's); None where the system does not say."""
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    free = next((int(line.split()[1]) * 1024 for line in meminfo.splitlines()
                 if line.startswith("MemAvailable:")), None)
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit, used = (cgroup / "memory.max").read_text().strip(), int((cgroup / "memory.current").read_text())
        if limit != "max" and free is not None:
            free = min(free, int(limit) - used)
    except (OSError, ValueError):
        pass
    return free


def check_fits(what: str, need: int, dev: torch.device, hint: str) -> None:
    """Refuses a run whose estimate `need` exceeds the device's free memory, before it allocates."""
    free = available_bytes(dev)
    if free is not None and need > free:
        raise FlashgenError(f"{what} needs about {need / 1e9:.1f} GB, and {dev.type} has {free / 1e9:.1f} GB free; {hint}")
