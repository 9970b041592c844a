"""Fixtures the runtime tests share."""

import pytest

import llmc


@pytest.fixture(scope="session")
def bf16_artifact(tmp_path_factory):
    """tiny-llama compiled for h100-bf16 (Triton kernels) once per session; read-only."""
    path = tmp_path_factory.getbasetemp() / "runtime-tiny-llama-h100-bf16.llmc"
    if not path.exists():
        llmc.compile("tiny-llama", target="h100-bf16", output=path)
    return path
