"""An artifact on disk is untrusted input and its output path holds someone's data: reads refuse
symlinks, special files and any manifest field of the wrong type or at odds with graph.json and
plan.json; writes replace nothing but a previous artifact (checked again at the rename), lose no
race to a raw OSError, give every file mode 0644, and give byte-identical artifacts."""

import json
import os
import random
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

import llmc
from llmc.compiler import artifact as artifact_module
from llmc.compiler.artifact import read_artifact, sha256_file, staged_output
from llmc.compiler.inspect import kernel_report, report
from llmc.errors import ArtifactError, LlmcError


def files_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def leftovers(directory: Path) -> list[str]:
    """Staging or set-aside siblings a write left behind."""
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def refusal(call, *args, **kwargs) -> str:
    with pytest.raises(LlmcError) as info:
        call(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def rehash(art: Path, name: str) -> None:
    """What a tamperer does after editing a listed file: make the manifest vouch for it again."""
    edit_json(art / "manifest.json", lambda m: m["files"].__setitem__(name, sha256_file(art / name)))


# -- reads refuse links and special files ---------------------------------------------------------------
def test_a_symlink_to_dev_zero_beside_the_manifest_is_refused_unread(art):
    (art / "timings.json").symlink_to("/dev/zero")
    for call in (read_artifact, report):
        assert "timings.json is a symlink" in refusal(call, art)


@pytest.mark.parametrize("name", ["graph.json", "plan.json", "weights.safetensors", "tokenizer"])
def test_a_listed_file_or_directory_replaced_by_a_symlink_to_the_same_bytes_is_refused(art, tmp_path, name):
    moved = tmp_path / "elsewhere" / name
    moved.parent.mkdir()
    (art / name).rename(moved)
    (art / name).symlink_to(moved)   # the hashes still match: the link itself is what is refused
    message = refusal(read_artifact, art)
    assert f"{name} is a symlink" in message and str(art) in message


def test_a_draft_target_holding_a_symlink_is_refused_before_the_compile(art, tmp_path):
    moved = (art / "tokenizer").rename(tmp_path / "tokenizer")
    (art / "tokenizer").symlink_to(moved)
    message = refusal(llmc.compile, "tiny-llama", "cpu", tmp_path / "draft.llmc", draft_of=art)
    assert "tokenizer is a symlink" in message
    assert not (tmp_path / "draft.llmc").exists() and leftovers(tmp_path) == []


def test_a_fifo_in_an_artifact_is_refused_without_opening_it(art):
    os.mkfifo(art / "timings.json")
    assert "timings.json is not a regular file" in refusal(read_artifact, art)
    assert "timings.json is not a regular file" in refusal(report, art)


def test_a_huge_manifest_is_refused_before_parsing(art, monkeypatch):
    monkeypatch.setattr(artifact_module, "MAX_MANIFEST_BYTES", 1024)
    assert "manifest.json" in refusal(read_artifact, art) and "larger than" in refusal(read_artifact, art)


def test_inspect_reads_no_timings_and_shows_the_hashed_pass_report(art):
    (art / "timings.json").write_text(json.dumps({"passes": [{"name": "dce", "seconds": 9.5}]}))
    rep = report(art)
    manifest = json.loads((art / "manifest.json").read_text())
    assert rep["passes"] == manifest["pipeline"] and "stages" not in rep
    assert all("seconds" not in p for p in rep["passes"])


def test_inspect_checks_the_hash_of_what_it_reads(art):
    edit_json(art / "plan.json", lambda p: p["meta"].__setitem__("note", "edited"))
    assert "plan.json fails its sha256 check" in refusal(report, art)


# -- the manifest fits its schema and agrees with graph.json and plan.json ---------------------------------
@pytest.mark.parametrize("path, bad", [
    (("target", "device"), "tpu"), (("target", "name"), 3), (("files",), []), (("weight_aliases",), {"a": 1}),
    (("pipeline", 0, "matches"), "0"), (("pipeline", 0, "accuracy"), {"ppl_before": 0}),
    (("report", "op_counts"), {"linear": -1}), (("report", "kv_bytes_per_token"), 4096),
    (("llmc_version",), None), (("model", "kv_cache", "scale_params"), "{layer.__class__}"),
    (("draft_of",), {"model": "x", "manifest_sha256": "00", "num_layers": 1, "vocab_size": 1}),
])
def test_any_manifest_field_llmc_reads_is_type_checked(art, path, bad):
    def change(manifest):
        node = manifest
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = bad
    edit_json(art / "manifest.json", change)
    message = refusal(read_artifact, art)
    assert ".".join(map(str, path)) in message or path[0] in message, message


def test_graph_meta_edited_and_rehashed_is_caught_against_the_manifest(art):
    edit_json(art / "graph.json", lambda g: g["meta"].__setitem__("num_kv_heads", 4))
    rehash(art, "graph.json")
    message = refusal(read_artifact, art)
    assert "model.num_kv_heads is 2 but graph.json says 4" in message


def test_a_consistent_lie_in_manifest_graph_and_plan_meta_is_caught_by_the_plan_steps(art):
    for name in ("graph.json", "plan.json"):
        edit_json(art / name, lambda d: d["meta"].update(num_kv_heads=4, kv_bytes_per_token=1024,
                                                        hf_config={**d["meta"]["hf_config"], "num_key_value_heads": 4}))
        rehash(art, name)
    edit_json(art / "manifest.json", lambda m: (m["model"].update(num_kv_heads=4, kv_bytes_per_token=1024,
                                                                  hf_config={**m["model"]["hf_config"],
                                                                             "num_key_value_heads": 4}),
                                                m["report"].update(kv_bytes_per_token=1024)))
    message = refusal(read_artifact, art)
    assert "model.num_kv_heads is 4 but plan.json's steps say" in message.replace("says", "say")


@pytest.mark.parametrize("name, change, field", [
    ("kernels.json", lambda index: index[0].__setitem__("steps", 5), "kernels.json field 0.steps"),
    ("kernels.json", lambda index: index[0].__setitem__("grid", None), "kernels.json field 0.grid"),
    ("plan.json", lambda plan: plan["meta"]["kernels"].__setitem__("triton_ops", "rms_norm"),
     "plan.json meta field kernels.triton_ops"),
])
def test_inspect_kernels_type_checks_the_kernel_index_and_plan_record(tmp_path, name, change, field):
    gpu = llmc.compile("tiny-llama", target="h100-bf16", output=tmp_path / "gpu.llmc")
    edit_json(gpu / name, change)
    rehash(gpu, name)
    assert field in refusal(kernel_report, gpu)


def test_a_manifest_that_is_not_an_object_is_refused(art):
    (art / "manifest.json").write_text("[1, 2]")
    assert "manifest.json" in refusal(read_artifact, art)


# -- writes ----------------------------------------------------------------------------------------------
def test_force_refuses_to_replace_what_is_not_an_artifact_and_leaves_it_whole(tmp_path):
    out = tmp_path / "out.llmc"
    (out / "userdata").mkdir(parents=True)
    (out / "userdata" / "important.txt").write_text(f"{random.random()}\n")
    before = files_of(tmp_path)
    with pytest.raises(ArtifactError, match="is a directory without an llmc manifest.json"):
        with staged_output(out, force=True):
            pytest.fail("the staging directory was made for a refused output")
    assert files_of(tmp_path) == before and leftovers(tmp_path) == []


def test_an_artifact_swapped_for_user_data_during_the_compile_is_not_replaced(compiled, tmp_path):
    out = Path(shutil.copytree(compiled, tmp_path / "out.llmc"))
    with pytest.raises(ArtifactError, match="holds notes.txt, which its manifest.json does not list"):
        with staged_output(out, force=True) as staging:
            (staging / "manifest.json").write_text("{}")
            (out / "notes.txt").write_text("written by the user while llmc compiled\n")
    assert (out / "notes.txt").is_file() and leftovers(tmp_path) == []


def test_a_destination_written_by_another_compile_is_left_intact(compiled, tmp_path):
    out = tmp_path / "out.llmc"
    with pytest.raises(ArtifactError, match="another compile wrote .* at the same time; .*retry"):
        with staged_output(out, force=False) as staging:
            (staging / "half-written").write_text("x")
            shutil.copytree(compiled, out)   # the other compile finished first
    assert files_of(out) == files_of(compiled) and leftovers(tmp_path) == []
    read_artifact(out)


def test_a_forced_write_racing_another_keeps_the_winners_artifact(compiled, tmp_path, monkeypatch):
    out = Path(shutil.copytree(compiled, tmp_path / "out.llmc"))
    real_set_aside = artifact_module.set_aside

    def other_writer_lands_between(path, kind):
        old = real_set_aside(path, kind)  # ours moved the previous artifact away...
        shutil.copytree(compiled, path)  # ...and another compile renamed its own into place
        return old

    monkeypatch.setattr(artifact_module, "set_aside", other_writer_lands_between)
    with pytest.raises(ArtifactError, match="another compile wrote"):
        with staged_output(out, force=True) as staging:
            shutil.copytree(compiled, staging, dirs_exist_ok=True)
    assert files_of(out) == files_of(compiled) and leftovers(tmp_path) == []


def test_an_unwritable_output_is_refused_before_the_staging_dir_and_leaves_no_parents(tmp_path):
    (tmp_path / "file").write_text("x")
    for out in (tmp_path / "file" / "x.llmc", Path("/proc/llmc-test.llmc")):
        with pytest.raises(ArtifactError, match="cannot write output"):
            with staged_output(out, force=False):
                pytest.fail("staged an unwritable output")
    with pytest.raises(RuntimeError):
        with staged_output(tmp_path / "new" / "deeper" / "x.llmc", force=False):
            raise RuntimeError("the compile failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def modes_of(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize("umask", [0o077, 0o022, 0o002])
def test_every_file_is_0644_and_every_directory_0755_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        with staged_output(tmp_path / "out.llmc", force=False) as staging:
            (staging / "graph.json").write_text("{}")
            (staging / "tokenizer").mkdir()
            os.close(tempfile.mkstemp(dir=staging / "tokenizer")[0])  # mkstemp makes 0600
    finally:
        os.umask(old)
    modes = modes_of(tmp_path / "out.llmc")
    assert len(modes) == 4
    assert {m for name, m in modes.items() if (tmp_path / "out.llmc" / name).is_dir()} == {0o755}
    assert {m for name, m in modes.items() if (tmp_path / "out.llmc" / name).is_file()} == {0o644}


def test_two_compiles_are_byte_identical_with_equal_modes_and_hold_no_timings(compiled, tmp_path):
    report_file = tmp_path / "report.json"
    old = os.umask(0o077)  # the second compile under a strict umask
    try:
        again = llmc.compile("tiny-llama", target="cpu", output=tmp_path / "again.llmc", report=report_file,
                             kernels="cpu")   # as `compiled` was
    finally:
        os.umask(old)
    assert files_of(again) == files_of(compiled)
    assert modes_of(again) == modes_of(compiled) and modes_of(again)["weights.safetensors"] == 0o644
    assert "timings.json" not in files_of(again)
    timings = json.loads(report_file.read_text())
    manifest = json.loads((again / "manifest.json").read_text())
    assert {p["name"] for p in manifest["pipeline"]} <= {p["name"] for p in timings["passes"]}
    assert timings["seconds"] > 0 and {s["name"] for s in timings["stages"]} >= {"load", "trace", "plan", "write"}
