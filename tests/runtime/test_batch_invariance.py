"""Batch invariance (runtime/batch_invariance.py, the default): a sequence's logits are the same bits
whatever else is in the step and however many rows it brings (decode rows, a speculative verification's
k + 1, prefill chunks of any size, a prefix-cache hit, a recompute after preemption), for tiny models
compiled for the CPU kernel families (fp32 through the fp32 GEMV, int8 and int4 through the native
GEMVs, GGUF Q4_1 / Q8_0 blocks through the int16-activation GEMVs, ONNX Runtime segments around the
native attention): hypothesis draws the batches and checks every sequence's logits against that sequence
run alone, one token a step; through the engine, batching, n-gram speculation and preemption by
recompute leave greedy tokens as they are alone."""

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_files import finish, llama_writer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

import llmc
from llmc import SamplingParams
from llmc.codegen.native import cpu_native
from llmc.compiler.frontends.samples import build_tiny_tokenizer
from llmc.runtime.paged_attention import PagedKVCache, StepMetadata

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="the native kernels are not built here")
BLOCK = 4
MAX_ROWS = 16


def write_gguf_llama(path, seed: int = 0) -> None:
    """A llama.cpp-style GGUF of a random tiny llama (K a multiple of 64, so the 4-bit and int8 GEMVs take
    int16 activation codes where the CPU has AVX-512 BW) whose matrices alternate Q4_1 and Q8_0."""
    rng = np.random.default_rng(seed)
    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, architectures=["LlamaForCausalLM"])
    writer = llama_writer(path, config, tokenizer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for i, (name, tensor) in enumerate(LlamaForCausalLM(config).state_dict().items()):
        stem, _, suffix = name.rpartition(".")
        if tensor.dim() == 1:
            writer.add_tensor(f"{names.get_name(stem)}.{suffix}",
                              (1 + 0.1 * rng.standard_normal(tensor.shape)).astype(np.float32))
            continue
        kind = (Q.Q4_1, Q.Q8_0)[i % 2]
        values = rng.standard_normal(tuple(tensor.shape)).astype(np.float32) / tensor.shape[1] ** 0.5
        writer.add_tensor(f"{names.get_name(stem)}.{suffix}", gguf.quants.quantize(values, kind), raw_dtype=kind)
    finish(writer)


MODELS = {"fp32": dict(quant="none"), "int8": dict(quant="int8"),
          "int4": dict(quant="int4-rtn", group_size=32), "gguf": {},
          # ONNX Runtime segments around the native attention: MLAS's fp32 MatMul and int8-compute MatMulNBits
          "ort-fp32": dict(quant="none", kernels="ort"), "ort-int4": dict(quant="int4-rtn", group_size=32,
                                                                           kernels="ort")}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch-invariance")
    write_gguf_llama(root / "tiny-q4_1-q8_0.gguf")
    out = {}
    for name, options in MODELS.items():
        source = str(root / "tiny-q4_1-q8_0.gguf") if name == "gguf" else "tiny-llama"
        out[name] = llmc.compile(source, target="cpu", output=root / f"{name}.llmc", quiet=True,
                                 **{"kernels": "cpu", **options})
    return out


@pytest.fixture(scope="module")
def loaded(artifacts):
    return {name: llmc.load(path, kv_memory="4MiB") for name, path in artifacts.items()}


class Runner:
    """An executor fed by hand through a paged cache of shuffled blocks: each step packs the rows the
    batch gives it and returns each row's logits."""

    def __init__(self, llm, blocks: int = 160):
        self.executor = llm.engine.executor
        layout = self.executor.plan.kv_layout()
        self.cache = PagedKVCache(layout["num_layers"], blocks, BLOCK, layout["num_kv_heads"], layout["head_dim"],
                                  dtype=self.executor.kv_dtype())
        self.backend = self.executor.paged_backend(self.cache)
        self.free = torch.randperm(blocks, generator=torch.Generator().manual_seed(blocks)).tolist()

    def table(self, tokens: int, shared: list[int] = ()) -> list[int]:
        table = list(shared)
        while len(table) * BLOCK < tokens:
            table.append(self.free.pop())
        return table

    def step(self, parts: list[tuple[list[int], list[int], int, int]]) -> list[torch.Tensor]:
        """parts: (block table, token ids, first position, rows) per sequence, in batch order."""
        ids, positions = [], []
        for table, tokens, start, n in parts:
            ids += tokens[start:start + n]
            positions += range(start, start + n)
        self.backend.metadata = StepMetadata.build([(t, s, n) for t, _, s, n in parts], BLOCK)
        logits = self.executor.run_values({"input_ids": torch.tensor(ids), "positions": torch.tensor(positions),
                                           "logits_indices": torch.arange(len(ids))}, self.backend)["logits"]
        out, row = [], 0
        for *_, n in parts:
            out.append(logits[row:row + n].clone())
            row += n
        return out


def alone(llm, tokens: list[int]) -> torch.Tensor:
    """The sequence's logits at every position, run alone one token a step."""
    runner = Runner(llm)
    table = runner.table(len(tokens))
    return torch.cat([runner.step([(table, tokens, p, 1)])[0] for p in range(len(tokens))])


def mixed(llm, sequences: list[list[int]], schedule: list[list[tuple[int, int]]], prefix: int | None):
    """Every sequence's logits, run together by `schedule` (per step: (sequence, rows wanted)); with
    `prefix`, sequence 1 starts from sequence 0's first `prefix` positions' cached blocks (a prefix hit)."""
    runner = Runner(llm)
    done = [0] * len(sequences)
    got: list[list[torch.Tensor]] = [[] for _ in sequences]
    tables: list[list[int] | None] = [None] * len(sequences)
    if prefix is not None:
        tables[0] = runner.table(len(sequences[0]))
        for start in range(0, prefix, MAX_ROWS):
            n = min(MAX_ROWS, prefix - start)
            got[0].append(runner.step([(tables[0], sequences[0], start, n)])[0])
        done[0] = prefix
        tables[1] = runner.table(len(sequences[1]), tables[0][:prefix // BLOCK])
        done[1] = prefix // BLOCK * BLOCK
    for i, tokens in enumerate(sequences):
        if tables[i] is None:
            tables[i] = runner.table(len(tokens))
    for wanted in schedule:
        parts, order = [], []
        for i, rows in wanted:
            n = min(rows, len(sequences[i]) - done[i])
            if n > 0 and i not in order:
                parts.append((tables[i], sequences[i], done[i], n))
                order.append(i)
                done[i] += n
        if parts:
            for i, logits in zip(order, runner.step(parts)):
                got[i].append(logits)
    while any(d < len(s) for d, s in zip(done, sequences)):   # what the schedule left: a row a step each
        parts, order = [], []
        for i, s in enumerate(sequences):
            if done[i] < len(s):
                parts.append((tables[i], s, done[i], 1))
                order.append(i)
                done[i] += 1
        for i, logits in zip(order, runner.step(parts)):
            got[i].append(logits)
    return [torch.cat(g) for g in got]


def draw_batch(draw, vocab: int):
    lengths = draw(st.lists(st.integers(3, 24), min_size=1, max_size=4))
    sequences = [draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)) for n in lengths]
    prefix = None
    if len(sequences) > 1 and draw(st.booleans()):   # sequence 1 shares sequence 0's first blocks
        room = min(len(sequences[0]), len(sequences[1]) - 1) // BLOCK
        if room:
            prefix = draw(st.integers(1, room)) * BLOCK
            sequences[1][:prefix] = sequences[0][:prefix]
    step = st.lists(st.tuples(st.integers(0, len(sequences) - 1), st.integers(1, MAX_ROWS)), min_size=1,
                    max_size=4)
    schedule = draw(st.lists(step, max_size=8))
    return sequences, schedule, prefix


@pytest.mark.parametrize("name", list(MODELS))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_logits_are_the_same_bits_whatever_the_batch(loaded, name, data):
    llm = loaded[name]
    assert llm.engine.executor.batch_invariant
    vocab = llm.engine.executor.plan.type_of("logits").shape[-1]
    sequences, schedule, prefix = data.draw(st.composite(lambda d: draw_batch(d, vocab))())
    together = mixed(llm, sequences, schedule, prefix)
    for i, tokens in enumerate(sequences):
        reference = alone(llm, tokens)
        first = prefix // BLOCK * BLOCK if prefix is not None and i == 1 else 0
        assert torch.equal(together[i], reference[first:]), f"sequence {i} of {len(sequences)}"


@pytest.mark.parametrize("name", ["int4", "gguf"])
def test_greedy_tokens_do_not_depend_on_the_batch_or_speculation(artifacts, name):
    """Through the engine: a prompt's greedy tokens alone, beside others, and verified k + 1 rows at a
    time by n-gram speculation are the same."""
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 3, 4, 9, 3, 4, 9, 3], [11, 12, 13, 14, 15]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    def greedy(llm, batch):
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], params)]
    plain = llmc.load(artifacts[name], kv_memory="4MiB")
    each = [greedy(plain, [p])[0] for p in prompts]
    assert greedy(plain, prompts) == each
    spec = llmc.load(artifacts[name], kv_memory="4MiB",
                     speculative={"method": "ngram", "num_speculative_tokens": 4})
    assert greedy(spec, prompts) == each


def test_preemption_by_recompute_keeps_the_tokens(artifacts):
    """A KV cache too small for the batch: sequences are preempted and recomputed (a prefill of what they
    had), and each still gets the greedy tokens it gets alone."""
    prompts = [[(7 * i + j) % 50 + 3 for j in range(20)] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    roomy = llmc.load(artifacts["gguf"], kv_memory="4MiB", block_size=4)
    each = [roomy.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in prompts]
    tight = llmc.load(artifacts["gguf"], kv_memory=str(64 * 4 * kv_bytes_per_token(roomy)), block_size=4)   # 64 blocks
    got = [o.outputs[0].token_ids for o in tight.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert tight.engine.scheduler.num_preemptions > 0 and got == each


def kv_bytes_per_token(llm) -> int:
    """KV bytes per token of the loaded model."""
    return llm.engine.model["kv_bytes_per_token"]


def test_auto_keeps_fp32_activation_matmulnbits_on_torch_and_offers_no_decode_graph(tmp_path, monkeypatch):
    """Timings faked so that ORT wins every segment kind: --kernels auto still keeps the 4-bit segments (their
    MatMulNBits on fp32 activations round a row differently at 1 and more rows) on torch, says so, and
    offers no decode graph; with --batch-invariant off it takes them."""
    from llmc.compiler.driver.tuning import ort_decode_timing, ort_timing

    monkeypatch.setenv("LLMC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ort_timing, "measure", lambda runners, graph, seg, outputs=None: {
        name: {"decode": 1.0 if name == "ort" else 2.0, "prefill": 1.0 if name == "ort" else 2.0} for name in runners})
    monkeypatch.setattr(ort_decode_timing, "measure_plans", lambda graph, candidates: {
        name: {"cpu": 300.0, "walk": 100.0, "graph": 50.0, "launches": 400.0}[name] for name in candidates})
    plans = {}
    for mode in ("on", "off"):
        path = llmc.compile("tiny-llama", output=tmp_path / f"{mode}.llmc", kernels="auto", quant="int4-rtn",
                            group_size=32, quiet=True, batch_invariant=mode)
        plans[mode] = json.loads((path / "plan.json").read_text())
    on, off = plans["on"]["meta"], plans["off"]["meta"]
    assert "kept on torch" in on["kernel_choice"]["batch_invariant"]
    assert not on.get("decode_graph", {}).get("chosen") and off["decode_graph"]["chosen"]
    assert on["batch_invariant"] is True and off["batch_invariant"] is False
    nbits = lambda plan: sum(s["kernel"] == "ort.segment" for s in plan["steps"])
    assert nbits(plans["off"]) > nbits(plans["on"])


def test_off_allows_the_row_dependent_kernels(artifacts):
    llm = llmc.load(artifacts["fp32"], kv_memory="4MiB", batch_invariant=False)
    assert not llm.engine.executor.batch_invariant
    assert llm.engine.executor.invariance() == "off"
    assert llmc.load(artifacts["fp32"], kv_memory="4MiB").engine.executor.invariance() == "on"


def test_bench_speculative_reports_the_policy_and_the_plain_tokens(artifacts, capsys):
    """`llmc bench --speculative` with batching: greedy speculation gives plain decoding's tokens (which
    follows from invariance), and the report says in how many steps the policy speculated and why
    sequences decoded plainly."""
    from llmc_cli import llmc_in_process

    code, out, _ = llmc_in_process(capsys, "bench", artifacts["gguf"], "-n", 4, "--input-len", 24, "--output-len", 24,
                                   "--kv-memory", "4MiB", "--speculative", "ngram", "--json")
    assert code == 0
    result = json.loads(out)
    spec = result["speculative"]
    assert spec["same_tokens_as_plain"] is True and result["batch_invariant"] == "on"
    assert spec["steps_speculated"] + spec["steps_plain"] > 0
    assert set(spec["stood_aside"]) <= {"no n-gram match", "would not pay at its acceptance rate",
                                        "would not pay even at a copying request's acceptance",
                                        "request asks for logprobs or penalties", "min_tokens pending",
                                        "at its token limit", "the draft model proposed nothing"}
    assert spec["steps_plain"] == 0 or spec["stood_aside"]


def test_inspect_names_what_the_artifact_keeps_outside_invariance(artifacts, tmp_path, capsys):
    """`llmc inspect` states the mode, and for an int8 KV cache that its attention rounds by the rows,
    as a load's invariance() does."""
    from llmc_cli import llmc_in_process

    code, out, _ = llmc_in_process(capsys, "inspect", artifacts["fp32"])
    assert code == 0 and "batch invariance: on (" in out
    kv8 = llmc.compile("tiny-llama", output=tmp_path / "kv8.llmc", quiet=True, kernels="cpu", kv_cache="int8",
                       calib_samples=2, calib_seq_len=16)
    code, out, _ = llmc_in_process(capsys, "inspect", kv8)
    assert code == 0 and "batch invariance: on, except attention over the int8 KV cache" in out
    assert "int8 KV cache" in llmc.load(kv8, kv_memory="4MiB").engine.executor.invariance()


def test_ort_segments_give_a_lone_row_a_second_where_this_cpu_rounds_it_apart(loaded):
    """Where this machine's MatMulNBits round a row called alone apart from 2+ rows (MLAS's GEMV and
    GEMM paths; measured on AVX2), an invariant load's segments run a one-row call as two copies of the
    row: the row then gets the bits it gets among others. A load with invariance off does not."""
    from llmc.codegen.ort import nbits_rows
    from llmc.runtime.ort_segment import OrtSegment

    segments = [launch.fn for launch in loaded["ort-int4"].engine.executor._program
                if isinstance(launch.fn, OrtSegment) and launch.fn.nbits_levels]
    assert segments and {s._row_dims for s in segments} <= {frozenset({"tokens"}), frozenset({"tokens", "rows"})}
    apart = nbits_rows.row_rounding(4) == nbits_rows.SINGLE
    assert all(s.pad_single_rows == apart for s in segments)
    segment = next(s for s in segments if "rows" not in s._row_dims)
    rows = [torch.randn(3, *t.shape[1:]) if t.dtype == "float32" else torch.randint(0, 32, (3,))
            for _, t, _ in segment.inputs]
    together = segment(*rows)
    for i in range(3):
        alone = segment(*[r[i:i + 1] for r in rows])
        assert all(torch.equal(a, t[i:i + 1]) for a, t in zip(alone, together))
    segment.pad_single_rows = False
    try:
        unpadded = segment(*[r[:1] for r in rows])
        assert apart != all(torch.equal(a, t[:1]) for a, t in zip(unpadded, together))
    finally:
        segment.pad_single_rows = apart
