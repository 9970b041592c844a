"""The compile driver: model source -> trace -> lower -> target pipeline -> plan -> artifact.
The output path is checked before any work; each stage is timed into the compile report, which
is printed (and written with --report), never stored in the artifact."""

from __future__ import annotations

import contextlib
import platform
import time
from pathlib import Path
from typing import Callable

import psutil
import torch
from transformers.utils import logging as hf_logging

import llmc
from llmc.codegen import autotune as triton_autotune  # through the module: tests fake autotune
from llmc.codegen.kernel_sources import kernel_sources
from llmc.codegen.native import cpu_native
from llmc.codegen.ort.ort_lowering import DEFAULT_MODE, check_kernels_option
from llmc.codegen.plan import build_plan
from llmc.compiler import recipes
from llmc.compiler.artifact import RankFiles, staged_output, write_contents
from llmc.compiler.calibration import calibration_sequences, calibration_source
from llmc.compiler.compile_report import check_report_path, peak_rss_bytes, process_age, timing_line, write_report
from llmc.compiler.draft import draft_options, read_draft_target
from llmc.compiler.driver.tuning.kernel_choice import lower_plans
from llmc.compiler.driver.tuning.ort_accuracy import CalibrationReference
from llmc.compiler.driver.tuning.ort_plan_choice import whole_step_refusal
from llmc.compiler.frontends import load_model
from llmc.compiler.frontends.gguf import one_thread
from llmc.compiler.ir import Graph, Node
from llmc.compiler.layer_stamp import traced_graph
from llmc.compiler.ops import ATTENTION_OPS, DTYPE_NAMES
from llmc.compiler.options import CompileOptions
from llmc.compiler.parallel_build import (
    hf_config_dict,
    parallel_section,
    run_passes,
    shard_record,
    weight_bytes_by_dtype,
    whole_model_meta,
)
from llmc.compiler.progress import Stages
from llmc.compiler.recipes import (
    added_passes,
    kv_cache_passes,
    kv_heads_passes,
    prune_passes,
    quant_passes,
    shard_passes,
)
from llmc.compiler.schemes import kv_cache_head_bytes, kv_format
from llmc.compiler.targets import Target, get_target
from llmc.errors import PassError
from llmc.passes.base import Pass, PassContext, PassManager, Stage, echo_stderr
from llmc.passes.lowering import LOWERING
from llmc.passes.quantize_kv import SCALE_PARAMS
from llmc.passes.registry import PassConfig, apply_options, drop_disabled, parse_pass_list, schedule
from llmc.runtime.kv_policy import kv_policy


def model_meta(config, graph: Graph, module: torch.nn.Module) -> dict:
    """Facts the runtime needs without the HF config: shapes of the KV cache, special tokens."""
    text = getattr(config, "text_config", config)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    attns = [n for n in graph.nodes if n.op in ATTENTION_OPS]
    # passes may change these (convert_kv_heads, head and layer pruning): the graph says what they are now
    layers, heads, kv_heads, head_dim = attention_shape(attns) or (text.num_hidden_layers, heads, kv_heads, head_dim)
    eos = text.eos_token_id if getattr(text, "eos_token_id", None) is not None else []
    # the cache holds keys in the dtype attention reads them (bf16 on GPU targets, whose logits stay fp32)
    dtype = graph.type_of(attns[0].inputs[1] if attns else graph.outputs[0]).dtype
    kv_cache = kv_cache_meta(attns, head_dim) or {"dtype": dtype, "scales": None}
    return {
        "architecture": (getattr(config, "architectures", None) or [type(module).__name__])[0],
        "num_layers": layers, "num_heads": heads, "num_kv_heads": kv_heads,
        "head_dim": head_dim, "hidden_size": text.hidden_size, "vocab_size": text.vocab_size,
        "max_position_embeddings": text.max_position_embeddings,
        "eos_token_ids": eos if isinstance(eos, list) else [eos],
        "bos_token_id": getattr(text, "bos_token_id", None),
        "kv_dtype": kv_cache["dtype"], "kv_cache": kv_cache,
        # static per-head scales are per layer, not per token: such a cache costs its codes alone (an
        # int4 cache's per-token scales count)
        "kv_bytes_per_token": 2 * layers * kv_heads * kv_cache_head_bytes(kv_cache, head_dim),
        # the whole HF config, so tools (the HF bench baseline) can rebuild the reference model
        "hf_config": hf_config_dict(config, kv_heads),
    }


def kv_cache_meta(attns: list[Node], head_dim: int) -> dict | None:
    """The quantised KV cache the attention nodes read (quantize_kv_cache sets each node's
    `kv_cache` dtype and scales input), for the runtime to allocate; None when it is unquantised.
    Every layer must agree, and its scales must be the param the runtime looks up by layer. An int4
    cache is uint8 rows of packed codes and their dynamic scales, in groups of `group_size` channels."""
    dtypes = {n.attrs.get("kv_cache") for n in attns}
    if dtypes == {None}:
        return None
    if len(dtypes) == 1 and None not in dtypes and not kv_format(next(iter(dtypes))).static:
        fmt = kv_format(dtypes.pop())
        return {"dtype": DTYPE_NAMES[fmt.torch_dtype], "format": fmt.name, "scales": "dynamic",
                "group_size": fmt.group_size(head_dim)}
    stray = [n.name for n in attns if n.inputs[-1] != SCALE_PARAMS.format(layer=n.attrs["layer"])]
    if len(dtypes) > 1 or stray:
        raise PassError(f"attention nodes disagree on the KV cache (dtypes {sorted(map(str, dtypes))}, "
                        f"scales not named {SCALE_PARAMS!r}: {stray[:3]}); quantise it with one "
                        f"quantize_kv_cache pass over every layer")
    return {"dtype": dtypes.pop(), "scales": "static", "scale_params": SCALE_PARAMS}


def attention_shape(attns: list[Node]) -> tuple[int, int, int, int] | None:
    """(layers, query heads, KV heads, head_dim) of a graph's attention nodes; None without any.
    The plan's kv_layout() refuses layers that differ and pruning cuts the same heads in every
    layer, so the first one speaks for all."""
    if not attns:
        return None
    first = attns[0].attrs
    return len(attns), first["num_heads"], first["num_kv_heads"], first["head_dim"]


def total_weight_bytes(graphs: list[Graph]) -> dict[str, int]:
    """Weight bytes by dtype over every rank's weights file."""
    out: dict[str, int] = {}
    for g in graphs:
        for dtype, n in weight_bytes_by_dtype(g).items():
            out[dtype] = out.get(dtype, 0) + n
    return dict(sorted(out.items()))


def set_model_meta(graphs: list[Graph], records: list, loaded) -> dict:
    """Give each rank's graph its meta and return the manifest's `model` facts: the graph's own,
    or for a sharded model the whole model's (each rank's graph keeps its own heads and KV bytes)."""
    for g in graphs:
        g.meta = model_meta(loaded.config, g, loaded.module)
    if len(graphs) == 1:
        return graphs[0].meta
    model = whole_model_meta(graphs[0].meta, shard_record(records), loaded.config)
    for g in graphs:
        g.meta["hf_config"] = model["hf_config"]
    return model


def rank_plan(graph: Graph, tgt: Target, opts: CompileOptions, echo):
    overrides, tuning = launch_configs(graph, tgt, opts, echo or echo_stderr)
    plan = build_plan(graph, tgt.name, opts.max_num_batched_tokens, overrides)
    if tuning is not None:
        plan.meta["autotune"] = tuning
    plan.meta["batch_invariant"] = opts.batch_invariant == "on"   # the runtime's default mode (--batch-invariant)
    if tgt.device == "cpu":   # how the native 4-bit GEMVs round activations (llmc.load may override it)
        plan.meta["q4_activations"] = opts.q4_activations
    policy = kv_policy(opts.kv_policy, opts.kv_budget, opts.kv_recent, opts.kv_sinks)
    if policy is not None:   # the runtime's default KV policy (runtime/kv_policy.py); llmc.load may override it
        plan.meta["kv_policy"] = policy.as_meta()
    return plan


def trace(module: torch.nn.Module, max_tokens: int, log: Callable[[str, float, dict], None]) -> Graph:
    """The model as a graph of aten nodes (torch.export, then translated into the IR)."""
    t = time.perf_counter()
    graph, copied = traced_graph(module, max(max_tokens, 16))
    log("trace", time.perf_counter() - t, {"aten_nodes": len(graph.nodes), "layers_copied": copied})
    return graph


def lowering_configs() -> list[PassConfig]:
    return [PassConfig.of(name, Stage.LOWER, origin="lowering") for name in LOWERING]


def trace_and_lower(module: torch.nn.Module, max_tokens: int, log: Callable[[str, float, dict], None]) -> Graph:
    """The model traced and lowered to LLM ops (the lowering stage alone, for tools and tests)."""
    graph = trace(module, max_tokens, log)
    configs = lowering_configs()
    PassManager([c.instantiate() for c in configs], PassContext(quiet=True), [c.stage for c in configs]).run(graph)
    return graph


def pass_configs(tgt: Target, opts: CompileOptions, source_quantised: bool = False) -> list[PassConfig]:
    """The whole pipeline: lowering, then --passes (in the user's order) or the target's
    pipeline, with the passes the compile flags ask for (--prune/--sparsity, --kv-heads, --quant
    or the default quantisation: a quantised source's own, else the target's; --kv-cache,
    --add-pass) placed by their stage."""
    explicit = opts.passes is not None
    base = (parse_pass_list(e for e in opts.passes.split(",") if e.strip()) if explicit
            else target_configs(tgt))
    quant = opts.quant or recipes.default_quant(explicit, source_quantised, tgt.default_quant)
    kv_cache = opts.kv_cache or (None if explicit else tgt.default_kv_cache)
    added = (prune_passes(opts.prune, opts.sparsity, opts.sparsity_method)
             + kv_heads_passes(opts.kv_heads, opts.kv_grouping)
             + quant_passes(quant, opts.group_size) + shard_passes(opts.tp, opts.pp, opts.pp_split)
             + kv_cache_passes(kv_cache, tgt.device)
             + added_passes(opts.add))
    configs = schedule(lowering_configs() + base, added)
    return apply_options(drop_disabled(configs, opts.disable), opts.pass_options)


def target_configs(tgt: Target) -> list[PassConfig]:
    """The target's default pipeline as typed pass configurations, in stage order."""
    configs = parse_pass_list(tgt.default_pipeline, origin=f"target {tgt.name}")
    assert [c.stage for c in configs] == sorted(c.stage for c in configs), tgt.name
    return configs


def full_pipeline(tgt: Target) -> list[str]:
    """The passes a compile for `tgt` without pipeline flags runs after lowering, as name:key=value
    specs: the default pipeline with the default_quant and default_kv_cache passes placed."""
    return [c.spec() for c in pass_configs(tgt, CompileOptions()) if c.origin != "lowering"]


def describe_target(tgt: Target) -> str:
    """The target's line in `llmc targets`: its facts, its recipe, whether it is ready."""
    ready = "ready" if tgt.compile_ready else "not ready yet"
    return f"{tgt.facts()}; {recipes.target_recipe(tgt)}; {ready}"


@contextlib.contextmanager
def transformers_bars(enabled: bool):
    """transformers' own progress bars ("Loading weights") on or off while a model loads."""
    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def instantiate(configs: list[PassConfig]) -> list[Pass]:
    return [c.instantiate() for c in configs]


def measures_kernels(mode: str | None, tgt: Target) -> bool:
    """Whether the plan stage times kernels on the weights (--kernels auto on a CPU target)."""
    return tgt.device == "cpu" and (mode or DEFAULT_MODE) == "auto"


def runs_model(pipeline: list) -> bool:
    """Whether a pass runs the source model (calibration samples from it and measures it)."""
    return any("calibration" in p.needs for p in pipeline)


def materialise(loaded, pipeline: list, log) -> None:
    """Read the whole source model into memory so that it can sample its own calibration text,
    where it fits. (With --calib FILE the passes stream: calibration runs layer by layer.)"""
    need, limit = loaded.weight_bytes, whole_model_limit()
    names = ", ".join(p.name for p in pipeline if "calibration" in p.needs)
    if need > limit:
        raise PassError(f"{names} calibrate on text the model samples itself, which needs the whole model "
                        f"in float32 ({need / 2**30:.1f} GiB), over the {limit / 2**30:.1f} GiB this compile "
                        f"may hold (half this machine's memory); pass --calib FILE (a text file) to "
                        f"calibrate layer by layer, or keep the source's quantisation (--quant gguf)")
    t = time.perf_counter()
    loaded.materialise()
    log("materialise", time.perf_counter() - t, {"bytes": need, "for": names})


def whole_model_limit() -> int:
    return psutil.virtual_memory().total // 2


def attach_lazy_weights(graph: Graph, loaded) -> None:
    """The traced graph's params read from the source when their values are needed, not from the
    module's placeholders; a param left on a placeholder is refused (its values were never read)."""
    placeholders = {loaded.module.get_parameter(name).data_ptr(): name for name in loaded.lazy_weights}
    for name in list(graph.weights):
        if name in loaded.lazy_weights:
            graph.weights[name] = loaded.lazy_weights[name]
        elif graph.weights.is_lazy(name):
            continue
        elif graph.weights[name].numel() and graph.weights[name].data_ptr() in placeholders:
            raise RuntimeError(f"param {name!r} of the traced graph holds the unread placeholder of source "
                            f"weight {placeholders[graph.weights[name].data_ptr()]!r}; this is a bug in llmc")


def calibrate(loaded, pipeline: list, opts: CompileOptions, log) -> list[torch.Tensor] | None:
    """Calibration sequences, made only when a lossy (or otherwise calibrated) pass will use
    them (so lossless compiles stay fast and never sample from the model)."""
    if not runs_model(pipeline):
        return None
    t = time.perf_counter()
    seqs = calibration_sequences(loaded, opts.calib, opts.calib_samples, opts.calib_seq_len, opts.calib_seed)
    log("calibrate", time.perf_counter() - t, {"source": calibration_source(opts.calib, opts.calib_seed),
                                                "sequences": len(seqs), "tokens": sum(len(s) for s in seqs)})
    return seqs


def pass_threads(calibration: list[torch.Tensor] | None):
    """Without calibration data no pass runs the model: the passes only slice, pack and compare
    weights, memory-bound work that one thread does faster than several (see one_thread)."""
    return one_thread() if calibration is None else contextlib.nullcontext()


def budget_options(opts: CompileOptions) -> dict:
    return {} if opts.max_ppl_increase is None else {"max_ppl_increase": opts.max_ppl_increase}


def note_calibration(records: list, calibration: list[torch.Tensor] | None, opts: CompileOptions) -> None:
    """Say in each measured pass's manifest entry what it was measured on."""
    if calibration is None:
        return
    about = {"source": calibration_source(opts.calib, opts.calib_seed), "samples": len(calibration),
             "seq_len": opts.calib_seq_len}
    for r in records:
        if r.accuracy is not None and "ppl_after" in r.accuracy:
            r.accuracy["calibration"] = dict(about)


def launch_configs(graph: Graph, tgt: Target, opts: CompileOptions, echo) -> tuple[dict, dict | None]:
    """(config overrides for the plan's Triton kernels, plan.meta["autotune"]); a CPU target has
    neither."""
    if tgt.device != "cuda":
        if opts.autotune and not opts.quiet:
            echo(f"llmc: target {tgt.name} launches no Triton kernels; --autotune has nothing to tune")
        return {}, None

    return triton_autotune.autotune(graph, tgt.name, opts.autotune, (lambda _: None) if opts.quiet else echo)


def compile_model(source: str, target: str | Target = "cpu", output: str | Path = "model.llmc",
                  options: CompileOptions | None = None, echo: Callable[[str], None] | None = None) -> Path:
    """Compile `source` (sample name, HF dir, GGUF file) for `target` into an artifact dir. The
    output (and --report) are checked before any work; the artifact is built in a staging
    directory that a failure or interrupt removes (see staged_output)."""
    opts = options or CompileOptions()
    output = Path(output)
    check_report_path(opts.report)
    startup = process_age()
    start = time.perf_counter()
    with staged_output(output, opts.force) as staging, Stages(echo or echo_stderr, opts.quiet) as announce:
        report = build_into(staging, source, target, opts, echo, announce)
    report["seconds"] = round(time.perf_counter() - start, 4)
    if startup is not None:
        report["startup_seconds"] = round(startup, 4)
    if not opts.quiet:
        (echo or echo_stderr)(timing_line(report))
    if opts.report is not None:
        write_report(opts.report, report)
    return output


def build_into(staging: Path, source: str, target: str | Target, opts: CompileOptions,
               echo: Callable[[str], None] | None, announce: Stages | None = None) -> dict:
    """Compile `source` into the empty directory `staging`; return the compile report (timings)."""
    announce = announce or Stages(echo or echo_stderr, quiet=True)
    say = announce.start
    tgt = get_target(target)
    tgt.check_ready()
    check_kernels_option(opts.kernels, tgt.name, tgt.device)
    if tgt.device == "cpu":   # the kernel timings load the native kernels: build them while the model loads
        cpu_native.build_in_background()
    if opts.kv_policy not in (None, "none") and tgt.device != "cpu":
        raise PassError(f"--kv-policy {opts.kv_policy}: the {tgt.name} target's Triton attention kernels keep no "
                        "attention scores; compile for --target cpu or drop --kv-policy")
    draft_target = read_draft_target(opts.draft_of, opts.draft_layers)  # checked before the slow load
    configs = pass_configs(tgt, opts)
    recipes.check_quant_kernels(tgt, opts.quant)
    stages: list[dict] = []

    def log(name, seconds, details):
        stages.append({"name": name, "seconds": round(seconds, 4), "details": details,
                       "peak_rss_bytes": peak_rss_bytes()})

    say(f"loading {source}")
    t = time.perf_counter()
    with transformers_bars(not opts.quiet):
        loaded = load_model(source, lazy=True)
    log("load", time.perf_counter() - t, {"kind": loaded.kind, "name": loaded.name})
    if draft_target is not None:  # how many layers to cut depends on the loaded model
        opts = draft_options(opts, loaded, draft_target)
    if draft_target is not None or loaded.stored_quant:  # on the cpu targets a GGUF keeps its blocks by default
        configs = pass_configs(tgt, opts, source_quantised=bool(loaded.stored_quant))
    weights = recipes.weight_choice(tgt, opts.quant, opts.passes is not None, bool(loaded.stored_quant))
    note = recipes.requantise_note(weights, loaded.stored_quant, tgt)
    if note and not opts.quiet:
        (echo or echo_stderr)(note)
    pipeline = instantiate(configs)
    if loaded.lazy_weights and runs_model(pipeline) and opts.calib is None:
        materialise(loaded, pipeline, log)   # the model samples its own calibration text
    say(f"tracing {loaded.name}")
    graph = trace(loaded.module, opts.max_num_batched_tokens, log)
    attach_lazy_weights(graph, loaded)
    if runs_model(pipeline):
        say(f"calibration text: {opts.calib_samples} x {opts.calib_seq_len} tokens "
            + (f"from {opts.calib}" if opts.calib else "sampled from the model"))
    calibration = calibrate(loaded, pipeline, opts, log)
    say(f"running {len(configs)} passes for target {tgt.name}")
    ctx = PassContext(target=tgt, options=budget_options(opts), calibration=calibration,
                      source_weights=loaded.stored_quant,
                      print_ir_after=set(opts.print_ir_after), dump_ir=opts.dump_ir,
                      quiet=opts.quiet, stages=announce, **({"echo": echo} if echo else {}))
    t = time.perf_counter()
    with pass_threads(calibration):
        graphs, records = run_passes(graph, configs, ctx)  # one graph per tensor-parallel rank
    log("passes", time.perf_counter() - t, {"count": len(records)})
    graph = graphs[0]
    note_calibration(records, calibration, opts)
    model = set_model_meta(graphs, records, loaded)
    t = time.perf_counter()
    if measures_kernels(opts.kernels, tgt) and all(whole_step_refusal(g) is None for g in graphs):
        for g in graphs:   # whole decode steps are timed on every weight: made once, not per candidate
            g.weights.materialise()
    say("planning kernels" + (" (timing candidates on this machine)" if measures_kernels(opts.kernels, tgt) else ""))
    reference = None if ctx.reference_logits is None else CalibrationReference(calibration, ctx.reference_logits)
    plans, ort_files = lower_plans(graphs, [rank_plan(g, tgt, opts, echo) for g in graphs], tgt, opts.kernels, echo,
                                   reference, batch_invariant=opts.batch_invariant == "on")
    plan = plans[0]
    kernels, kernel_index = kernel_sources(plan)
    log("plan", time.perf_counter() - t, {"steps": len(plan.steps), **({"kernels": len(kernels)} if kernels else {})})
    manifest = {
        "llmc_version": llmc.__version__, "torch_version": torch.__version__.split("+")[0],
        "target": tgt.to_dict(), "model": {"name": loaded.name, "source_kind": loaded.kind,
                                           "source_sha256": loaded.source_hash, **model},
        # lowering's records apart, so "pipeline" lists the passes a target or the flags chose
        "lowering": [r.to_dict(include_timing=False) for r in records if r.stage == Stage.LOWER.label],
        "pipeline": [r.to_dict(include_timing=False) for r in records if r.stage != Stage.LOWER.label],
        "weights": weights.record(),   # the --quant recipe applied and why (llmc inspect)
        "report": {
            "op_counts": graph.op_counts(), "weight_bytes": total_weight_bytes(graphs),
            "kv_bytes_per_token": model["kv_bytes_per_token"],
            "kv_bytes_full_context": model["kv_bytes_per_token"] * model["max_position_embeddings"],
            "activation_peak_bytes": plan.memory.peak_bytes, "activation_naive_bytes": plan.memory.naive_bytes,
            "max_num_batched_tokens": opts.max_num_batched_tokens,
        },
    }
    if draft_target is not None:
        manifest["draft_of"] = draft_target.record()
    if "kv_policy" in plan.meta:
        manifest["kv_policy"] = plan.meta["kv_policy"]
    if len(graphs) > 1:
        manifest["parallel"] = parallel_section(graphs, plans)
    say(f"writing the artifact ({sum(manifest['report']['weight_bytes'].values()) / 2**20:.0f} MiB of weights)")
    t = time.perf_counter()
    write_contents(staging, [RankFiles(g.to_json(), p.to_json(), g.weights) for g, p in zip(graphs, plans)],
                   loaded.tokenizer, manifest, kernels, kernel_index or None, ort_files)
    log("write", time.perf_counter() - t, {})
    return {"stages": stages, "passes": [{"name": r.name, "stage": r.stage, "seconds": round(r.seconds, 4)}
                                         for r in records], "host": platform.machine(),
            "weight_bytes": sum(manifest["report"]["weight_bytes"].values()), "peak_rss_bytes": peak_rss_bytes()}
