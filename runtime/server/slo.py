"""SLO-aware admission (`--ttft-slo-ms`): predict a new request's time to first token from the
prompt tokens that must be prefilled before and with it, at the speed the engine's last steps
ran; a request predicted to miss the SLO is refused at once (429 with Retry-After) instead of
queued to time out. Reject-early rather than deadline ordering: a deadline order would undo the
fair order between users, and a client told early can go to another replica."""

from __future__ import annotations

import math

# Weight of the newest step in the running averages: about the last ten steps count.
_SMOOTHING = 0.1


class TtftPredictor:
    def __init__(self, slo_seconds: float | None):
        self.slo_seconds = slo_seconds
        self.seconds_per_token: float | None = None   # step time over tokens in the step
        self.step_seconds: float | None = None

    def observe_step(self, seconds: float, batched_tokens: int) -> None:
        self.seconds_per_token = _average(self.seconds_per_token, seconds / max(batched_tokens, 1))
        self.step_seconds = _average(self.step_seconds, seconds)

    def predict(self, tokens_ahead: int) -> float | None:
        """Seconds until the first token of a request whose prefill is behind `tokens_ahead` prompt
        tokens (its own included); None before the engine has run a step (nothing measured yet)."""
        if self.seconds_per_token is None:
            return None
        return tokens_ahead * self.seconds_per_token + self.step_seconds

    def misses_slo(self, tokens_ahead: int) -> float | None:
        """The predicted TTFT when it is over the SLO, else None."""
        predicted = self.predict(tokens_ahead)
        if self.slo_seconds is None or predicted is None or predicted <= self.slo_seconds:
            return None
        return predicted

    def retry_after(self, tokens_ahead: int) -> int:
        """Whole seconds (at least 1) for the work ahead to clear, for a 429's Retry-After."""
        return max(1, math.ceil(self.predict(tokens_ahead) or 1))


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - _SMOOTHING) * old + _SMOOTHING * new
