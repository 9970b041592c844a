"""The decode graph (codegen/ort/ort_decode.py): a decode-only step's whole forward as one ONNX Runtime
session reading the paged KV cache. Its logits for a batch of decodes over shuffled cache blocks equal
the reference interpreter's over each whole sequence (fp32, 1e-4); through llmc.load its greedy tokens
and log-probs equal the plan walk's (fp32, int8, int4, w8a8) while steps holding a prefill still walk
the plan; a sliding-window model decoding past its window (blocks dropped) gives HF's tokens; a record
or ONNX file that was tampered with is refused at load; auto records its verdict and inspect shows it.
The graph stays a few large nodes a layer, its session spins only while it runs, and an onnxruntime
without one of its ops gets no decode graph under auto and a one-line error under --kernels ort."""

import json
from collections import Counter

import pytest
import tiny_hf_models as tiny
import torch
from tiny_hf_models import ARCHS, hf_greedy, max_relative_error, prompt_ids, save_checkpoint

import llmc
from llmc import SamplingParams
from llmc.codegen.ort.onnx_ops import FP32_COMPUTE
from llmc.codegen.plan import Plan
from llmc.compiler.artifact import read_artifact
from llmc.compiler.driver.tuning.decode_graph_choice import CLOSE_CALL, choose_decode_graph, plan_decode_graph
from llmc.compiler.driver.tuning.ort_decode_timing import measure_decode_step
from llmc.compiler.inspect import summarize
from llmc.compiler.interpreter import interpret
from llmc.compiler.ir import Graph
from llmc.errors import ArtifactError, RuntimeLlmcError
from llmc.runtime.executor import PlanExecutor
from llmc.runtime.ort_decode import DecodeGraph
from llmc.runtime.ort_segment import OrtSegment
from llmc.runtime.paged_attention import PagedAttention, PagedKVCache, StepMetadata

QUANTS = {"fp32": {}, "int8": {"quant": "int8"}, "int4": {"quant": "int4-rtn", "group_size": 32},
          "w8a8": {"quant": "w8a8"}}
# int8/int4 MatMulNBits (--kernels ort: int8 activations per block) and w8a8's per-token codes may
# round a value the other way when attention's float sums differ in their last bit (one flipped w8a8
# code moved tiny-llama's logits by up to 0.04, tests/codegen/test_ort_family.py); fp32 stays at float
# rounding
LOGPROB_ATOL = {"fp32": 1e-4, "w8a8": 0.05, "int8": 0.05, "int4": 0.05}
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ort_decode")
    return {name: llmc.compile("tiny-llama", output=root / f"{name}.llmc", kernels="ort", quiet=True, **options)
            for name, options in QUANTS.items()}


def _prefilled(executor: PlanExecutor, cache: PagedKVCache, seqs: list[tuple[list[int], list[int]]], block: int):
    """Each (ids, block table) prefilled through the plan walk into `cache`."""
    backend = PagedAttention(cache)
    for ids, table in seqs:
        backend.metadata = StepMetadata.build([(table, 0, len(ids))], block)
        executor.run_values({"input_ids": torch.tensor(ids), "positions": torch.arange(len(ids)),
                             "logits_indices": torch.tensor([len(ids) - 1])}, backend)


def test_batched_decode_logits_equal_the_reference_interpreter_over_shuffled_blocks(artifacts):
    a = read_artifact(artifacts["fp32"])
    plan, graph = Plan.from_json(a.plan_json), Graph.from_json(a.graph_json)
    executor = PlanExecutor(plan, a.weights, data=a.data)
    assert isinstance(executor.decode_graph, DecodeGraph)
    layout, block = plan.kv_layout(), 4
    cache = PagedKVCache(layout["num_layers"], 24, block, layout["num_kv_heads"], layout["head_dim"])
    blocks = torch.randperm(24, generator=torch.Generator().manual_seed(1)).tolist()
    # 6 and 11 blocks of 4: room for the longest draws (19 and 39 tokens) and their three decodes
    lengths = (int(torch.randint(3, 20, ())), int(torch.randint(20, 40, ())))
    seqs = [(prompt_ids(lengths[0], seed=2), blocks[:6]), (prompt_ids(lengths[1], seed=3), blocks[6:17])]
    _prefilled(executor, cache, seqs, block)
    for step in range(3):   # three decode steps of both sequences together
        new = prompt_ids(2, seed=10 + step)
        meta = StepMetadata.build([(table, len(ids), 1) for ids, table in seqs], block)
        inputs = {"input_ids": torch.tensor(new), "positions": torch.tensor([len(ids) for ids, _ in seqs]),
                  "logits_indices": torch.arange(2)}
        assert executor.decode_graph.serves(meta, cache)
        logits = executor.decode_graph(inputs, meta, cache)
        seqs = [(ids + [t], table) for (ids, table), t in zip(seqs, new)]
        for row, (ids, _) in enumerate(seqs):
            want = interpret(graph, {"input_ids": torch.tensor(ids), "positions": torch.arange(len(ids)),
                                     "logits_indices": torch.tensor([len(ids) - 1])}, weights=a.weights)
            assert max_relative_error(logits[row], want[graph.outputs[0]][0]) < 1e-4


@pytest.mark.parametrize("quant", list(QUANTS))
def test_greedy_tokens_and_logprobs_equal_the_plan_walk_and_prefills_still_walk_it(artifacts, quant, monkeypatch):
    calls = {"graph": 0, "walk": 0}
    graph_call, walk = DecodeGraph.__call__, PlanExecutor.run_values

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return run
    monkeypatch.setattr(DecodeGraph, "__call__", counted("graph", graph_call))
    monkeypatch.setattr(PlanExecutor, "run_values", counted("walk", walk))
    prompts = [{"prompt_token_ids": prompt_ids(n, seed=n)} for n in (5, 17, 30)]
    params = SamplingParams(max_tokens=24, logprobs=1, **GREEDY)
    runs = {}
    for use_graph in (True, False):
        llm = llmc.load(artifacts[quant], block_size=4, batch_invariant=False)   # on: no decode graph
        if not use_graph:
            llm.engine.executor.decode_graph = None
        runs[use_graph] = llm.generate(prompts, params)
        if use_graph:   # one prefill step for the three prompts, then decode-only steps
            assert calls["walk"] == 1 and calls["graph"] == 23
    for ours, want in zip(runs[True], runs[False]):
        assert ours.outputs[0].token_ids == want.outputs[0].token_ids
        torch.testing.assert_close(torch.tensor([lp[t].logprob for lp, t in zip(ours.outputs[0].logprobs,
                                                                                ours.outputs[0].token_ids)]),
                                   torch.tensor([lp[t].logprob for lp, t in zip(want.outputs[0].logprobs,
                                                                                want.outputs[0].token_ids)]),
                                   atol=LOGPROB_ATOL[quant], rtol=0)


def test_a_sliding_window_model_decoding_past_its_window_gives_hf_s_tokens(tmp_path):
    module = save_checkpoint(ARCHS["mistral"](sliding_window=16), tmp_path / "src", seed=11)
    path = llmc.compile(str(tmp_path / "src"), output=tmp_path / "mistral.llmc", kernels="ort", quiet=True)
    assert llmc.load(path, block_size=4, kv_memory="128KiB").engine.executor.decode_graph is None   # invariant
    llm = llmc.load(path, block_size=4, kv_memory="128KiB", batch_invariant=False)
    assert llm.engine.executor.decode_graph is not None and llm.engine.block_manager.window == 16
    ids = prompt_ids(40, seed=5)
    assert tiny.llmc_greedy(llm, ids, 60) == hf_greedy(module, ids, 60)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def _plan_with(path, edit) -> tuple[Plan, dict]:
    a = read_artifact(path)
    plan = Plan.from_json(a.plan_json)
    record = json.loads(json.dumps(plan.meta["decode_graph"]))
    edit(record)
    plan.meta = {**plan.meta, "decode_graph": record}
    return plan, a


def test_a_tampered_decode_graph_record_or_file_is_refused_at_load(artifacts):
    def foreign_param(record):
        name = next(iter(record["initializers"]))
        record["initializers"][name] = ["not.a.param", "same"]
    plan, a = _plan_with(artifacts["fp32"], foreign_param)
    with pytest.raises(ArtifactError, match="meta.decode_graph: initializer .* not a plan param"):
        PlanExecutor(plan, a.weights, data=a.data)
    plan, a = _plan_with(artifacts["fp32"], lambda record: record.update(num_layers=7))
    with pytest.raises(ArtifactError, match="meta.decode_graph: its KV layout differs"):
        PlanExecutor(plan, a.weights, data=a.data)
    plan, a = _plan_with(artifacts["fp32"], lambda record: None)
    data = {**a.data, "ort/decode.onnx": a.data["ort/decode.onnx"] + b"\0"}
    with pytest.raises(ArtifactError, match="ort/decode.onnx differs from the file the plan records"):
        PlanExecutor(plan, a.weights, data=data)


def test_auto_records_its_verdict_and_inspect_shows_it(tmp_path):
    path = llmc.compile("tiny-llama", output=tmp_path / "auto.llmc", quiet=True)
    meta = json.loads(read_artifact(path).plan_json)["meta"]
    if meta["kernel_choice"]["whole_plan"]["chosen"] == "cpu":   # timed faster here: no ORT at all
        assert "decode_graph" not in meta and not read_artifact(path).data
        assert "whole plan: the torch kernels throughout" in summarize(path)
        return
    record = meta["decode_graph"]
    assert isinstance(record["chosen"], bool)
    assert ("ort/decode.onnx" in read_artifact(path).data) == record["chosen"]
    us = record.get("decode_us", {})
    if record["chosen"] and not record.get("native_first"):
        assert us["graph_segments"] <= us["plan_segments"] or us["graph_step"] < us["plan_step"] or \
            meta["kernel_choice"]["whole_plan"]["chosen"] == "graph"
    else:
        assert record["why"]
    assert "decode graph:" in summarize(path)
    cpu = llmc.compile("tiny-llama", output=tmp_path / "cpu.llmc", kernels="cpu", quiet=True)
    assert "decode_graph" not in json.loads(read_artifact(cpu).plan_json)["meta"]
    assert llmc.load(cpu).engine.executor.decode_graph is None


def _kinds(ort_us: float, cpu_us: float, chosen: str = "cpu", why: str | None = None) -> dict:
    kind = {"first": "embedding_0", "segments": 3, "chosen": chosen,
            "us": {"cpu": {"decode": cpu_us, "prefill": 1.0}, "ort": {"decode": ort_us, "prefill": 1.0}}}
    return {"measured": {"kinds": [kind | ({"why": why} if why else {})]}}


def test_auto_keeps_the_graph_where_its_segments_cost_no_more_and_times_a_step_on_a_close_call():
    assert choose_decode_graph(_kinds(10.0, 12.0))["chosen"] is True
    assert choose_decode_graph(_kinds(12.0, 12.0, chosen="ort"))["chosen"] is True
    close = choose_decode_graph(_kinds(13.0, 12.0))
    assert close["chosen"] is False and close["close_call"]
    far = choose_decode_graph(_kinds(CLOSE_CALL * 12.0 + 1, 12.0))
    assert far["chosen"] is False and "against 36 us" in far["why"] and "close_call" not in far
    refused = choose_decode_graph(_kinds(1.0, 12.0, why="ORT's outputs are 1e-2 of the largest off the reference"))
    assert refused["chosen"] is False and "do not run in ORT" in refused["why"]


def test_a_close_call_times_a_whole_decode_step_both_ways(artifacts, tmp_path, monkeypatch):
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path))   # measured afresh, not recalled
    a = read_artifact(artifacts["fp32"])
    plan, graph = Plan.from_json(a.plan_json), Graph.from_json(a.graph_json)
    graph.weights = a.weights
    record = plan.meta.pop("decode_graph")   # the lowered plan, as the compile measures it
    files = {name: data for name, data in a.data.items() if name != record["file"]}
    us = measure_decode_step(graph, plan, files, a.data[record["file"]], record)
    assert set(us) == {"plan", "graph", "launches"} and all(0 < t < 1e6 for t in us.values())
    plan.meta["kernel_choice"] = _kinds(13.0, 12.0)   # what auto measured of the segments: a close call
    verdict = plan_decode_graph(graph, plan, files, "auto", FP32_COMPUTE)
    us = verdict["decode_us"]
    assert {"graph_step", "plan_step", "launches_step"} <= set(us)
    # the graph takes every decode step where it beat the walk, else those the native decode program does
    # not take where it beat the walk launch by launch (which runs them then), else none
    assert verdict["chosen"] == (us["graph_step"] < us["plan_step"] or us["graph_step"] < us["launches_step"])
    assert verdict.get("native_first", False) == (us["plan_step"] <= us["graph_step"] < us["launches_step"])
    assert (record["file"] in files) == verdict["chosen"]


def test_the_decode_graph_is_a_few_large_nodes_a_layer_and_spins_only_while_it_runs(artifacts):
    import onnx

    a = read_artifact(artifacts["int4"])
    plan = Plan.from_json(a.plan_json)
    model = onnx.load_from_string(a.data["ort/decode.onnx"])
    layers = plan.kv_layout()["num_layers"]
    ops = Counter(n.op_type for n in model.graph.node)
    # each node is a dispatch: the rotary and the scores are one contrib op each, not ~20 small ones
    assert ops["RotaryEmbedding"] == 2 * layers and ops["FusedMatMul"] == 2 * layers
    # ~37 a layer for SmolLM2 (61 before: 1,837 nodes for 30 layers), besides the embedding, head and tables
    assert len(model.graph.node) <= 40 * layers + 40
    executor = PlanExecutor(plan, a.weights, data=a.data)
    options = executor.decode_graph.session.session.get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    assert options.get_session_config_entry("session.force_spinning_stop") == "1"
    segment = next(launch.fn for launch in executor._program if isinstance(launch.fn, OrtSegment))
    assert segment.session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_an_onnxruntime_without_the_decode_graph_s_ops_gets_none_under_auto_and_an_error_under_ort(
        artifacts, monkeypatch):
    import llmc.runtime.ort_segment as ort_segment

    a = read_artifact(artifacts["fp32"])
    plan, graph = Plan.from_json(a.plan_json), Graph.from_json(a.graph_json)
    graph.weights = a.weights
    plan.meta.pop("decode_graph")
    have = ort_segment.cpu_kernel_ops()
    monkeypatch.setattr(ort_segment, "cpu_kernel_ops", lambda: have - {("com.microsoft", "RotaryEmbedding")})
    files = {}
    verdict = plan_decode_graph(graph, plan, files, "auto", FP32_COMPUTE)
    assert verdict == {"chosen": False, "why": "onnxruntime lacks com.microsoft.RotaryEmbedding"} and not files
    with pytest.raises(RuntimeLlmcError, match="decode graph.*no CPU kernel for com.microsoft.RotaryEmbedding"):
        plan_decode_graph(graph, plan, files, "ort", FP32_COMPUTE)
