"""The runtime on GPU-target artifacts, run here through Triton's interpreter: the Triton attention
backend over the paged KV cache (mixed prefill/decode batches, fused rotary, int8/fp8 caches)
against float64 attention; tiny-llama compiled for h100-bf16 through the engine against the
reference interpreter's greedy tokens on the same bf16 graph, and for h100-fp8 within a documented
tolerance; kernels the plan records are re-rendered and checked at load, so a tampered kernel file
or a changed template is refused; and every kernel a step launches is one it records."""

import json
import shutil

import pytest
import torch

import llmc
from llmc.compiler.artifact import read_artifact, sha256_file
from llmc.compiler.interpreter import interpret
from llmc.compiler.ir import Graph
from llmc.compiler.ops import rope_ref
from llmc.errors import ArtifactError
from llmc.runtime.attention import attend
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.paged_attention import PagedKVCache, StepMetadata
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.triton_attention_backend import TritonNoCacheAttention, TritonPagedAttention

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 4, 2, 16, 4, 40
SCALE = HEAD_DIM ** -0.5
# (cached tokens, new tokens): a prefill chunk from mid-sequence, decodes (one right after a block
# boundary), a fresh prefill and a one-token prompt
SHAPES = [(9, 7), (5, 1), (16, 1), (0, 9), (0, 1)]
# Attention output: max |error| / max |reference|; the output is bf16 (8 significant bits) and the
# reference attends over what the cache holds, so quantised caches need no more.
OUTPUT_TOLERANCE = 2 ** -7
# A stored key's relative rounding by cache dtype, plus half a quantisation step for int8/fp8 codes:
# e4m3 rounds to 4 significant bits; bf16 keeps 8, but Triton's interpreter truncates fp32 -> bf16
# (a GPU rounds to nearest), so a whole bf16 ulp.
STORE_ROUNDING = {torch.bfloat16: 2 ** -7, torch.int8: 0.0, torch.float8_e4m3fn: 2 ** -4}


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path_factory, monkeypatch):
    # rendered kernel sources go to a session-wide temporary cache, not the user's
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path_factory.getbasetemp() / "llmc-cache"))


def random_layout(gen: torch.Generator) -> list[tuple[list[int], int, int]]:
    """Disjoint block tables in random order for SHAPES: (table, start, new tokens)."""
    ids = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    layout = []
    for start, n in SHAPES:
        need = -(-(start + n) // BLOCK)
        layout.append((ids[:need], start, n))
        ids = ids[need:]
    return layout


def random_cache(gen: torch.Generator, dtype: torch.dtype) -> PagedKVCache:
    quantized = dtype in (torch.int8, torch.float8_e4m3fn)
    # scales large enough that N(0, 1) keys never saturate the int8 codes
    scales = [0.05 + 0.05 * torch.rand(2, KV_HEADS, generator=gen)] if quantized else None
    cache = PagedKVCache(1, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype, kv_scales=scales)
    for t in cache.k_cache + cache.v_cache:   # earlier tokens' keys and values, as codes for a quantised cache
        t.copy_(torch.randn(t.shape, generator=gen) if not quantized else
                (torch.randn(t.shape, generator=gen) * 60).clamp(-120, 120).to(dtype))
    return cache


def float64_reference(cache: PagedKVCache, layout, q, positions, inv_freq) -> torch.Tensor:
    """Each sequence's (rotated) queries against the whole context the cache then holds, in float64."""
    q = rope_ref(q.double(), positions, inv_freq.double(), head_dim=HEAD_DIM)[0] if inv_freq is not None else q
    out, row = [], 0
    for table, start, n in layout:
        keys, values = cache.read(0, torch.tensor(table), torch.float64)
        ctx = start + n
        out.append(attend(q[row:row + n].double(), keys.double().reshape(-1, KV_HEADS, HEAD_DIM)[:ctx],
                          values.double().reshape(-1, KV_HEADS, HEAD_DIM)[:ctx], start=start, num_heads=HEADS,
                          num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, scale=SCALE, causal=True))
        row += n
    return torch.cat(out)


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("dtype,fused_rope", [(torch.bfloat16, False), (torch.bfloat16, True),
                                              (torch.int8, True), (torch.float8_e4m3fn, True)])
def test_paged_backend_mixed_batch_matches_float64_attention(dtype, fused_rope):
    gen = torch.Generator().manual_seed(3)
    cache = random_cache(gen, dtype)
    layout = random_layout(gen)
    tokens = sum(n for _, _, n in layout)
    q, k, v = (torch.randn(tokens, h * HEAD_DIM, generator=gen).to(torch.bfloat16) for h in (HEADS, KV_HEADS, KV_HEADS))
    positions = torch.cat([torch.arange(start, start + n) for _, start, n in layout])
    inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    backend = TritonPagedAttention(cache, "h100-bf16")
    backend.metadata = StepMetadata.build(layout, BLOCK)
    rope = dict(positions=positions, inv_freq=inv_freq) if fused_rope else {}
    out = backend.forward(0, q, k, v, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, scale=SCALE,
                          causal=True, **rope)
    # the new keys landed in their slots (rotated when the rotary is fused), as the CPU cache writes them
    k_stored = rope_ref(k.float(), positions, inv_freq, head_dim=HEAD_DIM)[0] if fused_rope else k.float()
    written = cache.read(0, backend.metadata.slot_mapping // BLOCK, torch.float32)[0]
    rows = torch.arange(tokens)
    got = written[rows, backend.metadata.slot_mapping % BLOCK].float().reshape(tokens, -1)
    step = cache.kv_scales[0][0].repeat(HEAD_DIM, 1).T.reshape(-1) if cache.quantized else 0.0
    assert (got - k_stored).abs().le(k_stored.abs() * STORE_ROUNDING[dtype] + step * 0.51 + 1e-6).all()
    ref = float64_reference(cache, layout, q, positions, inv_freq if fused_rope else None)
    assert out.dtype == q.dtype and out.shape == (tokens, HEADS * HEAD_DIM)
    assert relative_error(out, ref) <= OUTPUT_TOLERANCE


def test_no_cache_backend_is_causal_attention_over_the_forward():
    gen = torch.Generator().manual_seed(4)
    n = 11
    q, k, v = (torch.randn(n, h * HEAD_DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
    backend = TritonNoCacheAttention("h100-bf16", block_size=BLOCK)
    out = backend.forward(1, q, k, v, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, scale=SCALE,
                          causal=True)
    ref = attend(q.double(), k.double(), v.double(), start=0, num_heads=HEADS, num_kv_heads=KV_HEADS,
                 head_dim=HEAD_DIM, scale=SCALE, causal=True)
    assert relative_error(out, ref) <= 1e-5


# -- tiny-llama compiled for GPU targets, through the engine ------------------------------------
PREFIX = list(range(40, 60))                 # 20 tokens: a shared first block of 16
FIRST = [("long", PREFIX + list(range(100, 114)), 4), ("short", [7, 300, 21, 99, 5], 4), ("one", [77], 3)]
LATE = [("shared", PREFIX + list(range(200, 209)), 4)]    # arrives once the prefix block is cached


@pytest.fixture(scope="module")
def fp8_artifact(tmp_path_factory):
    """tiny-llama for h100-fp8 (fp8 weights and activations in GEMMs) with an fp8 KV cache, so the
    quantised cache runs end to end too; calibrated on little text."""
    path = tmp_path_factory.mktemp("fp8") / "tiny-h100-fp8.llmc"
    return llmc.compile("tiny-llama", target="h100-fp8", output=path, kv_cache="fp8", calib_samples=2,
                        calib_seq_len=32)


def run_engine(path) -> dict:
    """FIRST, then LATE after two steps, greedy, through the engine on the CPU with the debug check
    that every launched kernel is one its step records. Chunked prefill (16-token budget), a
    mid-sequence prefill chunk, decodes and a prefix-cache hit share steps."""
    engine = Engine(path, EngineConfig(kv_memory="1MiB", block_size=16, max_num_batched_tokens=24, max_num_seqs=8,
                                       device="cpu", check_kernels=True))
    done = {}
    for rid, prompt, n in FIRST:
        engine.add_request(rid, prompt_token_ids=prompt, params=SamplingParams(temperature=0.0, max_tokens=n,
                                                                               ignore_eos=True))
    for step in range(100):
        if step == 2:
            for rid, prompt, n in LATE:
                engine.add_request(rid, prompt_token_ids=prompt,
                                   params=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    return done


def reference_logits(art, ids: list[int]) -> torch.Tensor:
    """The artifact's own graph run by the reference interpreter on one sequence: logits [len, vocab].
    A quantised KV cache is left out (keys and values stay bf16), as the fp8 tolerance below assumes:
    the engine rotates keys in fp32 before storing fp8 codes, the reference in bf16, so the two
    roundings part on near-ties in a way unrelated to what this test checks."""
    graph = Graph.from_json(art.graph_json)
    for node in graph.nodes:
        if node.attrs.pop("kv_cache", None):
            node.inputs.pop()
    inputs = {"input_ids": torch.tensor(ids), "positions": torch.arange(len(ids))}
    if "logits_indices" in [v.name for v in graph.inputs]:
        inputs["logits_indices"] = torch.arange(len(ids))
    return interpret(graph, inputs, weights=art.weights)["logits"].float()


def reference_greedy(art, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(reference_logits(art, ids)[-1].argmax()))
    return ids[len(prompt):]


def test_bf16_engine_matches_reference_interpreter_greedy_tokens(bf16_artifact):
    done = run_engine(bf16_artifact)
    art = read_artifact(bf16_artifact)
    assert done["shared"].metrics.num_cached_tokens >= 16, "the late request should reuse the cached prefix block"
    for rid, prompt, n in FIRST + LATE:
        assert done[rid].outputs[0].token_ids == reference_greedy(art, prompt, n), rid


# fp8: the engine's GEMMs quantise activations in-kernel (and run bf16 elsewhere) where the reference
# fake-quantises in fp32, and its KV cache holds fp8 codes where the reference keeps bf16 keys, so
# tokens may part where the reference is nearly tied. Tolerance: on every
# sequence the engine produced, teacher-forced through the reference, at least 90% of its tokens are
# the reference's top-1 and none lies more than FP8_TIE_MARGIN logits below the reference's best; and
# the logits of one forward are within FP8_LOGIT_ERROR of the reference's (relative to their range).
FP8_TIE_MARGIN = 0.25
FP8_LOGIT_ERROR = 0.05


def test_fp8_engine_stays_within_fp8_tolerance_of_reference(fp8_artifact):
    done = run_engine(fp8_artifact)
    art = read_artifact(fp8_artifact)
    agree, total = 0, 0
    for rid, prompt, n in FIRST + LATE:
        out = done[rid].outputs[0].token_ids
        assert len(out) == n
        logits = reference_logits(art, prompt + out)[len(prompt) - 1:-1]     # the rows that chose `out`
        best = logits.max(dim=-1).values
        chosen = logits[torch.arange(n), torch.tensor(out)]
        assert (best - chosen).max() <= FP8_TIE_MARGIN, (rid, best - chosen)
        agree += int((chosen == best).sum())
        total += n
    assert agree >= 0.9 * total, f"{agree}/{total} tokens are the reference's top-1"


def test_fp8_one_shot_logits_within_tolerance(fp8_artifact):
    """executor.run with no backend: the Triton no-cache attention over a temporary paged cache."""
    from llmc.runtime.executor import PlanExecutor
    from llmc.runtime.kernel_check import verified_plan

    art = read_artifact(fp8_artifact)
    executor = PlanExecutor(verified_plan(art), art.weights, "cpu", check_kernels=True)
    ids = FIRST[0][1]
    ours = executor.run_values({"input_ids": torch.tensor(ids), "positions": torch.arange(len(ids)),
                                "logits_indices": torch.arange(len(ids))})["logits"].float()
    ref = reference_logits(art, ids)
    assert (ours - ref).abs().max() <= FP8_LOGIT_ERROR * (ref.max() - ref.min())


# -- the load-time kernel check ------------------------------------------------------------------
def copy_artifact(src, dst):
    shutil.copytree(src, dst)
    return dst


def rehash(path, name: str) -> None:
    """Update the manifest's sha256 of `name`, as a careful tamperer would."""
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][name] = sha256_file(path / name)
    (path / "manifest.json").write_text(json.dumps(manifest))


def first_kernel_file(path) -> str:
    return sorted(p.relative_to(path).as_posix() for p in (path / "kernels").glob("*.py"))[0]


def test_artifact_stores_every_recorded_kernel(bf16_artifact):
    from llmc.codegen.kernel_sources import kernel_file
    from llmc.runtime.kernel_check import recorded_kernels

    art = read_artifact(bf16_artifact)
    recorded = recorded_kernels(Engine(bf16_artifact, EngineConfig(device="cpu")).executor.plan)
    assert recorded and {kernel_file(r) for r, _ in recorded.values()} <= set(art.kernels)


def test_tampered_kernel_source_is_refused_even_with_its_manifest_hash_updated(bf16_artifact, tmp_path):
    path = copy_artifact(bf16_artifact, tmp_path / "tampered.llmc")
    name = first_kernel_file(path)
    (path / name).write_text((path / name).read_text() + "\nimport os  # injected\n")
    with pytest.raises(ArtifactError, match="fails its sha256 check"):
        Engine(path, EngineConfig(device="cpu"))
    rehash(path, name)
    with pytest.raises(ArtifactError, match=rf"{name}.*differs from the kernel the plan records.*recompile"):
        Engine(path, EngineConfig(device="cpu"))


def test_kernel_changed_in_installed_templates_is_refused(bf16_artifact, tmp_path, monkeypatch):
    import jinja2

    from llmc.codegen.triton import triton_render

    templates = tmp_path / "templates"
    shutil.copytree(triton_render.TEMPLATE_DIR, templates)
    changed = templates / "rms_norm.py.j2"
    changed.write_text(changed.read_text() + "\n# a later llmc's edit\n")
    monkeypatch.setattr(triton_render, "_ENV", jinja2.Environment(
        loader=jinja2.FileSystemLoader(templates), undefined=jinja2.StrictUndefined, trim_blocks=True,
        lstrip_blocks=True, keep_trailing_newline=True, autoescape=False))
    with pytest.raises(ArtifactError, match=r"kernel rms_norm.*renders differently.*recompile the model"):
        Engine(bf16_artifact, EngineConfig(device="cpu"))


def test_debug_check_fails_a_step_that_launches_an_unrecorded_kernel(bf16_artifact):
    from llmc.runtime.executor import PlanExecutor
    from llmc.runtime.kernel_check import verified_plan

    art = read_artifact(bf16_artifact)
    plan = verified_plan(art)
    step = next(s for s in plan.steps if s.kernel == "triton.swiglu")
    step.attrs["kernels"] = []
    executor = PlanExecutor(plan, art.weights, "cpu", check_kernels=True)
    with pytest.raises(AssertionError, match=rf"{step.node}.*launched kernel swiglu.*does not record"):
        executor.run_values({"input_ids": torch.tensor([5, 6, 7]), "positions": torch.arange(3),
                             "logits_indices": torch.tensor([2])})


# -- the "triton.<op>" kernel registry -----------------------------------------------------------
def op_case(op: str, gen: torch.Generator) -> tuple[list, dict]:
    """Fresh random (inputs, attrs) of one op at a small ragged shape: 7 tokens, bf16 activations."""
    from llmc.compiler.quant import pack_int4, quantize_fp8, quantize_int4, quantize_int8

    def bf16(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)
    x, w = bf16(7, 64), torch.randn(48, 64, generator=gen) / 8
    norm = (1 + 0.1 * torch.randn(64, generator=gen)).to(torch.bfloat16)
    rope = [torch.arange(3, 10), 1.0 / 10000 ** (torch.arange(0, 16, 2) / 16)]
    linear = dict(in_features=64, out_features=48, group_size=32, has_zeros=False, has_act_scale=False,
                  has_bias=False)
    codes, s4, z4 = quantize_int4(w, 32)
    cases = {
        "rms_norm": ([x, norm], dict(eps=1e-5)),
        "add_rms_norm": ([x, bf16(7, 64), norm], dict(eps=1e-5)),
        "swiglu": ([bf16(7, 96)], {}),
        "rope": ([bf16(7, 64), *rope], dict(head_dim=16, scaling=1.0)),
        "qlinear-int8": ([x, *quantize_int8(w)], dict(linear, scheme="int8")),
        "qlinear-int4": ([x, pack_int4(codes), s4, z4], dict(linear, scheme="int4", has_zeros=True)),
        "qlinear-fp8": ([x, *quantize_fp8(w), torch.tensor([0.01])], dict(linear, scheme="fp8", has_act_scale=True)),
        "qlinear-w8a8": ([x, *quantize_int8(w), bf16(48)], dict(linear, scheme="w8a8", has_bias=True)),
    }
    return cases[op]


@pytest.mark.parametrize("case", ["rms_norm", "add_rms_norm", "swiglu", "rope", "qlinear-int8", "qlinear-int4",
                                  "qlinear-fp8", "qlinear-w8a8"])
def test_triton_kernels_give_the_reference_results(case):
    from llmc.codegen.triton.triton_kernels import resolve_kernel
    from llmc.compiler.ops import OPS

    op = case.split("-")[0]
    inputs, attrs = op_case(case, torch.Generator().manual_seed(5))
    ours = resolve_kernel(f"triton.{op}")(*inputs, **attrs, target="h100-bf16")
    # the reference on fp32 copies: the kernels compute in fp32 and round once to bf16
    ref = OPS[op].reference(*[t.float() if t.is_floating_point() and t.dtype != torch.float8_e4m3fn else t
                              for t in inputs], **attrs)
    assert len(ours) == len(ref)
    for o, r in zip(ours, ref):
        assert o.dtype == inputs[0].dtype and o.shape == r.shape
        # two bf16 ulps: one for the output's rounding, one for the reference's own (rms_norm
        # rounds its normalised value before the weight)
        assert relative_error(o, r.double()) <= 2 ** -6, case


def test_torch_ops_of_triton_plans_reuse_the_cpu_kernels():
    from llmc.codegen.torch_cpu.cpu_kernels import CPU_KERNELS
    from llmc.codegen.triton.triton_kernels import TORCH_OPS, resolve_kernel

    for op in TORCH_OPS:
        assert resolve_kernel(f"triton.{op}") is CPU_KERNELS[f"cpu.{op}"]
    with pytest.raises(ArtifactError, match="triton.conv2d.*recompile"):
        resolve_kernel("triton.conv2d")


def test_interpreted_steps_show_progress_once(bf16_artifact, monkeypatch, capfd):
    """A GPU artifact on the CPU runs its Triton kernels through the interpreter, minutes a step on a
    long prompt: the first step that runs past the stage delay says so on stderr (once, not per step)."""
    monkeypatch.setenv("LLMC_STAGE_DELAY", "0")
    engine = Engine(bf16_artifact, EngineConfig(kv_memory="1MiB", block_size=16, device="cpu"))
    capfd.readouterr()
    engine.add_request("a", prompt_token_ids=[5, 6, 7, 8], params=SamplingParams(temperature=0.0, max_tokens=3,
                                                                                  ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    err = capfd.readouterr().err
    assert err.count("through Triton's interpreter") == 1, err
