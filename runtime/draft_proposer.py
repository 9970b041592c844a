"""A draft artifact proposing tokens for speculative decoding: it runs on its own paged KV cache,
one shadow sequence per target sequence; each step it catches up on the tokens the target kept
(dropping the KV of the drafts the target rejected) and draws k drafts, one batched forward each."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.compiler.artifact import load_tokenizer, read_artifact
from llmc.errors import RuntimeLlmcError
from llmc.runtime.block_manager import BlockManager
from llmc.runtime.executor import PlanExecutor
from llmc.runtime.kernel_check import verified_plan
from llmc.runtime.model_runner import ModelRunner
from llmc.runtime.sampler import Sampler, SamplingState, filtered_probs
from llmc.runtime.sequence import Sequence


@dataclass
class _Shadow:
    """The draft's copy of a target sequence: its tokens then the drafts fed to the draft model."""
    seq: Sequence
    target: Sequence
    synced: int = 0  # tokens known equal to the target's at the last sync


class DraftProposer:
    def __init__(self, path: str, engine):
        from llmc.runtime.engine import _check_kv_fits, paged_kv_cache  # engine -> speculative -> this module: a cycle

        art = read_artifact(path)
        check_same_vocabulary(art, load_tokenizer(art), engine, path)
        self.model = art.manifest["model"]
        plan = verified_plan(art)
        # the draft's proposals as the target's mode makes them: a draft's tokens then do not depend on the batch
        self.runner = ModelRunner(PlanExecutor(plan, art.weights, engine.device, data=art.data,
                                               batch_invariant=engine.executor.batch_invariant),
                                  self._cache(art, engine, paged_kv_cache, _check_kv_fits))
        # as many blocks as the target: the draft holds the same tokens; no prefix cache, so
        # rolling back a shadow never touches a hash
        self.block_manager = BlockManager(engine.block_manager.num_blocks, engine.config.block_size,
                                          enable_prefix_caching=False)
        self.max_tokens = plan.max_tokens
        self.sampler: Sampler = engine.sampler
        self.shadows: dict[int, _Shadow] = {}

    def _cache(self, art, engine, paged_kv_cache, check_fits):
        num_blocks, block_size = engine.block_manager.num_blocks, engine.config.block_size
        check_fits(num_blocks * block_size * self.model["kv_bytes_per_token"], engine.device,
                   f"{engine.config.kv_memory} (and the draft's cache beside it)")
        return paged_kv_cache(self.model, art.weights, num_blocks, block_size, engine.device)

    def propose(self, seqs: list[Sequence], ks: list[int], states: list[SamplingState]):
        """Up to ks[i] drafts for seqs[i], and the distributions q they were drawn from ([k, vocab];
        None for greedy requests, whose drafts are the draft model's argmax)."""
        shadows = [self._sync(seq) if k > 0 else None for seq, k in zip(seqs, ks)]  # Sequence | None
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = [i for i, sh in enumerate(shadows) if sh is not None]
        while active:
            logits = self._forward([shadows[i] for i in active])
            tokens, q = self._draw(logits, [states[i] for i in active])
            for row, i in enumerate(active):
                drafts[i].append(tokens[row])
                if row in q:
                    probs[i].append(q[row])
            active = [i for i in active if len(drafts[i]) < ks[i] and self._feed(shadows[i], drafts[i][-1])]
        return drafts, [torch.stack(p) if p else None for p in probs]

    def forget_finished(self) -> None:
        for seq_id in [i for i, sh in self.shadows.items() if sh.target.is_finished]:
            self.block_manager.free(self.shadows.pop(seq_id).seq)

    def _sync(self, seq: Sequence) -> Sequence | None:
        """The shadow of `seq` holding exactly its tokens: drafts the target rejected are cut,
        its new tokens appended, KV kept only where the tokens agree. None if no blocks are left."""
        entry = self.shadows.get(seq.seq_id)
        if entry is None:
            entry = _Shadow(Sequence(seq.token_ids, seq_id=seq.seq_id, request_id=seq.request_id), seq)
            if not self.block_manager.can_allocate(entry.seq):
                return None
            self.block_manager.allocate(entry.seq)
            self.shadows[seq.seq_id] = entry
        shadow = entry.seq
        common = _common_prefix(shadow.token_ids, seq.token_ids, entry.synced)
        del shadow.token_ids[common:]  # the shadow's own list: drafts the target did not keep
        for token in seq.token_ids[common:]:
            shadow.append_token(token)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, common, seq.num_tokens - 1)
        entry.synced = seq.num_tokens
        self.block_manager.trim(shadow)
        return shadow if self._reserve(shadow) else None

    def _feed(self, shadow: Sequence, token: int) -> bool:
        """Append a draft to the shadow for the next forward; False if no block is left for it."""
        shadow.append_token(token)
        return self._reserve(shadow)

    def _reserve(self, shadow: Sequence) -> bool:
        if not self.block_manager.can_append(shadow):
            return False
        self.block_manager.append_slot(shadow)
        return True

    def _forward(self, shadows: list[Sequence]) -> torch.Tensor:
        """Compute every shadow's uncomputed tokens, in forwards of at most the plan's token budget;
        returns the logits after each one's last token, [len(shadows), vocab]."""
        rows: dict[int, torch.Tensor] = {}
        pending = list(shadows)
        while pending:
            scheduled, sampled, budget = [], [], self.max_tokens
            for sh in pending:
                n = min(sh.num_uncomputed_tokens, budget)
                if n == 0:
                    break
                scheduled.append((sh, n))
                budget -= n
                if n == sh.num_uncomputed_tokens:
                    sampled.append(sh)
            logits = self.runner.execute(scheduled, sampled, [])
            for sh, n in scheduled:
                sh.num_computed_tokens += n
            rows.update((sh.seq_id, row) for sh, row in zip(sampled, logits))
            pending = [sh for sh in pending if sh.num_uncomputed_tokens > 0]
        return torch.stack([rows[sh.seq_id] for sh in shadows]).float()

    def _draw(self, logits: torch.Tensor, states: list[SamplingState]) -> tuple[list[int], dict[int, torch.Tensor]]:
        """Greedy rows take the argmax; the others draw from q, their request's filtered draft
        distribution (what the rejection test needs), with their request's generator. Returns the
        tokens and, by row, the q of the rows that drew."""
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if not random_rows:
            return tokens.tolist(), {}
        rows = torch.tensor(random_rows, device=logits.device)
        sub = [states[i] for i in random_rows]
        q = filtered_probs(logits[rows], [s.params for s in sub])
        noise = self.sampler.noise(sub, logits.shape[1], logits.device, "exponential")
        tokens[rows] = (q / noise.clamp_min(1e-10)).argmax(dim=-1)
        return tokens.tolist(), dict(zip(random_rows, q))


def _common_prefix(a: list[int], b: list[int], known: int) -> int:
    """Length of the common prefix of a and b, the first `known` tokens being known equal."""
    n = min(len(a), len(b), known)
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def check_same_vocabulary(art, tokenizer, engine, path: str) -> None:
    """A draft must score the target's token ids: same tokenizer vocabulary and logits width."""
    ours, theirs = art.manifest["model"]["vocab_size"], engine.model["vocab_size"]
    if ours != theirs:
        raise RuntimeLlmcError(f"speculative draft '{path}' scores {ours} tokens but the target scores "
                               f"{theirs}; use a draft built with `llmc compile --draft-of` for this target")
    if tokenizer.get_vocab() != engine.tokenizer.get_vocab():
        raise RuntimeLlmcError(f"speculative draft '{path}' has another tokenizer than the target; use a "
                               "draft built with `llmc compile --draft-of` for this target")
