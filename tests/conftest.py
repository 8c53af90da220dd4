"""Shared pytest fixtures for the whole suite."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# The suite runs in several processes on few cores (2 in CI): torch's intra-op pool of one
# thread per core in each process, and in each subprocess a test starts, spins against the
# others. One thread each made the paired SchNet benchmark's test 20x faster on a loaded
# 2-core machine. Set before any test module imports torch; subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

TESTS_DIR = Path(__file__).resolve().parent
GOLDEN_DIR = TESTS_DIR / "data" / "atp"


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    """Directory of the golden `.atp` files written by atompack-db."""
    return GOLDEN_DIR


@pytest.fixture
def golden_expected() -> dict:
    """The parsed `expected.json` describing every golden file (a fresh copy per test,
    so that no test can change what the next one expects)."""
    with open(GOLDEN_DIR / "expected.json", encoding="utf-8") as handle:
        return json.load(handle)


# every object-store server (s3, gs, az), started at most once per test process
from servers.stores import store_servers  # noqa: E402, F401
