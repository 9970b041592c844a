"""The native decode program (runtime/native_decode.py): which launches it takes over, and that decode
steps through it give the walk's logits (to fp32 rounding) and HF's, past a sliding window, with
biases, int8 weights, a batch, and a run whose inputs are first read after the arena reused a region;
what it does not cover (a quantised KV cache, more rows than MAX_ROWS, a step wanting logits of other
rows than all in order) keeps the walk."""

import pytest
import torch
from tiny_hf_models import SPECIAL, VOCAB, hf_logits, max_relative_error, paged_logits, prompt_ids, save_checkpoint
from transformers import MistralConfig, Qwen2Config

import llmc
from llmc import SamplingParams
from llmc.codegen.native import cpu_native
from llmc.runtime import native_decode
from llmc.runtime.paged_attention import PagedKVCache, StepMetadata

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="the native kernels are not built here")
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, **SPECIAL)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (HF module or None, artifact path): torch kernels throughout, so the walk is all cpu launches."""
    root = tmp_path_factory.mktemp("native-decode")
    out = {}
    for name, config in (("mistral", MistralConfig(**SIZES, sliding_window=16)), ("qwen2", Qwen2Config(**SIZES))):
        module = save_checkpoint(config, root / name, seed=4)
        out[name] = module, llmc.compile(str(root / name), output=root / f"{name}.llmc", kernels="cpu", quiet=True)
    out["int8"] = None, llmc.compile("tiny-llama", output=root / "int8.llmc", kernels="cpu", quant="int8",
                                     quiet=True)
    out["int4"] = None, llmc.compile("tiny-llama", output=root / "int4.llmc", kernels="cpu", quant="int4-rtn",
                                     group_size=32, quiet=True)
    return out


def _attention_steps(executor) -> list[int]:
    return [i for i, s in enumerate(executor.plan.steps) if s.kernel == "cpu.flash_attention"]


def _without_program(llm):
    program = llm.engine.executor.native_decode
    llm.engine.executor.native_decode = None
    return program


@pytest.mark.parametrize("name", ["mistral", "qwen2", "int8", "int4"])
def test_decode_steps_match_the_walk_and_hf(models, name):
    """Every layer in one run; a prompt then 30 decode steps through shuffled blocks (past Mistral's 16-token
    window) equal the walk's logits to fp32 rounding, and HF's to 1e-4 where the weights are HF's."""
    module, path = models[name]
    llm = llmc.load(path, kv_memory="8MiB")
    program = llm.engine.executor.native_decode
    attention = _attention_steps(llm.engine.executor)
    assert program is not None and program.start <= attention[0] and program.end > attention[-1]
    assert program.end == len(llm.engine.executor.plan.steps)   # the LM head too: logits leave as a copy
    ids = prompt_ids(40, seed=7)
    rounded = cpu_native.int16_activations() and name in ("int8", "int4")
    # the quantised GEMVs' activation codes round at 2^-16 (int16) or 2^-8 (int8, the 4-bit GEMVs' default) of
    # a block's largest, so an fp32 rounding difference upstream (a SwiGLU in torch on the walk, native in the
    # program) can move a code: the walk's function is checked on fp32 activations, then integer ones stay
    # within their rounding of it
    with cpu_native.fp32_activations():
        got = paged_logits(llm, ids, prefill_chunks=(10,))
    if rounded:
        on_codes = paged_logits(llm, ids, prefill_chunks=(10,))
        int8 = llm.engine.executor.q4_activations == "int8" and name == "int4"
        assert max_relative_error(on_codes, got) < (2e-2 if int8 else 1e-3)
        assert (on_codes.argmax(-1) == got.argmax(-1)).float().mean() >= (0.9 if int8 else 1.0)
    _without_program(llm)
    with cpu_native.fp32_activations():
        walked = paged_logits(llm, ids, prefill_chunks=(10,))
    assert max_relative_error(got, walked) < 1e-5
    if module is not None:
        assert max_relative_error(got, hf_logits(module, ids)) < 1e-4


def test_a_run_whose_inputs_are_read_late(models, monkeypatch):
    """A run starting at layer 0's split (as after an ONNX Runtime segment that ends in the qkv projection)
    reads the embedding first at the attention's residual add, after the arena has given a freed region
    to a later value: the inputs get regions of their own, so the logits are the walk's."""
    _, path = models["qwen2"]

    def from_split(executor):
        first = next(i for i, s in enumerate(executor.plan.steps) if s.kernel == "cpu.split")
        end, found = native_decode._encode_run(executor, first, native_decode._last_uses(executor))
        return native_decode.NativeDecode(executor, first, end, *found)
    monkeypatch.setattr(native_decode, "build", from_split)
    llm = llmc.load(path, kv_memory="8MiB")
    program = llm.engine.executor.native_decode
    assert len(program._inputs) == 2
    ids = prompt_ids(30, seed=8)
    got = paged_logits(llm, ids, prefill_chunks=(12,))
    _without_program(llm)
    assert max_relative_error(got, paged_logits(llm, ids, prefill_chunks=(12,))) < 1e-5


def _counting_runs(monkeypatch) -> list[bool]:
    ran, run = [], native_decode.NativeDecode.run

    def counted(self, regs, backend, rope_cache, borrow=False):
        ran.append(run(self, regs, backend, rope_cache, borrow))
        return ran[-1]
    monkeypatch.setattr(native_decode.NativeDecode, "run", counted)
    return ran


def test_a_decode_step_wanting_other_rows_walks(models, monkeypatch):
    """The program takes select_rows as the identity, which it is when every row's logits are wanted in
    order: a decode step of two sequences that wants the second one's alone, or both swapped, walks and
    gives the rows it asked for."""
    executor = llmc.load(models["qwen2"][1], kv_memory="8MiB").engine.executor
    layout = executor.plan.kv_layout()
    cache = PagedKVCache(layout["num_layers"], 8, 4, layout["num_kv_heads"], layout["head_dim"],
                         dtype=executor.kv_dtype())
    backend = executor.paged_backend(cache)
    tables, prompts = [[5, 1, 6], [0, 3, 2]], [prompt_ids(9, seed=1), prompt_ids(6, seed=2)]

    def run(layout, ids, positions, rows):
        backend.metadata = StepMetadata.build(layout, 4)
        return executor.run_values({"input_ids": torch.tensor(ids), "positions": torch.tensor(positions),
                                    "logits_indices": torch.tensor(rows)}, backend)["logits"]
    for table, ids in zip(tables, prompts):
        run([(table, 0, len(ids) - 1)], ids[:-1], list(range(len(ids) - 1)), [len(ids) - 2])
    ran = _counting_runs(monkeypatch)
    step = ([(t, len(ids) - 1, 1) for t, ids in zip(tables, prompts)], [ids[-1] for ids in prompts],
            [len(ids) - 1 for ids in prompts])
    both = run(*step, [0, 1])
    assert ran == [True]
    for rows in ([1], [1, 0]):
        got = run(*step, rows)
        assert ran[-1] is False and max_relative_error(got, both[rows]) < 1e-5


def _greedy(llm, prompts, n=12):
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_batches_up_to_max_rows_run_it_and_larger_ones_walk(models, monkeypatch):
    """int8 tiny-llama: 3 sequences decode through the program, MAX_ROWS + 1 through the walk; the greedy
    tokens are the walk's either way."""
    _, path = models["int8"]
    llm = llmc.load(path, kv_memory="16MiB")
    ran = _counting_runs(monkeypatch)
    few = [prompt_ids(9 + i, seed=i) for i in range(3)]
    many = [prompt_ids(5 + i, seed=10 + i) for i in range(cpu_native.MAX_ROWS + 1)]
    program = (_greedy(llm, few), _greedy(llm, many))
    assert True in ran and False in ran
    _without_program(llm)
    assert program == (_greedy(llm, few), _greedy(llm, many))


def test_a_quantised_kv_cache_keeps_the_walk(tmp_path):
    path = llmc.compile("tiny-llama", output=tmp_path / "kv.llmc", kernels="cpu", kv_cache="int8", calib_samples=4,
                        calib_seq_len=64, quiet=True)
    assert llmc.load(path, kv_memory="8MiB").engine.executor.native_decode is None


def test_op_seconds_add_up_each_kind_when_asked(models):
    """bench/decode_step.py --by-kernel's split: each op's wall time lands at its kind, only when asked."""
    llm = llmc.load(models["int8"][1], kv_memory="8MiB")
    program = llm.engine.executor.native_decode
    _greedy(llm, [prompt_ids(9, seed=3)], n=4)
    program.op_seconds = torch.zeros(native_decode.OP_KINDS, dtype=torch.float64)
    _greedy(llm, [prompt_ids(9, seed=3)], n=4)
    seconds = program.op_seconds.tolist()
    assert all(seconds[kind] > 0 for kind in (native_decode.OP_GEMV_Q8, native_decode.OP_ATTENTION,
                                             native_decode.OP_ADD_RMS_NORM, native_decode.OP_SWIGLU))
    assert seconds[native_decode.OP_GEMV_Q4] == 0   # no 4-bit weights


@pytest.mark.parametrize("name", ["qwen2", "int4"])
def test_a_verification_chunk_runs_it_and_gives_the_walks_bits(models, monkeypatch, name):
    """A speculative verification (one sequence's k + 1 rows after its context, every row's logits) beside
    a decode: each chunk row runs as a decode row of the program, and in batch-invariant mode (the
    default) that is what the walk runs for it too, so the logits are the walk's bit for bit."""
    executor = llmc.load(models[name][1], kv_memory="8MiB").engine.executor
    assert executor.batch_invariant
    layout = executor.plan.kv_layout()

    def step(program: bool) -> torch.Tensor:
        executor.native_decode = saved if program else None
        cache = PagedKVCache(layout["num_layers"], 8, 4, layout["num_kv_heads"], layout["head_dim"],
                             dtype=executor.kv_dtype())
        backend = executor.paged_backend(cache)
        tables, prompts = [[5, 1, 6, 7], [0, 3, 2]], [prompt_ids(9, seed=1), prompt_ids(6, seed=2)]
        for table, ids in zip(tables, prompts):
            backend.metadata = StepMetadata.build([(table, 0, len(ids))], 4)
            executor.run_values({"input_ids": torch.tensor(ids), "positions": torch.arange(len(ids)),
                                 "logits_indices": torch.tensor([len(ids) - 1])}, backend)
        drafts, next_id = prompt_ids(4, seed=3), prompt_ids(1, seed=4)
        backend.metadata = StepMetadata.build([(tables[0], 9, 4), (tables[1], 6, 1)], 4)
        return executor.run_values({"input_ids": torch.tensor(drafts + next_id),
                                    "positions": torch.tensor([9, 10, 11, 12, 6]),
                                    "logits_indices": torch.arange(5)}, backend)["logits"]
    saved = executor.native_decode
    ran = _counting_runs(monkeypatch)
    got = step(program=True)
    assert ran[-1] is True
    assert torch.equal(got, step(program=False))


def test_q4_activations_are_the_artifacts_unless_a_load_asks(models):
    """A cpu compile records int8 activations for the 4-bit GEMVs (--q4-activations' default), `llmc inspect`
    says so, and a load may ask for int16 ones; an unknown rounding is refused in one line."""
    from llmc.compiler.inspect import summarize
    from llmc.errors import LlmcError

    _, path = models["int4"]

    def rounding(llm) -> set:
        return {launch.attrs["native_gemv"].int8 for launch in llm.engine.executor._program
                if type(launch.attrs.get("native_gemv")) is cpu_native.Q4Weights}
    llm = llmc.load(path, kv_memory="8MiB")
    assert llm.engine.executor.q4_activations == "int8"
    assert rounding(llm) == {cpu_native.int16_activations()}   # int8 where the GEMVs take integer codes
    assert "4-bit GEMV activations: int8 codes per block of 32" in summarize(path)
    llm = llmc.load(path, kv_memory="8MiB", q4_activations="int16")
    assert llm.engine.executor.q4_activations == "int16" and rounding(llm) == {False}
    with pytest.raises(LlmcError, match="q4_activations='int4'"):
        llmc.load(path, kv_memory="8MiB", q4_activations="int4")
