"""An artifact's plan is untrusted data: a re-hashed plan.json that names a file, storage, random,
in-place or out= op, or carries ill-typed attrs, undeclared sizes or a broken memory plan, is refused
at load with one line naming the step; the compiler refuses to emit what the runtime would refuse."""

import json
import os
import re

import pytest
import torch
from llmc_cli import error_line, llmc_in_process
from tampered import add_steps, aten_step, tampered_copy
from transformers import LlamaConfig, LlamaForCausalLM

import llmc
from llmc.codegen.plan import Plan, build_plan
from llmc.compiler.artifact import read_weights
from llmc.compiler.ir import Graph, TensorType
from llmc.compiler.pipeline import trace_and_lower
from llmc.errors import ArtifactError, IRError, LlmcError
from llmc.runtime.executor import PlanExecutor

STEP = r"plan\.json step (\d+) \(node '([^']*)', kernel ([\w.]+)\)"


def load_plan(artifact, edit) -> PlanExecutor:
    """The executor for the artifact's plan after `edit` (what llmc.load builds, without the tokenizer)."""
    plan = json.loads((artifact / "plan.json").read_text())
    edit(plan)
    weights = read_weights(artifact, json.loads((artifact / "manifest.json").read_text()))
    return PlanExecutor(Plan.from_dict(plan), weights)


def refused(artifact, edit, *fragments) -> str:
    """The ArtifactError message loading the edited plan raises; it must contain every fragment."""
    with pytest.raises(ArtifactError) as info:
        load_plan(artifact, edit)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def step_of(plan: dict, kernel: str) -> tuple[int, dict]:
    return next((i, s) for i, s in enumerate(plan["steps"]) if s["kernel"] == kernel)


# -- the file-writing exploit -------------------------------------------------------------
def file_writing_edit(victim):
    """aten.from_file(shared=True) maps the victim; aten.fill_ overwrites it through the map."""
    def edit(plan):
        add_steps(plan, aten_step("evil_map", "aten.from_file.default", [], [str(victim), True, 8],
                                  {"dtype": {"$dtype": "uint8"}}),
                  aten_step("evil_fill", "aten.fill_.Scalar", ["evil_map.0"], [{"$in": 0}, 88]))
    return edit


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "outside" / "victim.bin"
    path.parent.mkdir()
    path.write_bytes(os.urandom(64))
    return path


def test_a_plan_that_maps_and_fills_a_file_is_refused_by_llmc_run_and_the_file_is_unchanged(
        artifact, tmp_path, victim, capfd):
    before = victim.read_bytes()
    evil = tampered_copy(artifact, tmp_path / "evil.llmc", {"plan.json": file_writing_edit(victim)})
    code, out, err = llmc_in_process(capfd, "run", evil, "-p", "hello", "--max-tokens", "2")
    assert code == 2
    line = error_line(err)
    index, node, kernel = re.match(STEP, line).groups()
    assert (node, kernel) == ("evil_map", "cpu.aten") and "'aten.from_file.default'" in line
    assert "not an allowed pure tensor op" in line and "recompile" in line
    assert victim.read_bytes() == before


def test_llmc_load_refuses_the_file_writing_plan_with_an_llmc_error(artifact, tmp_path, victim):
    before = victim.read_bytes()
    evil = tampered_copy(artifact, tmp_path / "evil.llmc", {"plan.json": file_writing_edit(victim)})
    with pytest.raises(LlmcError, match="from_file"):
        llmc.load(evil)
    assert victim.read_bytes() == before


# -- ops off the allow-list ------------------------------------------------------------------
@pytest.mark.parametrize("target, why", [
    ("aten.rand_like.default", "not an allowed pure tensor op"),        # random source
    ("aten.bernoulli.default", "not an allowed pure tensor op"),
    ("aten.dropout.default", "not an allowed pure tensor op"),
    ("aten.add_.Tensor", "not an allowed pure tensor op"),              # in place
    ("aten.add.out", "writes its arguments"),                           # out= variant
    ("aten.set_.source_Tensor", "not an allowed pure tensor op"),
    ("aten._local_scalar_dense.default", "not an allowed pure tensor op"),
    ("aten.no_such_op.default", "not an allowed pure tensor op"),
    ("aten.add.no_such_overload", "does not exist in this torch"),
    ("torch.load", "not of the form aten.<op>.<overload>"),
])
def test_an_aten_step_outside_the_allow_list_is_refused_naming_the_step(artifact, target, why):
    def edit(plan):
        add_steps(plan, aten_step("odd", target, ["logits"], [{"$in": 0}, {"$in": 0}],
                                  type={"shape": ["rows", 512], "dtype": "float32"}))
    message = refused(artifact, edit, f"'{target}'", why)
    assert re.match(STEP, message).groups()[1:] == ("odd", "cpu.aten")


# -- ill-typed aten arguments ------------------------------------------------------------------
@pytest.mark.parametrize("args, kwargs, why", [
    ([{"$in": 1}, 2.0], {}, "no reference to one of the step's 1 inputs"),
    ([{"$in": "0"}, 2.0], {}, "no reference"),
    ([{"$in": 0}, "2"], {}, "no tensor input or number"),
    ([{"$in": 0}, 2.0], {"alpha": {"$py": "os.system"}}, "'alpha'"),
    ([{"$in": 0}, 2.0], {"out": {"$in": 0}}, "keyword argument 'out' is unknown"),
    ([{"$in": 0}, 2.0], {"other": 3.0}, "given twice"),
    ([{"$in": 0}, 2.0, 3.0], {}, "takes 2 positional arguments"),
    ([{"$in": 0}], {}, "required argument 'other' is missing"),
    ([{"$in": 0}, {"$float": "lots"}], {}, "is no tensor input or number"),
])
def test_aten_arguments_that_do_not_fit_the_schema_are_refused(artifact, args, kwargs, why):
    def edit(plan):
        add_steps(plan, aten_step("scaled", "aten.mul.Tensor", ["logits"], args, kwargs,
                                  type={"shape": ["rows", 512], "dtype": "float32"}))
    message = refused(artifact, edit, "'scaled'", "aten.mul.Tensor", why)
    assert re.match(STEP, message)


@pytest.mark.parametrize("kwargs, why", [
    ({"dtype": {"$dtype": "complex128"}}, "'dtype'"),
    ({"dtype": {"$dtype": "float32"}, "device": {"$device": "disk:/etc"}}, "'device'"),
    ({"dtype": {"$dtype": "float32"}, "layout": {"$layout": "sparse_coo"}}, "'layout'"),
    ({"dtype": {"$dtype": "float32"}, "non_blocking": 1}, "is not a bool"),
])
def test_dtype_device_and_layout_arguments_come_only_from_their_known_tables(artifact, kwargs, why):
    def edit(plan):
        add_steps(plan, aten_step("copied", "aten._to_copy.default", ["logits"], [{"$in": 0}], kwargs,
                                  type={"shape": ["rows", 512], "dtype": "float32"}))
    refused(artifact, edit, "'copied'", why)


def test_an_allowed_aten_step_whose_declared_type_is_wrong_is_refused_before_it_runs(artifact):
    def edit(plan):
        add_steps(plan, aten_step("flat", "aten.reshape.default", ["logits"], [{"$in": 0}, [-1, 7]],
                                  type={"shape": ["rows", 512], "dtype": "float32"}))
    refused(artifact, edit, "'flat'", "does not run on its declared inputs")


def test_an_allowed_aten_step_runs_when_everything_about_it_checks_out(artifact):
    factor = float(torch.rand(()) + 0.5)

    def edit(plan):
        add_steps(plan, aten_step("scaled", "aten.mul.Tensor", ["logits"], [{"$in": 0}, factor],
                                  type={"shape": ["rows", 512], "dtype": "float32"}))
        plan["outputs"].append("scaled.0")
    executor = load_plan(artifact, edit)
    ids = torch.randint(0, 512, (5,))
    values = executor.run_values({"input_ids": ids, "positions": torch.arange(5), "logits_indices": torch.tensor([4])})
    assert torch.allclose(values["scaled.0"], values["logits"] * factor)


# -- LLM-op attrs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel, attr, value, why", [
    ("cpu.rms_norm", "eps", "1e-5", "attr 'eps' is '1e-5', not a norm epsilon in [0, 1]"),
    ("cpu.add_rms_norm", "eps", -1, "attr 'eps' is -1, not a norm epsilon in [0, 1]"),
    ("cpu.add_rms_norm", "eps", 1e38, "attr 'eps' is 1e+38, not a norm epsilon in [0, 1]"),
    ("cpu.flash_attention", "scale", -0.25, "attr 'scale' is -0.25, not a positive number up to 1e6"),
    ("cpu.add_rms_norm", "eps", None, "attr 'eps' is None"),
    ("cpu.flash_attention", "num_heads", 3.5, "attr 'num_heads' is 3.5, not a positive int"),
    ("cpu.flash_attention", "num_kv_heads", 0, "attr 'num_kv_heads' is 0"),
    ("cpu.flash_attention", "backend", "evil", "attr 'backend' is not one this op takes"),
    ("cpu.flash_attention", "rope", {"scaling": "x"}, "attr 'rope'"),
    ("cpu.flash_attention", "head_dim", 12, "expected last dim"),
    ("cpu.split", "sizes", [64, 32, 31], "add up to 127"),
    ("cpu.split", "sizes", "64,32,32", "attr 'sizes'"),
    ("cpu.linear", "out_features", 7, "out_features 7 differs"),
])
def test_an_llm_step_with_a_tampered_attr_is_refused_naming_the_step(artifact, kernel, attr, value, why):
    def edit(plan):
        step_of(plan, kernel)[1]["attrs"][attr] = value
    plan = json.loads((artifact / "plan.json").read_text())
    index, step = step_of(plan, kernel)
    refused(artifact, edit, f"plan.json step {index} (node '{step['node']}', kernel {kernel})", why)


def test_a_missing_attr_and_a_wrong_input_count_are_refused(artifact):
    refused(artifact, lambda plan: step_of(plan, "cpu.rms_norm")[1]["attrs"].pop("eps"), "attr 'eps' is missing")
    refused(artifact, lambda plan: step_of(plan, "cpu.swiglu")[1]["inputs"].append("positions"),
            "kernel cpu.swiglu", "swiglu: gate is")
    refused(artifact, lambda plan: step_of(plan, "cpu.embedding")[1]["inputs"].append("positions"),
            "3 inputs, where embedding takes 2")


def test_attention_layers_must_index_the_kv_cache_once_each(artifact):
    def edit(plan):
        for step in plan["steps"]:
            if step["kernel"] == "cpu.flash_attention":
                step["attrs"]["layer"] = 0
    refused(artifact, edit, "KV-cache layers [0, 0]")


# -- declared types, sizes and the memory plan -----------------------------------------------------
def test_a_declared_shape_of_a_trillion_elements_is_refused_before_anything_is_allocated(artifact):
    def edit(plan):
        add_steps(plan, aten_step("huge", "aten.expand.default", ["logits"], [{"$in": 0}, [10 ** 12, 512]],
                                  type={"shape": [10 ** 12, 512], "dtype": "float32"}))
    refused(artifact, edit, "'huge.0'", "bytes")


def test_a_param_type_that_differs_from_the_weights_file_is_refused(artifact):
    def edit(plan):
        plan["types"]["lm_head.weight"]["shape"] = [512, 32]
    refused(artifact, edit, "param 'lm_head.weight'", "float32[512, 32]")


def test_a_step_whose_declared_output_type_lies_is_refused(artifact):
    def edit(plan):
        _, step = step_of(plan, "cpu.swiglu")
        plan["types"][step["outputs"][0]]["dtype"] = "int8"
    refused(artifact, edit, "kernel cpu.swiglu", "declares outputs")


def test_a_memory_plan_that_frees_a_value_before_its_last_read_is_refused(artifact):
    def edit(plan):
        _, step = step_of(plan, "cpu.swiglu")
        plan["memory"]["lifetimes"][step["inputs"][0]][1] -= 1   # freed at the step that defines it
    refused(artifact, edit, "kernel cpu.swiglu", "memory plan")


def test_malformed_plan_json_fields_are_artifact_errors_naming_the_field(artifact):
    refused(artifact, lambda plan: plan["steps"][3].update(inputs="qkv_proj_8"), "steps[3].inputs")
    refused(artifact, lambda plan: plan["memory"]["slot_of"].update(logits=-1), "memory.slot_of")
    refused(artifact, lambda plan: plan.update(max_tokens=10 ** 9), "max_tokens")
    refused(artifact, lambda plan: plan["types"]["logits"].update(dtype="complex64"), "types['logits'].dtype")


# -- compile time -----------------------------------------------------------------------------------
def _graph_with_fallback(target: str, args: list) -> Graph:
    g = Graph("fallback")
    g.add_input("x", TensorType(("tokens", 8), "float32"))
    node = g.make_node("aten", ["x"], [TensorType(("tokens", 8), "float32")],
                       {"target": target, "args": args, "kwargs": {}}, name="odd_fallback")
    g.nodes.append(node)
    g.outputs = [node.out.name]
    return g


def test_the_compiler_refuses_to_emit_a_fallback_the_runtime_would_refuse():
    with pytest.raises(IRError, match=r"node odd_fallback \(aten aten.bernoulli.default\).*not an allowed"):
        build_plan(_graph_with_fallback("aten.bernoulli.default", [{"$in": 0}]), "cpu", 16)
    with pytest.raises(IRError, match=r"odd_fallback.*required argument 'other' is missing"):
        build_plan(_graph_with_fallback("aten.mul.Tensor", [{"$in": 0}]), "cpu", 16)
    plan = build_plan(_graph_with_fallback("aten.mul.Tensor", [{"$in": 0}, 2.0]), "cpu", 16)
    x = torch.randn(3, 8)
    assert torch.equal(PlanExecutor(Plan.from_json(plan.to_json()), {}).run_values({"x": x})[plan.outputs[0]], x * 2)


@pytest.mark.parametrize("act", ["gelu_new", "quick_gelu"])
def test_the_fallbacks_lowering_leaves_in_llama_variants_are_allowed_and_load(act):
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, hidden_act=act)
    torch.manual_seed(0)
    graph = trace_and_lower(LlamaForCausalLM(cfg).eval(), 64, lambda *a: None)
    assert any(n.op == "aten" for n in graph.nodes)
    plan = Plan.from_json(build_plan(graph, "cpu", 64).to_json())
    executor = PlanExecutor(plan, dict(graph.weights))
    t = 6
    values = executor.run_values({"input_ids": torch.randint(0, 96, (t,)), "positions": torch.arange(t)}
                                 | ({"logits_indices": torch.arange(t)} if "logits_indices" in plan.inputs else {}))
    assert torch.isfinite(values[plan.outputs[0]]).all()


# -- Triton plans: kernel records and launch configs feed kernel source -------------------------------
def _first_record(plan: dict) -> dict:
    return next(r for s in plan["steps"] for r in s["attrs"].get("kernels", []))


@pytest.mark.parametrize("constant", ["bfloat16\nimport os; os.system('id')", {"nested": 1}, 2 ** 40])
def test_a_triton_kernel_record_with_a_constant_no_template_takes_is_refused(bf16_artifact, constant):
    plan = json.loads((bf16_artifact / "plan.json").read_text())
    _first_record(plan)["constants"]["X_DTYPE"] = constant
    with pytest.raises(ArtifactError, match=r"steps\[\d+\]\.attrs\.kernels\[0\]\.constants"):
        Plan.from_dict(plan)


@pytest.mark.parametrize("family, field, value", [("gemm", "num_warps", "4); import os #"),
                                                  ("gemm", "block_m", 0), ("attention", "num_stages", 10 ** 9),
                                                  ("attention", "evil", 1)])
def test_a_triton_launch_config_outside_small_positive_ints_is_refused(bf16_artifact, family, field, value):
    from llmc.runtime.executor import plan_launch_configs

    plan = json.loads((bf16_artifact / "plan.json").read_text())
    plan["meta"]["autotune"]["configs"][family][field] = value
    with pytest.raises(ArtifactError, match=f"meta.autotune.configs.{family}"):
        plan_launch_configs(Plan.from_dict(plan))


def test_every_allow_listed_op_exists_in_this_torch_and_has_a_pure_overload():
    from llmc.compiler.aten_allowlist import ALLOWED_ATEN, target_refusal

    for name in sorted(ALLOWED_ATEN):
        overloads = getattr(torch.ops.aten, name).overloads()
        assert any(target_refusal(f"aten.{name}.{o}") is None for o in overloads), name


def test_a_kv_cache_that_does_not_fit_the_plans_attention_layers_is_refused(artifact):
    from llmc.runtime.paged_attention import PagedKVCache

    executor = load_plan(artifact, lambda plan: None)
    layout = executor.plan.kv_layout()
    for wrong in ({"num_layers": layout["num_layers"] - 1}, {"head_dim": layout["head_dim"] * 2}):
        shape = {**layout, **wrong}
        cache = PagedKVCache(shape["num_layers"], 4, 16, shape["num_kv_heads"], shape["head_dim"])
        with pytest.raises(ArtifactError, match="does not fit the plan's attention layers"):
            executor.paged_backend(cache)
    cache = PagedKVCache(layout["num_layers"], 4, 16, layout["num_kv_heads"], layout["head_dim"], torch.bfloat16)
    with pytest.raises(ArtifactError, match="bfloat16 KV cache cannot hold"):
        executor.paged_backend(cache)
