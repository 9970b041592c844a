"""The compile driver through the Python API: the same input gives byte-identical artifacts (all
but the wall-clock timings.json, which the manifest does not hash), a damaged artifact is refused
naming its file, inspect pairs pass timings by position, and `llmc.load(...).generate` gives
HF transformers' greedy tokens."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

import llmc
from llmc import SamplingParams
from llmc.compiler.frontends import load_model
from llmc.compiler.inspect import report, summarize
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


def assert_same_bytes_but_timings(a: Path, b: Path) -> None:
    files_a, files_b = files_of(a), files_of(b)
    assert sorted(files_a) == sorted(files_b)
    assert "timings.json" in files_a and "weights.safetensors" in files_a
    for name in files_a:
        if name != "timings.json":
            assert files_a[name] == files_b[name], f"{name} differs between two compiles"


def test_same_input_gives_byte_identical_artifacts(twice):
    assert_same_bytes_but_timings(*twice)


def test_manifest_hashes_every_file_but_the_wall_clock_timings(twice):
    path = twice[0]
    manifest = json.loads((path / "manifest.json").read_text())
    unhashed = {"manifest.json", "timings.json"}
    assert manifest["files"] == {name: hashlib.sha256(data).hexdigest()
                                 for name, data in files_of(path).items() if name not in unhashed}
    timings = json.loads((path / "timings.json").read_text())
    assert [p["name"] for p in timings["passes"]] == [p["name"] for p in manifest["pipeline"]]
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
    assert_same_bytes_but_timings(by_absolute, tmp_path / by_relative)
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


def test_inspect_pairs_pass_timings_by_position_when_a_pass_repeats(tmp_path):
    path = llmc.compile("tiny-llama", output=tmp_path / "x.llmc", passes="dce,remove_noops,dce")
    # timings.json is not hashed, so give each run a distinct time to tell them apart
    timings = json.loads((path / "timings.json").read_text())
    for entry, seconds in zip(timings["passes"], [0.25, 0.5, 0.75]):
        entry["seconds"] = seconds
    (path / "timings.json").write_text(json.dumps(timings))
    assert [(p["name"], p["seconds"]) for p in report(path)["passes"]] == \
        [("dce", 0.25), ("remove_noops", 0.5), ("dce", 0.75)]
    assert "0.750 s" in summarize(path)

    timings["passes"] = timings["passes"][:2]  # a log that does not line up is not guessed at
    (path / "timings.json").write_text(json.dumps(timings))
    assert [p["seconds"] for p in report(path)["passes"]] == [None, None, None]


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

