"""Artifacts: written atomically and deterministically, read back only when every file matches
its manifest hash, weights via safetensors with tied tensors restored. The manifest, graph and
plan are a compiled tiny-llama's (a read checks that they agree); weights and kernels are made up."""

import json
import os
import pickle

import pytest
import torch

from llmc.compiler.artifact import Artifact, load_tokenizer, read_artifact, write_artifact
from llmc.errors import ArtifactError


@pytest.fixture
def inputs(tiny_model, compiled):
    weights = dict(tiny_model.module.state_dict())
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # tie them, as SmolLM2 does
    weights["transposed"] = torch.randn(8, 4, generator=torch.Generator().manual_seed(4)).t()
    manifest = json.loads((compiled / "manifest.json").read_text())
    for written_by_write_artifact in ("format_version", "files", "weight_aliases"):
        del manifest[written_by_write_artifact]
    return dict(graph_json=(compiled / "graph.json").read_text(), plan_json=(compiled / "plan.json").read_text(),
                weights=weights, tokenizer=tiny_model.tokenizer, manifest=manifest,
                kernels={"rms_norm.py": "# rms_norm kernel\n", "attention/decode.py": "# decode\n"})


@pytest.fixture
def artifact(tmp_path, inputs):
    return write_artifact(tmp_path / "model.llmc", **inputs)


def all_files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def error_for(path):
    with pytest.raises(ArtifactError) as info:
        read_artifact(path)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_round_trip_restores_everything(artifact, inputs, tiny_model):
    loaded = read_artifact(artifact)
    assert isinstance(loaded, Artifact)
    assert (loaded.graph_json, loaded.plan_json) == (inputs["graph_json"], inputs["plan_json"])
    assert loaded.kernels == inputs["kernels"]
    assert loaded.weights.keys() == inputs["weights"].keys()
    for name, tensor in inputs["weights"].items():
        assert torch.equal(loaded.weights[name], tensor), name
    assert loaded.manifest["target"]["name"] == "cpu" and loaded.manifest["format_version"] == 1
    assert loaded.manifest["model"]["source_sha256"] == tiny_model.source_hash
    tok = load_tokenizer(loaded)
    text = "The river runs east, past the mill."
    assert tok(text)["input_ids"] == tiny_model.tokenizer(text)["input_ids"]
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, tokenize=False) == \
        tiny_model.tokenizer.apply_chat_template(chat, tokenize=False)


def test_tied_weights_are_stored_once_and_restored_as_one_tensor(artifact):
    loaded = read_artifact(artifact)
    assert loaded.manifest["weight_aliases"] == {"model.embed_tokens.weight": "lm_head.weight"}
    from safetensors import safe_open
    with safe_open(artifact / "weights.safetensors", framework="pt") as f:
        stored = set(f.keys())
    assert "lm_head.weight" in stored and "model.embed_tokens.weight" not in stored
    assert loaded.weights["lm_head.weight"] is loaded.weights["model.embed_tokens.weight"]


def test_slices_of_one_storage_are_saved_as_separate_tensors(tmp_path, inputs):
    fused = torch.randn(6, 4, generator=torch.Generator().manual_seed(5))
    inputs["weights"] = {"q": fused[:2], "k": fused[2:4], "v": fused[4:]}
    loaded = read_artifact(write_artifact(tmp_path / "a", **inputs))
    for name, rows in (("q", slice(0, 2)), ("k", slice(2, 4)), ("v", slice(4, 6))):
        assert torch.equal(loaded.weights[name], fused[rows])
    assert loaded.manifest["weight_aliases"] == {}


def test_manifest_lists_the_sha256_of_every_file(artifact):
    manifest = json.loads((artifact / "manifest.json").read_text())
    files = sorted(set(all_files(artifact)) - {"manifest.json"})
    assert sorted(manifest["files"]) == files
    assert {"graph.json", "plan.json", "weights.safetensors", "tokenizer/tokenizer.json",
            "kernels/rms_norm.py", "kernels/attention/decode.py"} <= set(files)
    import hashlib
    for name in files:
        assert manifest["files"][name] == hashlib.sha256((artifact / name).read_bytes()).hexdigest()
    text = (artifact / "manifest.json").read_text()
    assert text.endswith("}\n") and text == json.dumps(manifest, sort_keys=True, indent=1) + "\n"


def test_same_inputs_give_byte_identical_artifacts(tmp_path, inputs, tiny_model):
    first = all_files(write_artifact(tmp_path / "a", **inputs))
    inputs["tokenizer"] = tiny_model.tokenizer  # the same tokenizer, saved again
    second = all_files(write_artifact(tmp_path / "b", **inputs))
    assert first.keys() == second.keys()
    assert [name for name in first if first[name] != second[name]] == []


def test_caller_manifest_is_not_modified(tmp_path, inputs):
    before = dict(inputs["manifest"])
    write_artifact(tmp_path / "a", **inputs)
    assert inputs["manifest"] == before


@pytest.mark.parametrize("name", ["weights.safetensors", "graph.json", "tokenizer/tokenizer.json",
                                  "kernels/rms_norm.py"])
def test_one_flipped_byte_names_the_file(artifact, name):
    path = artifact / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    message = error_for(artifact)
    assert f"file {name} fails its sha256 check" in message and str(artifact) in message


def test_truncated_weights_are_named(artifact):
    path = artifact / "weights.safetensors"
    path.write_bytes(path.read_bytes()[:-64])
    assert "file weights.safetensors fails its sha256 check (tampered or truncated)" in error_for(artifact)


def test_missing_file_is_named(artifact):
    (artifact / "plan.json").unlink()
    assert "file plan.json is missing" in error_for(artifact)


def test_unlisted_file_is_named(artifact):
    (artifact / "kernels" / "extra.py").write_text("print('hi')\n")
    assert "kernels/extra.py is not listed" in error_for(artifact)


def test_missing_or_corrupt_manifest_is_refused(artifact):
    manifest = artifact / "manifest.json"
    manifest.write_text("{")
    assert "manifest.json is not valid JSON" in error_for(artifact)
    manifest.unlink()
    assert "no manifest.json" in error_for(artifact)


def test_manifest_paths_may_not_leave_the_artifact(artifact, tmp_path):
    manifest = json.loads((artifact / "manifest.json").read_text())
    (tmp_path / "outside").write_text("x")
    manifest["files"]["../outside"] = "0" * 64
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    assert "'../outside' is not a plain relative path" in error_for(artifact)


def test_newer_format_version_is_refused(artifact):
    manifest = json.loads((artifact / "manifest.json").read_text())
    manifest["format_version"] = 2
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    assert "format version 2" in error_for(artifact)


def test_missing_artifact_is_named(tmp_path):
    assert str(tmp_path / "nothing") in error_for(tmp_path / "nothing")


def test_pickled_weights_are_never_unpickled(artifact, tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (artifact / "weights.safetensors").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(ArtifactError, match="weights.safetensors"):
        read_artifact(artifact, verify=False)
    assert not marker.exists()


def test_existing_output_is_refused_without_force(artifact, inputs):
    before = all_files(artifact)
    with pytest.raises(ArtifactError, match="exists; pass --force to overwrite") as info:
        write_artifact(artifact, **inputs)
    assert str(artifact) in str(info.value)
    assert all_files(artifact) == before


def test_force_replaces_and_leaves_no_siblings(artifact, inputs):
    inputs["plan_json"] = inputs["plan_json"].replace('"max_tokens": 2048', '"max_tokens": 1024')
    write_artifact(artifact, **inputs, force=True)
    assert '"max_tokens": 1024' in read_artifact(artifact).plan_json
    assert sorted(p.name for p in artifact.parent.iterdir()) == [artifact.name]


def test_failed_write_leaves_nothing_behind(tmp_path, inputs):
    inputs["weights"] = dict(inputs["weights"], broken=[1.0, 2.0])
    with pytest.raises(TypeError, match="broken"):
        write_artifact(tmp_path / "out", **inputs)
    assert list(tmp_path.iterdir()) == []


def test_failed_forced_write_keeps_the_old_artifact(artifact, inputs):
    before = all_files(artifact)
    inputs["weights"] = dict(inputs["weights"], broken="not a tensor")
    with pytest.raises(TypeError):
        write_artifact(artifact, **inputs, force=True)
    assert all_files(artifact) == before
    assert sorted(p.name for p in artifact.parent.iterdir()) == [artifact.name]
    read_artifact(artifact)


def test_kernel_names_may_not_leave_the_artifact(tmp_path, inputs):
    inputs["kernels"] = {"../escape.py": "x"}
    with pytest.raises(ArtifactError, match="escape"):
        write_artifact(tmp_path / "out", **inputs)
    assert list(tmp_path.iterdir()) == []


def test_artifact_directory_is_world_readable(artifact):
    assert os.stat(artifact).st_mode & 0o755 == 0o755
