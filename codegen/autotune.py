"""`llmc compile --autotune`: on a CUDA GPU, time each Triton kernel family's candidate launch configs
(codegen/triton/triton_configs.py) on the shapes the graph launches and keep the fastest per family; the
plan renders its kernels with the winners and records every timing in plan.meta["autotune"].
Without a GPU nothing is timed: the plan records the target's defaults and says why.

Families: "gemm" (quantised GEMMs: dequant_gemm, w8a8_gemm) and "attention" (paged prefill and
decode). The row kernels (RMSNorm, SwiGLU, rotary) render from the target alone, so they are
recorded with their defaults."""

from __future__ import annotations

import statistics
from typing import Callable, NamedTuple

import torch

from llmc.codegen.kernel_select import KV_BLOCK_SIZE
from llmc.codegen.triton.triton_attention import paged_decode_attention, paged_prefill_attention
from llmc.codegen.triton.triton_configs import (
    attention_candidates,
    attention_config,
    gemm_candidates,
    row_config,
    tile_config,
)
from llmc.codegen.triton.triton_gemm import dequant_gemm, w8a8_gemm
from llmc.compiler.ir import Graph, Node
from llmc.compiler.ops import ATTENTION_OPS, TORCH_DTYPES, qlinear_inputs
from llmc.compiler.schemes import INT8_PER_TOKEN, SCHEMES

TUNE_TOKENS = 256        # GEMM rows and prefill tokens each candidate is timed at
DECODE_BATCH = 16        # decode sequences, each with DECODE_CONTEXT keys
DECODE_CONTEXT = 1024
REPEATS = 10
NO_GPU = "autotuning needs a CUDA GPU and none is present"


class Case(NamedTuple):
    """One distinct shape of a family the graph launches, and how many steps launch it."""
    key: tuple
    node: Node
    in_dtypes: tuple
    count: int


def default_configs(target: str) -> dict:
    return {"gemm": tile_config(target), "attention": attention_config(target), "row": row_config(target)}


def record(configs: dict, tuned: bool, reason: str | None = None, **extra) -> dict:
    out = {"tuned": tuned, "configs": {family: c.to_dict() for family, c in sorted(configs.items())}, **extra}
    if reason is not None:
        out["reason"] = reason
    return out


def autotune(graph: Graph, target: str, requested: bool, echo: Callable[[str], None]) -> tuple[dict, dict]:
    """(config overrides for build_plan, plan.meta["autotune"]) for a GPU target's graph."""
    defaults = default_configs(target)
    if not requested:
        return {}, record(defaults, False, "not requested (compile with --autotune on a machine with a CUDA GPU)")
    if not torch.cuda.is_available():
        echo(f"llmc: {NO_GPU}; the plan records the target's default launch configs")
        return {}, record(defaults, False, NO_GPU)
    chosen, timings = {}, {}
    for family, (cases_of, candidates, prepare, launch) in FAMILIES.items():
        cases = cases_of(graph)
        if cases:
            operands = [prepare(case, "cuda") for case in cases]
            chosen[family], timings[family] = tune_family(cases, operands, candidates(target), launch, time_on_gpu)
    configs = {**defaults, **chosen}
    return chosen, record(configs, True, device=torch.cuda.get_device_name(), timings_ms=timings,
                          tokens=TUNE_TOKENS, decode=[DECODE_BATCH, DECODE_CONTEXT])


def tune_family(cases: list[Case], operands: list[dict], candidates: list, launch, timer) -> tuple[object, list[dict]]:
    """The candidate with the least total time of launch(case, operands, config) over the cases
    (each weighted by how many steps launch it), and each candidate's figures; a candidate that
    fails to compile or launch is out."""
    rows, best, best_ms = [], candidates[0], None
    for config in candidates:
        try:
            total = sum(case.count * timer(lambda c=case, o=ops: launch(c, o, config))
                        for case, ops in zip(cases, operands))
        except Exception as e:  # e.g. a tile the GPU's shared memory cannot hold: not a winner
            rows.append({"config": config.to_dict(), "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        rows.append({"config": config.to_dict(), "ms": round(total, 4)})
        if best_ms is None or total < best_ms:
            best, best_ms = config, total
    return best, rows


def time_on_gpu(fn: Callable[[], object]) -> float:
    """Median milliseconds of `fn` over REPEATS launches after one warm-up (which compiles)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def distinct_cases(graph: Graph, ops: tuple[str, ...], key: Callable[[Node, list], tuple]) -> list[Case]:
    types = graph.types()
    found: dict[tuple, Case] = {}
    for node in graph.nodes:
        if node.op in ops:
            dtypes = tuple(types[i].dtype for i in node.inputs)
            k = key(node, dtypes)
            prev = found.get(k)
            found[k] = Case(k, node, dtypes, 1) if prev is None else prev._replace(count=prev.count + 1)
    return list(found.values())


# -- gemm: qlinear steps --------------------------------------------------------------------------
def gemm_cases(graph: Graph) -> list[Case]:
    def key(node, dtypes):
        a = node.attrs
        return (a["scheme"], a["in_features"], a["out_features"], a.get("group_size"), dtypes)
    return distinct_cases(graph, ("qlinear",), key)


def qlinear_operands(case: Case, tokens: int, device: str, generator: torch.Generator) -> dict:
    """Random operands of the case's qlinear, laid out as docs/quantization.md stores them."""
    a = case.node.attrs
    scheme, k, n = a["scheme"], a["in_features"], a["out_features"]
    ins = qlinear_inputs(list(case.in_dtypes), a)

    def rand(*shape, dtype=torch.float32):
        return torch.rand(*shape, generator=generator).to(device=device, dtype=dtype)
    x = (rand(tokens, k) * 2 - 1).to(TORCH_DTYPES[ins.x])
    row = SCHEMES[scheme]
    if row.zeros_required:
        qweight = torch.randint(0, 256, (n, k // 2), generator=generator, dtype=torch.uint8).to(device)
        groups = k // a["group_size"]
        scales, zeros = rand(n, groups) * 0.02 + 1e-3, torch.full((n, groups), 8.0, device=device)
    elif row.gguf:  # GGUF blocks kept: codes, scales and optional minimums per group
        shape, dtype = (n, k // row.codes_per_element), getattr(torch, row.code_dtype)
        qweight = torch.randint(0, 16, shape, generator=generator, dtype=dtype).to(device)
        groups = k // a["group_size"]
        scales, zeros = rand(n, groups) * 0.02 + 1e-3, (rand(n, groups) - 0.5 if ins.zeros is not None else None)
    else:
        codes = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
        qweight = (codes if scheme != "fp8" else (codes.float() / 32).to(torch.float8_e4m3fn)).to(device)
        scales, zeros = rand(n) * 0.02 + 1e-3, None
    act_scale = rand(1) + 0.5 if ins.act_scale is not None else None
    bias = rand(n).to(TORCH_DTYPES[ins.bias]) if ins.bias is not None else None
    return dict(x=x, qweight=qweight, scales=scales, zeros=zeros, act_scale=act_scale, bias=bias)


def prepare_gemm(case: Case, device: str, tokens: int = TUNE_TOKENS) -> dict:
    return qlinear_operands(case, tokens, device, torch.Generator().manual_seed(0))


def launch_gemm(case: Case, o: dict, config) -> torch.Tensor:
    scheme = case.node.attrs["scheme"]
    if SCHEMES[scheme].activations == INT8_PER_TOKEN:
        return w8a8_gemm(o["x"], o["qweight"], o["scales"], bias=o["bias"], config=config)
    return dequant_gemm(o["x"], o["qweight"], o["scales"], o["zeros"], scheme=scheme,
                        group_size=case.node.attrs.get("group_size") if SCHEMES[scheme].grouped else None,
                        act_scale=o["act_scale"], bias=o["bias"], config=config)


# -- attention: paged prefill and decode ----------------------------------------------------------
def attention_cases(graph: Graph) -> list[Case]:
    def key(node, dtypes):
        a = node.attrs
        return (a["num_heads"], a["num_kv_heads"], a["head_dim"], a.get("window") is not None,
                a.get("rope") is not None, dtypes[:2])
    return distinct_cases(graph, ATTENTION_OPS, key)


def prepare_attention(case: Case, device: str, tokens: int = TUNE_TOKENS, batch: int = DECODE_BATCH,
                      context: int = DECODE_CONTEXT) -> dict:
    """Operands of one prefill of `tokens` tokens (one sequence) and one decode step of `batch`
    sequences of `context` keys, over random caches in the activations' dtype."""
    a = case.node.attrs
    heads, kv_heads, hd = a["num_heads"], a["num_kv_heads"], a["head_dim"]
    dtype = TORCH_DTYPES[case.in_dtypes[0]]
    generator = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-max(tokens, context) // KV_BLOCK_SIZE)
    num_blocks = blocks_per_seq * batch

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)
    k_cache, v_cache = randn(num_blocks, KV_BLOCK_SIZE, kv_heads, hd), randn(num_blocks, KV_BLOCK_SIZE, kv_heads, hd)
    tables = torch.arange(num_blocks, dtype=torch.int32, device=device).reshape(batch, blocks_per_seq)
    as_int = dict(dtype=torch.int32, device=device)
    rope = {}
    if a.get("rope") is not None:
        inv_freq = (1.0 / 10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)).to(device)
        rope = dict(inv_freq=inv_freq, rope_scaling=float(a["rope"]["scaling"]))
    return dict(k_cache=k_cache, v_cache=v_cache, tables=tables, rope=rope, tokens=tokens,
                prefill_q=randn(tokens, heads * hd), cu_seqlens=torch.tensor([0, tokens], **as_int),
                context_starts=torch.zeros(1, **as_int), prefill_positions=torch.arange(tokens, device=device),
                decode_q=randn(batch, heads * hd), context_lens=torch.full((batch,), context, **as_int),
                decode_positions=torch.full((batch,), context - 1, device=device))


def launch_attention(case: Case, o: dict, config) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill and the decode step of prepare_attention's operands with `config`."""
    a = case.node.attrs
    shape = dict(num_heads=a["num_heads"], num_kv_heads=a["num_kv_heads"], head_dim=a["head_dim"], scale=a["scale"],
                 window=a.get("window"), config=config)
    rope = o["rope"]
    prefill = paged_prefill_attention(
        o["prefill_q"], o["k_cache"], o["v_cache"], o["tables"][:1], o["cu_seqlens"], o["context_starts"],
        causal=a.get("causal", True), max_seqlen_q=o["tokens"],
        **({"positions": o["prefill_positions"], **rope} if rope else {}), **shape)
    decode = paged_decode_attention(
        o["decode_q"], o["k_cache"], o["v_cache"], o["tables"], o["context_lens"],
        **({"positions": o["decode_positions"], **rope} if rope else {}), **shape)
    return prefill, decode


# family -> (cases of a graph, candidate configs of a target, prepare(case, device), launch(case, operands, config))
FAMILIES = {"gemm": (gemm_cases, gemm_candidates, prepare_gemm, launch_gemm),
            "attention": (attention_cases, attention_candidates, prepare_attention, launch_attention)}

__all__ = ["autotune", "tune_family", "default_configs", "FAMILIES", "NO_GPU", "Case", "gemm_cases",
           "attention_cases", "prepare_gemm", "launch_gemm", "prepare_attention", "launch_attention"]
