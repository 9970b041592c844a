"""`llmc bench --url`: the bench workload (random prompts of set lengths, Poisson arrivals) sent to
a running OpenAI-compatible server as streamed completions (greedy, `ignore_eos`, so every request
makes its full length), timed at the client: TTFT, TPOT and ITL percentiles and throughput, as the
offline bench reports them, and per class for a mix of long and short prompts (--long-fraction). Each
stream chunk counts as the arrival of its tokens. Against a disaggregated server (`llmc serve
--disaggregate`), the KV moved per request and its transfer time, from the server's /metrics."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from llmc.errors import RuntimeLlmcError
from llmc.runtime.metrics import percentiles


def served_model(url: str, api_key: str | None) -> tuple[str, int]:
    """The name and vocabulary size of the model the server at `url` serves (llmc's /v1/models)."""
    try:
        reply = httpx.get(f"{url}/v1/models", headers=_headers(api_key), timeout=30)
    except httpx.HTTPError as e:
        raise RuntimeLlmcError(f"bench --url {url}: cannot reach the server ({e}); start it with "
                               "`llmc serve`") from None
    if reply.status_code != 200:
        raise RuntimeLlmcError(f"bench --url {url}: /v1/models answered {reply.status_code}: {reply.text[:200]}")
    model = reply.json()["data"][0]
    if "vocab_size" not in model:
        raise RuntimeLlmcError(f"bench --url {url}: the server does not report its vocab_size; bench --url "
                               "drives `llmc serve`, whose /v1/models does")
    return model["id"], model["vocab_size"]


def run_http(url: str, model: str, requests: list[dict], api_key: str | None = None) -> dict:
    """Send `requests` (Workload.build's) to the server at their arrival times; the latency report."""
    transfers = kv_transfers(url, api_key)
    started = time.perf_counter()
    timings = asyncio.run(_send_all(url, model, requests, api_key, started))
    total = max(times[-1] for _, times, _ in timings) - started
    tokens = sum(n for _, _, n in timings)
    report = {"url": url, "model": model, "requests_per_s": len(requests) / total,
              "output_tokens_per_s": tokens / total, "total_seconds": total, "output_tokens": tokens,
              **latencies(timings)}
    moved = {k: v - transfers.get(k, 0.0) for k, v in kv_transfers(url, api_key).items()}
    if moved.get(("seconds", "count")):
        report["kv_transfer"] = {"requests": int(moved["seconds", "count"]),
                                 "bytes": histogram_percentiles(moved, "bytes"),
                                 "ms": histogram_percentiles(moved, "seconds", 1e3)}
        if moved.get(("hold_seconds", "count")):
            report["kv_transfer"]["hold_ms"] = histogram_percentiles(moved, "hold_seconds", 1e3)
    classes = sorted({r["class"] for r in requests if "class" in r})
    if classes:   # a mixed workload: each class's latencies apart (long prompts stall short requests' decode)
        report["classes"] = {c: {"requests": sum(r.get("class") == c for r in requests),
                                 **latencies([t for t, r in zip(timings, requests) if r.get("class") == c])}
                             for c in classes}
    return report


def kv_transfers(url: str, api_key: str | None) -> dict:
    """The server's KV transfer histograms so far, {("seconds" | "bytes", bucket bound | "sum" | "count"):
    value}; {} from a server without them."""
    try:
        text = httpx.get(f"{url}/metrics", headers=_headers(api_key), timeout=30).text
    except httpx.HTTPError:
        return {}
    found = {}
    try:
        for family in text_string_to_metric_families(text):
            name = _KV_HISTOGRAMS.get(family.name)
            for s in family.samples if name else ():
                part = s.name.rpartition("_")[2]
                found[name, float(s.labels["le"]) if part == "bucket" else part] = s.value
    except ValueError:   # not Prometheus' text: another server's /metrics
        return {}
    return found


_KV_HISTOGRAMS = {"llmc:kv_transfer_seconds": "seconds", "llmc:kv_transfer_request_bytes": "bytes",
                  "llmc:kv_transfer_hold_seconds": "hold_seconds"}


def histogram_percentiles(moved: dict, name: str, scale: float = 1.0) -> dict[str, float]:
    """P50, P95 and P99 of histogram `name`'s observations in `moved` (kv_transfers' differences), each
    interpolated within its bucket as Prometheus' histogram_quantile does, and their exact mean."""
    count = moved[name, "count"]
    buckets = sorted((le, n) for (h, le), n in moved.items() if h == name and isinstance(le, float))
    result = {}
    for q in (50, 95, 99):
        rank, lower, below = q / 100 * count, 0.0, 0.0
        for le, cumulative in buckets:
            if cumulative >= rank:
                inside = (rank - below) / (cumulative - below) if cumulative > below else 1.0
                result[f"p{q}"] = (lower if le == float("inf") else lower + (le - lower) * inside) * scale
                break
            lower, below = le, cumulative
    return result | {"mean": moved[name, "sum"] / count * scale}


def latencies(timings: list[tuple[float, list[float], int]]) -> dict:
    """TTFT, TPOT and ITL percentiles (ms) of (sent time, chunk arrival times, tokens) per request."""
    ttft = [times[0] - sent for sent, times, _ in timings]
    itl = [b - a for _, times, _ in timings for a, b in zip(times, times[1:])]
    tpot = [(times[-1] - times[0]) / (n - 1) for _, times, n in timings if n > 1]
    return {"ttft_ms": percentiles(ttft, 1e3), "tpot_ms": percentiles(tpot, 1e3), "itl_ms": percentiles(itl, 1e3)}


async def _send_all(url, model, requests, api_key, started) -> list[tuple[float, list[float], int]]:
    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=len(requests))
    async with httpx.AsyncClient(base_url=url, headers=_headers(api_key), limits=limits, timeout=None) as client:
        return await asyncio.gather(*(_send(client, model, r, started) for r in requests))


async def _send(client, model: str, request: dict, started: float) -> tuple[float, list[float], int]:
    """(sent time, arrival time of each chunk, completion tokens) of one streamed request."""
    await asyncio.sleep(max(0.0, started + request["arrival"] - time.perf_counter()))
    body = {"model": model, "prompt": request["prompt_token_ids"], "max_tokens": request["max_tokens"],
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent, times, usage = time.perf_counter(), [], None
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            text = (await reply.aread()).decode(errors="replace")[:200]
            raise RuntimeLlmcError(f"bench --url: the server answered {reply.status_code}: {text}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("choices"):
                times.append(time.perf_counter())
            usage = chunk.get("usage") or usage
    if usage is None or not times:
        raise RuntimeLlmcError("bench --url: a stream ended without tokens or usage; is the server OpenAI-compatible?")
    return sent, times, usage["completion_tokens"]


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def percentile_cells(d: dict, form: str = "8.1f") -> str:
    """p50, p95 and p99 of a percentiles() dict, as the bench tables show them."""
    return "  ".join(f"{k} {d[k]:{form}}" if d.get(k) is not None else f"{k}      n/a" for k in ("p50", "p95", "p99"))


def latency_lines(r: dict) -> list[str]:
    """The bench table's throughput and latency lines (the offline bench's and --url's)."""
    return [f"requests/s        {r['requests_per_s']:.2f}",
            f"output tokens/s   {r['output_tokens_per_s']:.1f}",
            f"TTFT ms           {percentile_cells(r['ttft_ms'])}",
            f"TPOT ms           {percentile_cells(r['tpot_ms'])}",
            f"ITL ms            {percentile_cells(r['itl_ms'])}"]


def format_http_bench(r: dict) -> str:
    lines = [f"server            {r['url']} ({r['model']})", *latency_lines(r)]
    if r.get("kv_transfer"):
        t = r["kv_transfer"]
        mib = {k: v / 2**20 for k, v in t["bytes"].items()}
        lines += [f"KV transfer       {t['requests']} requests (packed, sent, received; percentiles within the "
                  f"server's histogram buckets)",
                  f"  MiB             {percentile_cells(mib, '8.2f')}  mean {mib['mean']:.2f}",
                  f"  ms              {percentile_cells(t['ms'])}  mean {t['ms']['mean']:.1f}"]
        if "hold_ms" in t:
            lines.append(f"  of which hold   {percentile_cells(t['hold_ms'])}  mean {t['hold_ms']['mean']:.1f}  "
                         f"(ms waiting for the decode engine's prefix-cache answer)")
    for name, c in r.get("classes", {}).items():
        lines += [f"{name} ({c['requests']} requests)",
                  f"  TTFT ms         {percentile_cells(c['ttft_ms'])}",
                  f"  TPOT ms         {percentile_cells(c['tpot_ms'])}"]
    return "\n".join(lines)
