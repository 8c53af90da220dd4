"""Shared pytest fixtures for the whole suite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
