"""Speculative decoding in the engine: before a step, a proposer (n-gram prompt lookup or a draft
artifact) drafts up to k tokens for each running request that may speculate; the step scores them
in the same target forward as everything else; afterwards the rejection sampler keeps a prefix of
them plus one token. Each request's k follows its own acceptance rate and what a draft costs (the
target step grows, a draft model reads its weights), and drops to 0 (plain decoding) where drafting
would not pay."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmc.errors import RuntimeLlmcError
from llmc.runtime.draft_proposer import DraftProposer
from llmc.runtime.draft_tree import DraftTree, merge_candidates
from llmc.runtime.metrics import SpeculativeMetrics
from llmc.runtime.ngram_proposer import NgramProposer
from llmc.runtime.paged_attention import PagedAttention
from llmc.runtime.rejection_sampler import rejection_sample
from llmc.runtime.sampler import Sampler, SamplingState, filtered_probs
from llmc.runtime.sequence import Sequence
from llmc.runtime.speculative_config import SpeculativeConfig
from llmc.runtime.step_cost import StepCost, measured_step_cost

PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.7, 1.0   # optimistic, so a request tries drafting first
DECAY = 0.95             # per verified step: acceptance follows what the request writes now
PROBE_AFTER = 64         # steps a request decodes plainly before it drafts again, to re-measure
PROBE_LONG_MATCH = 8     # the same, when prompt lookup matched its longest n-gram
PROBE_RATE = 0.9         # a probe is made only where drafts kept at this rate (a request copying its prompt) pay
MARGIN = 0.05            # drafting must promise this much more than plain decoding (see _paying_k)


# where the step cost is not measured (runtime/step_cost.py: a GPU, Triton's interpreter, tensor-parallel
# ranks, a KV cache too small to measure in), or before it is: on a CPU, MKL's matrix product of 4 to
# 8 rows costs about twice the 1-row GEMV; with oneDNN-blocked fp32 weights from 4 rows
# (cpu_kernels.blocked_linear_weight) a step verifying 1 draft cost 1.06x a decode step, 3 drafts
# 1.35x, 5 drafts 1.48x (SmolLM2, one thread, interleaved)
STEP_COSTS = {"cpu": StepCost(jump=1.0, per_token=0.1), "cpu-blocked": StepCost(jump=0.1, per_token=0.08),
              "cuda": StepCost(jump=0.0, per_token=0.02)}


@dataclass
class _Acceptance:
    """One sequence's recent acceptance: kept drafts over drafts tested (a draft after a rejected
    one is never tested), decayed."""
    seq: Sequence
    kept: float = 0.0
    tested: float = 0.0
    steps_off: int = 0

    @property
    def rate(self) -> float:
        return (self.kept + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (self.tested + PRIOR_WEIGHT)

    def update(self, num_drafts: int, num_accepted: int) -> None:
        self.kept = DECAY * self.kept + num_accepted
        self.tested = DECAY * self.tested + num_accepted + (num_accepted < num_drafts)


class Speculator:
    def __init__(self, config: SpeculativeConfig, engine):
        self.config = config
        self.sampler: Sampler = engine.sampler
        if config.method == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        else:
            self.proposer = DraftProposer(config.model, engine)
        self.max_model_len = engine.max_model_len
        self.acceptance: dict[int, _Acceptance] = {}
        self.step_cost = STEP_COSTS.get(engine.device.type, STEP_COSTS["cuda"])
        # verification multiplies k + 1 rows: see StepCost
        if engine.device.type == "cpu" and engine.executor.block_linear_weights() > _weight_bytes(engine.executor) / 2:
            self.step_cost = STEP_COSTS["cpu-blocked"]
        self.step_cost_record: dict = {"fixed": "not measured on this device"}
        if engine.device.type == "cpu" and engine.executor.family == "cpu" and "parallel" not in engine.manifest:
            measured = measured_step_cost(engine.executor, engine.runner.attention, engine.config.threads)
            if measured is not None:
                self.step_cost, self.step_cost_record = measured
        # a draft forward over a target one: both read their weights once
        self.draft_forward_cost = 0.0 if config.method == "ngram" else \
            _weight_bytes(self.proposer.runner.executor) / _weight_bytes(engine.executor)
        self.metrics = SpeculativeMetrics()
        self.cache = engine.cache
        if config.tree_candidates > 1:
            _check_trees_run(engine)

    # -- before the step -----------------------------------------------------------------
    def propose(self, seqs: list[Sequence], states: list[SamplingState]) -> dict[int, list[int]]:
        """Drafts for the decoding sequences that speculate now: seq_id -> tokens; the draft
        distributions they came from are kept for verify."""
        out = self._propose_ngram(seqs, states) if isinstance(self.proposer, NgramProposer) else \
            self._propose_draft(seqs, states)
        self.metrics.on_proposed(len(seqs), len(out))
        return out

    def _propose_draft(self, seqs: list[Sequence], states: list[SamplingState]) -> dict[int, list[int]]:
        step = [float(len(seqs)), float(len(seqs))]   # rows and expected tokens so far: see _k
        ks = [self._k(seq, state, len(seqs), step=step) for seq, state in zip(seqs, states)]
        chosen = [i for i, k in enumerate(ks) if k > 0]
        drafts, probs = self.proposer.propose([seqs[i] for i in chosen], [ks[i] for i in chosen],
                                              [states[i] for i in chosen])
        self._draft_probs = {seqs[i].seq_id: q for i, q in zip(chosen, probs)}
        for d in drafts:
            if not d:
                self.metrics.on_aside("the draft model proposed nothing")
        return {seqs[i].seq_id: d for i, d in zip(chosen, drafts) if d}

    def _propose_ngram(self, seqs: list[Sequence], states: list[SamplingState]) -> dict[int, list[int]]:
        """Look up first (it costs microseconds), then choose k only where there is a match: a
        step without one is no evidence, and a match of the longest n makes a probe worth it."""
        self._draft_probs = {}
        limits = [self._limit(seq, state) for seq, state in zip(seqs, states)]
        out = {}
        count = self.config.tree_candidates
        step = [float(len(seqs)), float(len(seqs))]   # rows and expected tokens so far: see _k
        for seq, state, limit, (found, n) in zip(seqs, states, limits, self.proposer.lookups(seqs, limits, count)):
            if found:
                k = self._k(seq, state, len(seqs), long_match=n >= self.config.prompt_lookup_max, step=step)
                if k > 0:   # a sampled request verifies one chain: see rejection_sample
                    found = found if state.params.greedy else found[:1]
                    out[seq.seq_id] = merge_candidates([c[:k] for c in found], k * len(found))
            else:
                self.metrics.on_aside("no n-gram match" if limit > 0 else self._aside_reason(seq, state))
        return out

    def _limit(self, seq: Sequence, state: SamplingState) -> int:
        """The most drafts `seq` may verify now: none if its request cannot speculate exactly
        (penalties, logprobs, min_tokens still pending); else k within its token limits."""
        p = state.params
        if (p.logprobs is not None or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                or p.presence_penalty != 0.0 or seq.num_output_tokens < p.min_tokens):
            return 0
        room = self.max_model_len - seq.num_tokens - 1
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - seq.num_output_tokens - 1)
        return max(min(self.config.num_speculative_tokens, room), 0)

    def _aside_reason(self, seq: Sequence, state: SamplingState) -> str:
        """Why _limit gave `seq` no drafts."""
        p = state.params
        if p.logprobs is not None or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 \
                or p.presence_penalty != 0.0:
            return "request asks for logprobs or penalties"
        return "min_tokens pending" if seq.num_output_tokens < p.min_tokens else "at its token limit"

    def _k(self, seq: Sequence, state: SamplingState, batch: int, long_match: bool = False,
           step: list[float] | None = None) -> int:
        """How many drafts `seq` gets now, in a step of `batch` decodes: the k within _limit that
        makes the most tokens per unit of step time at its acceptance rate. `step` ([rows, expected
        tokens] of the step so far: the decodes and the drafts given to sequences before this one) is
        updated with this one's, so each prices its drafts against the rows the others already added
        (a step of 4 decodes and two sequences' 4 drafts is 12 rows, not 8 twice). Off (k = 0), it
        probes again after PROBE_AFTER steps, or PROBE_LONG_MATCH when prompt lookup matched a
        suffix of the longest n (copying resumed: extraction answers quote in stretches)."""
        step = step if step is not None else [float(batch), float(batch)]
        k = self._chosen_k(seq, state, int(step[0]), long_match, step[1])
        if k > 0:
            rate = self.acceptance[seq.seq_id].rate if seq.seq_id in self.acceptance else PRIOR_ACCEPTANCE
            step[0] += k
            step[1] += sum(rate ** j for j in range(1, k + 1))
        return k

    def _chosen_k(self, seq: Sequence, state: SamplingState, rows: int, long_match: bool, tokens: float) -> int:
        """_k's choice for `seq`, given the step's rows and expected tokens before it."""
        k = self._limit(seq, state)
        if k <= 0:
            self.metrics.on_aside(self._aside_reason(seq, state))
        if not self.config.adaptive or k <= 0:
            return k
        acc = self.acceptance.setdefault(seq.seq_id, _Acceptance(seq))
        best = self._paying_k(acc.rate, k, rows, tokens)
        if best == 0:
            # a probe measures acceptance again, with the k that would pay most were the drafts kept as a
            # copying request's are: none where even that would not pay for the rows it adds
            probe = self._paying_k(PROBE_RATE, k, rows, tokens)
            if probe == 0:
                self.metrics.on_aside("would not pay even at a copying request's acceptance")
                return 0
            acc.steps_off += 1
            if acc.steps_off < (PROBE_LONG_MATCH if long_match else PROBE_AFTER):
                self.metrics.on_aside("would not pay at its acceptance rate")
                return 0
            acc.kept, acc.tested = 0.0, 0.0  # forget, and measure again
            best = probe
        acc.steps_off = 0
        return best

    def _paying_k(self, rate: float, limit: int, rows: int, tokens: float) -> int:
        """The k <= limit making the most tokens per unit of step time at `rate`, or 0 where that beats
        plain decoding by less than MARGIN (the step cost prices the forward, not the drafting and
        verification around it)."""
        score = lambda j: self.tokens_per_cost(rate, j, rows, tokens)
        best = max(range(limit + 1), key=score)
        return best if score(best) > (1 + MARGIN) * score(0) else 0

    def tokens_per_cost(self, rate: float, k: int, batch: int, tokens: float | None = None) -> float:
        """Tokens a step makes per unit of its time when, to a step of `batch` rows expected to make
        `tokens` tokens (default: `batch` decodes), one sequence adds k drafts kept with probability
        `rate` each (expected rate + ... + rate^k more tokens)."""
        made = (batch if tokens is None else tokens) + sum(rate ** j for j in range(1, k + 1))
        cost = self.step_cost.of(batch + k) + self.draft_forward_cost * k
        return made / cost

    # -- after the step ------------------------------------------------------------------
    def verify(self, seqs: list[Sequence], logits: torch.Tensor, states: list[SamplingState],
               drafts: dict[int, list[int]]) -> list[list[int]]:
        """The tokens each sequence keeps: its accepted drafts and one more. `logits` holds
        1 + k rows per sequence, in order (ModelRunner.execute's layout)."""
        starts = np.cumsum([0] + [len(drafts[s.seq_id]) + 1 for s in seqs[:-1]])
        kept: list[list[int]] = [[] for _ in seqs]
        sampled = [i for i, state in enumerate(states) if not state.params.greedy]
        if sampled:
            rows = self._verify_chains([seqs[i] for i in sampled], logits, [starts[i] for i in sampled],
                                       [states[i] for i in sampled], drafts)
            for i, row in zip(sampled, rows):
                kept[i] = row
        for i, seq in enumerate(seqs):
            if states[i].params.greedy:
                tree = _as_tree(drafts[seq.seq_id])
                kept[i] = self._verify_tree(seq, tree, logits[starts[i]:starts[i] + len(tree) + 1])
        return kept

    def _verify_tree(self, seq: Sequence, tree: DraftTree, logits: torch.Tensor) -> list[int]:
        """A greedy request's drafts (a chain is a tree of one branch): the path the target's argmax
        follows, which is what rejection sampling keeps against a one-hot p, without building the
        distributions; its KV moved from the path's rows to the positions its tokens now hold (a
        chain's, and the first candidate's, are in place)."""
        kept, path = tree.accept_greedy(logits.argmax(dim=-1).tolist())
        depths = tree.depths()
        moved = [(node + 1, depths[node]) for node in path if node + 1 != depths[node]]
        if moved:
            start = seq.num_computed_tokens
            self.cache.copy_slots([self._slot(seq, start + row) for row, _ in moved],
                                  [self._slot(seq, start + depth) for _, depth in moved])
        self._record(seq, max(depths), len(path))
        return kept

    def _slot(self, seq: Sequence, position: int) -> int:
        size = self.cache.block_size
        return seq.block_table[position // size] * size + position % size

    def _record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        self.metrics.on_verified(num_drafts, num_accepted)
        self.acceptance.setdefault(seq.seq_id, _Acceptance(seq)).update(num_drafts, num_accepted)

    def _verify_chains(self, seqs: list[Sequence], logits: torch.Tensor, starts: list[int],
                       states: list[SamplingState], drafts: dict[int, list[int]]) -> list[list[int]]:
        """Rejection sampling over chains of drafts whose rows begin at `starts`."""
        ks = [len(drafts[s.seq_id]) for s in seqs]
        width, device = max(ks), logits.device
        index = torch.tensor([[s + min(j, k) for j in range(width + 1)] for s, k in zip(starts, ks)], device=device)
        target = self._target_probs(logits.float(), index, states)
        tokens = torch.tensor([drafts[s.seq_id] + [0] * (width - k) for s, k in zip(seqs, ks)], device=device)
        uniform, noise = self._randomness(states, width, logits.shape[1], device)
        out, emitted = rejection_sample(target, self._stacked_draft_probs(seqs, tokens, ks, logits.shape[1]),
                                        tokens, torch.tensor(ks, device=device), uniform, noise)
        kept = [row[:n] for row, n in zip(out.tolist(), emitted.tolist())]
        for seq, k, row in zip(seqs, ks, kept):
            self._record(seq, k, len(row) - 1)
        return kept

    def _target_probs(self, logits: torch.Tensor, index: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """[seqs, k + 1, vocab]: each (sampled) request's filtered distribution."""
        per_row = [s.params for s in states for _ in range(index.shape[1])]
        return filtered_probs(logits[index.flatten()], per_row).view(*index.shape, -1)

    def _randomness(self, states: list[SamplingState], width: int, vocab: int, device):
        """Uniforms for the acceptance tests and Exp(1) noise for the last token."""
        return (self.sampler.noise(states, width, device, "uniform"),
                self.sampler.noise(states, vocab, device, "exponential"))

    def _stacked_draft_probs(self, seqs, tokens: torch.Tensor, ks: list[int], vocab: int) -> torch.Tensor | None:
        """[seqs, width, vocab] draft distributions (one-hot rows for greedy drafts), or None
        when every draft is one-hot (n-gram, all greedy)."""
        probs = [self._draft_probs.get(s.seq_id) for s in seqs]
        if all(q is None for q in probs):
            return None
        out = torch.nn.functional.one_hot(tokens, vocab).float()
        for i, (k, q) in enumerate(zip(ks, probs)):
            if q is not None:
                out[i, :k] = q[:k].to(out.device)
        return out

    def forget_finished(self) -> None:
        """Drop what finished sequences held: acceptance records, histories, draft KV blocks."""
        for seq_id in [i for i, acc in self.acceptance.items() if acc.seq.is_finished]:
            del self.acceptance[seq_id]
        self.proposer.forget_finished()


def _as_tree(drafts: list[int]) -> DraftTree:
    return drafts if isinstance(drafts, DraftTree) else DraftTree(drafts, list(range(-1, len(drafts) - 1)))


def _check_trees_run(engine) -> None:
    """Token trees need the CPU paged attention (its tree masks) and full attention (a node's
    position is its depth, not its row)."""
    if not isinstance(getattr(engine.runner, "attention", None), PagedAttention):
        raise RuntimeLlmcError("speculative tree_candidates > 1 runs on the CPU kernels' paged attention, "
                               "not this artifact's; use tree_candidates=1")
    if any(step.attrs.get("window") for step in engine.executor.plan.attention_steps()):
        raise RuntimeLlmcError("speculative tree_candidates > 1 is not supported with sliding-window "
                               "attention; use tree_candidates=1")


def _weight_bytes(executor) -> int:
    """Bytes of weights a forward reads: what a decode step costs on a bandwidth-bound device."""
    return sum(executor.weight(name).nbytes for name in executor.plan.params)
