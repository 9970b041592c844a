"""The compile driver through the Python API: the same input gives byte-identical artifacts (the
compile's timings go to its report, never into the artifact), a damaged artifact is refused
naming its file, and `llmc.load(...).generate` gives HF transformers' greedy tokens."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

import llmc
from llmc import SamplingParams
from llmc.compiler.frontends import load_model
from llmc.errors import ArtifactError
from llmc.runtime.sampling_params import SamplingParams as RuntimeSamplingParams

PROMPTS = ["hello", {"prompt_token_ids": [5, 6, 7]}]


@pytest.fixture(scope="module")
def twice(tmp_path_factory) -> tuple[Path, Path]:
    """tiny-llama compiled twice, into two different directories."""
    root = tmp_path_factory.mktemp("twice")
    return tuple(llmc.compile("tiny-llama", target="cpu", output=root / name) for name in ("a", "b"))


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama")


def files_of(path: Path) -> dict[str, bytes]:
    return {f.relative_to(path).as_posix(): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def assert_same_bytes(a: Path, b: Path) -> None:
    files_a, files_b = files_of(a), files_of(b)
    assert sorted(files_a) == sorted(files_b)
    assert "weights.safetensors" in files_a and "timings.json" not in files_a
    for name in files_a:
        assert files_a[name] == files_b[name], f"{name} differs between two compiles"


def test_same_input_gives_byte_identical_artifacts(twice):
    assert_same_bytes(*twice)


def test_manifest_hashes_every_other_file_and_holds_no_timings(twice):
    path = twice[0]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["files"] == {name: hashlib.sha256(data).hexdigest()
                                 for name, data in files_of(path).items() if name != "manifest.json"}
    assert all("seconds" not in p for p in manifest["pipeline"])


def save_checkpoint(tiny, path: Path) -> Path:
    tiny.module.save_pretrained(path, safe_serialization=True)
    tiny.tokenizer.save_pretrained(path)
    return path


def test_hf_checkpoint_compiles_the_same_whichever_way_its_path_is_spelled(tiny, tmp_path, monkeypatch):
    save_checkpoint(tiny, tmp_path / "tiny-hf")
    by_absolute = llmc.compile(str(tmp_path / "tiny-hf"), output=tmp_path / "absolute.llmc")
    monkeypatch.chdir(tmp_path)
    by_relative = llmc.compile("./tiny-hf/", output="relative.llmc")
    assert_same_bytes(by_absolute, tmp_path / by_relative)
    assert str(tmp_path) not in (by_absolute / "manifest.json").read_text()


@pytest.mark.parametrize("damage", ["flip-one-byte", "truncate"])
def test_load_refuses_a_damaged_artifact_naming_the_file(damage, twice, tmp_path):
    damaged = shutil.copytree(twice[0], tmp_path / "damaged.llmc")
    weights = damaged / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "flip-one-byte":
        data[len(data) // 3] ^= 0x01
    else:
        del data[len(data) // 2:]
    weights.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"weights\.safetensors"):
        llmc.load(damaged)


def hf_greedy(tiny, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = tiny.module.generate(torch.tensor([prompt_token_ids]), max_new_tokens=max_tokens,
                                   do_sample=False, pad_token_id=tiny.tokenizer.pad_token_id)
    return out[0, len(prompt_token_ids):].tolist()


def test_python_api_generates_hf_greedy_tokens(twice, tiny):
    assert SamplingParams is RuntimeSamplingParams
    model = llmc.load(twice[0])
    outputs = model.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
    assert len(outputs) == len(PROMPTS)
    assert outputs[0].prompt_token_ids == tiny.tokenizer("hello").input_ids
    assert outputs[1].prompt_token_ids == [5, 6, 7]
    for out in outputs:
        completion = out.outputs[0]
        assert completion.token_ids == hf_greedy(tiny, out.prompt_token_ids, 8)
        # like vLLM's detokenizer, the text holds back a trailing incomplete UTF-8 sequence
        full_text = tiny.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert completion.text and completion.text == full_text.rstrip("\ufffd")
        assert completion.finish_reason == ("stop" if tiny.config.eos_token_id in completion.token_ids
                                            else "length")

