"""A large artifact file is hashed on its first load and, while its identity and times are
unchanged, not again; any change to it (even one that puts its size and mtime back) is hashed
and refused; records are kept only in a private directory."""

import os
import shutil
from pathlib import Path

import pytest

import llmc
from llmc.compiler import artifact, verified_files
from llmc.errors import ArtifactError


@pytest.fixture()
def compiled(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(verified_files, "REMEMBERED_BYTES", 0)
    art = llmc.compile("tiny-llama", output=tmp_path / "a.llmc", kernels="cpu", quiet=True)
    hashed = []
    real = artifact.sha256_file
    monkeypatch.setattr(artifact, "sha256_file", lambda p: hashed.append(p.name) or real(p))
    return art, hashed


def load(art):
    return artifact.read_artifact(art)


def test_a_file_hashed_once_is_not_hashed_again_while_unchanged(compiled):
    art, hashed = compiled
    load(art)
    assert hashed == []                                   # the compile recorded the hashes it took
    shutil.rmtree(Path(os.environ["LLMC_CACHE"]) / "verified")   # records lost: hashed on the next load
    load(art)
    assert "weights.safetensors" in hashed
    hashed.clear()
    load(art)
    assert hashed == []                                   # every file recorded, none hashed again


def test_a_changed_file_is_hashed_and_refused_even_with_its_size_and_mtime_put_back(compiled):
    art, hashed = compiled
    load(art)
    weights = art / "weights.safetensors"
    info = os.stat(weights)
    os.chmod(weights, 0o644)
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(info.st_atime_ns, info.st_mtime_ns))   # size and mtime as they were
    with pytest.raises(ArtifactError, match="fails its sha256 check"):
        load(art)


def test_rehash_hashes_every_time(compiled, monkeypatch):
    art, hashed = compiled
    load(art)
    hashed.clear()
    monkeypatch.setenv("LLMC_REHASH", "1")
    load(art)
    assert "weights.safetensors" in hashed


def test_records_in_a_directory_others_can_write_are_not_trusted(compiled, tmp_path):
    art, hashed = compiled
    load(art)
    os.chmod(tmp_path / "cache" / "verified", 0o777)
    hashed.clear()
    load(art)
    assert "weights.safetensors" in hashed
