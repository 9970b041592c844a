"""prompt_logprobs: the logprob of each prompt token under the model given the tokens before it
(vLLM's `RequestOutput.prompt_logprobs`; None for the first token). The rows come from the prefill
steps that compute the prompt, so such a request skips the prefix cache (a cached block has no
logits); a prompt recomputed after a preemption is not recorded twice."""

from __future__ import annotations

import torch

from llmc.runtime.outputs import Logprob
from llmc.runtime.sampler import raw_logprobs


def prompt_rows(scheduled, recorded) -> dict[int, int]:
    """seq_id -> how many leading rows of its scheduled chunk give prompt logprobs this step;
    `recorded(seq)` is the list the sequence records into (None when it asks for none)."""
    rows = {}
    for seq, n in scheduled:
        entries = recorded(seq)
        start = seq.num_computed_tokens
        if entries is None or len(entries) != start + 1:
            continue
        count = min(start + n, seq.num_prompt_tokens - 1) - start   # the last prompt row samples
        if count > 0:
            rows[seq.seq_id] = count
    return rows


def record(seq, entries: list, logits: torch.Tensor, top: int, token_text) -> None:
    """Append the logprobs of the prompt tokens that follow the rows `logits` [rows, vocab] of
    `seq`'s chunk; `token_text(id)` gives each entry's decoded_token."""
    start = len(entries) - 1
    following = seq.prompt_token_ids[start + 1:start + 1 + logits.shape[0]]
    out = raw_logprobs(logits.float(), torch.tensor(following, device=logits.device), [top] * len(following))
    for i, token in enumerate(following):
        entry = {token: Logprob(out.logprobs[i], out.ranks[i], token_text(token))}
        for rank, (tid, lp) in enumerate(out.top_logprobs[i], 1):
            entry.setdefault(tid, Logprob(lp, rank, token_text(tid)))
        entries.append(entry)
