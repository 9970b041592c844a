"""`llmc bench --plot`: latency CDFs and throughput over time, ours beside the baseline."""

from __future__ import annotations

import numpy as np


def plot_bench(result, path: str, baseline=None, title: str = "llmc bench", baseline_name: str = "HF") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, thr) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, values in (("TTFT", result.ttft_s), ("TPOT", result.tpot_s), ("ITL", result.itl_s)):
        if values:
            v = np.sort(np.asarray(values) * 1e3)
            cdf.plot(v, np.arange(1, len(v) + 1) / len(v), label=name)
    cdf.set_xscale("log")
    cdf.set_xlabel("latency (ms)")
    cdf.set_ylabel("fraction of samples")
    cdf.set_title("latency CDFs")
    cdf.grid(alpha=0.3)
    cdf.legend()
    t = np.array([p[0] for p in result.timeline])
    n = np.array([p[1] for p in result.timeline])
    if len(t):
        width = max(t[-1] / 40, 1e-3)
        bins = np.arange(0, t[-1] + width, width)
        counts, edges = np.histogram(t, bins=bins, weights=n)
        thr.plot(edges[:-1], counts / width, label=f"llmc ({result.output_tokens_per_s:.0f} tok/s overall)")
    if baseline is not None:
        thr.axhline(baseline.output_tokens_per_s, color="gray", linestyle="--",
                    label=f"{baseline_name} baseline ({baseline.output_tokens_per_s:.0f} tok/s overall)")
    thr.set_xlabel("time (s)")
    thr.set_ylabel("output tokens/s")
    thr.set_title("throughput over time")
    thr.grid(alpha=0.3)
    thr.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
