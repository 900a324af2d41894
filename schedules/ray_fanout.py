"""`flashgen tune --ray ADDRESS`: the fan-out of schedules/fanout.py over the GPUs of a Ray cluster, whose
hosts may be many.

One Ray actor per GPU of the cluster (`num_gpus=1`: Ray gives each its own CUDA_VISIBLE_DEVICES), or a
given number of one-CPU actors for the cpu target. An actor's host need not see this machine's files,
so each actor tunes into a database of its own, seeded with the one database's records of the target
(what was measured is not measured again, and the cost model learns from them), and hands back every
record its tunes added; the driver adds them to the one database as each group ends. Groups
(`fanout.groups`) go to actors as they free up, each workload to one actor. A group whose actor dies
is reported as not tuned, line by line; what that actor had measured stays in its own database, on its
host.
"""
from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable

from flashgen.errors import FlashgenError, one_line, reason
from flashgen.extras import require
from flashgen.schedules.builder import Builder
from flashgen.schedules.fanout import Plan, TuneOptions, groups, tune_line
from flashgen.schedules.tuner import TuneResult
from flashgen.targets.descriptor import Target
from flashgen.workload import Workload

JOIN_TIMEOUT_S = 5.0  # for a cluster's address to take a TCP connection


class TuneActor:
    """One Ray actor's tunes (made remote by `fan_out_ray`), into a database of its own."""

    def __init__(self, target: Target, seed: list, options: TuneOptions):
        from flashgen.db import Database

        self.target, self.options = target, options
        self.db = Database(Path(tempfile.mkdtemp(prefix="flashgen-ray-")) / "tuning.db")
        self.db.add_many(seed)
        self.builder = Builder(target, _build_workers())

    def tune_group(self, lines: list[tuple[int, Workload, Workload | None]]) -> list[tuple[int, TuneResult | str, list]]:
        """Each line's index, TuneResult (or why it failed) and the records its tune added."""
        out = []
        for i, wl, producer in lines:
            before = len(self.db.records(wl.key, self.target.id))
            try:
                res: TuneResult | str = tune_line(wl, producer, self.target, self.db, self.options, self.builder)
            except Exception as e:  # noqa: BLE001 (this line's failure; its records still go back)
                res = reason(e)
            out.append((i, res, self.db.records(wl.key, self.target.id)[before:]))
        return out


def _build_workers() -> int:
    """Cores for this actor's Builder: its host's, shared out among the host's GPUs."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    res = next((n["Resources"] for n in ray.nodes() if n["NodeID"] == node), {})
    return max(1, int(res.get("CPU", os.cpu_count() or 1) // max(1, res.get("GPU", 1))))


def _join(ray: Any, address: str | None) -> None:
    """Join the cluster at `address`, or say in one line why not. A HOST:PORT that takes no TCP
    connection is refused at once (Ray itself would retry it for minutes)."""
    host, sep, port = (address or "").rpartition(":")
    if sep and port.isdigit() and "://" not in address:
        try:
            socket.create_connection((host, int(port)), timeout=JOIN_TIMEOUT_S).close()
        except OSError as e:
            raise FlashgenError(f"--ray {address}: no Ray cluster answers there ({e.strerror or e})") from None
    try:
        ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise FlashgenError(f"--ray {address}: cannot join a Ray cluster: {one_line(e)[:300]}") from None


def fan_out_ray(plan: Plan, target: Target, db_path: str | None, options: TuneOptions, address: str | None,
                on_result: Callable[[int, TuneResult | str], None], cpu_workers: int = 0) -> None:
    """Tune every line of `plan` on the actors of the Ray cluster at `address` (the one this process
    joined already, if any), calling `on_result(index, TuneResult or why it failed)` as each group ends
    (module docstring). The cpu target takes `cpu_workers` one-CPU actors."""
    from flashgen.db import Database

    ray = require("ray", "--ray")
    if not ray.is_initialized():
        _join(ray, address)
    if target.backend == "tvm":
        n, resources = cpu_workers, {"num_cpus": 1}
    else:
        n, resources = int(ray.cluster_resources().get("GPU", 0)), {"num_gpus": 1}
    if n < 1:
        raise FlashgenError(f"--ray {address}: the cluster has no {'GPU' if resources.get('num_gpus') else 'worker'}")
    with Database(db_path) as db:
        seed = ray.put(db.records(target_key=target.id))
        actor = ray.remote(**resources)(TuneActor)
        idle: list[Any] = [actor.remote(target, seed, options) for _ in range(n)]
        todo, running = groups(plan), {}
        while todo or running:
            while todo and idle:
                a, g = idle.pop(), todo.pop(0)
                running[a.tune_group.remote([(i, *plan[i]) for i in g])] = (a, g)
            if not running:  # every actor failed
                for i in (i for g in todo for i in g):
                    on_result(i, "not tuned: every Ray actor failed")
                return
            [ref], _ = ray.wait(list(running))
            a, g = running.pop(ref)
            try:
                done = ray.get(ref)
            except ray.exceptions.RayError as e:  # the actor or its host died: it takes no more groups
                for i in g:
                    on_result(i, f"its Ray actor failed: {one_line(e)[:300]}")
                continue
            for i, res, records in done:
                db.add_many(records)
                on_result(i, res)
            idle.append(a)
