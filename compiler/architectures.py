"""The decoder architectures llmc compiles, what each is checked for and by which tests, and the ones it
refuses with the piece it lacks: the single source of the README's architecture table
(bench/arch_table.py prints it; tests/compiler/test_arch_table.py checks the README holds exactly
that, that every supported key has a tiny model in tests/tiny_hf_models.py, and that each test file
named here covers it)."""

from __future__ import annotations

from dataclasses import dataclass

from llmc.compiler.schemes import SCHEMES

# The passes tests/compiler/test_arch_passes.py runs on every architecture.
PASSES = ("int8", "int4", "fp8", "w8a8", "fuse", "cast_bf16", "kv_heads", "prune")
QUANT = ("int8", "int4", "fp8", "w8a8")
ONE_KV = "one KV head"


@dataclass(frozen=True)
class Arch:
    key: str                  # the tiny model's key in tests/tiny_hf_models.ARCHS
    name: str
    raised: str               # what lowering raises beyond Llama's embedding/rms_norm/linear/rope/attention/SwiGLU
    tests: tuple[str, ...]    # the test files that check it against HF (under tests/)
    gpu: str = ""             # how a GPU target (through the Triton interpreter) is checked, or why refused
    refused_passes: tuple[tuple[str, str, str], ...] = ()   # (pass, the start of its one-line refusal, why)


SUPPORTED = (
    Arch("llama", "Llama", "", ("compiler/test_arch_rotary.py",),
         gpu="tiny-llama, h100-bf16 and h100-fp8 (`tests/runtime/test_triton_runtime.py`)"),
    Arch("mistral", "Mistral", "sliding window", ("runtime/test_sliding_window.py",),
         gpu="greedy tokens past the window, h100-bf16 (`tests/compiler/test_arch_gpu_target.py`)"),
    Arch("qwen2", "Qwen2", "q/k/v biases, per-layer sliding window",
         ("compiler/test_arch_rotary.py", "runtime/test_sliding_window.py")),
    Arch("qwen3", "Qwen3", "`qk_norm`", ("compiler/test_arch_rotary.py",),
         gpu="greedy tokens, h100-bf16 (`tests/compiler/test_arch_gpu_target.py`)"),
    Arch("gemma", "Gemma", "`gelu` (tanh), (1 + w) RMSNorm, scaled embeddings", ("compiler/test_arch_rotary.py",),
         refused_passes=(("prune", "prune_heads: fraction 0.5 of 1 KV groups per layer rounds to none", ONE_KV),)),
    Arch("gemma2", "Gemma 2", "attention `softcap`, alternating windows, logit soft-capping",
         ("compiler/test_arch_gemma2.py",),
         gpu="refused: the Triton attention kernels do not soft-cap (`tests/compiler/test_arch_gemma2.py`)"),
    Arch("phi3", "Phi-3", "fused qkv and gate_up projections split by columns", ("compiler/test_arch_rotary.py",)),
    Arch("gpt_neox", "GPT-NeoX / Pythia", "`partial_rope`, `layer_norm`, `gelu`, parallel residual",
         ("compiler/test_arch_rotary.py",), gpu="greedy tokens, h100-bf16 (`tests/compiler/test_arch_gpu_target.py`)"),
    Arch("gpt2", "GPT-2", "Conv1D linears, learned positions, `layer_norm`, `gelu`",
         ("compiler/test_arch_layer_norm.py",),
         refused_passes=(("prune", "prune_ffn: found no MLP", "no gated MLP"),)),
    Arch("opt", "OPT", "`layer_norm`, ReLU, position offset", ("compiler/test_arch_layer_norm.py",),
         refused_passes=(("prune", "prune_heads: attention node attention_0's q input comes from aten node",
                          "q is scaled before attention"),)),
    Arch("falcon", "Falcon", "multi-query fused qkv, parallel attention and MLP", ("compiler/test_arch_layer_norm.py",),
         refused_passes=(("prune", "prune_heads: fraction 0.5 of 1 KV groups per layer rounds to none", ONE_KV),)),
    Arch("starcoder2", "StarCoder2", "`layer_norm`, `gelu`, biases", ("compiler/test_arch_rotary.py",)),
    Arch("olmo", "OLMo", "`layer_norm` without gain", ("compiler/test_arch_rotary.py",)),
    Arch("mixtral", "Mixtral", "`moe` (top-k router, SwiGLU experts; sparse on the CPU)",
         ("compiler/test_arch_moe.py", "compiler/test_arch_moe_quant.py"),
         gpu="greedy tokens, fp32 h100 (`tests/compiler/test_arch_moe.py`)",
         refused_passes=tuple((q, "node moe_0 (moe): this weight format covers linears",
                               "experts are stored by int8/int4 only") for q in QUANT if not SCHEMES[q].qmoe)
         + (("prune", "prune_ffn: found no MLP", "no dense MLP"),)),
)


@dataclass(frozen=True)
class Refused:
    name: str
    missing: str
    test: str


REFUSED = (
    Refused("OLMoE and other non-Mixtral MoE blocks", "their experts run transformers' `grouped_mm` op; the `moe` op "
            "covers Mixtral's block only", "compiler/test_arch_moe.py"),
    Refused("Falcon with `alibi=True`", "ALiBi position bias on attention scores", "compiler/test_arch_refusals.py"),
    Refused("RoPE scaling `dynamic`", "rotary tables that change with the sequence length",
            "compiler/test_arch_refusals.py"),
    Refused("`use_bidirectional_attention=True`", "non-causal attention in a decoder",
            "compiler/test_arch_refusals.py"),
)


def passes_cell(arch: Arch) -> str:
    """"all", or "all but" the refused passes grouped by why."""
    if not arch.refused_passes:
        return "all"
    reasons: dict[str, list[str]] = {}
    for case, _, why in arch.refused_passes:
        reasons.setdefault(why, []).append(case)
    return "all but " + "; ".join(f"{', '.join(cases)} ({why})" for why, cases in reasons.items())


def markdown_table() -> str:
    """The README's architecture table (supported, then refused), one row each."""
    rows = ["| architecture | lowering raises | tests (HF logits at every position of a 40-token prompt + 24 paged "
            "decode steps to 1e-4; greedy tokens) | passes that work (of int8, int4, fp8, w8a8, fuse, cast_bf16, "
            "kv_heads, prune; the rest refuse in one line) | GPU target (Triton interpreter) |",
            "|---|---|---|---|---|"]
    for a in SUPPORTED:
        tests = ", ".join(f"`tests/{t}`" for t in a.tests)
        rows.append(f"| {a.name} | {a.raised or 'the Llama ops'} | {tests} | {passes_cell(a)} | {a.gpu or 'not run'} |")
    rows += ["", "| refused | missing piece | test |", "|---|---|---|"]
    rows += [f"| {r.name} | {r.missing} | `tests/{r.test}` |" for r in REFUSED]
    return "\n".join(rows)
