"""The server's Prometheus metrics, named as vLLM's with the prefix `llmc:` (colons are legal in
metric names and reserved for such recording-rule-like namespaces), each labelled with the
served model's name. Token counters and per-request histograms are recorded when a request
finishes, so after N requests they equal the `usage` the N responses reported."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's buckets (seconds, and tokens per step).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_STEP_SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# vLLM's 1-2-5 series for per-request token counts
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name}
        gauge, counter, histogram = self._family(Gauge), self._family(Counter), self._family(Histogram)
        self.running = gauge("num_requests_running", "Requests in the engine's running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting: in the server's queue or the engine's.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks held by live requests (0-1).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.preemptions = counter("num_preemptions", "Sequences preempted (recomputed later) for KV blocks.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", buckets=_TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between a request's successive tokens.",
                             buckets=_ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", buckets=_REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival until the engine first schedules it.",
                                    buckets=_REQUEST_BUCKETS)
        self.step_tokens = histogram("iteration_tokens_total", "Tokens in one engine step (the batch size).",
                                     buckets=_STEP_TOKEN_BUCKETS)
        self.step_seqs = histogram("iteration_sequences", "Sequences in one engine step's batch.",
                                   buckets=_STEP_SEQ_BUCKETS)
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative decoding: drafts verified (one per "
                                   "sequence and step).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens proposed.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.")
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of each finished request.",
                                               buckets=_TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens", "Generated tokens of each "
                                                   "finished request.", buckets=_TOKEN_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "A finished request's mean time per output token "
                              "after the first.", buckets=_ITL_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled until its first token.",
                                      buckets=_REQUEST_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token until finished.",
                                     buckets=_REQUEST_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "First scheduled until finished.",
                                        buckets=_REQUEST_BUCKETS)
        self.result_cache_hits = counter("result_cache_hits", "Requests answered from the result cache.")
        self.result_cache_misses = counter("result_cache_misses", "Requests the result cache could have answered "
                                           "(their output is determined) but did not hold.")
        self.semantic_cache_hits = counter("semantic_cache_hits", "Opted-in requests answered with the result "
                                           "of a request close in meaning.")
        self.semantic_cache_misses = counter("semantic_cache_misses", "Opted-in requests the semantic cache "
                                             "held nothing close enough to.")
        self.result_cache_bytes = gauge("result_cache_bytes", "Bytes the result cache holds.")
        self._success = Counter("llmc:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)

    def _family(self, kind):
        def make(name, doc, **kw):
            return kind(f"llmc:{name}", doc, list(self.labels), registry=self.registry, **kw).labels(**self.labels)
        return make

    def request_finished(self, finish_reason: str, prompt_tokens: int, generation_tokens: int,
                         e2e: float | None, metrics=None, scheduled_at: float | None = None) -> None:
        """`metrics`: the request's RequestMetrics; `scheduled_at`: when the engine first ran it (same clock)."""
        self._success.labels(finished_reason=finish_reason, **self.labels).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        if e2e is not None:
            self.e2e.observe(e2e)
        if metrics is not None:
            self._phases(metrics, scheduled_at)

    def _phases(self, m, scheduled_at: float | None) -> None:
        if m.tpot is not None:
            self.tpot.observe(m.tpot)
        first, done = m.first_token_time, m.finished_time
        if scheduled_at is not None and first is not None:
            self.prefill_time.observe(max(first - scheduled_at, 0.0))
        if first is not None and done is not None:
            self.decode_time.observe(max(done - first, 0.0))
        if scheduled_at is not None and done is not None:
            self.inference_time.observe(max(done - scheduled_at, 0.0))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
