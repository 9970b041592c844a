"""Batched sampling: turns one step's logits into one token per sequence, applying each
sequence's own SamplingParams, vectorised across the batch like vLLM's sampler.

Order of processing, per row (as vLLM and HF transformers):
  0. a constrained row's grammar mask, in place on the logits (so, as in vLLM, its logprobs are those
     of the masked logits); then logit_bias, bad words and the request's logits processors;
  1. penalties: repetition on prompt + output tokens (HF/vLLM: divide positive logits,
     multiply negative ones), then frequency and presence on output tokens (OpenAI:
     logit -= frequency * count + presence * [count > 0]);
  2. min_tokens: EOS and stop_token_ids get -inf until min_tokens tokens are out;
  3. greedy rows stop here and take the argmax (no randomness, no sort);
  4. temperature; 5. top-k; 6. top-p; 7. min-p (filters in probability space, each on
     the distribution the previous one left, renormalised);
  8. draw: argmax(probs / q) with q ~ Exp(1) per token, which picks token i with
     probability probs[i] (the exponential race); q comes from the row's own generator
     when it has a seed, so a seeded row's draws do not depend on the rest of the batch.
Logprobs are those of the raw model output (log_softmax of the unprocessed logits),
vLLM's default, so they do not change with temperature or filters.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.sequence import Sequence
from llmc.runtime.structured_output import apply_grammar_masks, consume


@dataclass
class SamplingState:
    """One sequence as the sampler sees it: its parameters and generator; its tokens are
    read from `seq`, never copied. Sample `sample_index` of an n > 1 request is seeded
    with seed + sample_index so the n samples differ (as vLLM)."""
    params: SamplingParams
    seq: Sequence
    sample_index: int = 0
    device: str | torch.device = "cpu"  # where the seeded generator draws
    generator: torch.Generator | None = None
    grammar: object = None  # the llguidance matcher of a constrained request, at this sequence's end
    bad_words_ids: list[list[int]] | None = None  # token sequences never to complete

    def __post_init__(self):
        if self.generator is None and self.params.seed is not None:
            self.generator = torch.Generator(device=self.device)
            self.generator.manual_seed(self.params.seed + self.sample_index)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # raw logprob of each sampled token; None when no row asked for logprobs (a log-softmax over the
    # vocabulary costs ~0.2 ms a row on the CPU: 13 ms of a batch-64 decode step)
    logprobs: list[float] | None
    # per row, its `params.logprobs` most likely (token_id, logprob), best first; [] for
    # rows that asked for none; None when no row asked
    top_logprobs: list[list[tuple[int, float]]] | None = None
    ranks: list[int] | None = None  # rank of each sampled token (1 = most likely), as above


class Sampler:
    def __init__(self, eos_token_id: int | Iterable[int] | None, seed: int | None = None):
        """`seed` seeds the generator shared by rows without their own seed; None uses
        torch's global RNG."""
        if eos_token_id is None:
            self.eos_token_ids = []
        elif isinstance(eos_token_id, int):
            self.eos_token_ids = [eos_token_id]
        else:
            self.eos_token_ids = list(eos_token_id)
        self.seed = seed
        self._shared_generators: dict[torch.device, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        # logits: [batch, vocab]
        assert logits.dim() == 2 and logits.shape[0] == len(states), (logits.shape, len(states))
        logits = logits.float()
        constrained = [i for i, s in enumerate(states) if s.grammar is not None]
        if constrained:
            apply_grammar_masks(logits, constrained, [states[i].grammar for i in constrained])
        processed = apply_request_processors(logits, states)
        processed = apply_penalties(processed, states)
        processed = self._mask_early_stops(processed, states)
        token_ids = processed.argmax(dim=-1)
        random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            sub_states = [states[i] for i in random_rows]
            probs = filtered_probs(processed[rows], [s.params for s in sub_states])
            token_ids[rows] = self._draw(probs, sub_states)
        if constrained:
            chosen = token_ids.tolist()
            for i in constrained:
                consume(states[i].grammar, chosen[i])
        return raw_logprobs(logits, token_ids, [s.params.logprobs for s in states])

    def _mask_early_stops(self, logits, states):
        """EOS and stop ids cannot be sampled before min_tokens tokens are out."""
        vocab = logits.shape[1]
        rows, cols = [], []
        for i, s in enumerate(states):
            if s.seq.num_output_tokens >= s.params.min_tokens:
                continue
            if s.grammar is not None and s.grammar.is_stopped():
                continue   # its grammar is complete and allows EOS alone
            eos = [] if s.params.ignore_eos else self.eos_token_ids
            for t in set(s.params.stop_token_ids) | set(eos):
                if t < vocab:
                    rows.append(i)
                    cols.append(t)
        if not rows:
            return logits
        index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
        return logits.index_put(index, torch.tensor(float("-inf"), device=logits.device))

    def _draw(self, probs, states):
        # probs: [rows, vocab], each row summing to 1 over the tokens it keeps
        q = self.noise(states, probs.shape[1], probs.device, "exponential")
        # exponential_ can return exactly 0 on some devices; keep the division finite
        return (probs / q.clamp_min_(1e-10)).argmax(dim=-1)

    def noise(self, states, width: int, device, kind: str) -> torch.Tensor:
        """[rows, width] draws ("exponential": Exp(1), "uniform": U[0, 1)), each row from its
        request's own generator when it has a seed, else from the shared one."""
        fill = {"exponential": torch.Tensor.exponential_, "uniform": torch.Tensor.uniform_}[kind]
        out = torch.empty(len(states), width, device=device)
        shared = [i for i, s in enumerate(states) if s.generator is None]
        if len(shared) == len(states):
            fill(out, generator=self._shared_generator(device))
        elif shared:
            rows = torch.tensor(shared, device=device)
            out[rows] = fill(torch.empty(len(shared), width, device=device),
                             generator=self._shared_generator(device))
        for i, s in enumerate(states):
            if s.generator is not None:
                out[i] = fill(torch.empty(width, device=s.generator.device), generator=s.generator)
        return out

    def _shared_generator(self, device):
        if self.seed is None:
            return None
        device = torch.device(device)
        if device not in self._shared_generators:
            self._shared_generators[device] = torch.Generator(device=device)
            self._shared_generators[device].manual_seed(self.seed)
        return self._shared_generators[device]


def apply_request_processors(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """logit_bias, bad words and the logits processors of each row's request; returns `logits`
    itself when no row has any, else a changed copy (the raw logits keep giving the logprobs)."""
    rows = [i for i, s in enumerate(states)
            if s.params.logit_bias or s.bad_words_ids or s.params.logits_processors]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for i in rows:
        s = states[i]
        bias = [(t, b) for t, b in (s.params.logit_bias or {}).items() if t < vocab]
        if bias:
            ids = torch.tensor([t for t, _ in bias], device=logits.device)
            logits[i, ids] += torch.tensor([b for _, b in bias], device=logits.device)
        banned = bad_word_tokens(s.seq.output_token_ids, s.bad_words_ids or [])
        if banned:
            logits[i, [t for t in banned if t < vocab]] = float("-inf")
        for process in s.params.logits_processors or []:
            logits[i] = call_processor(process, s.seq, logits[i])
    return logits


def call_processor(process, seq: Sequence, row: torch.Tensor) -> torch.Tensor:
    """vLLM's two forms: process(output_ids, logits) or process(prompt_ids, output_ids, logits)."""
    try:
        required = [p for p in inspect.signature(process).parameters.values() if p.default is p.empty
                    and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        takes_prompt = len(required) == 3
    except (TypeError, ValueError):   # a builtin without a signature
        takes_prompt = False
    if takes_prompt:
        return process(seq.prompt_token_ids, seq.output_token_ids, row)
    return process(seq.output_token_ids, row)


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word's token ids, alone and after a space (as vLLM: a word mid-text is usually
    tokenized with its leading space)."""
    out = []
    for word in words:
        for text in dict.fromkeys((word.lstrip(), " " + word.lstrip())):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if ids and ids not in out:
                out.append(ids)
    return out


def bad_word_tokens(output: list[int], bad_words_ids: list[list[int]]) -> set[int]:
    """The tokens that would complete one of `bad_words_ids` after `output` (vLLM's rule: a bad
    word's last token is banned where the tokens before it were just generated)."""
    banned = set()
    for word in bad_words_ids:
        prefix = word[:-1]
        if len(prefix) <= len(output) and (not prefix or output[len(output) - len(prefix):] == prefix):
            banned.add(word[-1])
    return banned


def apply_penalties(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens, then frequency and presence over
    output tokens. Returns `logits` itself when no row has a penalty."""
    params = [s.params for s in states]
    rep_rows = [p.repetition_penalty != 1.0 for p in params]
    out_rows = [r or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
                for r, p in zip(rep_rows, params)]
    if not any(out_rows):
        return logits
    vocab, device = logits.shape[1], logits.device
    output_counts = token_counts([s.seq.output_token_ids if need else []
                                  for s, need in zip(states, out_rows)], vocab, device)
    if any(rep_rows):
        prompt_counts = token_counts([s.seq.prompt_token_ids if need else []
                                      for s, need in zip(states, rep_rows)], vocab, device)
        penalty = _column([p.repetition_penalty for p in params], device)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where((prompt_counts + output_counts) > 0, penalised, logits)
    frequency = _column([p.frequency_penalty for p in params], device)
    presence = _column([p.presence_penalty for p in params], device)
    return logits - frequency * output_counts - presence * (output_counts > 0).float()


def token_counts(token_lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[batch, vocab] float32: how often each token occurs in each row's list."""
    width = max((len(t) for t in token_lists), default=0)
    # pad with an extra column `vocab`, dropped after the scatter
    ids = torch.full((len(token_lists), width), vocab, dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        ids[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    ids = ids.to(device)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p; returns [rows, vocab] probabilities."""
    vocab, device = logits.shape[1], logits.device
    logits = logits / _column([p.temperature for p in params], device)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        logits = apply_top_k_top_p(logits, torch.tensor(top_k, device=device),
                                   torch.tensor(top_p, device=device))
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = _column([p.min_p for p in params], device)
        # min-p keeps tokens at least min_p times as likely as the best one
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """One sort for the whole batch; top_k: [rows] (vocab = off), top_p: [rows] (1 = off).
    Top-k keeps ties with the k-th logit (as HF); top-p keeps the smallest prefix of the
    top-k distribution, renormalised, whose mass reaches p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    kth = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # rows with p = 1 skip the cut: float cumsum can reach 1 before the tail
    cut = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def raw_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                 num_top: list[int | None]) -> SamplerOutput:
    """Logprobs of the sampled tokens, and the top ones where asked, under log_softmax of
    the unprocessed logits; none when no row asks for logprobs, and without a full log_softmax
    when no row asks for top ones."""
    if all(k is None for k in num_top):
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=None)
    log_norm = torch.logsumexp(logits, dim=-1)
    chosen = logits.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    out = SamplerOutput(token_ids=token_ids.tolist(), logprobs=(chosen - log_norm).tolist())
    out.ranks = ((logits > chosen.unsqueeze(1)).sum(dim=-1) + 1).tolist()
    widest = min(max(k or 0 for k in num_top), logits.shape[1])
    top_values, top_ids = logits.topk(widest, dim=-1)
    top_values = (top_values - log_norm.unsqueeze(1)).tolist()
    top_ids = top_ids.tolist()
    out.top_logprobs = [list(zip(top_ids[i][:k or 0], top_values[i][:k or 0]))
                        for i, k in enumerate(num_top)]
    return out


def _column(values: list[float], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)
