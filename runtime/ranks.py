"""The processes of a tensor-parallel run: each joins one torch.distributed group, started by torchrun or
spawned here by `launch`, and a failure in one stops all of them with one line.

A rank on a machine with GPUs takes the GPU of its local rank and talks through NCCL, NVLink multicast
(NVLS) off; on the CPU the ranks talk through gloo. Every collective has the group's timeout, so a rank
that waits on a dead or stalled peer fails within it instead of hanging (gloo notices a peer's exit at
once). `launch` waits for its ranks; when one fails it gives the others that timeout to stop by
themselves, then ends them, and raises the first failure, naming its rank.
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import socket
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from flashgen.errors import FlashgenError, reason
from flashgen.processes import ignore_sigint, sigint_deferred

DEFAULT_TIMEOUT_S = 120.0
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    """Whether this process is one rank of a torchrun launch (its environment says so)."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def free_port() -> int:
    """A TCP port free on the loopback interface, for a group of ranks on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rank(tp: int, rank: int | None = None, port: int | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.device:
    """Join the group of `tp` ranks as `rank`, rendezvous on 127.0.0.1:`port` (with `rank` None: as
    torchrun's environment says), and return this rank's device."""
    if rank is None:
        world = int(os.environ["WORLD_SIZE"])
        if world != tp:
            raise FlashgenError(f"torchrun started {world} ranks, and tp={tp}: give --nproc-per-node {tp}")
        rank, local, init = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), "env://"
    else:
        local, init = rank, f"tcp://127.0.0.1:{port}"
    if torch.cuda.is_available():
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))  # the ranks share the cores
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=tp,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return device


def stop_rank() -> None:
    """Leave the group after a rank's work ended well (a failed rank just exits: its peers see it gone)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _rank_main(fn: Callable[..., Any], args: tuple, rank: int, tp: int, port: int, timeout_s: float,
               failures: Any) -> None:
    """One spawned rank: `fn(device, *args)` in the group; a failure is reported on `failures`, as
    (rank, one line), and ends the process at once, so that its peers see it gone."""
    ignore_sigint()  # (the launcher stops its ranks on Ctrl-C)
    try:
        fn(start_rank(tp, rank, port, timeout_s), *args)
    except BaseException as e:  # noqa: BLE001 (reported to the launcher)
        failures.put((rank, reason(e)))
        os._exit(1)
    stop_rank()


def launch(tp: int, fn: Callable[..., Any], args: tuple = (), timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Run `fn(device, *args)` in `tp` spawned ranks of one group (`fn` must be importable by name) and
    wait for them; the first failure is a FlashgenError naming its rank (module docstring)."""
    ctx = multiprocessing.get_context("spawn")
    failures = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, args, r, tp, port, timeout_s, failures)) for r in range(tp)]
    with sigint_deferred():
        for p in procs:
            p.start()
    try:
        deadline = None
        while any(p.is_alive() for p in procs):
            if deadline is None and any(p.exitcode not in (None, 0) for p in procs):
                deadline = time.monotonic() + timeout_s  # the others stop by their own timeouts
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    errors = []
    while not failures.empty():
        errors.append(failures.get())
    errors += [(r, f"exited with code {p.exitcode}") for r, p in enumerate(procs)
               if p.exitcode and r not in {e[0] for e in errors}]
    if errors:
        said = [why if why.startswith(f"rank {r}:") else f"rank {r}: {why}" for r, why in errors]
        raise FlashgenError(said[0] + (f" (then {'; '.join(said[1:])})" if len(said) > 1 else ""))
