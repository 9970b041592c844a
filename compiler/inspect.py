"""What `llmc inspect` shows: an artifact's graph summary, pass log with timings, and
memory figures, read from its manifest without loading the weights."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from llmc.errors import ArtifactError


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"'{path.parent}' is not an llmc artifact: {path.name} is missing; "
                            f"compile one with `llmc compile MODEL -o DIR`") from None
    except json.JSONDecodeError as e:
        raise ArtifactError(f"artifact '{path.parent}': {what} {path.name} is corrupt ({e}); recompile") from None


def _read_manifest(path: Path) -> dict:
    if not path.is_dir():
        raise ArtifactError(f"artifact '{path}' not found (no such directory); "
                            f"compile one with `llmc compile MODEL -o DIR`")
    manifest = _read_json(path / "manifest.json", "manifest")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("report"), dict):
        raise ArtifactError(f"'{path}' is not an llmc artifact: its manifest.json has no report; "
                            f"compile one with `llmc compile MODEL -o DIR`")
    return manifest


def _pass_seconds(pipeline: list[dict], timed: list[dict]) -> list[float | None]:
    """Each pipeline entry's wall time, paired by position: a pass may run more than once."""
    if [t["name"] for t in timed] != [p["name"] for p in pipeline]:
        return [None] * len(pipeline)
    return [t["seconds"] for t in timed]


def report(artifact: str | Path) -> dict:
    """Machine-readable summary; keys are stable for pipelines."""
    path = Path(artifact)
    manifest = _read_manifest(path)
    timings = _read_json(path / "timings.json", "build log") if (path / "timings.json").exists() else {}
    seconds = _pass_seconds(manifest["pipeline"], timings.get("passes", []))
    rep = manifest["report"]
    return {
        "target": manifest["target"]["name"],
        "model": manifest["model"],
        "op_counts": rep["op_counts"],
        "weight_bytes": rep["weight_bytes"],
        "weight_bytes_total": sum(rep["weight_bytes"].values()),
        "quant": quant_summary(manifest["pipeline"]),
        "kv_bytes_per_token": rep["kv_bytes_per_token"],
        "kv_bytes_full_context": rep["kv_bytes_full_context"],
        "activation_peak_bytes": rep["activation_peak_bytes"],
        "activation_naive_bytes": rep["activation_naive_bytes"],
        "max_num_batched_tokens": rep["max_num_batched_tokens"],
        "passes": [{**p, "seconds": t} for p, t in zip(manifest["pipeline"], seconds)],
        "stages": timings.get("stages", []),
        "artifact_bytes": sum(f.stat().st_size for f in path.rglob("*") if f.is_file()),
        "llmc_version": manifest["llmc_version"],
        "torch_version": manifest["torch_version"],
        "draft_of": manifest.get("draft_of"),   # the target artifact a speculative-decoding draft serves
    }


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
    for entry in out.values():
        entry["ratio"] = round(entry["bytes_after"] / entry["bytes_before"], 4) if entry["bytes_before"] else None
    return dict(sorted(out.items()))


def _quant_lines(quant: dict) -> list[str]:
    lines = []
    for scheme, q in quant.items():
        group = f", group {q['group_size']}" if q["group_size"] and q["group_size"] > 0 else ""
        ratio = f" ({q['ratio']:.1%})" if q["ratio"] is not None else ""
        lines.append(f"  quant {scheme} ({q['method']}{group}): {q['linears']} linears, "
                     f"{_mib(q['bytes_before'])} -> {_mib(q['bytes_after'])}{ratio}; "
                     f"{q['kept_linears']} kept in float")
    return lines


def _accuracy_line(a: dict) -> str:
    """A lossy pass's measured cost on the calibration text."""
    change = 100 * (a["ppl_after"] / a["ppl_before"] - 1)
    return (f"calibration ppl {a['ppl_before']:.4g} -> {a['ppl_after']:.4g} ({change:+.2f}%), "
            f"KL {a['kl']:.4g}, top-1 agreement {a['top1_agreement']:.3f} over {a['tokens']} tokens")


def _size_line(d: dict) -> str:
    """A pruning or KV-head pass's figures: params removed, KV bytes per token before and after."""
    parts = [f"params {d['params_removed']:,} removed"
             + (f" ({_mib(d['bytes_removed'])})" if "bytes_removed" in d else "")]
    if "kv_bytes_per_token_before" in d:
        parts.append(f"KV {d['kv_bytes_per_token_before']:,} -> {d['kv_bytes_per_token_after']:,} bytes/token")
    if "zeros_after" in d:
        parts.append(f"{d['zeros_after']:,} of {d['weights']:,} linear weights zero ({d['storage']}); "
                     f"expected speedup: {d['expected_speedup']}")
    return ", ".join(parts)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def summarize(artifact: str | Path, brief: bool = False, show_ir: bool = False) -> str:
    r = report(artifact)
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
    lines += _quant_lines(r["quant"])
    stage_time = sum(s["seconds"] for s in r["stages"]) + sum(p["seconds"] or 0 for p in r["passes"])
    lines.append(f"  compile time: {stage_time:.1f} s")
    if brief:
        return "\n".join(lines)
    lines.append("  stages:")
    lines += [f"    {s['name']:<16} {s['seconds']:8.3f} s  {json.dumps(s['details'], sort_keys=True)}"
              for s in r["stages"]]
    lines.append("  passes:")
    for p in r["passes"]:
        t = f"{p['seconds']:8.3f} s" if p["seconds"] is not None else "       ? s"
        lines.append(f"    {p['name']:<16} {t}  matches {p['matches']:<4} "
                     f"bytes saved {p['bytes_saved']:,}  {json.dumps(p['details'], sort_keys=True)[:80]}")
        if "params_removed" in (p["details"] or {}):
            lines.append(f"    {'':<16} {_size_line(p['details'])}")
        if p.get("accuracy"):
            lines.append(f"    {'':<16} {_accuracy_line(p['accuracy'])}")
    if show_ir:
        from llmc.compiler.ir import Graph
        lines.append(str(Graph.from_json((Path(artifact) / "graph.json").read_text())))
    return "\n".join(lines)


# -- Triton kernels (`llmc inspect ART --kernels [--source NAME]`) ---------------------------------
def kernel_report(artifact: str | Path) -> dict:
    """The artifact's Triton kernels from kernels.json (each with its `launches`: the plan steps
    that launch it), which ops run as torch calls, and the launch configs from autotuning."""
    path = Path(artifact)
    manifest = _read_manifest(path)
    meta = _read_json(path / "plan.json", "plan").get("meta", {})
    index = _read_json(path / "kernels.json", "kernel index") if (path / "kernels.json").exists() else []
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
    try:
        source = (path / entry["file"]).read_bytes()
    except OSError as e:
        raise ArtifactError(f"artifact '{path}': {entry['file']} cannot be read ({e}); recompile") from None
    if hashlib.sha256(source).hexdigest() != entry["sha256"]:
        raise ArtifactError(f"artifact '{path}': {entry['file']} fails its sha256 check (edited after "
                            f"compiling?); recompile")
    return source.decode()
