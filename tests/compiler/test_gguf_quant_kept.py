"""A GGUF file's block-quantised weights kept as they are (--quant gguf, the default for GGUF
sources): every format imports as affine4/affine8 params that dequantise to gguf.quants'
values bit for bit, a compiled tiny llama holding all of them computes the --quant none
artifact's logits, the compile says when another --quant re-quantises the file, and SmolLM2
with its Q4_1 kept decodes the fp32 artifact's greedy tokens."""

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf_files import finish, llama_writer, write_tensors
from transformers import LlamaConfig, LlamaForCausalLM

import llmc
from llmc import SamplingParams
from llmc.compiler.artifact import read_artifact
from llmc.compiler.frontends.gguf import unpermute_rows
from llmc.compiler.frontends.gguf_dequant import decode
from llmc.compiler.frontends.samples import build_tiny_tokenizer
from llmc.compiler.interpreter import interpret
from llmc.compiler.ir import Graph
from llmc.compiler.options import CompileOptions
from llmc.compiler.pipeline import compile_model
from llmc.compiler.quant import dequantize_affine, unpack_int4
from llmc.errors import PassError

QUANTISABLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)   # gguf-py quantises these itself
K_SCALE_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}   # fp16 d (and dmin) per block
FORMATS = (*QUANTISABLE, *K_SCALE_FIELDS)
# scheme, group size, whether the format has minimums, codes' range
EXPECTED = {Q.Q4_0: ("affine4", 32, False, (0, 15)), Q.Q4_1: ("affine4", 32, True, (0, 15)),
            Q.Q5_0: ("affine8", 32, False, (-16, 15)), Q.Q5_1: ("affine8", 32, True, (0, 31)),
            Q.Q8_0: ("affine8", 32, False, (-128, 127)), Q.Q4_K: ("affine4", 32, True, (0, 15)),
            Q.Q5_K: ("affine8", 32, True, (0, 31)), Q.Q6_K: ("affine8", 16, False, (-32, 31))}


def blocks_of(rng, kind: Q, values: np.ndarray) -> np.ndarray:
    """`values` quantised by gguf-py, or, for the K-quants it cannot quantise, random blocks of
    the same shape whose fp16 scales make weights of about the values' size."""
    if kind in QUANTISABLE:
        return gguf.quants.quantize(values, kind)
    block, type_size = GGML_QUANT_SIZES[kind]
    rows, columns = values.shape
    data = rng.integers(0, 256, (rows, columns // block * type_size), dtype=np.uint8)
    per_block = data.reshape(-1, type_size)
    magnitude = np.abs(values).mean() / (400 if kind == Q.Q6_K else 100)   # 6-bit scales times codes
    for start in K_SCALE_FIELDS[kind]:
        field = (rng.standard_normal((len(per_block), 1)) * magnitude).astype(np.float16)
        per_block[:, start:start + 2] = field.view(np.uint8)
    return data


@pytest.mark.parametrize("kind", FORMATS, ids=lambda k: k.name)
def test_each_format_imports_as_affine_params_that_dequantise_to_gguf_bit_for_bit(kind, tmp_path):
    rng = np.random.default_rng()
    values = blocks_of(rng, kind, rng.standard_normal((6, 512)).astype(np.float32))
    (tensor,) = write_tensors(tmp_path / "t.gguf", {"w": (values, kind)}).tensors
    _, stored = decode(tensor)
    scheme, group_size, has_mins, (low, high) = EXPECTED[kind]
    assert (stored.scheme, stored.group_size, stored.mins is not None, stored.format) == (
        scheme, group_size, has_mins, kind.name)
    codes = unpack_int4(stored.qweight) if scheme == "affine4" else stored.qweight
    assert codes.shape == (6, 512) and low <= int(codes.min()) and int(codes.max()) <= high
    # GGUF's own fp16 scales stay fp16; K-quant sub-block scales (fp16 times 6 bits) stay packed as the file
    # has them: an fp16 factor a super-block and an int8 a group (2 K/256 + K/g bytes a row)
    if kind in K_SCALE_FIELDS:
        assert stored.scales.dtype == torch.uint8 and stored.scales.shape == (6, 2 * 2 + 512 // group_size)
    else:
        assert stored.scales.dtype == torch.float16
    ours = dequantize_affine(stored.scheme, stored.qweight, stored.scales, stored.mins)
    reference = torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, kind))).reshape(6, 512)
    assert torch.equal(ours.view(torch.int32), reference.view(torch.int32))


# -- a tiny llama holding every format, compiled --------------------------------------------------
def tiny_config(tokenizer) -> LlamaConfig:
    """K-quants need K a multiple of 256."""
    return LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, architectures=["LlamaForCausalLM"])


def write_model(path, rng) -> dict[str, tuple[str, np.ndarray, Q]]:
    """A llama.cpp-style GGUF of a random tiny llama whose 2-D weights cycle through FORMATS;
    returns hf name -> (gguf name, stored data, format)."""
    tokenizer = build_tiny_tokenizer()
    config = tiny_config(tokenizer)
    writer = llama_writer(path, config, tokenizer)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    written, matrices = {}, 0
    for name, tensor in LlamaForCausalLM(config).state_dict().items():
        stem, _, suffix = name.rpartition(".")
        gguf_name = f"{name_map.get_name(stem)}.{suffix}"
        if tensor.dim() == 1:
            writer.add_tensor(gguf_name, (1 + 0.1 * rng.standard_normal(tensor.shape)).astype(np.float32))
            continue
        kind = FORMATS[matrices % len(FORMATS)]
        matrices += 1
        values = rng.standard_normal(tuple(tensor.shape)).astype(np.float32) / tensor.shape[1] ** 0.5
        data = blocks_of(rng, kind, values)
        writer.add_tensor(gguf_name, data, raw_dtype=kind)
        written[name] = (gguf_name, data, kind)
    finish(writer)
    return written


def file_values(name: str, data: np.ndarray, kind: Q, config) -> torch.Tensor:
    """What the file stores for HF param `name`, dequantised by gguf and un-permuted as transformers does."""
    values = torch.from_numpy(np.array(gguf.quants.dequantize(data, kind)))
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    count = next((n for proj, n in heads.items() if f".{proj}." in name), None)
    return unpermute_rows(values, count) if count else values


def artifact_graph(path) -> tuple[Graph, dict]:
    art = read_artifact(path)
    graph = Graph.from_json(art.graph_json)
    graph.weights = art.weights
    return graph, art.manifest


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-kept")
    written = write_model(root / "tiny.gguf", np.random.default_rng())
    kept = llmc.compile(str(root / "tiny.gguf"), target="cpu", output=root / "kept.llmc", quiet=True)
    plain = llmc.compile(str(root / "tiny.gguf"), target="cpu", output=root / "none.llmc", quant="none", quiet=True)
    return written, artifact_graph(kept), artifact_graph(plain), root


def stored_weight(graph: Graph, weight: str) -> torch.Tensor:
    params = {key: graph.weights.get(f"{weight}.{key}") for key in ("qweight", "scales", "zeros")}
    scheme = "affine4" if params["qweight"].dtype == torch.uint8 else "affine8"
    return dequantize_affine(scheme, params["qweight"], params["scales"], params["zeros"])


def test_the_artifact_stores_every_format_and_its_weights_are_the_files_exactly(compiled):
    written, (graph, manifest), _, _ = compiled
    config = LlamaConfig(**{k: v for k, v in manifest["model"]["hf_config"].items() if k != "model_type"})
    counts = graph.op_counts()
    assert "linear" not in counts and counts["qembedding"] == 1
    for name, (_, data, kind) in written.items():
        assert graph.params[f"{name}.qweight"].quant.method == f"gguf:{kind.name}", name
        assert torch.equal(stored_weight(graph, name), file_values(name, data, kind, config)), name
    keep = next(p for p in manifest["pipeline"] if p["name"] == "keep_gguf_quant")
    figures = keep["details"]["quant"]["gguf"]
    assert figures["formats"] == {name: kind.name for name, (_, _, kind) in written.items()}
    assert (figures["linears"], figures["embeddings"], figures["kept_linears"]) == (len(written) - 1, 1, 0)


def test_kept_logits_equal_the_dequantised_fp32_artifacts(compiled):
    _, (kept, _), (plain, _), _ = compiled
    assert "qlinear" not in plain.op_counts() and "qembedding" not in plain.op_counts()
    ids = torch.randint(0, 512, (11,), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "positions": torch.arange(11), "logits_indices": torch.arange(11)}
    got, want = interpret(kept, inputs)["logits"], interpret(plain, inputs)["logits"]
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def test_cpu_bf16_keeps_the_blocks_and_their_fp16_scales_uncast(compiled, tmp_path):
    """cpu-bf16 on a GGUF: the kept blocks' fp16 scales feed their kernels as stored (a cast node on
    one once crashed the ONNX Runtime segment build: KeyError 'cast_92'); bf16 activations round the
    logits within bf16's 2^-8."""
    _, (kept, _), _, root = compiled
    graph, _ = artifact_graph(llmc.compile(str(root / "tiny.gguf"), target="cpu-bf16",
                                           output=tmp_path / "bf16.llmc", quiet=True))
    scales = {n.inputs[2] for n in graph.nodes if n.op in ("qlinear", "qembedding")}
    assert scales and scales <= set(graph.params)
    ids = torch.randint(0, 512, (9,), generator=torch.Generator().manual_seed(2))
    inputs = {"input_ids": ids, "positions": torch.arange(9), "logits_indices": torch.arange(9)}
    got, want = interpret(graph, inputs)["logits"], interpret(kept, inputs)["logits"]
    assert ((got - want).abs().max() / want.abs().max()).item() < 0.05


def test_another_quant_re_quantises_and_says_so(compiled, tmp_path):
    *_, root = compiled
    messages = []
    out = compile_model(str(root / "tiny.gguf"), "cpu", tmp_path / "int8.llmc", CompileOptions(quant="int8"),
                        echo=messages.append)
    assert any("re-quantises them from their dequantised values" in m and "--quant gguf" in m for m in messages)
    graph, _ = artifact_graph(out)
    schemes = {n.attrs["scheme"] for n in graph.nodes if n.op in ("qlinear", "qembedding")}
    assert schemes == {"int8"}


def test_quant_gguf_on_a_source_without_quantised_weights_is_refused(tmp_path):
    with pytest.raises(PassError, match="keeps the quantised weights of a GGUF file"):
        llmc.compile("tiny-llama", target="cpu", output=tmp_path / "x.llmc", quant="gguf", quiet=True)
    assert not (tmp_path / "x.llmc").exists()


@pytest.mark.smollm2
def test_smollm2_with_its_q4_1_kept_gives_the_fp32_artifacts_greedy_tokens(smollm2_gguf, smollm2_fp32, tmp_path):
    kept = llmc.compile("smollm2-135m", target="cpu", output=tmp_path / "kept.llmc")
    plain = smollm2_fp32
    graph, manifest = artifact_graph(kept)
    formats = next(p for p in manifest["pipeline"] if p["name"] == "keep_gguf_quant")["details"]["quant"]["gguf"]
    assert sorted(set(formats["formats"].values())) == ["Q4_1", "Q8_0"] and "linear" not in graph.op_counts()
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = ["What is the capital of France?", "def fibonacci(n):", "The three primary colours are"]
    # the kept blocks are the dequantised weights exactly: on int16 activation codes (2^-16) the same tokens
    theirs = [out.outputs[0].token_ids for out in llmc.load(plain, kv_memory="64MiB").generate(prompts, params)]
    exact = llmc.load(kept, kv_memory="64MiB", q4_activations="int16")
    assert [out.outputs[0].token_ids for out in exact.generate(prompts, params)] == theirs
    # the default int8 codes (llama.cpp's Q8_1 rounding, top-1 0.966 per token on samples/eval.txt) part
    # from them somewhere, but not at once
    got = [out.outputs[0].token_ids for out in llmc.load(kept, kv_memory="64MiB").generate(prompts, params)]
    assert all(g[:3] == t[:3] for g, t in zip(got, theirs))


def test_the_kept_artifact_exports_to_onnx_with_the_same_logits(compiled, tmp_path):
    """Every block format through `llmc export`: MatMulNBits over the codes (fp32 activations),
    the minimums as their own product, the embedding's rows dequantised after the gather."""
    import onnxruntime as ort

    *_, root = compiled
    exported = llmc.export(root / "kept.llmc", output=tmp_path / "kept.onnx")
    config = json.loads((exported / "llmc_onnx.json").read_text())
    past = {f"past_{kind}.{layer}": np.zeros((0, config["num_kv_heads"], config["head_dim"]), np.float32)
            for layer in range(config["num_layers"]) for kind in ("key", "value")}
    ids = torch.randint(0, 512, (11,), generator=torch.Generator().manual_seed(2))
    session = ort.InferenceSession(str(exported / "model.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(["logits"], {"input_ids": ids.numpy(), "positions": np.arange(11)} | past)[0]
    graph, _ = artifact_graph(root / "kept.llmc")
    want = interpret(graph, {"input_ids": ids, "positions": torch.arange(11), "logits_indices": torch.arange(11)})
    want = want["logits"].numpy()
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


def test_k_quant_params_shard_for_tensor_parallel_ranks(compiled, tmp_path):
    """--tp 2 on K-quant blocks: column cuts keep their params packed (uint8), row cuts take their fp32
    values (a packed row holds its super-blocks' factors whole), and the ranks together give the
    unsharded artifact's logits."""
    from tests.parallel.test_shard_pass import run_ranks

    _, (kept, _), _, root = compiled
    out = llmc.compile(str(root / "tiny.gguf"), target="cpu", output=tmp_path / "tp2.llmc", quiet=True, tp=2)
    ranks = []
    for rank in range(2):
        art = read_artifact(out, rank=rank)
        graph = Graph.from_json(art.graph_json)
        graph.weights = art.weights
        ranks.append(graph)
    dtypes = {graph.weights[n.inputs[2]].dtype for n in ranks[0].nodes if n.op == "qlinear"}
    assert torch.uint8 in dtypes and torch.float32 in dtypes
    ids = torch.randint(0, 512, (11,), generator=torch.Generator().manual_seed(3))
    inputs = {"input_ids": ids, "positions": torch.arange(11), "logits_indices": torch.arange(11)}
    got, want = run_ranks(ranks, inputs), interpret(kept, inputs)["logits"]
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
