"""A target is a recipe, and it is applied: each GPU preset quantises the weights its own way
whatever the source (a GGUF's blocks are re-quantised, and the compile says so), the cpu targets
keep a GGUF's blocks, an explicit `--quant gguf` keeps them on every target whose kernels read
them (else it is refused in one line), and the manifest and `llmc inspect` say which format each
linear ended in and why. SmolLM2's GGUF (Q4_1 and Q8_0 blocks) is stood for by its recipe
resolution and by a tiny GGUF of the same block formats, compiled: the calibrated SmolLM2 compiles
take minutes."""

import json

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf_files import finish, llama_writer
from transformers import LlamaConfig, LlamaForCausalLM

import llmc
from llmc.compiler import recipes
from llmc.compiler.frontends.samples import build_tiny_tokenizer
from llmc.compiler.inspect import report, summarize
from llmc.compiler.options import CompileOptions
from llmc.compiler.pipeline import compile_model, describe_target, pass_configs
from llmc.compiler.targets import TARGETS, get_target
from llmc.errors import PassError

FAST = dict(calib_samples=2, calib_seq_len=16, max_num_batched_tokens=64)
# target -> (the quantising passes a GGUF source gets without --quant, why, the linears' formats in
# inspect: the LM head, tied to the Q8_0 embedding, stays in float under the GPU recipes)
EXPECTED = {
    "cpu": (["keep_gguf_quant"], recipes.KEPT_FROM_SOURCE, {"Q4_1", "Q8_0"}),
    "cpu-bf16": (["keep_gguf_quant"], recipes.KEPT_FROM_SOURCE, {"Q4_1", "Q8_0"}),
    "h100-fp8": (["quantize_fp8"], recipes.TARGET_DEFAULT, {"fp8 (fp8 activations)", "bf16"}),
    "h100-bf16": ([], recipes.TARGET_DEFAULT, {"bf16"}),
    "a100-bf16": ([], recipes.TARGET_DEFAULT, {"bf16"}),
    "a100-int8": (["smoothquant", "quantize_w8a8"], recipes.TARGET_DEFAULT, {"int8 (int8 activations)", "bf16"}),
    "rtx4090-int4": (["quantize_int4:method=awq"], recipes.TARGET_DEFAULT, {"int4 g128", "bf16"}),
    "orin-int4": (["quantize_int4:method=gptq"], recipes.TARGET_DEFAULT, {"int4 g128", "bf16"}),
}
QUANT_PASSES = ("keep_gguf_quant", "quantize_fp8", "smoothquant", "quantize_w8a8", "quantize_int4", "quantize_int8")


def quant_specs(target: str, source_quantised: bool, **options) -> list[str]:
    """The quantising passes a compile for `target` runs, as name[:key=value] without their defaults."""
    configs = pass_configs(get_target(target), CompileOptions(**options), source_quantised=source_quantised)
    return [c.spec().replace(":all_linears=true", "") for c in configs if c.name in QUANT_PASSES]


def test_every_target_is_covered():
    assert set(EXPECTED) == set(TARGETS)


@pytest.mark.parametrize("target", list(EXPECTED))
def test_a_gguf_source_gets_the_targets_recipe(target):
    """What SmolLM2's GGUF gets for each --target: its blocks kept only where the recipe keeps the source."""
    passes, reason, _ = EXPECTED[target]
    assert quant_specs(target, source_quantised=True) == passes
    choice = recipes.weight_choice(get_target(target), None, False, source_quantised=True)
    assert choice.reason == reason and target in choice.origin


@pytest.mark.parametrize("target", list(EXPECTED))
def test_a_float_source_gets_the_same_recipe_except_on_the_cpu_targets(target):
    passes, _, _ = EXPECTED[target]
    assert quant_specs(target, source_quantised=False) == ([] if passes == ["keep_gguf_quant"] else passes)
    assert recipes.weight_choice(get_target(target), None, False, False).reason == recipes.TARGET_DEFAULT


@pytest.mark.parametrize("target", list(EXPECTED))
def test_an_explicit_quant_gguf_keeps_the_blocks_on_every_target_with_kernels_for_them(target):
    recipes.check_quant_kernels(get_target(target), "gguf")
    assert quant_specs(target, source_quantised=True, quant="gguf") == ["keep_gguf_quant"]
    choice = recipes.weight_choice(get_target(target), "gguf", False, source_quantised=True)
    assert (choice.quant, choice.reason, choice.origin) == ("gguf", recipes.USER_FLAG, "--quant gguf")


def test_quant_gguf_is_refused_in_one_line_where_the_kernels_cannot_read_blocks(monkeypatch, tmp_path):
    monkeypatch.setattr(recipes, "served_schemes", lambda device: ("int8", "fp8"))
    with pytest.raises(PassError, match=r"^--quant gguf keeps a GGUF file's blocks \(affine4, affine8 codes\), "
                                        r"but target h100-fp8 has no kernels for them; choose another") as e:
        llmc.compile("tiny-llama", target="h100-fp8", output=tmp_path / "x.llmc", quant="gguf", quiet=True)
    assert "\n" not in str(e.value) and not (tmp_path / "x.llmc").exists()


def test_passes_given_by_the_user_are_the_reason():
    choice = recipes.weight_choice(get_target("h100-fp8"), None, True, source_quantised=True)
    assert (choice.quant, choice.reason) == (None, recipes.USER_PASSES)


@pytest.mark.parametrize("target", list(EXPECTED))
def test_llmc_targets_states_each_recipe(target):
    t = get_target(target)
    line, quant = describe_target(t), t.default_quant
    if quant is None:
        assert ("recipe: a quantised source's own blocks kept (a GGUF's), other sources "
                f"{t.weight_dtype} weights") in line
    elif quant == "none":
        assert f"recipe: {t.weight_dtype} weights whatever the source" in line
    else:
        assert f"recipe: --quant {quant}, {recipes.RECIPE_FORMATS[quant]}, whatever the source" in line


@pytest.fixture(scope="module")
def smollm2_stored(smollm2_gguf):
    """SmolLM2's GGUF as a compile loads it (lazily: its stored blocks, no weights read)."""
    from llmc.compiler.frontends import load_model

    return load_model(str(smollm2_gguf), lazy=True).stored_quant


@pytest.mark.smollm2
@pytest.mark.parametrize("target", list(EXPECTED))
def test_smollm2s_gguf_gets_each_targets_recipe_and_the_compile_says_what_becomes_of_its_blocks(
        smollm2_stored, target):
    """What `llmc compile smollm2-135m --target T` resolves, as build_into does, without the
    (calibrated, minutes-long) compile."""
    tgt = get_target(target)
    passes, reason, _ = EXPECTED[target]
    assert quant_specs(target, source_quantised=bool(smollm2_stored)) == passes
    choice = recipes.weight_choice(tgt, None, False, bool(smollm2_stored))
    note = recipes.requantise_note(choice, smollm2_stored, tgt)
    assert choice.reason == reason
    if reason == recipes.KEPT_FROM_SOURCE:
        assert note is None
    else:
        assert note.startswith("llmc: the source stores quantised weights (210 Q4_1, 2 Q8_0); "
                               f"target {target}'s recipe ")


# -- a tiny GGUF of SmolLM2's block formats, compiled ---------------------------------------------
def write_gguf(path) -> None:
    """A random tiny llama whose linears are Q4_1 blocks and whose embedding is Q8_0, as SmolLM2's file."""
    rng = np.random.default_rng()
    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, architectures=["LlamaForCausalLM"])
    writer = llama_writer(path, config, tokenizer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for name, tensor in LlamaForCausalLM(config).state_dict().items():
        stem, _, suffix = name.rpartition(".")
        if name == "lm_head.weight":
            continue   # tied to the embedding, as SmolLM2's
        target = f"{names.get_name(stem)}.{suffix}"
        if tensor.dim() == 1:
            writer.add_tensor(target, (1 + 0.1 * rng.standard_normal(tensor.shape)).astype(np.float32))
            continue
        kind = Q.Q8_0 if "embed" in name else Q.Q4_1
        values = (rng.standard_normal(tuple(tensor.shape)) / tensor.shape[1] ** 0.5).astype(np.float32)
        writer.add_tensor(target, gguf.quants.quantize(values, kind), raw_dtype=kind)
    finish(writer)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("recipes") / "tiny-q4_1.gguf"
    write_gguf(path)
    return path


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path_factory.getbasetemp() / "llmc-cache"))


def compile_tiny(source, target: str, out, **options):
    messages: list[str] = []
    path = compile_model(str(source), target, out, CompileOptions(**FAST, kernels="cpu" if target == "cpu" else None,
                                                                 **options), echo=messages.append)
    return report(path), messages, path


@pytest.mark.parametrize("target", ["cpu", "h100-fp8", "h100-bf16", "a100-int8"])
def test_the_tiny_ggufs_linears_end_in_the_targets_format_and_the_manifest_says_why(tiny_gguf, tmp_path, target):
    passes, reason, formats = EXPECTED[target]
    rep, messages, path = compile_tiny(tiny_gguf, target, tmp_path / "a.llmc")
    weights = rep["weights"]
    assert set(weights["formats"]) == formats and weights["reason"] == reason
    assert json.loads((path / "manifest.json").read_text())["weights"]["reason"] == reason
    said = [m for m in messages if "the source stores quantised weights" in m]
    if reason == recipes.KEPT_FROM_SOURCE:
        assert not said and weights["quant"] == "gguf"
    else:   # the file's blocks are re-quantised (or stored as bf16): the compile says so, once
        assert len(said) == 1 and f"target {target}'s recipe" in said[0] and "--quant gguf keeps" in said[0]
    listed = ", ".join(f"{n} {fmt}" for fmt, n in weights["formats"].items())
    assert f"  linear weights (by GEMM, a fused one once): {listed}; from " in summarize(path, brief=True)
    assert f"({reason}: target {target}" in summarize(path, brief=True)


def test_quant_gguf_on_h100_fp8_keeps_the_blocks_and_says_it_was_the_users_flag(tiny_gguf, tmp_path):
    rep, messages, path = compile_tiny(tiny_gguf, "h100-fp8", tmp_path / "a.llmc", quant="gguf")
    assert set(rep["weights"]["formats"]) == {"Q4_1", "Q8_0"} and rep["weights"]["reason"] == recipes.USER_FLAG
    assert not [m for m in messages if "the source stores quantised weights" in m]
    assert rep["model"]["kv_dtype"] == "float8_e4m3fn"   # the rest of the target's recipe stands
    assert "linear weights (by GEMM" in summarize(path) and "(user flag: --quant gguf)" in summarize(path)


def test_float_weights_the_recipe_left_say_why(tmp_path):
    """tiny-llama's untied LM head stays in float under int8; inspect names the quantising pass's reason."""
    rep, _, path = compile_tiny("tiny-llama", "cpu", tmp_path / "a.llmc", quant="int8")
    weights = rep["weights"]
    assert weights["reason"] == recipes.USER_FLAG and weights["formats"]["int8"] >= 1
    assert weights["formats"].get("fp32") == 1 and any(why.startswith("lm_head") for why in weights["left_in_float"])
    assert "left in float: 1 lm_head" in summarize(path)


def test_an_artifact_without_the_record_says_so_and_a_bad_record_is_refused(tmp_path):
    import shutil

    from llmc.errors import ArtifactError

    _, _, path = compile_tiny("tiny-llama", "cpu", tmp_path / "a.llmc")
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["weights"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert report(path)["weights"]["reason"] == "not recorded"
    bad = tmp_path / "b.llmc"
    shutil.copytree(path, bad)
    (bad / "manifest.json").write_text(json.dumps({**manifest, "weights": {"quant": 3}}))
    with pytest.raises(ArtifactError, match="manifest.json: weights must be an object"):
        report(bad)


def test_a_users_pass_list_is_named_as_the_reason(tiny_gguf, tmp_path):
    rep, messages, path = compile_tiny(tiny_gguf, "cpu", tmp_path / "a.llmc", passes="keep_gguf_quant,dce")
    assert set(rep["weights"]["formats"]) == {"Q4_1", "Q8_0"} and rep["weights"]["reason"] == recipes.USER_PASSES
    assert "; from the passes given (user pipeline: --passes, in the order given)" in summarize(path)
