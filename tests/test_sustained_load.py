"""The sustained-load benchmark's arithmetic on recorded windows (no GPU): the plateau skips the
settling windows, and the ratio is cuBLAS's plateau over each kernel's, per shape."""
import random
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
import sustained_load as sl  # noqa: E402


def _raw(shape: str, kernel: str, us: list[float]) -> dict:
    return {"shape": shape, "M": 4096, "kernel": kernel, "windows": len(us), "first_us": us[0], "last_us": us[-1],
            "min_us": min(us), "max_us": max(us), "first_half_card": "", "second_half_card": "", "schedule": "",
            "windows_us": " ".join(str(u) for u in us)}


def test_plateau_skips_settling_windows_and_compares_with_cublas() -> None:
    rng = random.Random()
    fast = [100.0, 105.0, 110.0]  # the first 300 ms of a 1 s run in 10 windows (ceil(0.3 * 10 / 1) = 3)
    w4 = fast + [rng.uniform(118, 122) for _ in range(7)]
    cub = [90.0, 95.0, 99.0] + [rng.uniform(104, 108) for _ in range(7)]
    rows = sl.with_plateau([_raw("o", "flashgen w4a16", w4), _raw("o", sl.PEER, cub), _raw("qkv", "x", [5.0, 6.0])],
                           seconds=1.0, settle_ms=300.0)
    col = {c: i for i, c in enumerate(sl.HEADER)}
    assert rows[0][col["plateau_us"]] == pytest.approx(statistics.median(w4[3:]))
    assert rows[0][col["plateau_over_first"]] == pytest.approx(statistics.median(w4[3:]) / 100.0)
    assert rows[0][col["plateau_vs_cublas"]] == pytest.approx(statistics.median(cub[3:]) / statistics.median(w4[3:]))
    assert rows[1][col["plateau_vs_cublas"]] == pytest.approx(1.0)
    assert rows[2][col["plateau_vs_cublas"]] == ""  # no cuBLAS run of that shape
    assert rows[2][col["plateau_us"]] == 6.0  # settling never eats the last window


def test_half_summary_medians_and_reasons() -> None:
    samples = [(0.0, ["1980", "650", "60", "N/A", "0x0000000000000004"]),
               (1.0, ["1500", "700", "62", "N/A", "0x0000000000000000"]),
               (2.0, ["1400", "690", "64", "N/A", "0x0000000000000004"])]
    text = sl.half_summary(samples)
    assert text.startswith("1500 MHz / 690 W / 62 C gpu / n/a C mem")
    assert text.endswith("reasons 0x0000000000000000 0x0000000000000004")
    assert sl.half_summary([]) == "no samples"
