"""Offline serving benchmark: a synthetic workload (prompt/output length distributions,
arrival all at once or Poisson) run through the engine, with latency percentiles, KV
figures, and optionally the same workload through HF transformers as a baseline."""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from llmc.errors import RuntimeLlmcError
from llmc.runtime.metrics import EngineMetrics, SpeculativeMetrics, percentiles
from llmc.runtime.sampling_params import SamplingParams
from llmc.tools.bench_workloads import text_prompts
from llmc.tools.hf_baseline import dequantised_weights


@dataclass
class Workload:
    num_requests: int = 64
    input_len: int = 128
    output_len: int = 128
    input_spread: float = 0.0        # lengths uniform in len * [1 - spread, 1 + spread]
    output_spread: float = 0.0
    prefix_len: int = 0              # tokens every prompt shares (prefix-cache workloads)
    qps: float = math.inf            # inf: all requests arrive at once; else Poisson arrivals
    seed: int = 0
    kind: str = "random"             # random token ids, or a text workload (llmc/tools/bench_workloads.py)
    ignore_eos: bool = False         # text requests end at EOS unless set; random ones have no natural end
    long_fraction: float = 0.0       # random workloads: this share of requests is "long" (the rest "short")
    long_input_len: int = 0          # a long request's prompt length (--input-len is a short one's)

    def __post_init__(self):
        self.ignore_eos = self.ignore_eos or self.kind == "random"
        for name in ("num_requests", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise RuntimeLlmcError(f"bench: --{name.replace('_', '-')} must be at least 1")
        if not 0 <= self.input_spread < 1 or not 0 <= self.output_spread < 1:
            raise RuntimeLlmcError("bench: length spreads must lie in [0, 1)")
        if self.prefix_len < 0 or self.seed < 0:
            raise RuntimeLlmcError("bench: --prefix-len and --seed must be at least 0")
        if not self.qps > 0:  # also nan: no request would ever arrive
            raise RuntimeLlmcError(f"bench: --qps is {self.qps}; it must be positive (or inf for all at once)")
        if not 0 <= self.long_fraction <= 1 or (self.long_fraction > 0) != (self.long_input_len > 0):
            raise RuntimeLlmcError("bench: --long-fraction (in [0, 1]) and --long-input-len go together")
        if self.long_fraction > 0 and self.kind != "random":
            raise RuntimeLlmcError("bench: long and short requests mix in random workloads only")

    def build(self, vocab_size: int, tokenizer=None) -> list[dict]:
        """The requests; a text workload's prompts (their own lengths) need the tokenizer."""
        rng = np.random.default_rng(self.seed)
        prefix = rng.integers(0, vocab_size, self.prefix_len).tolist()
        gaps = np.zeros(self.num_requests) if math.isinf(self.qps) else rng.exponential(1 / self.qps, self.num_requests)
        arrivals = np.cumsum(gaps) - gaps[0]
        texts = None if self.kind == "random" else text_prompts(self.kind, self.num_requests, self.seed)
        # a mixed workload's classes are drawn from their own stream: the short requests keep their lengths
        long = np.random.default_rng([self.seed, 1]).random(self.num_requests) < self.long_fraction
        reqs = []
        for i in range(self.num_requests):
            n_in = _spread(rng, self.long_input_len if long[i] else self.input_len, self.input_spread)
            n_out = _spread(rng, self.output_len, self.output_spread)
            ids = prefix + (rng.integers(0, vocab_size, max(1, n_in - self.prefix_len)).tolist() if texts is None
                            else tokenizer(texts[i])["input_ids"])
            reqs.append({"prompt_token_ids": ids, "max_tokens": n_out, "ignore_eos": self.ignore_eos,
                         "arrival": float(arrivals[i])} | ({"class": "long" if long[i] else "short"}
                                                            if self.long_fraction > 0 else {}))
        return reqs


def _spread(rng, n: int, spread: float) -> int:
    return n if spread == 0 else int(rng.integers(max(1, round(n * (1 - spread))), round(n * (1 + spread)) + 1))


@dataclass
class StepTotals:
    """Wall time inside engine.step(), and the part of it spent in decode steps: steps whose
    every token was a sequence's next one (no prompt tokens), each reading the weights once."""
    seconds: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0

    def add(self, metrics, steps_before: int, new_tokens: int, seconds: float) -> None:
        self.seconds += seconds
        if metrics.steps > steps_before and metrics.batch_tokens[-1] == new_tokens > 0:
            self.decode_steps += 1
            self.decode_tokens += new_tokens
            self.decode_seconds += seconds


@dataclass
class BenchResult:
    requests_per_s: float
    output_tokens_per_s: float
    total_seconds: float
    ttft_ms: dict
    tpot_ms: dict
    itl_ms: dict
    kv_waste: float | None = None
    prefix_hit_rate: float | None = None
    preemptions: int | None = None
    peak_kv_usage: float | None = None
    kv_window: dict | None = None   # blocks given back behind a sliding window (window_report)
    timeline: list[tuple[float, int]] = field(default_factory=list)   # (seconds, tokens) per step
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    steps: StepTotals = field(default_factory=StepTotals)
    output_tokens: int = 0
    decode_tpot_s: float | None = None   # see decode_time_per_token
    token_ids: dict[str, list[int]] = field(default_factory=dict)   # each request's output (llmc runs)
    metrics: EngineMetrics | None = None   # the engine's over this run (llmc runs)
    kv_per_seq: dict | None = None   # KV bytes each sequence held at its most (kv_held_report)

    def to_dict(self) -> dict:
        keys = ("requests_per_s", "output_tokens_per_s", "output_tokens", "total_seconds", "ttft_ms", "tpot_ms",
                "itl_ms", "kv_waste", "prefix_hit_rate", "preemptions", "peak_kv_usage", "kv_window", "kv_per_seq")
        return {k: getattr(self, k) for k in keys}


def run_engine(engine, requests: list[dict], progress: bool = True) -> BenchResult:
    """Feed requests at their arrival times, step until all finish; time every token."""
    pending = sorted(enumerate(requests), key=lambda r: r[1]["arrival"])
    token_times: dict[str, list[float]] = {}
    arrival: dict[str, float] = {}
    timeline: list[tuple[float, int]] = []
    bar = tqdm(total=len(requests), desc="bench", unit="req", disable=not progress)
    start = time.perf_counter()
    total_tokens, totals, finished = 0, StepTotals(), []
    bm = engine.block_manager
    dropped_before, peak_dropped = bm.total_dropped_blocks, 0
    held: dict[int, list[int]] = {}   # seq_id -> [most blocks held, tokens at the end]
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0][1]["arrival"] <= now:
            i, r = pending.pop(0)
            rid = f"bench-{i}"
            params = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=r["ignore_eos"])
            engine.add_request(rid, prompt_token_ids=r["prompt_token_ids"], params=params,
                               arrival_time=time.monotonic())
            arrival[rid], token_times[rid] = now, []
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][1]["arrival"] - now))
            continue
        steps_before, t0 = engine.metrics.steps, time.perf_counter()
        outs = engine.step()
        t = time.perf_counter() - start
        seconds = time.perf_counter() - t0
        step_tokens = 0
        for out in outs:
            n = len(out.outputs[0].token_ids) - len(token_times[out.request_id])
            token_times[out.request_id] += [t] * n
            step_tokens += n
            if out.finished:
                finished.append(out)
                bar.update(1)
        total_tokens += step_tokens
        timeline.append((t, step_tokens))
        totals.add(engine.metrics, steps_before, step_tokens, seconds)
        peak_dropped = max(peak_dropped, bm.num_dropped_blocks)
        for seq in engine.scheduler.running:
            most = held.setdefault(seq.seq_id, [0, 0])
            most[0], most[1] = max(most[0], len(seq.live_blocks)), seq.num_tokens
    total = time.perf_counter() - start
    bar.close()
    token_ids = {out.request_id: list(out.outputs[0].token_ids) for out in finished}
    ttft = [ts[0] - arrival[r] for r, ts in token_times.items() if ts]
    itl = [b - a for ts in token_times.values() for a, b in zip(ts, ts[1:])]
    tpot = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in token_times.values() if len(ts) > 1]
    m = engine.metrics
    return BenchResult(len(requests) / total, total_tokens / total, total, percentiles(ttft, 1e3),
                       percentiles(tpot, 1e3), percentiles(itl, 1e3), m.kv_waste, m.prefix_hit_rate,
                       m.preemptions, m.peak_kv_usage,
                       window_report(engine, bm.total_dropped_blocks - dropped_before, peak_dropped),
                       timeline, ttft, itl, tpot, totals, total_tokens, decode_time_per_token(token_times.values()),
                       token_ids, m, kv_per_seq=kv_held_report(engine, held))


def kv_held_report(engine, held: dict[int, list[int]]) -> dict | None:
    """KV bytes a sequence held at its most (whole blocks, mean and max over the run's sequences), beside
    what the full cache holds for its tokens, and the KV policy that held it there (runtime/kv_policy.py)."""
    if not held:
        return None
    bs = engine.block_manager.block_size
    block = bs * engine.model["kv_bytes_per_token"]
    peaks = [most * block for most, _ in held.values()]
    full = [-(-tokens // bs) * block for _, tokens in held.values()]
    policy = getattr(engine, "kv_policy", None)
    return {"mean_bytes": sum(peaks) / len(peaks), "max_bytes": max(peaks),
            "full_cache_mean_bytes": sum(full) / len(full), "policy": policy.describe() if policy else "none"}


def median_run(runs: list[BenchResult]) -> BenchResult:
    """The run with the median output tokens/s (the faster middle one of an even count): every
    figure reported comes from that one run, so latencies and throughput agree."""
    return sorted(runs, key=lambda r: r.output_tokens_per_s)[len(runs) // 2]


def run_engine_repeated(engine, requests: list[dict], repeats: int, progress: bool = True,
                        after_each: Callable[[], None] | None = None) -> list[BenchResult]:
    """`repeats` runs of the same requests, each from an empty prefix cache and fresh metrics (a
    later run must not find the earlier one's prompts cached); `after_each` runs after each (a
    baseline alternating with them)."""
    runs = []
    for i in range(repeats):
        if i:
            fresh_run(engine)
        runs.append(run_engine(engine, requests, progress))
        if after_each is not None:
            after_each()
    return runs


def fresh_run(engine) -> None:
    """Ready `engine` to run a workload again as the first time: an empty prefix cache, fresh metrics."""
    if not engine.block_manager.reset_prefix_cache():
        raise RuntimeLlmcError("bench: a run left sequences holding KV blocks; cannot repeat it cleanly")
    _fresh_metrics(engine)


def _fresh_metrics(engine) -> None:
    """Metrics that count from now (the scheduler's cumulative counters, which they copy, too)."""
    engine.scheduler.reset_counters()
    engine.metrics = EngineMetrics(speculative=SpeculativeMetrics() if engine.speculator else None)
    if engine.speculator:
        engine.speculator.metrics = engine.metrics.speculative


def decode_time_per_token(token_times) -> float | None:
    """Seconds per output token after each request's first, weighted by tokens: the mean of the
    requests' TPOTs would weigh a request that stopped early at EOS as much as a long one."""
    spans = [(ts[-1] - ts[0], len(ts) - 1) for ts in token_times if len(ts) > 1]
    tokens = sum(n for _, n in spans)
    return sum(s for s, _ in spans) / tokens if tokens else None


def window_report(engine, dropped: int, peak: int) -> dict | None:
    """What dropping KV blocks behind the sliding window gave back in a run (None without a window):
    blocks dropped, the most dropped at once, and the bytes those held."""
    bm = engine.block_manager
    if bm.window is None:
        return None
    return {"window": bm.window, "blocks_dropped": dropped, "peak_blocks_dropped": peak,
            "peak_bytes_saved": peak * bm.block_size * engine.model["kv_bytes_per_token"]}


def warm_up(engine) -> None:
    """One short request through every code path a timed run takes (first calls into torch cost
    more), so two engines compared in one run both start warm."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("warm-up", prompt_token_ids=[engine.eos_token_ids[0] ^ 1] * 16, params=params)
    while engine.has_unfinished():
        engine.step()
    _fresh_metrics(engine)


def speculative_summary(engine, ours: BenchResult, plain: BenchResult) -> dict:
    """A speculative run against the plain run of the same workload: acceptance and speedup.
    Greedy speculation gives plain decoding's tokens, so both runs did the same work; whether
    they did is reported, and the speedups divide tokens per second either way."""
    config = engine.config.speculative
    return {**engine.metrics.speculative.to_dict(), "method": config.method,
            "num_speculative_tokens": config.num_speculative_tokens, "draft": config.model,
            "plain_output_tokens_per_s": plain.output_tokens_per_s, "plain_tpot_ms": plain.tpot_ms,
            "same_tokens_as_plain": ours.token_ids == plain.token_ids,
            # what the policy priced a step of n rows at (runtime/step_cost.py): measured here, or fixed
            "step_cost": {**vars(engine.speculator.step_cost), **engine.speculator.step_cost_record}
            if engine.speculator else None,
            "speedup": ours.output_tokens_per_s / plain.output_tokens_per_s,
            # decode alone (time per output token): the prefill, the same in both, left out
            "decode_speedup": plain.decode_tpot_s / ours.decode_tpot_s
            if ours.decode_tpot_s and plain.decode_tpot_s else None}


# fused projection (passes/fuse_projections.py names it <prefix>.<kind>_proj) -> its parts, in order
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def unfused_weights(weights: dict[str, torch.Tensor], hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` with each fused q/k/v or gate/up projection split back into the HF model's
    separate ones (row counts from the HF model's own shapes)."""
    out = {}
    for name, tensor in weights.items():
        module, _, leaf = name.rpartition(".")          # model.layers.0.self_attn.qkv_proj, weight
        stem, _, kind = module.rpartition(".")
        parts = [f"{stem}.{p}.{leaf}" for p in FUSED_PARTS.get(kind, ())]
        if parts and all(p in hf_state for p in parts):
            sizes = [hf_state[p].shape[0] for p in parts]
            if sum(sizes) == tensor.shape[0]:
                out.update(zip(parts, tensor.split(sizes)))
                continue
        out[name] = tensor
    return out


_LAYER = re.compile(r"^(model\.layers\.)(\d+)(\..*)$")


def renumbered_layers(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Layer-pruned weights keep their original layer numbers; HF wants 0..n-1 in order."""
    kept = sorted({int(m.group(2)) for name in weights if (m := _LAYER.match(name))})
    new = {old: i for i, old in enumerate(kept)}
    return {(_LAYER.sub(lambda m: f"{m.group(1)}{new[int(m.group(2))]}{m.group(3)}", name)): t
            for name, t in weights.items()}


def pruned_shapes(meta: dict, weights: dict[str, torch.Tensor]) -> dict:
    """HF config fields as the compiled graph has them: pruning and KV-head conversion change
    layers, heads and the FFN width, the source config does not."""
    shapes = {"num_hidden_layers": meta["num_layers"], "num_attention_heads": meta["num_heads"],
              "num_key_value_heads": meta["num_kv_heads"], "head_dim": meta["head_dim"]}
    down = next((t for name, t in weights.items() if name.endswith("mlp.down_proj.weight")), None)
    if down is not None:
        shapes["intermediate_size"] = down.shape[1]
    return shapes


def hf_model_from_artifact(engine) -> torch.nn.Module:
    """Rebuild the HF model from the artifact's own config and weights (same numbers, no
    download), so the baseline runs exactly what we compiled; quantised weights are dequantised
    to fp32 (llmc/tools/hf_baseline.py), so HF does the fp32 work the source model would."""
    import transformers  # transformers: ~0.5 s; only the HF baseline

    if "parallel" in engine.manifest:  # rank 0 holds its part of the weights only
        raise RuntimeLlmcError("--baseline hf rebuilds the model from the artifact's weights, and a tensor-parallel "
                               "artifact's ranks each hold a part; give the unsharded artifact as --baseline PATH")
    plan, weight = engine.executor.plan, engine.executor.weight
    dequantised, replaced = dequantised_weights(plan, weight)
    weights = renumbered_layers({name: weight(name) for name in plan.params if name not in replaced} | dequantised)
    cfg_dict = {**engine.manifest["model"]["hf_config"], **pruned_shapes(engine.model, weights)}
    arch = engine.model["architecture"]
    config = transformers.AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
    config._attn_implementation = "sdpa"
    model = getattr(transformers, arch)(config).eval()
    weights = unfused_weights(weights, model.state_dict())
    missing, _ = model.load_state_dict(weights, strict=False)
    tied = "model.embed_tokens.weight" if config.tie_word_embeddings else None
    missing = [m for m in missing if "rotary_emb" not in m and m != tied]
    if missing:
        raise RuntimeLlmcError(f"artifact weights do not cover HF {arch}: missing {missing[:4]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def run_hf_baseline(model, requests: list[dict], pad_id: int, eos_token_ids: list[int],
                    batch_size: int | None = None, progress: bool = True) -> BenchResult:
    """HF `generate`, left-padded batches of `batch_size` (all at once by default), greedy, after an
    untimed warm-up; requests that honour EOS stop at any of `eos_token_ids`, as the engine's do."""
    batch_size = batch_size or len(requests)
    bar = tqdm(total=len(requests), desc="hf baseline", unit="req", disable=not progress)
    warm_up_hf(model, pad_id, eos_token_ids)
    start = time.perf_counter()
    tokens, ttft = 0, []
    for b in range(0, len(requests), batch_size):
        chunk = requests[b:b + batch_size]
        width = max(len(r["prompt_token_ids"]) for r in chunk)
        ids = torch.full((len(chunk), width), pad_id)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, r in enumerate(chunk):
            p = r["prompt_token_ids"]
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        n_out = max(r["max_tokens"] for r in chunk)
        fixed = all(r["ignore_eos"] for r in chunk)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n_out, min_new_tokens=n_out if fixed else 0,
                                 do_sample=False, pad_token_id=pad_id, eos_token_id=eos_token_ids)
        tokens += sum(produced(row[width:].tolist(), r["max_tokens"], () if fixed else eos_token_ids)
                      for row, r in zip(out, chunk))
        ttft += [time.perf_counter() - t0] * len(chunk)   # no streaming: tokens arrive at the end
        bar.update(len(chunk))
    total = time.perf_counter() - start
    bar.close()
    none = percentiles([])
    return BenchResult(len(requests) / total, tokens / total, total, percentiles(ttft, 1e3), none, none,
                       output_tokens=tokens)


def produced(generated: list[int], max_tokens: int, eos_token_ids) -> int:
    """Tokens a request got from a batched `generate`: up to and including its first EOS (HF pads
    a finished row until the batch ends), at most its own max_tokens."""
    end = next((i + 1 for i, t in enumerate(generated) if t in eos_token_ids), len(generated))
    return min(end, max_tokens)


def warm_up_hf(model, pad_id: int, eos_token_ids: list[int]) -> None:
    """A short untimed `generate`, so the baseline starts as warm as the engine (warm_up)."""
    ids = torch.full((1, 16), eos_token_ids[0] ^ 1)
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                       do_sample=False, pad_token_id=pad_id)
