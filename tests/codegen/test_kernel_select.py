"""Kernel selection for Triton plans: each step of tiny-llama, compiled through a GPU target's passes
(bf16, fused, quantised by every scheme), records the kernels a fresh render gives, and exactly
those the runtime's launchers load when run on the step's dtypes (through Triton's interpreter)."""

import pytest
import torch

from llmc.codegen.autotune import (
    NO_GPU,
    attention_cases,
    autotune,
    default_configs,
    gemm_cases,
    launch_attention,
    launch_gemm,
    prepare_attention,
    prepare_gemm,
    tune_family,
)
from llmc.codegen.kernel_select import KERNEL_OPS, kernel_record, kernels_for_step
from llmc.codegen.kernel_sources import kernel_sources
from llmc.codegen.plan import Plan, build_plan
from llmc.codegen.triton.triton_configs import attention_candidates, gemm_candidates, tile_config
from llmc.codegen.triton.triton_kernels import resolve_kernel
from llmc.codegen.triton.triton_render import record_loads, render_kernel
from llmc.compiler.frontends import load_model
from llmc.compiler.ir import Graph, TensorType
from llmc.compiler.ops import TORCH_DTYPES, run_reference
from llmc.compiler.pipeline import trace_and_lower
from llmc.compiler.recipes import quant_passes
from llmc.compiler.schemes import dequantize_weight
from llmc.compiler.targets import get_target
from llmc.errors import TargetError
from llmc.passes.base import PassContext, PassManager
from llmc.passes.registry import build_pipeline

TOKENS = 5


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path_factory.getbasetemp() / "llmc-cache"))


@pytest.fixture(scope="module")
def lowered():
    return trace_and_lower(load_model("tiny-llama").module, 64, lambda *a: None)


def calibration():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 512, (16,), generator=g) for _ in range(2)]


def gpu_graph(lowered: Graph, target: str, quant: str | None) -> Graph:
    """tiny-llama through `target`'s pipeline, quantised by the recipe `quant`."""
    graph = lowered.copy()
    configs = quant_passes(quant, 64 if quant and quant.startswith("int4") else None)
    passes = build_pipeline(configs + list(get_target(target).default_pipeline))
    PassManager(passes, PassContext(target=get_target(target), calibration=calibration(), quiet=True)).run(graph)
    return graph


CASES = [("h100-bf16", None), ("a100-int8", "int8"), ("rtx4090-int4", "int4-rtn"), ("h100-fp8", "fp8"),
         ("a100-int8", "w8a8")]


@pytest.fixture(scope="module")
def graphs(lowered):
    return {case: gpu_graph(lowered, *case) for case in CASES}


def step_types(graph: Graph, node):
    types = graph.types()
    return [types[i] for i in node.inputs], [v.type for v in node.outputs]


@pytest.mark.parametrize("case", CASES)
def test_steps_record_the_kernels_a_fresh_render_gives(graphs, case):
    target, quant = case
    graph = graphs[case]
    plan = Plan.from_json(build_plan(graph, target, 32).to_json())
    assert all(s.kernel == f"triton.{n.op}" for s, n in zip(plan.steps, graph.nodes))
    with_kernels = set()
    for step, node in zip(plan.steps, graph.nodes):
        records = step.attrs.get("kernels", [])
        if node.op not in KERNEL_OPS:
            assert records == []
            continue
        with_kernels.add(node.op)
        assert records == [kernel_record(k) for k in kernels_for_step(node.op, node.attrs, *step_types(graph, node),
                                                                       target)]
        for r in records:
            assert render_kernel(r["template"], r["name"], r["constants"]).sha256 == r["sha256"]
    meta = plan.meta["kernels"]
    assert set(meta["triton_ops"]) == with_kernels and "flash_attention" in with_kernels
    assert set(meta["triton_ops"]) | set(meta["torch_ops"]) == set(graph.op_counts())
    assert not set(meta["triton_ops"]) & set(meta["torch_ops"])
    assert ("qlinear" in with_kernels) == (quant is not None)


def random_inputs(graph: Graph, node, tokens: int) -> list:
    """The step's params as stored, activations drawn at `tokens` rows (ids and positions as ints)."""
    g = torch.Generator().manual_seed(len(node.name))
    values = []
    for name, t in zip(node.inputs, step_types(graph, node)[0]):
        if name in graph.weights:
            values.append(graph.weights[name])
        elif name == "positions":
            values.append(torch.arange(tokens))
        else:
            shape = [tokens if isinstance(d, str) else d for d in t.shape]
            values.append(torch.randn(*shape, generator=g).to(TORCH_DTYPES[t.dtype]))
    return values


@pytest.mark.parametrize("case", CASES)
def test_the_runtime_launchers_load_exactly_the_recorded_kernels(graphs, case):
    target, _ = case
    graph = graphs[case]
    seen = set()
    for node in graph.nodes:
        if node.op not in KERNEL_OPS or node.op in ("attention", "flash_attention") or node.op in seen:
            continue
        seen.add(node.op)
        inputs = random_inputs(graph, node, TOKENS)
        fn = resolve_kernel(f"triton.{node.op}")
        with record_loads() as loaded:
            got = fn(*inputs, **node.attrs, target=target)
        want = [k.sha256 for k in kernels_for_step(node.op, node.attrs, *step_types(graph, node), target)]
        assert [k.sha256 for k in loaded] == want, node.op
        ref = run_reference(node, inputs)
        for a, b in zip(got, ref):
            assert a.dtype == b.dtype and a.shape == b.shape
            torch.testing.assert_close(a.float(), b.float(), rtol=0.02, atol=0.02 * float(b.abs().max()))
    assert "rms_norm" in seen and "swiglu" in seen


def test_attention_prefill_loads_recorded_kernels(graphs):
    from llmc.runtime.triton_attention_backend import TritonNoCacheAttention

    graph = graphs[("h100-bf16", None)]
    node = next(n for n in graph.nodes if n.op == "flash_attention")
    inputs = random_inputs(graph, node, TOKENS)
    backend = TritonNoCacheAttention("h100-bf16")
    with record_loads() as loaded:
        [out] = resolve_kernel("triton.flash_attention")(*inputs, **node.attrs, backend=backend)
    recorded = {k.sha256: k for k in kernels_for_step(node.op, node.attrs, *step_types(graph, node), "h100-bf16")}
    assert {k.name for k in loaded} == {"kv_cache_write", "flash_attention_prefill"}
    assert {k.sha256 for k in loaded} <= set(recorded)
    [ref] = run_reference(node, inputs)
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.02, atol=0.02 * float(ref.abs().max()))


def test_torch_ops_record_no_kernels():
    t = TensorType(("tokens", 64), "bfloat16")
    for op in ("linear", "embedding", "cast", "split", "select_rows", "aten", "qembedding", "mul"):
        assert kernels_for_step(op, {}, [t, t], [t], "h100-bf16") == []


def test_a_step_no_kernel_fits_is_a_target_error_naming_the_node():
    g = Graph("wide")
    g.add_input("input_ids", TensorType(("tokens",), "int64"))
    g.add_param("emb", TensorType((4, 70000), "bfloat16"))
    g.add_param("norm", TensorType((70000,), "bfloat16"))
    x = g.make_node("embedding", ["input_ids", "emb"], [TensorType(("tokens", 70000), "bfloat16")], name="x")
    y = g.make_node("rms_norm", ["x", "norm"], [TensorType(("tokens", 70000), "bfloat16")], {"eps": 1e-5},
                    name="final_norm")
    g.nodes, g.outputs = [x, y], ["final_norm"]
    with pytest.raises(TargetError, match="node final_norm: no Triton kernel for this rms_norm on target "
                                          "'h100-bf16'.*70000 features.*--target cpu"):
        build_plan(g, "h100-bf16", 8)
    assert "kernels" not in build_plan(g, "cpu", 8).meta


def test_bf16_buffers_are_two_bytes_an_element(graphs):
    graph = graphs[("h100-bf16", None)]
    plan = build_plan(graph, "h100-bf16", 32)
    types = {v.name: v.type for n in graph.nodes for v in n.outputs}
    assert types["logits"].dtype == "float32"
    for name, nbytes in plan.memory.value_bytes.items():
        t = types[name]
        assert nbytes == t.numel({d: 32 for d in ("tokens", "rows")}) * {"bfloat16": 2, "float32": 4}[t.dtype]
    assert plan.memory.value_bytes["logits"] == 32 * 512 * 4


def test_kernel_sources_store_each_kernel_once(graphs):
    graph = graphs[("a100-int8", "int8")]
    plan = build_plan(graph, "a100-int8", 32)
    sources, index = kernel_sources(plan)
    records = {r["sha256"]: r for s in plan.steps for r in s.attrs.get("kernels", [])}
    assert len(sources) == len(index) == len(records)
    for entry in index:
        assert entry["file"] == f"kernels/{entry['name']}-{entry['sha256'][:12]}.py"
        assert render_kernel(entry["template"], entry["name"], entry["constants"]).source == \
            sources[entry["file"].removeprefix("kernels/")]
        launching = [s.node for s in plan.steps if entry["sha256"] in {r["sha256"] for r in s.attrs.get("kernels", [])}]
        assert entry["steps"] == launching
    qlinear_kernels = [e for e in index if e["template"] == "dequant_gemm.py.j2"]
    assert qlinear_kernels and sum(len(e["steps"]) for e in qlinear_kernels) == graph.op_counts()["qlinear"]


# -- autotune ------------------------------------------------------------------------------------
def test_autotune_without_a_gpu_says_so_once_and_records_the_defaults(graphs, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    said = []
    configs, meta = autotune(graphs[("h100-bf16", None)], "h100-bf16", True, said.append)
    assert configs == {} and len(said) == 1 and NO_GPU in said[0]
    assert meta == {"tuned": False, "reason": NO_GPU,
                    "configs": {f: c.to_dict() for f, c in sorted(default_configs("h100-bf16").items())}}
    configs, meta = autotune(graphs[("h100-bf16", None)], "h100-bf16", False, said.append)
    assert configs == {} and len(said) == 1 and "not requested" in meta["reason"]


def test_tune_family_keeps_the_fastest_candidate_and_drops_failing_ones(graphs):
    cases = gemm_cases(graphs[("a100-int8", "int8")])
    candidates = gemm_candidates("a100")
    # a test double for the GPU timer: the second candidate is fastest, the third fails to launch
    speed = {c: float(10 - i) if i != 1 else 0.5 for i, c in enumerate(candidates)}

    def launch(case, operands, config):
        if config == candidates[2]:
            raise RuntimeError("out of shared memory")
        return config

    best, rows = tune_family(cases, [{}] * len(cases), candidates, launch, lambda fn: speed[fn()])
    assert best == candidates[1]
    assert "error" in rows[2] and "out of shared memory" in rows[2]["error"]
    weight = sum(c.count for c in cases)
    assert rows[1]["ms"] == pytest.approx(0.5 * weight) and rows[0]["ms"] == pytest.approx(10 * weight)
    plan = build_plan(graphs[("a100-int8", "int8")], "a100-int8", 32, {"gemm": best})
    gemm = next(r for s in plan.steps for r in s.attrs.get("kernels", []) if r["template"] == "dequant_gemm.py.j2")
    assert (gemm["constants"]["BLOCK_M"], gemm["constants"]["BLOCK_N"]) == (best.block_m, best.block_n)
    assert best != tile_config("a100")


@pytest.mark.parametrize("case", [("a100-int8", "int8"), ("rtx4090-int4", "int4-rtn"), ("a100-int8", "w8a8")])
def test_every_gemm_candidate_computes_the_qlinear(graphs, case):
    target, _ = case
    [gemm] = gemm_cases(graphs[case])[:1]
    operands = prepare_gemm(gemm, "cpu", tokens=TOKENS)
    a = gemm.node.attrs
    w = dequantize_weight(a["scheme"], operands["qweight"], operands["scales"], operands["zeros"])
    ref = run_reference(gemm.node, [operands["x"], operands["qweight"], operands["scales"]]
                        + [operands[k] for k, flag in (("zeros", "has_zeros"), ("act_scale", "has_act_scale"),
                                                       ("bias", "has_bias")) if a.get(flag)])[0]
    assert w.shape == (a["out_features"], a["in_features"])
    for config in gemm_candidates(target):
        out = launch_gemm(gemm, operands, config)
        torch.testing.assert_close(out.float(), ref.float(), rtol=0.02, atol=0.02 * float(ref.abs().max()))


def test_every_attention_candidate_gives_the_same_prefill_and_decode(graphs):
    [case] = attention_cases(graphs[("h100-bf16", None)])
    assert case.count == 2  # both layers share one shape
    operands = prepare_attention(case, "cpu", tokens=TOKENS, batch=2, context=20)
    first = None
    for config in attention_candidates("rtx4090"):
        prefill, decode = launch_attention(case, operands, config)
        if first is None:
            first = (prefill.float(), decode.float())
            continue
        torch.testing.assert_close(prefill.float(), first[0], rtol=0.02, atol=0.02)
        torch.testing.assert_close(decode.float(), first[1], rtol=0.02, atol=0.02)


def test_plain_attention_kernels_follow_the_window_and_a_quantised_cache():
    q, kv = TensorType(("tokens", 64), "bfloat16"), TensorType(("tokens", 32), "bfloat16")
    attrs = dict(layer=0, num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25, causal=True, window=8)
    kernels = kernels_for_step("attention", attrs, [q, kv, kv], [q], "a100-bf16", kv_cache_dtype="int8")
    by_name = {}
    for k in kernels:
        by_name.setdefault(k.name, []).append(dict(k.constants))
    assert sorted(by_name) == ["flash_attention_prefill", "kv_cache_write", "paged_decode", "paged_decode_reduce"]
    assert by_name["kv_cache_write"][0]["ROPE"] is False
    [prefill] = by_name["flash_attention_prefill"]
    assert (prefill["HAS_WINDOW"], prefill["ROPE"], prefill["CACHE_DTYPE"], prefill["QUANTIZED"]) == \
        (True, False, "int8", True)
    assert sorted(c["SPLIT_K"] for c in by_name["paged_decode"]) == [False, True]
    # decode_num_splits picks 2..max_splits splits; the reduce tile is the next power of two
    assert sorted(c["BLOCK_S"] for c in by_name["paged_decode_reduce"]) == [2, 4, 8, 16]


def test_every_template_names_its_launch_grid():
    """Each launch's record carries its grid; a new template without one fails here, not at compile."""
    from llmc.codegen.kernel_select import GRIDS
    from llmc.codegen.triton.triton_render import TEMPLATE_DIR
    templates = {p.name for p in TEMPLATE_DIR.glob("*.py.j2") if not p.name.startswith("_")}
    assert templates == set(GRIDS)
