"""The command line around targets as a new user meets it: `llmc compile --help` lists the targets
and says which sample has random weights, `llmc targets` states each target's weight recipe, the
ONNX export of an artifact compiled for bf16 activations is refused in one line that says what to
do, and streamed `llmc run` output ends with a newline however the stream ends."""

import pytest
from llmc_cli import error_line, llmc_in_process

import llmc
from llmc.compiler.targets import TARGETS
from llmc.errors import RuntimeLlmcError


def test_compile_help_lists_every_target_and_says_tiny_llama_has_random_weights(capsys):
    code, out, _ = llmc_in_process(capsys, "compile", "--help")
    text = " ".join(out.split())   # click wraps the help text
    assert code == 0
    assert "Target: " + ", ".join(TARGETS) + "." in text.replace("orin- int4", "orin-int4")
    assert "tiny-llama (random weights" in text and "smollm2-135m" in text


def test_targets_says_what_each_target_makes_of_the_weights(capsys):
    code, out, _ = llmc_in_process(capsys, "targets")
    lines = {line.split(":")[0]: line for line in out.splitlines() if not line.startswith(" ")}
    assert code == 0 and set(lines) == set(TARGETS)
    assert "recipe: --quant fp8, fp8 e4m3 weights" in lines["h100-fp8"] and "whatever the source" in lines["h100-fp8"]
    assert "recipe: --quant w8a8, SmoothQuant int8 weights" in lines["a100-int8"]
    assert "recipe: --quant int4-awq, AWQ int4 weights" in lines["rtx4090-int4"]
    assert "recipe: bf16 weights whatever the source" in lines["h100-bf16"]
    assert "recipe: a quantised source's own blocks kept" in lines["cpu"]


@pytest.mark.parametrize("target", ["h100-bf16", "cpu-bf16"])
def test_exporting_an_artifact_with_bf16_activations_is_refused_in_one_line(capsys, tmp_path, monkeypatch, target):
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path / "cache"))
    path = llmc.compile("tiny-llama", target=target, output=tmp_path / "a.llmc", quiet=True,
                        max_num_batched_tokens=64, **({"kernels": "cpu"} if target == "cpu-bf16" else {}))
    code, _, err = llmc_in_process(capsys, "export", path, "-o", tmp_path / "onnx")
    line = error_line(err)
    assert code == 2 and f"compiled for target '{target}', whose activations are bf16" in line
    assert "--target cpu" in line and "--dtype" not in line and not (tmp_path / "onnx").exists()


def test_streamed_run_output_ends_with_a_newline(capsys, compiled):
    code, out, _ = llmc_in_process(capsys, "run", compiled, "-p", "hello", "--max-tokens", "4")
    assert code == 0 and out.endswith("\n") and out.strip()


def test_a_stream_refused_midway_still_ends_its_line_before_the_error(capsys, compiled, monkeypatch):
    def stream(self, prompt, params=None):
        yield "partial"
        raise RuntimeLlmcError("the request was aborted: out of KV cache blocks")

    monkeypatch.setattr(llmc.api.LLM, "stream", stream)
    code, out, err = llmc_in_process(capsys, "run", compiled, "-p", "hello")
    assert code == 2 and out == "partial\n" and error_line(err).startswith("the request was aborted")
