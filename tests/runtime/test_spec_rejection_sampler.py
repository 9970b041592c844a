"""The rejection sampler is exact: whatever the drafts and the distributions they were drawn
from, the token at each output position is distributed as the target's filtered distribution
(temperature, top-k, top-p) there. Checked by chi-square on 2e5 draws over a vocabulary of 32."""

import pytest
import torch
from scipy.stats import chisquare

from llmc.runtime.rejection_sampler import rejection_sample
from llmc.runtime.sampler import filtered_probs
from llmc.runtime.sampling_params import SamplingParams

VOCAB, ROWS = 32, 200_000
FILTERS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=10),
           SamplingParams(temperature=1.3, top_p=0.8)]


def target_and_draft(gen: torch.Generator, k: int, params: SamplingParams):
    """Fresh target logits per position, and a draft q near the target (so some drafts are kept)."""
    logits = torch.randn(k + 1, VOCAB, generator=gen) * 2
    p = filtered_probs(logits, [params] * (k + 1))
    q = torch.softmax(logits[:k] + torch.randn(k, VOCAB, generator=gen), dim=-1)
    return p, q


def draw_drafts(gen, q: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.multinomial(q[j], ROWS, replacement=True, generator=gen) for j in range(len(q))], 1)


def run(p, q, drafts, one_hot: bool, gen):
    k = drafts.shape[1]
    return rejection_sample(p.expand(ROWS, -1, -1), None if one_hot else q.expand(ROWS, -1, -1), drafts,
                            torch.full((ROWS,), k), torch.rand(ROWS, k, generator=gen),
                            torch.empty(ROWS, VOCAB).exponential_(generator=gen))


def assert_distributed_as(tokens: torch.Tensor, p: torch.Tensor, where: str) -> None:
    """Chi-square of the tokens' counts against p on p's support (cells expected < 5 pooled)."""
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    support = p > 0
    assert counts[~support].sum() == 0, f"{where}: tokens outside the target's support"
    expected = p[support].double() * len(tokens)
    observed = counts[support]
    small = expected < 5
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum().unsqueeze(0)])
        observed = torch.cat([observed[~small], observed[small].sum().unsqueeze(0)])
    if len(expected) < 2:
        return
    result = chisquare(observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item())
    assert result.pvalue > 1e-3, f"{where}: chi-square p = {result.pvalue:.2e}"


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-probs", "one-hot"])
@pytest.mark.parametrize("params", FILTERS, ids=["t1", "t0.7-k10", "t1.3-p0.8"])
def test_every_output_position_follows_the_target(k, one_hot, params):
    gen = torch.Generator().manual_seed(1000 * k + one_hot)
    p, q = target_and_draft(gen, k, params)
    drafts = draw_drafts(gen, q)  # a one-hot draft is a token proposed by a rule: any choice is fine
    tokens, emitted = run(p, q, drafts, one_hot, gen)
    assert ((emitted >= 1) & (emitted <= k + 1)).all()
    for j in range(k + 1):
        reached = emitted > j
        if reached.sum() >= 2000:
            assert_distributed_as(tokens[reached, j], p[j], f"position {j} of {k}")


def test_kept_drafts_are_the_drafts_and_rows_may_carry_fewer():
    gen = torch.Generator().manual_seed(7)
    k, rows = 4, 1000
    p = torch.softmax(torch.randn(rows, k + 1, VOCAB, generator=gen), -1)
    drafts = torch.randint(0, VOCAB, (rows, k), generator=gen)
    num_drafts = torch.randint(0, k + 1, (rows,), generator=gen)
    tokens, emitted = rejection_sample(p, None, drafts, num_drafts, torch.rand(rows, k, generator=gen),
                                       torch.empty(rows, VOCAB).exponential_(generator=gen))
    assert (emitted <= num_drafts + 1).all()
    for i in range(rows):
        assert tokens[i, :emitted[i] - 1].tolist() == drafts[i, :emitted[i] - 1].tolist()


def test_one_hot_target_keeps_the_longest_agreeing_prefix():
    """Greedy: p one-hot at the argmax; drafts are kept while they equal it, then the argmax follows."""
    k = 5
    best = torch.tensor([3, 1, 4, 1, 5, 9])
    p = torch.nn.functional.one_hot(best, VOCAB).float().unsqueeze(0)
    drafts = torch.tensor([[3, 1, 4, 2, 5]])
    tokens, emitted = rejection_sample(p, None, drafts, torch.tensor([k]), torch.zeros(1, k), torch.ones(1, VOCAB))
    assert emitted.item() == 4 and tokens[0, :4].tolist() == [3, 1, 4, 1]
    tokens, emitted = rejection_sample(p, None, best[None, :k], torch.tensor([k]), torch.zeros(1, k),
                                       torch.ones(1, VOCAB))
    assert emitted.item() == 6 and tokens[0].tolist() == best.tolist()
