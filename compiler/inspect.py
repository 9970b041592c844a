"""What `llmc inspect` shows: an artifact's graph summary, pass log and memory figures, read
from its manifest (checked against its schema and against graph.json and plan.json, whose hashes
are checked) without loading the weights. Compile timings are no part of an artifact: see
`llmc compile --report`."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import llmc
from llmc.cache import summary_line
from llmc.compiler.artifact import (
    GRAPH,
    KERNEL_INDEX,
    PLAN,
    not_a_directory,
    parse_json,
    rank_count,
    rank_file,
    rank_view,
    read_manifest,
    verify_file,
)
from llmc.compiler.bounded_input import read_json_bytes
from llmc.compiler.ir import Graph
from llmc.compiler.manifest_schema import RECOMPILE, check_kernel_records, check_model_agrees
from llmc.compiler.schemes import INT8_PER_TOKEN, SCHEMES
from llmc.errors import ArtifactError
from llmc.runtime.memory_report import expected, measure, memory_line


def _read_manifest(path: Path) -> dict:
    """The artifact's manifest, after checking its schema and that graph.json and plan.json (every
    rank's) say the same of the model."""
    if not path.is_dir():
        raise ArtifactError(f"artifact '{path}' {not_a_directory(path)}; "
                            f"compile one with `llmc compile MODEL -o DIR`")
    manifest = read_manifest(path)
    for rank in range(rank_count(manifest)):
        view = rank_view(manifest, rank, f"artifact '{path}'")
        check_model_agrees(view, _read_json(path, manifest, rank_file(view, GRAPH)),
                           _read_json(path, manifest, rank_file(view, PLAN)), f"artifact '{path}'")
    return manifest


def _read_listed(path: Path, manifest: dict, name: str) -> str:
    """The text of a file the manifest lists, after checking its sha256."""
    if name not in manifest["files"]:
        raise ArtifactError(f"artifact '{path}': {name} is not listed in its manifest.json; recompile")
    try:
        file = verify_file(path, name, manifest["files"][name])
        return read_json_bytes(file, f"artifact '{path}': {name}", ArtifactError).decode()
    except UnicodeDecodeError as e:
        raise ArtifactError(f"artifact '{path}': {name} is not UTF-8 text ({e}); recompile") from None


def _read_json(path: Path, manifest: dict, name: str):
    return parse_json(path, name, _read_listed(path, manifest, name))


def _rank0_plan(path: Path, manifest: dict) -> dict:
    """plan.json (rank 0's of a tensor-parallel artifact)."""
    return _read_json(path, manifest, rank_file(rank_view(manifest, 0, f"artifact '{path}'"), PLAN))


def report(artifact: str | Path, kv_memory: str = "1GiB") -> dict:
    """Machine-readable summary; keys are stable for pipelines. `kv_memory`: the KV cache budget
    memory_at_load assumes."""
    path = Path(artifact)
    manifest = _read_manifest(path)
    rep = manifest["report"]
    plan = _rank0_plan(path, manifest)
    plan_meta = plan["meta"]
    return {
        "target": manifest["target"]["name"],
        "target_device": manifest["target"]["device"],
        "model": manifest["model"],
        "op_counts": rep["op_counts"],
        "weight_bytes": rep["weight_bytes"],
        "weight_bytes_total": sum(rep["weight_bytes"].values()),
        "quant": quant_summary(manifest["pipeline"]),
        "weights": weight_summary(_rank0_graph(path, manifest), manifest),
        "kv_bytes_per_token": rep["kv_bytes_per_token"],
        "kv_bytes_full_context": rep["kv_bytes_full_context"],
        "activation_peak_bytes": rep["activation_peak_bytes"],
        "activation_naive_bytes": rep["activation_naive_bytes"],
        "max_num_batched_tokens": rep["max_num_batched_tokens"],
        "passes": manifest["pipeline"],
        "artifact_bytes": sum(f.stat().st_size for f in path.rglob("*") if f.is_file()),
        "llmc_version": manifest["llmc_version"],
        "torch_version": manifest["torch_version"],
        "draft_of": manifest.get("draft_of"),   # the target artifact a speculative-decoding draft serves
        "distilled": manifest.get("distilled"),   # `llmc distill`: teacher, text, steps, held-out KL
        "kernel_choice": plan_meta.get("kernel_choice"),  # cpu: --kernels
        # cpu: the mode a load runs unless it asks otherwise (--batch-invariant; before the flag: on)
        "batch_invariant": plan_meta.get("batch_invariant", True) is not False,
        "batch_invariant_except": invariance_exceptions(plan, manifest["model"]),
        "q4_activations": plan_meta.get("q4_activations"),   # cpu: how the 4-bit GEMVs round activations
        "decode_graph": _decode_graph_summary(plan_meta.get("decode_graph")),
        "parallel": manifest.get("parallel"),   # tensor parallel: what each rank holds and runs per step
        "memory_at_load": _memory_at_load(plan, manifest["model"], kv_memory),   # rank 0's
    }


def _rank0_graph(path: Path, manifest: dict) -> dict:
    return _read_json(path, manifest, rank_file(rank_view(manifest, 0, f"artifact '{path}'"), GRAPH))


# short names of float weight dtypes (compiler/targets.py PRECISION_DTYPES, inverted)
FLOAT_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


def linear_format(node: dict, params: dict[str, dict]) -> str:
    """The weight format of a linear or qlinear node of graph.json: a float dtype, a scheme (int4
    with its group), or for a GGUF's kept blocks the file's own format (Q4_1, Q8_0, ...)."""
    attrs = node["attrs"]
    if node["op"] == "linear":
        dtype = params[node["inputs"][1]]["type"]["dtype"]
        return FLOAT_NAMES.get(dtype, dtype)
    scheme = attrs["scheme"]
    row = SCHEMES[scheme]
    if row.gguf:
        method = (params[node["inputs"][1]].get("quant") or {}).get("method", "")
        return method.removeprefix("gguf:") or scheme
    if row.grouped:
        return f"{scheme} g{attrs['group_size']}"
    if row.activations == INT8_PER_TOKEN:
        return f"{row.code_dtype} (int8 activations)"
    return f"{scheme} ({scheme} activations)" if attrs.get("has_act_scale") else scheme


def weight_summary(graph: dict, manifest: dict) -> dict:
    """Which weight format the compiled graph's linears hold (counted by GEMM: a fused q/k/v or
    gate/up projection counts once) and why: the manifest's record of the --quant recipe applied
    (its reason: target default, user flag, kept from source, user pipeline), and why the
    quantising passes left weights in float."""
    params = {p["name"]: p for p in graph["params"]}
    formats = Counter(linear_format(n, params) for n in graph["nodes"] if n["op"] in ("linear", "qlinear"))
    left: Counter = Counter()
    for record in manifest["pipeline"]:
        if (record.get("details") or {}).get("quant"):
            for why, weights in (record["details"].get("skipped") or {}).items():
                left[why] += len(weights)
    return {**_recipe_record(manifest), "formats": dict(formats.most_common()), "left_in_float": dict(left)}


def _recipe_record(manifest: dict) -> dict:
    """The manifest's `weights` record (absent from artifacts compiled before it was kept)."""
    record = manifest.get("weights")
    if record is None:
        return {"quant": None, "reason": "not recorded", "origin": "compiled by an llmc that did not record it"}
    fields = (record.get("quant"), record.get("reason"), record.get("origin")) if isinstance(record, dict) else ()
    if not fields or not isinstance(fields[0], (str, type(None))) or not all(isinstance(f, str) for f in fields[1:]):
        raise ArtifactError(f"manifest.json: weights must be an object of quant (string or null), reason and origin "
                            f"(strings), not {json.dumps(record)[:80]}; {RECOMPILE}")
    return {"quant": fields[0], "reason": fields[1], "origin": fields[2]}


def _weight_lines(weights: dict) -> list[str]:
    formats = ", ".join(f"{n} {fmt}" for fmt, n in weights["formats"].items()) or "none"
    recipe = ("the passes given" if weights["reason"] == "user pipeline" else
              "float weights" if weights["quant"] in (None, "none") else f"--quant {weights['quant']}")
    lines = [f"  linear weights (by GEMM, a fused one once): {formats}; from {recipe} "
             f"({weights['reason']}: {weights['origin']})"]
    if weights["left_in_float"]:
        lines.append("    left in float: " + "; ".join(f"{n} {why}" for why, n in weights["left_in_float"].items()))
    return lines


def _memory_at_load(plan: dict, model: dict, kv_memory: str) -> dict:
    return expected(plan, model, kv_memory)


def measured_memory(artifact: str | Path, kv_memory: str) -> dict:
    """Load the artifact (its KV cache at `kv_memory`) and split this process's RSS as the runtime holds it
    (runtime/memory_report.py)."""
    return measure(llmc.load(artifact, kv_memory=kv_memory).engine).to_dict()


def memory_lines(at_load: dict, measured: dict | None = None) -> list[str]:
    """What a load holds: expected from the plan, and measured when the artifact was loaded."""
    repacked = at_load["weights_repacked"]
    lines = [f"  memory at load: weights {_mib(at_load['weights_file'])} read from the mapped weights file"
             + (f", {_mib(repacked)} of them held repacked instead (4-bit weights in the AMX GEMM's tiles, "
                "or integer zero points converted)" if repacked else ""),
             f"    KV cache {_mib(at_load['kv_cache'])} at --kv-memory {at_load['kv_memory']} "
             f"({at_load['kv_blocks']:,} blocks); activations up to {_mib(at_load['activations_planned'])} planned"]
    if at_load["ort_sessions"]:
        lines.append(f"    {at_load['ort_sessions']} ONNX Runtime sessions: each packs its own copy of the weights "
                     f"its MatMulNBits read, beside their fp32 scales made once for all (--memory measures them)")
    if measured:
        lines.append(f"  memory measured after a load: {memory_line(measured)}")
    return lines


def quant_summary(pipeline: list[dict]) -> dict:
    """Per quantisation scheme (from the quantising passes' `details["quant"]`): the passes,
    method, group size, linears quantised and kept, and their weight bytes before and after."""
    out: dict[str, dict] = {}
    for record in pipeline:
        for scheme, fig in (record.get("details") or {}).get("quant", {}).items():
            entry = out.setdefault(scheme, {"passes": [], "method": fig.get("method"),
                                            "group_size": fig.get("group_size"), "linears": 0,
                                            "kept_linears": 0, "bytes_before": 0, "bytes_after": 0})
            entry["passes"].append(record["name"])
            for key in ("linears", "kept_linears", "bytes_before", "bytes_after"):
                entry[key] += fig.get(key, 0)
            if fig.get("moe_ops"):  # mixtures of experts whose expert weights the pass stored
                entry["moe_ops"] = entry.get("moe_ops", 0) + fig["moe_ops"]
            if "formats" in fig:  # kept GGUF weights: each one's source block format
                entry.setdefault("formats", {}).update(fig["formats"])
    for entry in out.values():
        entry["ratio"] = round(entry["bytes_after"] / entry["bytes_before"], 4) if entry["bytes_before"] else None
    return dict(sorted(out.items()))


def _quant_lines(quant: dict) -> list[str]:
    lines = []
    for scheme, q in quant.items():
        group = f", group {q['group_size']}" if q["group_size"] and q["group_size"] > 0 else ""
        ratio = f" ({q['ratio']:.1%})" if q["ratio"] is not None else ""
        experts = f" and {q['moe_ops']} moe ops' experts" if q.get("moe_ops") else ""
        lines.append(f"  quant {scheme} ({q['method']}{group}): {q['linears']} linears{experts}, "
                     f"{_mib(q['bytes_before'])} -> {_mib(q['bytes_after'])}{ratio}; "
                     f"{q['kept_linears']} kept in float")
        if q.get("formats"):
            counts = Counter(q["formats"].values())
            lines.append("    source formats: " + ", ".join(f"{n} x {f}" for f, n in sorted(counts.items())))
    return lines


def _accuracy_line(a: dict) -> str:
    """A lossy pass's measured cost on the calibration text."""
    change = 100 * (a["ppl_after"] / a["ppl_before"] - 1)
    return (f"calibration ppl {a['ppl_before']:.4g} -> {a['ppl_after']:.4g} ({change:+.2f}%), "
            f"KL {a['kl']:.4g}, top-1 agreement {a['top1_agreement']:.3f} over {a['tokens']} tokens")


def _size_line(d: dict) -> str:
    """A pruning or KV-head pass's figures: params removed, KV bytes per token before and after."""
    parts = [f"params {d['params_removed']:,} removed"
             + (f" ({_mib(d['bytes_removed'])})" if d.get("bytes_removed") is not None else "")]
    if d.get("kv_bytes_per_token_before") is not None:
        parts.append(f"KV {d['kv_bytes_per_token_before']:,} -> {d.get('kv_bytes_per_token_after', '?')} bytes/token")
    if d.get("zeros_after") is not None:
        parts.append(f"{d['zeros_after']:,} of {d.get('weights', '?')} linear weights zero ({d.get('storage')}); "
                     f"expected speedup: {d.get('expected_speedup')}")
    return ", ".join(parts)


def _parallel_lines(parallel: dict | None) -> list[str]:
    """Per tensor-parallel rank: its weights, its KV cache per token, its collectives per step."""
    if not parallel:
        return []
    if parallel.get("pp", 1) > 1:
        return _pipeline_lines(parallel)
    lines = [f"  tensor parallel: {parallel['tp']} ranks (each loads only its own folder's weights)"]
    for r in parallel["ranks"]:
        collectives = ", ".join(f"{op} {n}" for op, n in sorted(r["collectives"].items()) if n) or "none"
        lines.append(f"    {r['dir']}: weights {_mib(sum(r['weight_bytes'].values()))}, KV {r['kv_bytes_per_token']:,} "
                     f"bytes/token ({r['num_kv_heads']} KV heads, {r['num_heads']} query heads), collectives per "
                     f"step: {collectives}")
    return lines


def _pipeline_lines(parallel: dict) -> list[str]:
    """Per pipeline stage: its decoder layers, weights and KV cache per token."""
    split = ",".join(map(str, parallel["split"]))
    tp = f" x {parallel['tp']} tensor-parallel ranks each" if parallel.get("tp", 1) > 1 else ""
    lines = [f"  pipeline parallel: {parallel['pp']} stages{tp}, layers split {split} (each rank loads only its own "
             f"folder's weights and holds only its layers' KV cache)"]
    for r in parallel["ranks"]:
        first, stop = r["layers"]
        where = f" (stage {r['stage']}, tp rank {r['tp_rank']})" if "stage" in r else ""
        lines.append(f"    {r['dir']}{where}: layers {first}-{stop - 1} ({r['num_layers']}), weights "
                     f"{_mib(sum(r['weight_bytes'].values()))}, KV {r['kv_bytes_per_token']:,} bytes/token")
    return lines


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def summarize(artifact: str | Path, brief: bool = False, show_ir: bool = False, memory: dict | None = None,
              kv_memory: str = "1GiB") -> str:
    """The text report; `memory`: a measured_memory split to show beside what the plan expects."""
    r = report(artifact, kv_memory)
    m = r["model"]
    lines = [f"artifact {artifact}: {m['name']} ({m['architecture']}) for target {r['target']}",
             "  ops: " + ", ".join(f"{k} {v}" for k, v in r["op_counts"].items()),
             "  weights: " + ", ".join(f"{k} {_mib(v)}" for k, v in r["weight_bytes"].items()),
             f"  KV cache: {r['kv_bytes_per_token']:,} bytes/token, "
             f"{_mib(r['kv_bytes_full_context'])} for the full context of {m['max_position_embeddings']}",
             f"  activations: peak {_mib(r['activation_peak_bytes'])} planned vs "
             f"{_mib(r['activation_naive_bytes'])} naive at {r['max_num_batched_tokens']} tokens",
             f"  artifact size: {_mib(r['artifact_bytes'])}"]
    if r["draft_of"]:
        d = r["draft_of"]
        lines.append(f"  draft of: {d['model']} ({d['num_layers']} layers; this draft has {m['num_layers']}), "
                     f"target manifest sha256 {d['manifest_sha256'][:16]}")
    lines += distilled_lines(r["distilled"])
    lines += (memory_lines(r["memory_at_load"], memory) + _weight_lines(r["weights"]) + _quant_lines(r["quant"])
              + _parallel_lines(r["parallel"]))
    if r["target_device"] == "cpu":
        lines += kernel_choice_lines(r["kernel_choice"]) + decode_graph_lines(r["decode_graph"])
        lines.append(batch_invariance_line(r["batch_invariant"], r["batch_invariant_except"]))
        lines.append(q4_activations_line(r["q4_activations"]))
    if brief:
        return "\n".join(lines)
    lines.append("  passes:")
    for p in r["passes"]:
        lines.append(f"    {p['name']:<16} matches {p['matches']:<4} "
                     f"bytes saved {p['bytes_saved']:,}  {json.dumps(p['details'], sort_keys=True)[:80]}")
        if (p["details"] or {}).get("params_removed") is not None:
            lines.append(f"    {'':<16} {_size_line(p['details'])}")
        if p.get("accuracy"):
            lines.append(f"    {'':<16} {_accuracy_line(p['accuracy'])}")
    if show_ir:
        path = Path(artifact)
        view = rank_view(read_manifest(path), 0, f"artifact '{path}'")
        lines.append(str(Graph.from_json(_read_listed(path, view, rank_file(view, GRAPH)))))
    return "\n".join(lines)


def distilled_lines(record: dict | None) -> list[str]:
    """What `llmc distill` recorded: from which teacher, on which text, how long, and the held-out
    KL(teacher || student) before and after (and the hidden-state loss, where matched)."""
    if not record:
        return []
    teacher = record["teacher"]
    loss = "-" if record["final_loss"] is None else f"{record['final_loss']:.4f}"
    lines = [f"  distilled from: {teacher['model']} (teacher manifest sha256 {teacher['manifest_sha256'][:16]}), "
             f"{record['steps']} steps of {record['batch']} x {record['seq_len']} tokens at lr {record['lr']:g}",
             f"    text sha256 {record['text_sha256'][:16]} ({record['text_tokens']:,} tokens); held-out "
             f"KL(teacher || student) {record['kl_before']:.4f} -> {record['kl_after']:.4f} over "
             f"{record['held_out_tokens']:,} tokens; final training loss {loss}"]
    hidden = record.get("hidden")
    if hidden:
        lines.append(f"    hidden states matched ({hidden['loss']}, weight {hidden['weight']:g}, student -> teacher "
                     f"layer {', '.join(f'{s}->{t}' for s, t in hidden['layer_map'])}): held-out loss "
                     f"{hidden['before']:.4f} -> {hidden['after']:.4f}")
    return lines


def invariance_exceptions(plan: dict, model: dict) -> list[str]:
    """What of a cpu plan rounds by the row count even in batch-invariant mode, as far as the artifact
    shows it (runtime/batch_invariance.py's describe adds what only a load knows: the native kernels built)."""
    out = []
    kv = (model.get("kv_cache") or {}).get("dtype", "float32")
    if kv != "float32":
        out.append(f"attention over the {kv} KV cache")
    if any(s["kernel"] == "cpu.flash_attention" and s["attrs"].get("softcap") is not None for s in plan["steps"]):
        out.append("soft-capped attention")
    return out


def q4_activations_line(mode: str | None) -> str:
    """How the native 4-bit GEMVs round activations unless a load asks otherwise (--q4-activations)."""
    if mode == "int8":
        return ("  4-bit GEMV activations: int8 codes per block of 32, llama.cpp's Q8_1 rounding "
                "(llmc.load(..., q4_activations=\"int16\") for int16 codes per 64)")
    why = "--q4-activations int16" if mode == "int16" else "compiled before --q4-activations"
    return (f"  4-bit GEMV activations: int16 codes per block of 64 ({why}; llmc.load(..., "
            f"q4_activations=\"int8\") for llama.cpp's Q8_1 rounding, the faster)")


def batch_invariance_line(on: bool, exceptions: list[str] = ()) -> str:
    if on and exceptions:
        return (f"  batch invariance: on, except {'; '.join(exceptions)} (those round by the rows in a step; the "
                f"rest of a sequence's logits do not depend on the batch)")
    if on:
        return ("  batch invariance: on (a sequence's logits do not depend on the batch or its rows per step; "
                "llmc.load(..., batch_invariant=False) allows the faster row-dependent kernels)")
    return ("  batch invariance: off (compiled --batch-invariant off: logits may differ in the last bits with the "
            "batch; llmc.load(..., batch_invariant=True) turns it on)")


def kernel_choice_lines(choice: dict | None) -> list[str]:
    """What --kernels chose for a cpu artifact: ORT segments or torch, and for auto what was measured
    (microseconds per call at decode and prefill shapes, each kind of segment once)."""
    timed = _machine_lines((choice or {}).get("machine")) + _timings_lines((choice or {}).get("timings"))
    if not choice or choice["mode"] == "cpu":
        return ["  kernels: cpu (torch)"] + timed
    lines = [f"  kernels: {choice['mode']} (ONNX Runtime segments where chosen, torch attention)"] + timed
    measured = choice.get("measured")
    if measured and measured["kinds"]:
        tokens = measured["tokens"]
        lines.append(f"    measured with {measured['threads']} threads at {tokens['decode']} and {tokens['prefill']} "
                     f"tokens (us decode/prefill, outputs off the reference relative to their largest; chosen "
                     f"by {measured['cost']}):")
        for kind in measured["kinds"]:
            lines.append(f"    {kind['chosen']:<4} x{kind['segments']:<3} {kind['ops']}: {_kind_figures(kind)}")
    lines += _int8_gate_lines(choice.get("int8_activations")) + _whole_plan_lines(choice.get("whole_plan"))
    by_reason: dict[str, list[str]] = {}
    for node, why in (choice.get("kept_in_torch") or {}).items():
        by_reason.setdefault(why, []).append(node)
    for why, nodes in by_reason.items():
        named = ", ".join(nodes[:3]) + (f" and {len(nodes) - 3} more" if len(nodes) > 3 else "")
        lines.append(f"    torch: {named}: {why}")
    dispatch = choice.get("qlinear_dispatch") or {}
    if dispatch.get("shapes"):
        lines.append(f"    torch qlinear, low-bit kernel (int8 codes: the native GEMV up to 8 rows where built) vs "
                     f"dequantise + fp32 GEMM ({dispatch['threads']} threads, us at rows "
                     f"{'/'.join(map(str, dispatch['rows']))}; dense from the row shown):")
    for key, entry in (dispatch.get("shapes") or {}).items():
        us = " ".join(f"{r}:{entry['us']['packed'][r]:.0f}/{entry['us']['dense'][r]:.0f}"
                      for r in entry["us"]["packed"])
        lines.append(f"      {key} x{entry['steps']}: dense from {entry['dense_from']} rows; {us}")
    return lines


def _whole_plan_lines(verdict: dict | None) -> list[str]:
    """auto's last choice: the lowered plan (walked or through its decode graph), or the cpu plan whose
    decode steps run the native decode program (compiler/driver/tuning/ort_plan_choice.py)."""
    if not verdict:
        return []
    if "step_us" not in verdict:
        return [f"    whole plan: lowered ({verdict['why']})"]
    runs = {"cpu": "the torch kernels throughout, no ORT segments", "walk": "the lowered plan, walked",
            "graph": "the lowered plan, decode steps through its decode graph"}
    names = {"cpu": "unlowered (native decode program)", "walk": "lowered and walked", "graph": "decode graph",
             "launches": "lowered, walked launch by launch"}
    steps = ", ".join(f"{us:.0f} us {names[name]}" for name, us in verdict["step_us"].items())
    return [f"    whole plan: {runs[verdict['chosen']]}; a decode step {steps}; the unlowered prefill "
            f"{verdict['prefill_extra_us']:+.0f} us; by {verdict['cost']}"
            + (f"; {verdict['why']}" if verdict.get("why") else "")]


def _machine_lines(machine: dict | None) -> list[str]:
    """Where the choices were made: another machine (or thread count) re-checks them at load
    (compiler/driver/tuning/run_site.py)."""
    if not isinstance(machine, dict):
        return []
    return [f"    chosen on {machine.get('cpu')} at {machine.get('threads')} threads; a load on another CPU or "
            f"thread count, or after timings taken busy, re-checks them there (LLMC_RECHECK_KERNELS=0|1 to "
            f"never|always)"]


def _timings_lines(record: dict | None) -> list[str]:
    """When and under what load the compile's kernel timings were measured
    (compiler/driver/tuning/ort_timing_cache.py)."""
    return [f"    timings: {summary_line(record)}"] if record else []


def _int8_gate_lines(gate: dict | None) -> list[str]:
    """auto's check of int8 activations on the calibration text (compiler/driver/tuning/ort_accuracy.py)."""
    if not gate:
        return []
    if "exact" not in gate:
        return [f"    int8 activations: not checked: {gate['why']}"]
    exact = gate["exact"]
    tried = "; ".join(f"{t['segments']} segments on int8: KL {t['kl']:.4g}, top-1 {t['top1']:.3f}"
                      f" ({'kept' if t['kept'] else 'refused'})" for t in gate["tried"])
    return [f"    int8 activations, checked over {gate['tokens']} calibration tokens against the source model: "
            f"exact kernels KL {exact['kl']:.4g}, top-1 {exact['top1']:.3f}; {tried}"]


def _decode_graph_summary(record) -> dict | None:
    """plan.meta's decode-graph record without its initializer list."""
    return {k: v for k, v in record.items() if k != "initializers"} if isinstance(record, dict) else None


def decode_graph_lines(record: dict | None) -> list[str]:
    """Whether decode-only steps run as one ONNX Runtime session (codegen/ort/ort_decode.py), and why not."""
    if not record:
        return []
    if not record.get("chosen"):
        return [f"  decode graph: none ({record.get('why')})"]
    us = record.get("decode_us") or {}
    measured = (f"; its segments {us['graph_segments']:.0f} us a decode step in ORT, {us['plan_segments']:.0f} us "
                f"as the plan walk runs them" if us else "")
    if "graph_step" in us:
        measured += f"; a whole decode step {us['graph_step']:.0f} us through it, {us['plan_step']:.0f} us walked"
    steps = "decode-only steps"
    if "launches_step" in us:
        measured += f", {us['launches_step']:.0f} us walked launch by launch"
    if record.get("native_first"):
        steps = "decode-only steps the native decode program does not take (over 8 sequences)"
    return [f"  decode graph: {steps} run as one ONNX Runtime session ({record['file']}, attention "
            f"over the paged KV cache inside it){measured}"]


def _kind_figures(kind: dict) -> str:
    error, excluded = kind.get("error") or {}, kind.get("excluded") or {}
    figures = [f"{family} {t['decode']:.0f}/{t['prefill']:.0f}"
               + (f" off {error[family]:.1e}" if family in error else "")
               + (f" (excluded: {excluded[family]})" if family in excluded else "")
               for family, t in (kind.get("us") or {}).items()]
    return "; ".join(figures + ([kind["why"]] if kind.get("why") else []))


# -- Triton kernels (`llmc inspect ART --kernels [--source NAME]`) ---------------------------------
def kernel_report(artifact: str | Path) -> dict:
    """The artifact's Triton kernels from kernels.json (each with its `launches`: the plan steps
    that launch it), which ops run as torch calls, and the launch configs from autotuning."""
    path = Path(artifact)
    manifest = _read_manifest(path)
    meta = _rank0_plan(path, manifest)["meta"]
    index = _read_json(path, manifest, KERNEL_INDEX) if KERNEL_INDEX in manifest["files"] else []
    check_kernel_records(index, meta, f"artifact '{path}'")
    return {"target": manifest["target"]["name"],
            "kernels": [{**entry, "launches": len(entry["steps"])} for entry in index],
            "triton_ops": meta.get("kernels", {}).get("triton_ops", []),
            "torch_ops": meta.get("kernels", {}).get("torch_ops", []),
            "autotune": meta.get("autotune")}


def kernels_summary(artifact: str | Path, as_json: bool = False) -> str:
    r = kernel_report(artifact)
    if as_json:
        return json.dumps(r, indent=2, sort_keys=True)
    if not r["kernels"]:
        return f"artifact {artifact} (target {r['target']}) launches no Triton kernels: its plan runs torch ops"
    lines = [f"artifact {artifact} (target {r['target']}): {len(r['kernels'])} Triton kernels for "
             f"{', '.join(r['triton_ops'])}; torch runs {', '.join(r['torch_ops']) or 'nothing'}"]
    tune = r["autotune"]
    if tune is not None:
        lines.append(f"  launch configs: autotuned on {tune['device']}" if tune["tuned"] else
                     f"  launch configs: the target's defaults; autotune: {tune['reason']}")
    for k in r["kernels"]:
        lines.append(f"  {k['file'].removeprefix('kernels/'):<44} {k['template']:<32} sha256 {k['sha256'][:12]}  "
                     f"launched by {k['launches']} step{'s' if k['launches'] != 1 else ''}")
        lines.append("      " + ", ".join(f"{name}={value}" for name, value in sorted(k["constants"].items())))
        lines.append(f"      grid {k['grid']}")
    return "\n".join(lines)


def kernel_source(artifact: str | Path, name: str) -> str:
    """The stored source of the kernel `name`: its file (with or without kernels/ and .py) or, when
    only one kernel has it, its kernel name; checked against the index's sha256."""
    path = Path(artifact)
    kernels = kernel_report(path)["kernels"]
    stem = name.removeprefix("kernels/").removesuffix(".py")
    hits = [k for k in kernels if k["file"] == f"kernels/{stem}.py"] or [k for k in kernels if k["name"] == stem]
    if len(hits) != 1:
        files = ", ".join(k["file"].removeprefix("kernels/") for k in (hits or kernels)) or "none"
        what = "names several kernels" if hits else "is no kernel of it"
        raise ArtifactError(f"artifact '{path}': {name!r} {what}; give one of its files: {files}")
    entry = hits[0]
    source = _read_listed(path, read_manifest(path), entry["file"]).encode()
    if hashlib.sha256(source).hexdigest() != entry["sha256"]:
        raise ArtifactError(f"artifact '{path}': {entry['file']} fails its sha256 check (edited after "
                            f"compiling?); recompile")
    return source.decode()
