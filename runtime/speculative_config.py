"""What speculative decoding a user asked for (`--speculative ngram|draft:PATH`, or
`speculative={"method": ..., ...}` in Python), checked when the engine is configured."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from llmc.errors import RuntimeLlmcError

METHODS = ("ngram", "draft")


@dataclass
class SpeculativeConfig:
    method: str                          # "ngram": prompt lookup; "draft": a draft artifact
    num_speculative_tokens: int = 4      # the most drafts verified per step (adaptive k stays below)
    model: str | None = None             # the draft artifact (method "draft")
    # n-gram sizes the lookup matches (method "ngram"); a one-token match seldom predicts what follows
    # (on the grounded workload its drafts kept 0.8 tokens on average, a 4-token match's 4.7)
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    adaptive: bool = True                # lower k, or stop drafting, for requests where it does not pay
    # n-gram continuations merged into a token tree (runtime/draft_tree.py) for greedy requests, each
    # up to k tokens; 1: one chain. Sampled requests verify the first as a chain.
    tree_candidates: int = 1

    def __post_init__(self):
        if self.method not in METHODS:
            raise RuntimeLlmcError(f"speculative method {self.method!r} is unknown; use 'ngram' or "
                                   "'draft' (with model=PATH of a draft artifact)")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "tree_candidates"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RuntimeLlmcError(f"speculative {name}={value!r} must be an integer >= 1")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise RuntimeLlmcError(f"speculative prompt_lookup_max={self.prompt_lookup_max} is below "
                                   f"prompt_lookup_min={self.prompt_lookup_min}; raise it")
        if not isinstance(self.adaptive, bool):
            raise RuntimeLlmcError(f"speculative adaptive={self.adaptive!r} must be True or False")
        self._check_model()

    def _check_model(self) -> None:
        if self.method == "draft" and self.tree_candidates != 1:
            raise RuntimeLlmcError(f"speculative tree_candidates={self.tree_candidates} needs method 'ngram' "
                                   "(a draft model proposes one chain); drop it or use method 'ngram'")
        if self.method == "ngram":
            if self.model is not None:
                raise RuntimeLlmcError("speculative method 'ngram' takes no model; drop it, or use "
                                       "method 'draft' to run a draft artifact")
            return
        if not isinstance(self.model, (str, Path)) or not str(self.model):
            raise RuntimeLlmcError("speculative method 'draft' needs model=PATH of a draft artifact "
                                   "(`llmc compile MODEL --draft-of TARGET -o PATH` builds one)")
        if not Path(self.model).is_dir():
            raise RuntimeLlmcError(f"speculative draft model '{self.model}' is no artifact directory; "
                                   "give the path of a draft artifact")
        self.model = str(self.model)


def speculative_config(value) -> SpeculativeConfig | None:
    """None, a SpeculativeConfig, a dict of its fields, or the CLI's 'ngram' / 'ngram:tree=N' /
    'draft:PATH'."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        method, _, rest = value.partition(":")
        if method == "ngram" and rest:
            return SpeculativeConfig(method, tree_candidates=_tree_candidates(rest))
        return SpeculativeConfig(method, model=rest or None)
    if not isinstance(value, dict):
        raise RuntimeLlmcError(f"speculative={value!r:.80} must be a dict such as {{'method': 'ngram', "
                               "'num_speculative_tokens': 5}, 'ngram' or 'draft:PATH'")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown or "method" not in value:
        problem = f"unknown key(s) {', '.join(map(str, unknown))}" if unknown else "no method"
        raise RuntimeLlmcError(f"speculative: {problem}; the keys are {', '.join(sorted(known))} "
                               "(method is required)")
    return SpeculativeConfig(**value)


def _tree_candidates(option: str) -> int:
    name, _, number = option.partition("=")
    if name != "tree" or not number.isdigit():
        raise RuntimeLlmcError(f"speculative 'ngram:{option}': the n-gram method takes only tree=N (N candidate "
                               "continuations merged into a token tree), e.g. 'ngram:tree=3'")
    return int(number)
