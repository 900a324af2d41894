"""A tune loses no measurement and wastes none: each is recorded the moment it ends (kill -9 keeps
them), its worker dies with it, two tunes of one workload measure different schedules, and
`--retry-failed` measures again what a loaded machine marked timeout or crash."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import flashgen
from flashgen.cli import main
from flashgen.db import Database, Record
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import get_target
from tests.faulty import HANG_S

ROOT = Path(__file__).resolve().parents[1]
WL = flashgen.workload("rmsnorm", M=4, N=512, dtype="fp32")
TUNE = """
import sys
import flashgen
from flashgen.db import Database
from flashgen.schedules.measure import Runner
from flashgen.schedules.tuner import TuneTask, tune
from flashgen.targets import get_target
wl, t = flashgen.workload("rmsnorm", M=4, N=512, dtype="fp32"), get_target("cpu")
runner = Runner(t, devices=["cpu"], timeout_s=600, runs=3, factory=sys.argv[2], start_timeout_s=120)
with Database(sys.argv[1]) as db:
    tune(TuneTask(wl, t, int(sys.argv[3]), strategy="random", seed=7), db, batch=8, runner=runner)
"""


def _start(db: Path, factory: str, trials: int, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", TUNE, str(db), factory, str(trials)], cwd=ROOT,
                            env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _records(db: Path) -> list[Record]:
    """The tune's records so far: none while its process has not yet created the database (the file
    exists, empty, between its creation and its schema's first write)."""
    if not db.exists() or db.stat().st_size == 0:
        return []
    with Database(db, readonly=True) as d:
        return d.records(WL.key, get_target("cpu").id)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # exited; its new parent has not reaped it yet


def test_kill_9_keeps_every_finished_measurement_and_its_worker_exits(tmp_path):
    db, pidfile = tmp_path / "t.db", tmp_path / "worker.pid"
    proc = _start(db, "tests.faulty:hang_after_two_factory", 8, FLASHGEN_TEST_PIDFILE=str(pidfile))
    deadline = time.monotonic() + 240
    while len(_records(db)) < 2:  # the third candidate hangs: the tune is mid-measurement
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "the first two measurements were not recorded"
        time.sleep(0.2)
    time.sleep(0.5)
    worker = int(pidfile.read_text())
    proc.kill()
    proc.wait()
    assert [r.status for r in _records(db)] == ["ok", "ok"]
    # (its watch notices within a second on an idle machine; left alone, it would sleep out the hung
    # kernel's HANG_S, so a bound far under that, and far over what a busy machine adds, tells them apart)
    deadline = time.monotonic() + HANG_S / 10
    while not _gone(worker):
        assert time.monotonic() < deadline, "the worker outlived its tuning parent"
        time.sleep(0.1)


def test_two_tunes_at_once_measure_different_schedules(tmp_path):
    """Both propose the same schedules in the same order (one seed); each measures what the other has
    not claimed."""
    db = tmp_path / "t.db"
    with Database(db):
        pass  # created before both start
    procs = [_start(db, "tests.faulty:slow_factory", 6) for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=400) == 0, p.stderr.read().decode()[-2000:]
    keys = [r.schedule_key for r in _records(db)]
    assert len(keys) == len(set(keys)), "a schedule was measured twice"
    assert len(keys) >= 8  # both tunes measured: the second did not just wait for the first
    with Database(db, readonly=True) as d:
        assert d._conn.execute("SELECT COUNT(*) FROM claims").fetchone()[0] == 0  # released at the end


def test_retry_failed_measures_timeouts_and_crashes_again(tmp_path, capsys):
    db, target = tmp_path / "t.db", get_target("cpu")
    default = ScheduleSpace(WL, target).default()
    with Database(db) as d:
        d.add(Record(workload_key=WL.key, workload=WL.to_json(), target_key=target.id, schedule=default,
                     status="timeout", device="cpu", extra={"error": "no answer within 30 s"}))
    argv = ["tune", "rmsnorm", "--dim", "M=4", "--dim", "N=512", "--dtype", "fp32", "--target", "cpu",
            "--trials", "1", "--strategy", "random", "--db", str(db)]
    assert main(argv) == 0
    first = _records(db)
    assert len(first) == 2 and first[1].schedule != default  # recorded failures are not measured again
    assert main([*argv, "--retry-failed"]) == 0
    capsys.readouterr()
    again = _records(db)[2:]
    assert len(again) == 1 and again[0].schedule == default and again[0].status == "ok"
    with Database(db, readonly=True) as d:
        assert d.best(WL.key, target.id) is not None
