"""`--prune` and `--sparsity` as passes: parts parsed into pass specs in a fixed order, bad parts
refused with one line that names them (exit 2 from the CLI, before any model loads), pruning
placed ahead of KV-head conversion, quantisation and cleanup, and one compile that prunes heads,
FFN channels and a layer, sparsifies 2:4 and quantises int8, then runs through the engine."""

import json

import pytest
import torch
from llmc_cli import llmc_in_process

import llmc
from llmc import SamplingParams
from llmc.cli import main
from llmc.compiler.options import CompileOptions
from llmc.compiler.pipeline import pass_configs
from llmc.compiler.recipes import parse_prune, prune_passes
from llmc.compiler.targets import get_target
from llmc.errors import PassError


def specs(configs) -> list[str]:
    return [c.spec() for c in configs]


def test_prune_parts_become_passes_layers_then_heads_then_ffn_then_sparsity():
    assert parse_prune(" ffn:0.3, layers:4 ,heads:0.25") == {"ffn": "0.3", "layers": "4", "heads": "0.25"}
    assert specs(prune_passes("ffn:0.3,layers:4,heads:0.25", "2:4")) == [
        "prune_layers:count=4", "prune_heads", "prune_ffn:fraction=0.3", "prune_sparse:pattern=2:4"]
    assert specs(prune_passes(None, 0.5, "magnitude")) == ["prune_sparse:sparsity=0.5:method=magnitude"]
    assert specs(prune_passes(None, "0.7")) == ["prune_sparse:sparsity=0.7"]
    assert prune_passes() == []


def test_configs_hold_typed_options():
    configs = prune_passes("heads:0.25,layers:4", "2:4", "magnitude")
    assert [c.options.to_dict() for c in configs] == [
        {"count": 4}, {"fraction": 0.25, "unit": "group"},
        {"sparsity": 0.0, "pattern": "2:4", "method": "magnitude"}]
    assert all(c.instantiate().lossy for c in configs) and {c.stage.label for c in configs} == {"prune"}


@pytest.mark.parametrize("prune, sparsity, method, message", [
    ("heads", None, None, "--prune part 'heads' has no amount; write heads:FRACTION"),
    ("heads:abc", None, None, "--prune part 'heads:abc': 'abc' is not a number"),
    ("mlp:0.3,heads:0.2", None, None, "--prune part 'mlp:0.3': unknown kind 'mlp'"),
    ("heads:0.2,heads:0.3", None, None, "--prune part 'heads:0.3': heads is given twice"),
    ("layers:2.5", None, None, "--prune part 'layers:2.5': '2.5' is not a whole number of layers"),
    ("layers:0", None, None, "--prune part 'layers:0'"),
    ("ffn:1.5", None, None, "--prune part 'ffn:1.5': the fraction must lie strictly between 0 and 1"),
    (" , ", None, None, "--prune is empty"),
    (None, "abc", None, "--sparsity 'abc' is neither a fraction"),
    (None, "1.5", None, "--sparsity '1.5': the fraction of weights to zero must lie strictly between 0 and 1"),
    (None, "4:2", None, "--sparsity '4:2' is not an N:M pattern"),
    (None, None, "wanda", "--sparsity-method needs --sparsity"),
    (None, "0.5", "random", "--sparsity-method 'random' is unknown"),
])
def test_bad_specs_name_the_bad_part(prune, sparsity, method, message):
    with pytest.raises(PassError) as e:
        prune_passes(prune, sparsity, method)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_pruning_runs_before_kv_head_conversion_quantisation_and_cleanup():
    opts = CompileOptions(prune="ffn:0.25,layers:2", sparsity="2:4", kv_heads=1, quant="int8")
    names = [c.name for c in pass_configs(get_target("cpu"), opts) if c.origin != "lowering"]
    assert names[:4] == ["prune_layers", "prune_ffn", "prune_sparse", "convert_kv_heads"]
    assert names.index("quantize_int8") == 4 and names[5:] == list(get_target("cpu").default_pipeline)


def test_explicit_passes_that_already_prune_refuse_a_second_pruning():
    with pytest.raises(PassError, match="--passes already holds prune_ffn .prune. and --prune adds prune_layers"):
        pass_configs(get_target("cpu"), CompileOptions(passes="prune_ffn:fraction=0.5,dce", prune="layers:1"))
    assert [c.name for c in pass_configs(get_target("cpu"), CompileOptions(passes="dce"))][-1] == "dce"


def test_cli_refuses_a_bad_prune_on_one_line_with_exit_2(tmp_path, capsys):
    code, out, err = llmc_in_process(capsys, "compile", "tiny-llama", "--prune", "heads:0.25,fnn:0.3",
                                     "-o", tmp_path / "x.llmc")
    assert code == 2 and err.count("\n") == 1
    assert "--prune part 'fnn:0.3': unknown kind 'fnn'" in err
    assert not (tmp_path / "x.llmc").exists()


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    """tiny-llama with heads, FFN channels and a layer pruned, 2:4 sparsity and int8 weights."""
    out = tmp_path_factory.mktemp("prune") / "pruned.llmc"
    code = 0
    try:
        main(["compile", "tiny-llama", "--prune", "heads:0.5,ffn:0.25,layers:1", "--sparsity", "2:4",
              "--quant", "int8", "--calib-samples", "2", "--calib-seq-len", "24", "-o", str(out), "-q"])
    except SystemExit as e:
        code = e.code
    assert code == 0
    return out


def test_pruning_sparsity_and_int8_compose_and_the_manifest_reports_each_step(composed):
    manifest = json.loads((composed / "manifest.json").read_text())
    steps = {p["name"]: p for p in manifest["pipeline"]}
    names = [p["name"] for p in manifest["pipeline"]]
    assert names[:5] == ["prune_layers", "prune_heads", "prune_ffn", "prune_sparse", "quantize_int8"]
    assert steps["prune_layers"]["details"]["kv_bytes_per_token_before"] == 2 * 2 * 2 * 16 * 4
    assert steps["prune_heads"]["details"]["kv_bytes_per_token_after"] == 2 * 1 * 1 * 16 * 4
    assert steps["prune_ffn"]["details"]["channels_after"] == [96]
    assert steps["prune_sparse"]["details"]["expected_speedup"].startswith("none")
    for name in ("prune_layers", "prune_heads", "prune_ffn", "prune_sparse"):
        accuracy = steps[name]["accuracy"]
        assert accuracy["ppl_before"] > 0 and accuracy["ppl_after"] > 0 and accuracy["kl"] > 0
        assert "params_removed" in steps[name]["details"]
    model = manifest["model"]
    assert (model["num_layers"], model["num_heads"], model["num_kv_heads"]) == (1, 2, 1)
    assert model["kv_bytes_per_token"] == manifest["report"]["kv_bytes_per_token"] == 2 * 16 * 4


def test_inspect_shows_what_each_pruning_pass_removed_and_cost(composed, capsys):
    code, out, _ = llmc_in_process(capsys, "inspect", composed)
    assert code == 0
    assert "KV 512 -> 256 bytes/token" in out and "KV 256 -> 128 bytes/token" in out
    assert "linear weights zero (dense); expected speedup: none" in out
    assert out.count("calibration ppl") >= 5


def test_the_pruned_int8_artifact_generates_through_the_engine(composed):
    model = llmc.load(composed)
    cache = model.engine.cache
    assert len(cache.k_cache) == 1 and tuple(cache.k_cache[0].shape[2:]) == (1, 16)
    outs = model.generate(["The river", "A small"], SamplingParams(max_tokens=6, temperature=0))
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    ids = torch.randint(0, 512, (9,), generator=torch.Generator().manual_seed(4))
    rows = torch.arange(9)
    logits = model.engine.executor.run_values({"input_ids": ids, "positions": rows, "logits_indices": rows})["logits"]
    assert logits.shape == (9, 512) and torch.isfinite(logits).all()


def test_pruning_then_mqa_conversion_then_int8_compile_in_one_go_and_run(tmp_path):
    out = llmc.compile("tiny-llama", output=tmp_path / "mqa.llmc", prune="ffn:0.25,layers:1", kv_heads=1,
                       quant="int8", calib_samples=2, calib_seq_len=24)
    manifest = json.loads((out / "manifest.json").read_text())
    assert [p["name"] for p in manifest["pipeline"][:4]] == ["prune_layers", "prune_ffn", "convert_kv_heads",
                                                             "quantize_int8"]
    assert manifest["model"]["kv_bytes_per_token"] == 1 * 1 * 16 * 4 * 2
    result = llmc.load(out).generate("The river", SamplingParams(max_tokens=5, temperature=0))
    assert len(result[0].outputs[0].token_ids) == 5
