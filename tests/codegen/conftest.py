"""Codegen tests share the hand-built tiny Llama graph kept beside the runtime tests."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from tiny_llama import build_tiny_llama  # noqa: E402


@pytest.fixture
def tiny_llama():
    return build_tiny_llama()
