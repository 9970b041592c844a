"""What a request gives back, shaped like vLLM's results (`RequestOutput` holding one
`CompletionOutput` per sample), each with `to_dict()` for the HTTP server."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # one dict per generated token
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id; None for EOS

    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_dict(self) -> dict:
        logprobs = None
        if self.logprobs is not None:
            logprobs = [{tid: lp.to_dict() for tid, lp in step.items()} for step in self.logprobs]
        return {"index": self.index, "text": self.text, "token_ids": list(self.token_ids),
                "cumulative_logprob": self.cumulative_logprob, "logprobs": logprobs,
                "finish_reason": self.finish_reason, "stop_reason": self.stop_reason}


@dataclass
class RequestMetrics:
    """Times are seconds from `time.monotonic()` (any one clock, used consistently)."""
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        if self.finished_time is None or self.first_token_time is None \
                or self.num_generated_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_generated_tokens - 1)

    @property
    def e2e(self) -> float | None:
        """End-to-end latency, arrival to finish."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    def to_dict(self) -> dict:
        return {**asdict(self), "ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e}


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    # with SamplingParams.prompt_logprobs: per prompt token, its logprob given the ones before (None first)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def to_dict(self) -> dict:
        prompt_logprobs = None if self.prompt_logprobs is None else [
            None if step is None else {tid: lp.to_dict() for tid, lp in step.items()} for step in self.prompt_logprobs]
        return {"request_id": self.request_id, "prompt": self.prompt,
                "prompt_token_ids": list(self.prompt_token_ids), "prompt_logprobs": prompt_logprobs,
                "outputs": [o.to_dict() for o in self.outputs], "finished": self.finished,
                "metrics": self.metrics.to_dict() if self.metrics is not None else None}
