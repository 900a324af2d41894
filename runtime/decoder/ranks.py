"""The processes of a tensor-parallel run: each joins one torch.distributed group, started by torchrun or
spawned here by `launch`, and a failure in one stops all of them with one line.

A rank on a machine with GPUs takes the GPU of its local rank and talks through NCCL, NVLink multicast
(NVLS) off; on the CPU the ranks talk through gloo. Every collective has the group's timeout, so a rank
that waits on a dead or stalled peer fails within it instead of hanging (gloo notices a peer's exit at
once); it fails with `PeerFailure`, the fault being elsewhere.

`launch` hosts the group's rendezvous itself, on a loopback port bound before any rank starts (so a
port in use is one line at once, and no other process can take the port between choosing and binding),
and waits for its ranks. When one fails on its own, it gives the others `STOP_GRACE_S` to report their
own failure (under gloo they see it gone at once; a rank computing, or blocked in NCCL, would only see
it at its next collective's timeout), then stops them. When the first failure is a `PeerFailure`, the
peer it waited for has had the whole timeout already: a stalled rank never stops by itself, so the
others are stopped at once and the run ends within the timeout of the stall (under NCCL, whose watchdog
ends a rank that waited past the timeout without a word, after the grace). The error names the rank
that failed first on its own (an error, or its process's death), then those that lost it.
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from flashgen.errors import FlashgenError, one_line, reason
from flashgen.processes import ignore_sigint, sigint_deferred

DEFAULT_TIMEOUT_S = 120.0
STOP_GRACE_S = 5.0
HOST = "127.0.0.1"
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class PeerFailure(FlashgenError):
    """A collective failed because another rank died or did not answer within the group's timeout."""


def under_torchrun() -> bool:
    """Whether this process is one rank of a torchrun launch (its environment says so)."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def _host_rendezvous(port: int, timeout_s: float) -> dist.TCPStore:
    """The store where `launch`'s ranks meet, served by this process on HOST:`port` (0: a free port the
    system picks); a port that cannot be bound is one line, at once."""
    try:
        return dist.TCPStore(HOST, port, is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as e:
        raise FlashgenError(f"cannot host the ranks' rendezvous on {HOST}:{port}: {one_line(e)}") from None


def start_rank(tp: int, rank: int | None = None, port: int | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.device:
    """Join the group of `tp` ranks as `rank`, meeting at the store `launch` hosts on HOST:`port` (with
    `rank` None: as torchrun's environment says), and return this rank's device. A rendezvous that
    fails (a peer never comes; under torchrun's variables without torchrun's store, rank 0 cannot bind
    MASTER_PORT) is one line."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank is None:
        world = int(os.environ["WORLD_SIZE"])
        if world != tp:
            raise FlashgenError(f"torchrun started {world} ranks, and tp={tp}: give --nproc-per-node {tp}")
        rank, local, init = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), "env://"
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    else:
        local, init, where = rank, None, f"{HOST}:{port}"
    if torch.cuda.is_available():
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    try:
        store = None if init else dist.TCPStore(HOST, port, is_master=False, timeout=timeout)
        dist.init_process_group(backend, init_method=init, store=store, rank=rank, world_size=tp, timeout=timeout)
    except (RuntimeError, dist.DistError) as e:
        raise FlashgenError(f"rank {rank}: joining the group at {where} failed: {one_line(e)}") from None
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))  # the ranks share the cores
    return device


def stop_rank() -> None:
    """Leave the group after a rank's work ended well (a failed rank just exits: its peers see it gone)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _rank_main(fn: Callable[..., Any], args: tuple, rank: int, tp: int, port: int, timeout_s: float,
               failures: Any) -> None:
    """One spawned rank: `fn(device, *args)` in the group; a failure is reported on `failures`, as
    (rank, one line, whether it is a PeerFailure), and ends the process at once, so that its peers see
    it gone."""
    ignore_sigint()  # (the launcher stops its ranks on Ctrl-C)
    try:
        fn(start_rank(tp, rank, port, timeout_s), *args)
    except BaseException as e:  # noqa: BLE001 (reported to the launcher)
        failures.put((rank, reason(e), isinstance(e, PeerFailure)))
        os._exit(1)
    stop_rank()


def launch(tp: int, fn: Callable[..., Any], args: tuple = (), timeout_s: float = DEFAULT_TIMEOUT_S,
           port: int = 0, grace_s: float = STOP_GRACE_S) -> None:
    """Run `fn(device, *args)` in `tp` spawned ranks of one group (`fn` must be importable by name),
    meeting on HOST:`port` (0: a free one), and wait for them; the first failure is a FlashgenError
    naming its rank, after the others had `grace_s` (none after a PeerFailure) to report theirs (module
    docstring)."""
    store = _host_rendezvous(port, timeout_s)  # (bound before any rank starts)
    ctx = multiprocessing.get_context("spawn")
    failures = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank_main, args=(fn, args, r, tp, store.port, timeout_s, failures))
             for r in range(tp)]
    with sigint_deferred():
        for p in procs:
            p.start()
    errors: list[tuple[int, str, bool]] = []
    stopped: list[int] = []
    try:
        deadline = None
        while any(p.is_alive() for p in procs):
            failed = any(p.exitcode not in (None, 0) for p in procs)
            while not failures.empty():  # (read after the exit codes: a rank reports before it exits)
                errors.append(failures.get())
            if deadline is None and (failed or errors):
                deadline = time.monotonic() + (0.0 if errors and errors[0][2] else grace_s)
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(0.05)
    finally:
        for r, p in enumerate(procs):
            if p.is_alive():
                stopped.append(r)
                p.kill()
            p.join()
    while not failures.empty():
        errors.append(failures.get())
    said = {r for r, _, _ in errors}
    ranked = [(int(peer), why if why.startswith(f"rank {r}:") else f"rank {r}: {why}") for r, why, peer in errors]
    for r, p in enumerate(procs):
        if r in stopped and r not in said:
            ranked.append((2, f"rank {r}: stopped, still running"))
        elif p.exitcode and r not in said:
            ranked.append((0, f"rank {r}: exited with code {p.exitcode}"))
    # a rank's own failure or death first, then those that lost it, then those stopped (stable: in order)
    lines = [line for _, line in sorted(ranked, key=lambda kind_line: kind_line[0])]
    if lines:
        raise FlashgenError(lines[0] + (f" (then {'; '.join(lines[1:])})" if len(lines) > 1 else ""))
