"""fuse_qkv and fuse_gate_up, and the split op they emit: split is consecutive column blocks
(views on the CPU); on tiny-llama each layer's q/k/v and gate/up become one GEMM over exactly the
concatenated weights, found by structure rather than names, for float, int8, int4, w8a8 and fp8
weights, and the fused graph computes the unfused logits (reference interpreter and CPU plan);
fp8 projections with different activation scales stay apart; --disable-pass turns a fusion off."""

import json

import pytest
import torch
from renamed_params import renamed

import llmc
from llmc import SamplingParams
from llmc.cli import main
from llmc.codegen.plan import Plan, build_plan
from llmc.codegen.torch_cpu.cpu_kernels import resolve_kernel
from llmc.compiler.frontends import load_model
from llmc.compiler.interpreter import interpret
from llmc.compiler.ir import Graph, TensorType
from llmc.compiler.ops import OPS, infer_types
from llmc.compiler.pipeline import trace_and_lower
from llmc.compiler.targets import CPU_FUSIONS
from llmc.errors import IRError
from llmc.passes.base import PassContext, PassManager
from llmc.passes.fuse_projections import FP8_ACT_SCALES_DIFFER
from llmc.passes.registry import get_pass
from llmc.runtime.attention import NoCacheAttention
from llmc.runtime.executor import PlanExecutor

CLEANUP = ["remove_noops", "fold_constants", "dce"]
ATTN = "model.layers.{}.self_attn.{}_proj.weight"
MLP = "model.layers.{}.mlp.{}_proj.weight"


def run_passes(graph, names, calibration=None):
    ctx = PassContext(calibration=calibration, quiet=True)
    return {r.name: r for r in PassManager([get_pass(n) for n in names], ctx).run(graph)}


@pytest.fixture(autouse=True)
def packed_kernels(monkeypatch):
    """Quantised linears keep their packed kernels at every row count: where the dense switch
    (codegen/torch_cpu/cpu_qlinear_dense.py) starts is measured per weight shape, so a fused and an unfused
    projection could otherwise run different (equally valid) kernels at the same row count."""
    from llmc.codegen.torch_cpu.cpu_qlinear_dense import DENSE_FROM_ENV, NEVER_DENSE
    monkeypatch.setenv(DENSE_FROM_ENV, str(NEVER_DENSE))


@pytest.fixture(scope="module")
def lowered():
    graph = trace_and_lower(load_model("tiny-llama").module, 64, lambda *a: None)
    run_passes(graph, CLEANUP)
    return graph


@pytest.fixture(scope="module")
def calibration():
    gen = torch.Generator().manual_seed(31)
    return [torch.randint(0, 512, (20,), generator=gen) for _ in range(2)]


def prompt(seed, tokens):
    ids = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "positions": torch.arange(tokens), "logits_indices": torch.arange(tokens)}


def plan_logits(graph, inputs):
    # through JSON, so the executor sees only what an artifact holds
    plan = Plan.from_json(build_plan(graph, "cpu", 32).to_json())
    return PlanExecutor(plan, dict(graph.weights)).run_values(inputs, NoCacheAttention())["logits"]


def assert_same_logits(unfused, fused, atol=1e-5):
    for seed, tokens in ((0, 1), (1, 7), (2, 13)):
        inputs = prompt(seed, tokens)
        torch.testing.assert_close(interpret(fused, inputs)["logits"], interpret(unfused, inputs)["logits"],
                                   rtol=1e-4, atol=atol)
        torch.testing.assert_close(plan_logits(fused, inputs), plan_logits(unfused, inputs), rtol=1e-4, atol=atol)


# -- the split op -----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape, sizes", [((5, 10), [3, 5, 2]), ((1, 128), [64, 32, 32]), ((2, 3, 9), [9]),
                                          ((7, 12), [6, 6])])
def test_split_is_consecutive_column_blocks_and_views_on_cpu(shape, sizes):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(len(sizes)))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    want = [x[..., a:a + n] for a, n in zip(starts, sizes)]
    for got in (OPS["split"].reference(x, sizes=sizes), resolve_kernel("cpu.split")(x, sizes=sizes)):
        assert len(got) == len(sizes)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    views = resolve_kernel("cpu.split")(x, sizes=sizes)
    assert all(v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for v in views)


def test_split_type_rule_gives_one_output_per_size_and_rejects_bad_sizes():
    node = Graph().make_node("split", ["x"], [], {"sizes": [4, 2]})
    assert infer_types(node, [TensorType(("tokens", 6), "float32")]) == [
        TensorType(("tokens", 4), "float32"), TensorType(("tokens", 2), "float32")]
    for sizes in ([4, 3], [], [6, 0]):
        node.attrs["sizes"] = sizes
        with pytest.raises(IRError, match="split: sizes"):
            infer_types(node, [TensorType(("tokens", 6), "float32")])


# -- float projections ------------------------------------------------------------------------------
def test_fuse_qkv_concatenates_q_k_v_into_one_gemm_per_layer(lowered):
    graph = lowered.copy()
    record = run_passes(graph, ["fuse_qkv"])["fuse_qkv"]
    assert record.matches == 2 and record.details["skipped"] == {}
    assert graph.op_counts()["linear"] == 15 - 4 and graph.op_counts()["split"] == 2
    for layer in range(2):
        fused = f"model.layers.{layer}.self_attn.qkv_proj.weight"
        parts = [lowered.weights[ATTN.format(layer, p)] for p in "qkv"]
        assert torch.equal(graph.weights[fused], torch.cat(parts))
        assert not {ATTN.format(layer, p) for p in "qkv"} & set(graph.params)
    splits = [n for n in graph.nodes if n.op == "split"]
    assert [n.attrs["sizes"] for n in splits] == [[64, 32, 32]] * 2
    attention = [n for n in graph.nodes if n.op == "attention"]
    producers = graph.producers()
    # v goes straight from the split to attention, q and k through their rope
    assert [attention[i].inputs[2] for i in range(2)] == [s.outputs[2].name for s in splits]
    assert producers[attention[0].inputs[0]].inputs[0] == splits[0].outputs[0].name


def test_fuse_gate_up_puts_gate_before_up(lowered):
    graph = lowered.copy()
    record = run_passes(graph, ["fuse_gate_up"])["fuse_gate_up"]
    assert record.matches == 2
    fused = graph.weights["model.layers.1.mlp.gate_up_proj.weight"]
    assert torch.equal(fused, torch.cat([lowered.weights[MLP.format(1, "gate")], lowered.weights[MLP.format(1, "up")]]))
    assert [n.attrs["sizes"] for n in graph.nodes if n.op == "split"] == [[128, 128]] * 2
    assert_same_logits(lowered, graph)


def test_fused_float_graph_computes_the_unfused_logits(lowered):
    graph = lowered.copy()
    records = run_passes(graph, [*CPU_FUSIONS, "dce"])
    assert [records[n].matches for n in CPU_FUSIONS] == [2, 2, 2, 4]
    assert "silu" not in graph.op_counts() and "mul" not in graph.op_counts()
    assert_same_logits(lowered, graph)


def test_fuse_qkv_finds_the_projections_of_a_flash_attention_that_rotates_them_itself(lowered):
    graph = lowered.copy()
    records = run_passes(graph, ["fuse_attention", "fuse_qkv"])
    assert records["fuse_attention"].matches == 2 and records["fuse_qkv"].matches == 2
    split = graph.producers()
    for node in (n for n in graph.nodes if n.op == "flash_attention"):
        assert [split[i].op for i in node.inputs[:3]] == ["split"] * 3
    inputs = prompt(9, 10)
    torch.testing.assert_close(interpret(graph, inputs)["logits"], interpret(lowered, inputs)["logits"],
                               rtol=1e-4, atol=1e-5)


def test_projections_are_found_by_structure_not_by_param_names(lowered):
    graph = renamed(lowered)
    records = run_passes(graph, ["fuse_qkv", "fuse_gate_up"])
    assert records["fuse_qkv"].matches == 2 and records["fuse_gate_up"].matches == 2
    # no common prefix: the fused params are numbered instead
    assert {"qkv_proj.weight", "qkv_proj_2.weight", "gate_up_proj.weight", "gate_up_proj_2.weight"} <= set(graph.params)
    assert_same_logits(renamed(lowered), graph)


def test_projections_with_biases_fuse_with_a_zero_bias_where_one_is_missing():
    gen = torch.Generator().manual_seed(5)
    g = Graph("biased")
    g.add_input("x", TensorType(("tokens", 16), "float32"))
    outs = []
    for name, n, bias in (("q", 16, True), ("k", 8, False), ("v", 8, True)):
        g.add_param(f"{name}.weight", TensorType((n, 16), "float32"), torch.randn(n, 16, generator=gen))
        inputs = ["x", f"{name}.weight"]
        if bias:
            g.add_param(f"{name}.bias", TensorType((n,), "float32"), torch.randn(n, generator=gen))
            inputs.append(f"{name}.bias")
        g.nodes.append(g.make_node("linear", inputs, [TensorType(("tokens", n), "float32")], name=f"{name}_proj"))
        outs.append(g.nodes[-1].out.name)
    attrs = {"num_heads": 2, "num_kv_heads": 1, "head_dim": 8, "scale": 8 ** -0.5, "layer": 0}
    g.nodes.append(g.make_node("attention", outs, [TensorType(("tokens", 16), "float32")], attrs, name="attn"))
    g.outputs = ["attn"]
    fused = g.copy()
    assert run_passes(fused, ["fuse_qkv"])["fuse_qkv"].matches == 1
    want = torch.cat([g.weights["q.bias"], torch.zeros(8), g.weights["v.bias"]])
    assert torch.equal(fused.weights["qkv_proj.bias"], want)
    x = torch.randn(6, 16, generator=gen)
    torch.testing.assert_close(interpret(fused, {"x": x})["attn"], interpret(g, {"x": x})["attn"], rtol=1e-5, atol=1e-6)


# -- quantised projections ----------------------------------------------------------------------------
QUANTISERS = {
    "int8": ["quantize_int8"],
    "int4": ["quantize_int4"],              # group 128 shrinks to 64 on tiny-llama's K=64
    "w8a8": ["smoothquant", "quantize_w8a8"],
    "fp8": ["quantize_fp8"],
}


def quantised(lowered, calibration, scheme, per_channel=True):
    graph = lowered.copy()
    passes = [get_pass(n, **({"per_channel": per_channel} if n == "quantize_fp8" else {})) for n in QUANTISERS[scheme]]
    PassManager(passes, PassContext(calibration=calibration, quiet=True)).run(graph)
    return graph


@pytest.mark.parametrize("scheme", list(QUANTISERS))
def test_quantised_projections_fuse_exactly_and_keep_their_logits(lowered, calibration, scheme):
    unfused = quantised(lowered, calibration, scheme)
    graph = unfused.copy()
    records = run_passes(graph, [*CPU_FUSIONS, "dce"])
    assert [records[n].matches for n in CPU_FUSIONS] == [2, 2, 2, 4]
    assert graph.op_counts()["qlinear"] == unfused.op_counts()["qlinear"] - 6
    for kind, parts in (("self_attn.qkv", [ATTN.format(0, p) for p in "qkv"]),
                        ("mlp.gate_up", [MLP.format(0, p) for p in ("gate", "up")])):
        stem = f"model.layers.0.{kind}_proj.weight"
        for field in ("qweight", "scales", "zeros"):
            if f"{parts[0]}.{field}" in unfused.weights:
                want = torch.cat([unfused.weights[f"{p}.{field}"] for p in parts])
                assert torch.equal(graph.weights[f"{stem}.{field}"], want), field
        assert graph.params[f"{stem}.qweight"].quant.scales == f"{stem}.scales"
    atol = 1e-4 if scheme in ("int4", "int8") else 1e-5    # the CPU int4/int8 GEMMs run in bf16
    assert_same_logits(unfused, graph, atol=atol)


def test_fp8_per_tensor_weight_scales_become_per_channel_exactly(lowered, calibration):
    unfused = quantised(lowered, calibration, "fp8", per_channel=False)
    graph = unfused.copy()
    records = run_passes(graph, ["fuse_qkv", "fuse_gate_up"])
    assert [records[n].details["per_tensor_scales_made_per_channel"] for n in ("fuse_qkv", "fuse_gate_up")] == [2, 2]
    scales = graph.weights["model.layers.0.self_attn.qkv_proj.weight.scales"]
    want = torch.cat([unfused.weights[f"{ATTN.format(0, p)}.scales"].expand(n) for p, n in zip("qkv", (64, 32, 32))])
    assert torch.equal(scales, want)
    assert_same_logits(unfused, graph)


def test_fp8_projections_with_different_activation_scales_stay_apart(lowered, calibration):
    unfused = quantised(lowered, calibration, "fp8")
    name = f"{ATTN.format(1, 'k')}.act_scale"
    unfused.weights[name] = unfused.weights[name] * 2
    graph = unfused.copy()
    record = run_passes(graph, ["fuse_qkv"])["fuse_qkv"]
    assert record.matches == 1 and list(record.details["fused"]) == ["model.layers.0.self_attn.qkv_proj"]
    [[q, k, v]] = record.details["skipped"][FP8_ACT_SCALES_DIFFER]
    assert {unfused.producers()[n].inputs[1] for n in (q, k, v)} == {f"{ATTN.format(1, p)}.qweight" for p in "qkv"}
    assert_same_logits(unfused, graph)


def test_float_and_quantised_projections_of_one_input_stay_apart(lowered):
    graph = lowered.copy()
    PassManager([get_pass("quantize_int8", skip=["*v_proj*"])], PassContext(quiet=True)).run(graph)
    record = run_passes(graph, ["fuse_qkv"])["fuse_qkv"]
    assert record.matches == 0
    assert len(record.details["skipped"]["projections differ in op or read different inputs"]) == 2


# -- from the command line -----------------------------------------------------------------------------
def compile_in_process(path, *flags):
    try:
        main(["compile", "tiny-llama", "-o", str(path), "-q", *flags])
    except SystemExit as e:
        assert e.code in (0, None), e.code


def test_disable_pass_turns_fusions_off_from_the_cli(tmp_path):
    fused, plain = tmp_path / "fused.llmc", tmp_path / "plain.llmc"
    compile_in_process(fused)
    compile_in_process(plain, *[a for name in CPU_FUSIONS for a in ("--disable-pass", name)])
    ops = {p: [n["op"] for n in json.loads((p / "graph.json").read_text())["nodes"]] for p in (fused, plain)}
    passes = {p: [r["name"] for r in json.loads((p / "manifest.json").read_text())["pipeline"]] for p in (fused, plain)}
    assert set(CPU_FUSIONS) <= set(passes[fused]) and not set(CPU_FUSIONS) & set(passes[plain])
    assert ops[fused].count("split") == 2 and ops[fused].count("linear") == 15 - 6
    assert "split" not in ops[plain] and ops[plain].count("linear") == 15
    # the runtime (paged KV cache, batched prompts) generates the same greedy tokens from both
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": prompt(s, n)["input_ids"].tolist()} for s, n in ((3, 5), (4, 9))]
    tokens = [[o.outputs[0].token_ids for o in llmc.load(p).generate(prompts, params)] for p in (fused, plain)]
    assert tokens[0] == tokens[1]


def test_disable_pass_of_one_fusion_keeps_the_others(tmp_path):
    path = tmp_path / "no-qkv.llmc"
    compile_in_process(path, "--disable-pass", "fuse_qkv")
    ops = [n["op"] for n in json.loads((path / "graph.json").read_text())["nodes"]]
    assert "split" not in ops and ops.count("linear") == 15 - 2 and ops.count("swiglu") == 2


# -- SmolLM2 ------------------------------------------------------------------------------------------
def greedy(graph, ids, steps):
    plan = build_plan(graph, "cpu", 64)
    executor = PlanExecutor(plan, graph.weights)
    ids = list(ids)
    for _ in range(steps):
        n = len(ids)
        logits = executor.run_values({"input_ids": torch.tensor(ids), "positions": torch.arange(n),
                                      "logits_indices": torch.tensor([n - 1])}, NoCacheAttention())["logits"]
        ids.append(int(logits[0].argmax()))
    return ids[-steps:]


@pytest.mark.smollm2
def test_smollm2_greedy_tokens_are_identical_with_and_without_fusions(smollm2_model):
    graph = trace_and_lower(smollm2_model.module, 64, lambda *a: None)
    run_passes(graph, CLEANUP)
    fused = graph.copy()
    records = run_passes(fused, [*CPU_FUSIONS, "dce"])
    assert [records[n].matches for n in CPU_FUSIONS] == [30, 30, 30, 60]
    ids = smollm2_model.tokenizer("The three primary colours are")["input_ids"]
    assert greedy(fused, ids, 12) == greedy(graph, ids, 12)
