"""Test-wide fixtures: a private cache folder and database per session, one interpreter pool."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """Keep tests off the user's cache and tuning database, and off the shipped records: a test checks
    what it measures or writes itself (test_shipped.py turns the shipped records back on)."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("flashgen-cache")
    mp.setenv("FLASHGEN_CACHE_DIR", str(root))
    mp.setenv("FLASHGEN_DB", str(root / "tuning.db"))
    mp.setenv("FLASHGEN_SHIPPED", "0")
    yield
    mp.undo()


@pytest.fixture(scope="session")
def interpreter():
    from flashgen.targets.triton.interpret import InterpreterPool

    with InterpreterPool(processes=1) as pool:
        yield pool
