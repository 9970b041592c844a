"""bench/scale.sh's report: reads each row's step outputs in DIR (NAME.compile.json, .load.json, .decode.json,
.prefill.json, .llamacpp.json, each with its .time and .busy) and writes the markdown table (stdout and DIR/scale.md),
every figure (DIR/scale.json) and the plot (DIR/scale.png: decode tok/s and runtime RSS against weight GB,
llmc and llama.cpp). A step that failed shows its error's line in its cells. Usage:
    python bench/scale_table.py --threads N DIR NAME...   (NAME: size-format, e.g. llama-1b-q4_1)"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

GB, GIB = 1e9, 2 ** 30
MISSING = "—"


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def process_figures(base: str) -> dict:
    """A step's process as /usr/bin/time saw it (BASE.time: peak RSS KiB, user s, system s, wall s; a
    failed command's status line comes before them) and the cores other processes kept busy meanwhile
    (BASE.busy: the machine's busy CPU seconds before and after)."""
    try:
        rss_kib, user, system, wall = map(float, Path(f"{base}.time").read_text().split()[-4:])
    except (OSError, ValueError):
        return {}
    out = {"max_rss_bytes": int(rss_kib) * 1024, "wall_s": wall, "cpu_s": user + system}
    try:
        before, after = map(float, Path(f"{base}.busy").read_text().split())
        out["other_cores"] = max(0.0, (after - before - user - system) / wall) if wall > 0 else None
    except (OSError, ValueError):
        pass
    return out


def split_name(name: str) -> tuple[str, str]:
    if name.endswith("-hf-bf16"):
        return name[:-len("-hf-bf16")], "hf-bf16"
    size, _, fmt = name.rpartition("-")
    return size, fmt


def artifact_facts(art: Path) -> dict:
    """What the manifest says the decode reads: weight bytes, KV bytes per token, the artifact's size."""
    from llmc.compiler.inspect import report

    r = report(art)
    return {"weight_bytes": r["weight_bytes_total"], "kv_bytes_per_token": r["kv_bytes_per_token"],
            "artifact_bytes": r["artifact_bytes"], "kernels": kernel_summary(r["kernel_choice"])}


def kernel_summary(choice: dict | None) -> str | None:
    """What --kernels auto chose at compile, by its measurements there: segments per kernel family, and how
    decode steps run ("graph": one ONNX Runtime session; "lowered": the plan, the native decode program
    where it covers the layers)."""
    if not choice or not isinstance(choice.get("measured"), dict):
        return None
    families: dict[str, int] = {}
    for kind in choice["measured"].get("kinds", []):
        families[kind["chosen"]] = families.get(kind["chosen"], 0) + kind.get("segments", 1)
    whole = (choice.get("whole_plan") or {}).get("chosen")
    parts = [" + ".join(f"{f} {n}" for f, n in families.items()) + " segments" if families else "",
             f"decode {whole}" if whole else ""]
    return ", ".join(p for p in parts if p) or None


def step(d: Path, name: str, kind: str) -> dict | None:
    """A step's JSON with its process's figures beside it ("process"); {"error": ...} when it failed; None
    when it did not run."""
    r = read_json(d / f"{name}.{kind}.json")
    if r is not None:
        r["process"] = process_figures(f"{d}/{name}.{kind}")
    return r


def bandwidth_fraction(bytes_per_token: float, tokens_per_s: float | None, gbps: float | None) -> float | None:
    return bytes_per_token * tokens_per_s / (gbps * GB) if tokens_per_s and gbps else None


def llmc_figures(d: Path, name: str) -> dict:
    """The row's llmc figures; each step that failed as {"error": line}."""
    row = {"model": step(d, name, "model"), "compile": step(d, name, "compile")}
    if (d / f"{name}.llmc").is_dir() and row["compile"] and "error" not in row["compile"]:
        row["artifact"] = artifact_facts(d / f"{name}.llmc")
    for kind in ("load", "decode", "prefill"):
        row[kind] = step(d, name, kind)
    dec, art = row["decode"], row.get("artifact")
    if ok(dec) and art:
        roof, w = dec["roofline"], dec["workload"]
        context = w["input_len"] + w["output_len"] / 2   # mean tokens a decode step attends to
        row["decode_bytes_per_token"] = art["weight_bytes"] + art["kv_bytes_per_token"] * context
        row["decode_tokens_per_s"] = roof["decode_steps_per_s"]
        row["decode_bandwidth_fraction"] = bandwidth_fraction(
            row["decode_bytes_per_token"], roof["decode_steps_per_s"], roof["bandwidth_gbps"])
    if ok(row["prefill"]):
        p = row["prefill"]
        row["prefill_tokens_per_s"] = p["workload"]["input_len"] / p["total_seconds"]
    return row


def llamacpp_figures(d: Path, name: str, gbps: float | None) -> dict | None:
    r = step(d, name, "llamacpp")
    if ok(r):
        r["decode_bytes_per_token"] = r["weight_bytes"] + r["kv_bytes_per_token"] * r["decode_context_mean"]
        r["decode_bandwidth_fraction"] = bandwidth_fraction(r["decode_bytes_per_token"], r["decode_tokens_per_s"],
                                                            gbps)
    return r


def ok(step_result: dict | None) -> bool:
    return step_result is not None and "error" not in step_result


def measured_bandwidth(rows: list[dict]) -> float | None:
    return next((r["decode"]["roofline"]["bandwidth_gbps"] for r in rows if ok(r["decode"])), None)


def collect(d: Path, names: list[str]) -> list[dict]:
    rows = [{"name": n, "size": split_name(n)[0], "format": split_name(n)[1], **llmc_figures(d, n)} for n in names]
    gbps = measured_bandwidth(rows)
    for r in rows:
        r["llamacpp"] = llamacpp_figures(d, r["name"], gbps) if r["format"] != "hf-bf16" else None
    return rows


# --- the table: each cell a figure, or the failed step's line, or MISSING where the step did not run

def failed(*steps: dict | None) -> str | None:
    """The first failed step's error line (a cell shows it instead of figures that step would give)."""
    for s in steps:
        if s is not None and "error" in s:
            return s["error"].replace("|", "\\|")
    return None


def gib(n: int | None) -> str:
    return f"{n / GIB:.2f}" if n is not None else MISSING


def split_cell(m: dict) -> str:
    """RSS and its split; the weights as held: mapped from the file, repacked copies, ONNX Runtime's own."""
    parts = {k[len("weights_"):]: v for k, v in m.items() if k.startswith("weights_") and k != "weights_file" and v}
    held = ", ".join(f"{k} {gib(v)}" for k, v in parts.items())
    return (f"{gib(m['rss'])} (weights {gib(sum(parts.values()))}{f' = {held}' if held else ''}; "
            f"KV {m['kv_cache'] / 2**20:.0f} MiB, act {m['activations'] / 2**20:.0f} MiB, rest {gib(m['rest'])})")


def pct(x: float | None) -> str:
    return f"{x:.0%}" if x is not None else MISSING


def compile_cell(r: dict) -> str:
    c = r["compile"]
    if failed(r["model"], c):
        return failed(r["model"], c)
    if c is None:
        return MISSING
    p = c["process"]
    peak = max(c.get("peak_rss_bytes") or 0, p.get("max_rss_bytes") or 0)
    return f"{p.get('wall_s', c['seconds']):.1f} s, peak {gib(peak)} GiB"


def artifact_cell(art: dict | None) -> str:
    if not art:
        return MISSING
    kernels = f", {art['kernels']}" if art["kernels"] else ""
    return f"{art['weight_bytes'] / GB:.2f} GB, artifact {art['artifact_bytes'] / GB:.2f} GB{kernels}"


def llmc_cells(r: dict, llama: dict | None) -> list[str]:
    load, dec, pre = r["load"], r["decode"], r["prefill"]
    if failed(r["model"], r["compile"]):
        return [MISSING] * 6
    ratio = (f" ({r['decode_tokens_per_s'] / llama['decode_tokens_per_s']:.2f}x llama.cpp)"
             if ok(llama) and "decode_tokens_per_s" in r else "")
    pre_ratio = (f" ({r['prefill_tokens_per_s'] / llama['prefill_tokens_per_s']:.2f}x)"
                 if ok(llama) and "prefill_tokens_per_s" in r else "")
    return [artifact_cell(r.get("artifact")),
            failed(load) or (f"{load['load_s']:.1f} s, RSS {split_cell(load['memory'])}" if load else MISSING),
            failed(dec) or (f"{r['decode_tokens_per_s']:.1f}{ratio}" if "decode_tokens_per_s" in r else MISSING),
            f"{pct(r['decode_bandwidth_fraction'])} ({r['decode_bytes_per_token'] / 2**20:.0f} MiB/token)"
            if "decode_bytes_per_token" in r else MISSING,
            failed(pre) or (f"{r['prefill_tokens_per_s']:.0f}{pre_ratio}" if "prefill_tokens_per_s" in r else MISSING),
            f"{split_cell(dec['memory'])}, peak {gib(dec['process'].get('max_rss_bytes'))}" if ok(dec) else MISSING]


def llamacpp_cells(r: dict, installed: bool) -> list[str]:
    x = r["llamacpp"]
    if r["format"] == "hf-bf16":
        return ["no GGUF"] + [""] * 3
    if x is None:
        return [MISSING if installed else "not installed"] + [""] * 3
    if not ok(x):
        return [failed(x)] + [""] * 3
    return [f"{x['decode_tokens_per_s']:.1f}",
            f"{pct(x['decode_bandwidth_fraction'])} ({x['decode_bytes_per_token'] / 2**20:.0f} MiB/token)",
            f"{x['prefill_tokens_per_s']:.0f}",
            f"{gib(x['rss_bytes'])}, peak {gib(x['process'].get('max_rss_bytes'))}, load {x['load_s']:.1f} s"]


def others_cell(r: dict) -> str:
    """Cores other processes kept busy during the timed steps: above ~0.2 the figures are not a quiet run's."""
    cores = [(s["process"] or {}).get("other_cores") for s in (r["decode"], r["prefill"], r["llamacpp"]) if s]
    return " · ".join(f"{c:.1f}" if c is not None else MISSING for c in cores) or MISSING


HEADER = ["model", "compile (wall, peak RSS)", "weights, artifact, kernels chosen",
          "load (s, RSS GiB: weights, KV, activations, rest)",
          "decode tok/s", "decode of DRAM BW (bytes read)", "prefill-512 tok/s",
          "runtime RSS GiB after decode (split), peak", "llama.cpp decode tok/s", "llama.cpp of DRAM BW",
          "llama.cpp prefill-512 tok/s", "llama.cpp RSS GiB, peak, load",
          "other processes' cores during decode · prefill · llama.cpp"]


def table(rows: list[dict], threads: int, installed: bool) -> str:
    gbps = measured_bandwidth(rows)
    version = next((r["llamacpp"]["llama_cpp_version"] for r in rows if ok(r["llamacpp"])), None)
    lines = [f"threads {threads} · DRAM bandwidth {f'{gbps:.1f} GB/s' if gbps else MISSING} (llmc bench's roofline) · "
             f"llama.cpp {version or ('not installed' if not installed else MISSING)} · decode: the 127 steps after "
             "the first token of 128 in, 128 out, batch 1 · GB = 1e9 bytes, GiB = 2^30", "",
             "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in rows:
        cells = [r["name"], compile_cell(r), *llmc_cells(r, r["llamacpp"]), *llamacpp_cells(r, installed),
                 others_cell(r)]
        lines.append("| " + " | ".join(cells) + " |")
    fractions = [x.get("decode_bandwidth_fraction") or 0 for r in rows for x in (r, r["llamacpp"]) if ok(x)]
    if max(fractions, default=0) > 1:
        lines += ["", "A decode above 100% of the bandwidth: the weights fit in the CPU's caches, or the bandwidth "
                  "figure is understated (cached by `llmc bench` while the machine was busy); give BANDWIDTH=GBPS, or "
                  "delete $LLMC_CACHE/bandwidth.json to measure it again."]
    return "\n".join(lines)


# --- the plot

def weight_gb(r: dict) -> float | None:
    """The row's x: llmc's weight bytes (the artifact's), else the GGUF's as llama.cpp counts them."""
    if r.get("artifact"):
        return r["artifact"]["weight_bytes"] / GB
    return r["llamacpp"]["weight_bytes"] / GB if ok(r["llamacpp"]) else None


BUSY_CORES = 0.2   # other processes' cores above which a point is marked as not a quiet run's


def busy(step_result: dict) -> bool:
    return (step_result["process"].get("other_cores") or 0) > BUSY_CORES


def series(rows: list[dict]) -> dict[tuple[str, str], list[tuple[float, float, float, bool]]]:
    """(runtime, format) -> [(weight GB, decode tok/s, RSS GiB, busy)], by size."""
    out: dict[tuple[str, str], list] = {}
    for r in rows:
        x = weight_gb(r)
        if x is None:
            continue
        if "decode_tokens_per_s" in r:
            out.setdefault(("llmc", r["format"]), []).append(
                (x, r["decode_tokens_per_s"], r["decode"]["memory"]["rss"] / GIB, busy(r["decode"])))
        if ok(r["llamacpp"]):
            lc = r["llamacpp"]
            out.setdefault(("llama.cpp", r["format"]), []).append(
                (x, lc["decode_tokens_per_s"], lc["rss_bytes"] / GIB, busy(lc)))
    return {k: sorted(v) for k, v in out.items()}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tps, ax_rss) = plt.subplots(1, 2, figsize=(11, 4.5))
    colors = {}
    for (runtime, fmt), pts in series(rows).items():
        color = colors.setdefault(fmt, f"C{len(colors)}")
        marker = "o" if runtime == "llmc" else "s"
        for ax, i in ((ax_tps, 1), (ax_rss, 2)):
            ax.plot([p[0] for p in pts], [p[i] for p in pts], color=color, marker=marker,
                    linestyle="-" if runtime == "llmc" else "--", label=f"{runtime} {fmt}", markerfacecolor=color)
            hollow = [p for p in pts if p[3]]
            ax.plot([p[0] for p in hollow], [p[i] for p in hollow], color=color, marker=marker, linestyle="",
                    markerfacecolor="white")
    top = max([weight_gb(r) or 0 for r in rows] + [0.1])
    ax_rss.plot([0, top * 1.05], [0, top * 1.05 * GB / GIB], color="grey", linewidth=0.8, linestyle=":",
                label="RSS = weights")
    ax_tps.set(xlabel="weights (GB)", ylabel="batch-1 decode tok/s", title="decode")
    ax_rss.set(xlabel="weights (GB)", ylabel="RSS after decode (GiB)", title="runtime memory")
    for ax in (ax_tps, ax_rss):
        ax.grid(alpha=0.3)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"{title}\nhollow: measured while other processes kept over {BUSY_CORES} cores busy", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("names", nargs="*")
    a = p.parse_args()
    installed = importlib.util.find_spec("llama_cpp") is not None
    rows = collect(a.dir, a.names)
    text = table(rows, a.threads, installed)
    print(text)
    (a.dir / "scale.md").write_text(text + "\n")
    meta = {"threads": a.threads, "bandwidth_gbps": measured_bandwidth(rows), "llama_cpp_installed": installed,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_average": os.getloadavg()}
    (a.dir / "scale.json").write_text(json.dumps({**meta, "rows": rows}, indent=1, sort_keys=True, default=str) + "\n")
    plot(rows, a.dir / "scale.png", f"llmc vs llama.cpp, {a.threads} threads, batch-1 decode (128 in, 128 out)")


if __name__ == "__main__":
    main()
