"""`llmc bench --baseline hf` on quantised artifacts: HF runs fp32 with the artifact's weights
dequantised (fused q/k/v and gate/up split back, AWQ's input scales folded in), computes the
same function as the artifact's own graph under the reference interpreter up to float
rounding, and the bench report names what the baseline ran."""

import json

import pytest
import torch
from click.testing import CliRunner

import llmc
from llmc.cli import cli
from llmc.compiler.artifact import read_artifact
from llmc.compiler.interpreter import interpret
from llmc.compiler.ir import Graph
from llmc.runtime.engine import Engine, EngineConfig
from llmc.tools.bench import hf_model_from_artifact

# max |HF - reference| over the reference logits' range: fp32 rounding sits near 1e-7
TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=["int8", "int4-rtn", "int4-awq"])
def quant_artifact(request, tmp_path_factory):
    path = tmp_path_factory.getbasetemp() / f"bench-quant-{request.param}.llmc"
    if not path.exists():
        llmc.compile("tiny-llama", target="cpu", output=path, quant=request.param)
    return path


def reference_logits(path, ids: torch.Tensor) -> torch.Tensor:
    """The artifact's graph, quantised ops and all, run by the reference interpreter."""
    art = read_artifact(path)
    graph = Graph.from_json(art.graph_json)
    inputs = {"input_ids": ids, "positions": torch.arange(len(ids))}
    if "logits_indices" in [v.name for v in graph.inputs]:
        inputs["logits_indices"] = torch.arange(len(ids))
    return interpret(graph, inputs, weights=art.weights)["logits"].float()


def test_hf_baseline_computes_the_quantised_artifacts_function(quant_artifact):
    engine = Engine(quant_artifact, EngineConfig(kv_memory="4MiB"))
    ids = torch.randint(0, engine.model["vocab_size"], (21,))
    with torch.inference_mode():
        hf = hf_model_from_artifact(engine)(ids[None]).logits[0]
    ref = reference_logits(quant_artifact, ids)
    err = (hf - ref).abs().max() / (ref.max() - ref.min())
    assert err < TOLERANCE, f"{quant_artifact.name}: HF baseline differs by {err:.2e} of the logit range"


def test_cli_bench_hf_baseline_on_a_quantised_artifact(quant_artifact):
    res = CliRunner().invoke(cli, ["bench", str(quant_artifact), "-n", "2", "--input-len", "8", "--output-len", "4",
                                   "--kv-memory", "4MiB", "--baseline", "hf", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["baseline"]["name"].startswith("hf (fp32, dequantised int")
    assert report["baseline"]["output_tokens_per_s"] > 0
    assert report["ratio"] == pytest.approx(report["output_tokens_per_s"] / report["baseline"]["output_tokens_per_s"])
    text = CliRunner().invoke(cli, ["bench", str(quant_artifact), "-n", "2", "--input-len", "8", "--output-len", "4",
                                    "--kv-memory", "4MiB", "--baseline", "hf"])
    assert text.exit_code == 0, text.output
    assert "baseline          hf (fp32, dequantised int" in text.stdout


def test_w8a8_baseline_says_its_activations_are_not_quantised(tmp_path):
    path = llmc.compile("tiny-llama", target="cpu", output=tmp_path / "w8a8.llmc", quant="w8a8")
    from llmc.tools.hf_baseline import baseline_name

    name = baseline_name(Engine(path, EngineConfig(kv_memory="4MiB")).executor.plan)
    assert name.startswith("hf (fp32, dequantised w8a8 weights") and "activations run in fp32" in name
