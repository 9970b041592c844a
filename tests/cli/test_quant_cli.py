"""Quantised tiny-llama from the command line and the Python API: `llmc compile --quant`
records its passes, `llmc inspect` shows the bytes before and after, and the artifacts
generate through `llmc.load` with logits close to the fp32 artifact's."""

import json

import pytest
import torch
import torch.nn.functional as F
from llmc_cli import llmc_in_process

import llmc
from llmc import SamplingParams


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """tiny-llama compiled as fp32, int8 and int4 (RTN, group 64) through the Python API."""
    root = tmp_path_factory.mktemp("quant")
    return {"fp32": llmc.compile("tiny-llama", output=root / "fp32"),
            "int8": llmc.compile("tiny-llama", output=root / "int8", quant="int8"),
            "int4": llmc.compile("tiny-llama", output=root / "int4", quant="int4-rtn", group_size=64)}


def all_logits(path, ids):
    executor = llmc.load(path).engine.executor
    rows = torch.arange(len(ids))
    return executor.run_values({"input_ids": ids, "positions": rows, "logits_indices": rows})["logits"]


def test_quantised_artifacts_give_logits_close_to_fp32(artifacts):
    ids = torch.randint(0, 512, (16,), generator=torch.Generator().manual_seed(0))
    fp32 = all_logits(artifacts["fp32"], ids)
    for name, bound in (("int8", 0.99), ("int4", 0.95)):
        cosine = F.cosine_similarity(fp32, all_logits(artifacts[name], ids), dim=-1)
        assert cosine.min() > bound, f"{name}: cosine {cosine.min():.4f}"


def test_quantised_artifacts_generate_and_int8_keeps_fp32_greedy_tokens(artifacts):
    greedy = SamplingParams(max_tokens=8, temperature=0)
    tokens = {name: llmc.load(path).generate("The river", greedy)[0].outputs[0].token_ids
              for name, path in artifacts.items()}
    assert all(len(t) == 8 for t in tokens.values())
    assert tokens["int8"] == tokens["fp32"]


def test_cli_compiles_int4_rtn_at_group_32_and_inspect_shows_the_bytes(tmp_path, capsys):
    out = tmp_path / "int4.llmc"
    code, stdout, err = llmc_in_process(capsys, "compile", "tiny-llama", "--quant", "int4-rtn",
                                        "--group-size", "32", "-o", out)
    assert code == 0, err
    assert "quant int4 (rtn, group 32): 14 linears" in stdout
    manifest = json.loads((out / "manifest.json").read_text())
    first = manifest["pipeline"][0]
    assert first["name"] == "quantize_int4" and first["options"]["group_size"] == 32
    assert manifest["report"]["weight_bytes"]["uint8"] > 0
    code, stdout, _ = llmc_in_process(capsys, "inspect", out)
    assert code == 0 and "calibration ppl" in stdout and "top-1 agreement" in stdout
    code, stdout, _ = llmc_in_process(capsys, "inspect", out, "--json")
    quant = json.loads(stdout)["quant"]["int4"]
    assert quant["linears"] == 14 and quant["passes"] == ["quantize_int4"]
    # group 32 stores fp32 scale and zero per 32 codes: 0.75 of 4 bytes per weight
    assert quant["ratio"] == pytest.approx(0.1875, abs=1e-3)


def test_cli_reports_linears_a_group_size_does_not_divide(tmp_path, capsys):
    code, _, err = llmc_in_process(capsys, "compile", "tiny-llama", "--quant", "int4-rtn",
                                   "--pass-option", "quantize_int4.shrink_groups=false",
                                   "-o", tmp_path / "g128.llmc")
    assert code == 0
    assert "12 linear(s) kept in float, in_features 64 is not a multiple of group_size 128" in err


@pytest.mark.parametrize("quant", ["int4-gptq", "int4-awq", "fp8", "w8a8"])
def test_every_calibrated_method_compiles_runs_and_benches_from_the_cli(quant, tmp_path, capsys):
    out = tmp_path / f"{quant}.llmc"
    code, _, err = llmc_in_process(capsys, "compile", "tiny-llama", "--quant", quant, "--calib-samples", "2",
                                   "--calib-seq-len", "24", "-o", out, "-q")
    assert code == 0, err
    code, stdout, err = llmc_in_process(capsys, "run", out, "-p", "The river", "--max-tokens", "4", "--no-stream",
                                        "--kv-memory", "4MiB")
    assert code == 0 and stdout.strip(), err
    code, stdout, err = llmc_in_process(capsys, "bench", out, "-n", "2", "--input-len", "8", "--output-len", "3",
                                        "--kv-memory", "4MiB", "--json")
    assert code == 0, err
    assert json.loads(stdout)["output_tokens_per_s"] > 0
    code, stdout, err = llmc_in_process(capsys, "inspect", out, "--json")
    scheme, method = {"int4-gptq": ("int4", "gptq"), "int4-awq": ("int4", "awq")}.get(quant, (quant, None))
    figures = json.loads(stdout)["quant"][scheme]
    assert figures["linears"] >= 14 and (method is None or figures["method"] == method)
