"""Fixtures the tests of llmc/tools (bench, eval) share."""

import pytest


@pytest.fixture(scope="session")
def artifact(compiled):
    """tiny-llama compiled for cpu once per session (tests/conftest.py); read-only."""
    return compiled
