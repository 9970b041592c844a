"""Bad input to `llmc`: each mistake prints exactly one stderr line, "llmc: error: ...", naming
what is wrong (path, target, pass) and what to do, exits 2, and leaves neither the artifact nor
its temporary sibling behind. Most cases call `llmc.cli.main` in-process (each subprocess pays a
torch import); the console script itself is checked on one compile and one run."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from llmc_cli import llmc_in_process

import llmc
from llmc.compiler.frontends import load_model
from llmc.compiler.targets import TARGETS
from llmc.passes.registry import valid_pass_names

LLMC = Path(sys.executable).parent / "llmc"




def error_line(err: str) -> str:
    """The one stderr line, without its "llmc: error: " prefix."""
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got:\n{err}"
    assert lines[0].startswith("llmc: error: "), lines[0]
    return lines[0].removeprefix("llmc: error: ")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    """A good HF checkpoint of tiny-llama beside broken model sources made from it."""
    root = tmp_path_factory.mktemp("sources")
    tiny = load_model("tiny-llama")
    good = root / "tiny-hf"
    tiny.module.save_pretrained(good, safe_serialization=True)
    tiny.tokenizer.save_pretrained(good)
    (root / "notes").mkdir()
    (root / "notes" / "README.md").write_text("not a model\n")
    (root / "truncated.gguf").write_bytes(b"GGUF" + bytes([3, 0, 0, 0, 7, 1]))
    weights = shutil.copytree(good, root / "corrupt") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    config_path = shutil.copytree(good, root / "gpt2") / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    return root


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return llmc.compile("tiny-llama", target="cpu", output=tmp_path_factory.mktemp("art") / "tiny.llmc")


PASSES = valid_pass_names()

# case: (compile arguments, fragments the error line must hold: the culprit and the remedy)
COMPILE_MISTAKES = {
    "missing-path": (["{src}/no/such/model"], ["no/such/model", "does not exist", "pass a sample name"]),
    "not-a-model": (["{src}/notes"], ["notes", "is not a model", "no config.json", "README.md"]),
    "truncated-gguf": (["{src}/truncated.gguf"], ["truncated.gguf", "truncated or corrupt", "re-download"]),
    "corrupt-safetensors": (["{src}/corrupt"], ["corrupt/model.safetensors", "truncated or corrupt",
                                                "re-download or re-save"]),
    "unsupported-architecture": (["{src}/gpt2"], ["GPT2LMHeadModel", "not supported", "LlamaForCausalLM"]),
    "unknown-target": (["tiny-llama", "--target", "tpu-v5"], ["'tpu-v5'", "valid targets", *TARGETS]),
    "unknown-pass": (["tiny-llama", "--passes", "dce,fuse_everything"],
                     ["'fuse_everything'", "valid passes", *PASSES]),
    "unknown-disabled-pass": (["tiny-llama", "--disable-pass", "fuse_everything"],
                              ["'fuse_everything'", "disable", "valid passes", *PASSES]),
    "unknown-pass-option": (["tiny-llama", "--pass-option", "fold_constants.speed=9"],
                            ["fold_constants", "'speed'", "valid options: max_growth"]),
    "missing-output-option": (["tiny-llama"], ["--output", "llmc compile --help"]),
}


@pytest.mark.parametrize("case", COMPILE_MISTAKES)
def test_compile_mistake_is_one_line_exit_2_and_leaves_nothing(case, sources, tmp_path, capfd):
    args, fragments = COMPILE_MISTAKES[case]
    args = [a.format(src=sources) for a in args]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    output = [] if case == "missing-output-option" else ["-o", out_dir / "model.llmc"]
    code, stdout, err = llmc_in_process(capfd, "compile", *args, *output)
    assert code == 2
    message = error_line(err)
    for fragment in fragments:
        assert fragment in message
    assert stdout == ""
    assert list(out_dir.iterdir()) == []  # neither model.llmc nor .model.llmc.tmp-*


def test_existing_output_is_refused_without_force_and_replaced_with_it_only_if_an_artifact(tmp_path, capfd):
    output = tmp_path / "model.llmc"
    output.mkdir()
    (output / "keep.txt").write_text("mine\n")
    code, _, err = llmc_in_process(capfd, "compile", "tiny-llama", "-o", output)
    assert code == 2
    message = error_line(err)
    assert f"'{output}'" in message and "exists" in message and "--force" in message
    assert sorted(p.name for p in output.iterdir()) == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["model.llmc"]

    code, _, err = llmc_in_process(capfd, "compile", "tiny-llama", "-o", output, "--force", "-q")
    assert code == 2 and "--force replaces only a previous llmc artifact" in error_line(err)
    assert sorted(p.name for p in output.iterdir()) == ["keep.txt"]  # not an artifact: kept

    (output / "keep.txt").unlink()
    output.rmdir()
    for force in ([], ["--force"]):  # a fresh artifact, then one that replaces it
        code, _, err = llmc_in_process(capfd, "compile", "tiny-llama", "-o", output, *force, "-q")
        assert code == 0, err
        assert (output / "manifest.json").is_file()
        assert [p.name for p in tmp_path.iterdir()] == ["model.llmc"]  # no .tmp-* or .old-* left


@pytest.mark.parametrize("case", ["missing", "not-an-artifact"])
def test_inspect_of_a_non_artifact_names_it(case, sources, tmp_path, capfd):
    path = tmp_path / "nothing-here" if case == "missing" else sources / "tiny-hf"
    code, stdout, err = llmc_in_process(capfd, "inspect", path)
    assert code == 2 and stdout == ""
    message = error_line(err)
    assert f"'{path}'" in message and "llmc compile" in message


def test_run_without_a_prompt_says_how_to_give_one(artifact):
    result = subprocess.run([str(LLMC), "run", str(artifact)], capture_output=True, text=True,
                            stdin=subprocess.DEVNULL, timeout=300)
    assert result.returncode == 2 and result.stdout == ""
    message = error_line(result.stderr)
    assert "no prompt" in message and "--prompt" in message and "stdin" in message


def test_console_script_reports_a_missing_model_on_one_line(tmp_path):
    output = tmp_path / "model.llmc"
    result = subprocess.run([str(LLMC), "compile", str(tmp_path / "missing"), "-o", str(output)],
                            capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert result.returncode == 2 and result.stdout == ""
    assert str(tmp_path / "missing") in error_line(result.stderr)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("damage", ["flip-one-byte", "truncate"])
def test_run_on_a_damaged_artifact_names_the_file(damage, artifact, tmp_path, capfd):
    damaged = shutil.copytree(artifact, tmp_path / "damaged.llmc")
    weights = damaged / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "flip-one-byte":
        data[len(data) // 2] ^= 0x01
    else:
        del data[-64:]
    weights.write_bytes(bytes(data))
    code, stdout, err = llmc_in_process(capfd, "run", damaged, "--prompt", "hello", "--max-tokens", "4")
    assert code == 2 and stdout == ""
    message = error_line(err)
    assert f"'{damaged}'" in message and "weights.safetensors" in message and "recompile" in message
