"""Token-tree speculation (tree_candidates > 1): candidates merge into a prefix tree; one forward
with the tree mask gives every node the logits its own path would get without the tree; a greedy
request keeps the longest path the argmax follows, and decodes exactly the tokens of plain
decoding, batched and alone, beside sampled requests (which verify one chain); no KV block leaks."""

import random

import numpy as np
import pytest
import torch
from llmc_cli import error_line, llmc_in_process
from test_spec_engine import assert_no_blocks_held, greedy, repetitive_prompts, run

from llmc.errors import RuntimeLlmcError
from llmc.runtime.draft_tree import DraftTree, merge_candidates
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.ngram_proposer import candidates, lookup
from llmc.runtime.sampling_params import SamplingParams

TREE = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False, "tree_candidates": 3}


def paths(tree: DraftTree) -> list[list[int]]:
    """Every root-to-node path as node indices."""
    out = []
    for node in range(len(tree)):
        path = [node]
        while tree.parents[path[0]] >= 0:
            path.insert(0, tree.parents[path[0]])
        out.append(path)
    return out


def test_candidates_merge_into_a_prefix_tree():
    tree = merge_candidates([[5, 6, 7], [5, 6, 8], [9], [5, 1, 2]], max_nodes=6)
    assert list(tree) == [5, 6, 7, 8, 9, 1] and tree.parents == [-1, 0, 1, 1, -1, 0]
    assert tree.depths() == [1, 2, 3, 3, 1, 2]
    assert merge_candidates([[5, 6, 7], [5, 6]], max_nodes=8) == [5, 6, 7]   # one chain: a plain list
    assert not isinstance(merge_candidates([[5, 6, 7], [5, 6]], max_nodes=8), DraftTree)


@pytest.mark.parametrize("seed", range(20))
def test_greedy_acceptance_follows_the_longest_agreeing_path(seed):
    rng = random.Random(seed)
    tree = merge_candidates([[rng.randrange(4) for _ in range(rng.randrange(1, 5))] for _ in range(4)], 12)
    tree = tree if isinstance(tree, DraftTree) else DraftTree(tree, list(range(-1, len(tree) - 1)))
    argmax = [rng.randrange(4) for _ in range(len(tree) + 1)]
    kept, path = tree.accept_greedy(argmax)
    # brute force: the longest node path whose tokens are each the argmax after their parent
    agreeing = [p for p in paths(tree) if all(tree[n] == argmax[(tree.parents[n] + 1)] for n in p)]
    best = max(agreeing, key=len, default=[])
    assert path == best
    assert kept == [tree[n] for n in best] + [argmax[(best[-1] + 1) if best else 0]]


@pytest.mark.parametrize("seed", range(10))
def test_ngram_candidates_are_the_distinct_continuations_of_the_best_matches(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 4, size=int(rng.integers(3, 200)))
    k, found_n = 3, None
    found, found_n = candidates(tokens, k, 2, 4, 3)
    assert lookup(tokens, k, 2, 4) == ((found[0] if found else []), found_n)
    # brute force: each earlier end i with its matched suffix length, longest first, latest first
    n = len(tokens)
    matches = []
    for i in range(n - 1):
        run = 0
        while run < min(4, i + 1) and tokens[i - run] == tokens[n - 1 - run]:
            run += 1
        if run >= 2:
            matches.append((run, i))
    expected = []
    for _, i in sorted(matches, key=lambda m: (-m[0], -m[1])):
        cont = tokens[i + 1:i + 1 + k].tolist()
        if cont not in expected and len(expected) < 3:
            expected.append(cont)
    assert found == expected
    assert found_n == max((m[0] for m in matches), default=0)


def test_tree_rows_get_the_logits_of_their_own_paths(artifact):
    """A prompt prefilled into the paged cache, then one tree verified: each node's row equals the
    logits a full, cache-free forward over the prompt and that node's path gives at its end."""
    engine = Engine(artifact, EngineConfig(kv_memory="4MiB", speculative=TREE))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 500, (37,), generator=gen).tolist()
    tree = merge_candidates([[11, 12, 13, 14], [11, 15, 16], [17, 18], [11, 12, 19]], 12)
    engine.add_request(prompt_token_ids=prompt, params=greedy(50))
    engine.step()   # prefill and the first token
    seq = engine.scheduler.running[0]
    out = engine.scheduler.schedule({seq.seq_id: tree})
    assert out.drafts[seq.seq_id] is tree
    logits = engine.runner.execute(out.scheduled, out.sampled, out.blocks_to_copy, drafts=out.drafts)
    known = seq.token_ids
    for row, path in [(0, [])] + [(p[-1] + 1, p) for p in paths(tree)]:
        ids = torch.tensor(known + [tree[n] for n in path])
        inputs = {"input_ids": ids, "positions": torch.arange(len(ids)), "logits_indices": torch.tensor([len(ids) - 1])}
        reference = engine.executor.run_values(inputs)["logits"][0]
        torch.testing.assert_close(logits[row], reference, rtol=1e-4, atol=1e-4)


def few_token_prompts(seed: int, n: int) -> list[list[int]]:
    """Prompts over 6 token ids: a suffix recurs with several continuations, so trees branch."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 9, (50,), generator=gen).tolist() for _ in range(n)]


@pytest.mark.parametrize("max_num_seqs", [1, 16])
def test_greedy_tree_speculation_gives_plain_decodings_tokens(artifact, max_num_seqs):
    prompts = repetitive_prompts(5, 3) + few_token_prompts(5, 4)
    requests = [(p, greedy(40)) for p in prompts] + [
        (prompts[0], SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True))]
    config = EngineConfig(kv_memory="4MiB", max_num_seqs=max_num_seqs)
    plain = run(Engine(artifact, config), requests)
    engine = Engine(artifact, EngineConfig(kv_memory="4MiB", max_num_seqs=max_num_seqs, speculative=TREE))
    trees = []
    verify = engine.speculator._verify_tree
    engine.speculator._verify_tree = lambda seq, tree, logits: trees.append(tree) or verify(seq, tree, logits)
    assert run(engine, requests) == plain
    assert trees and any(n != d for tree in trees for n, d in zip(range(1, len(tree) + 1), tree.depths()))
    assert_no_blocks_held(engine)


def test_no_kv_block_outlives_tree_requests_preemption_and_aborts(artifact):
    engine = Engine(artifact, EngineConfig(kv_memory="192KiB", speculative=TREE))
    rng = random.Random(1)
    prompts = repetitive_prompts(6, 60) + few_token_prompts(6, 60)
    rng.shuffle(prompts)
    live = []
    while prompts or engine.has_unfinished():
        if prompts and rng.random() < 0.5:
            params = SamplingParams(temperature=0.8 if rng.random() < 0.3 else 0.0, seed=rng.randrange(99),
                                    max_tokens=rng.randrange(1, 40), ignore_eos=True)
            live.append(engine.add_request(prompt_token_ids=prompts.pop(), params=params))
        if live and rng.random() < 0.08:
            engine.abort(live.pop(rng.randrange(len(live))))
        engine.step()
        engine.block_manager.check_invariants()
    assert engine.metrics.preemptions > 0 and engine.metrics.speculative.num_drafts > 0
    assert_no_blocks_held(engine)


def test_cli_runs_token_trees_and_refuses_bad_tree_options(artifact, capsys):
    args = ["run", artifact, "--prompt", "the cat sat on the mat. the cat sat on the hat. the cat",
            "--max-tokens", 24, "--kv-memory", "4MiB"]
    code, plain, _ = llmc_in_process(capsys, *args)
    assert code == 0
    code, out, _ = llmc_in_process(capsys, *args, "--speculative", "ngram:tree=3")
    assert code == 0 and out == plain
    for bad, fragment in (("ngram:trees=3", "takes only tree=N"), ("ngram:tree=0", "tree_candidates=0 must be")):
        code, _, err = llmc_in_process(capsys, *args, "--speculative", bad)
        assert code == 2 and fragment in error_line(err)


def test_trees_are_refused_for_a_draft_model(artifact):
    with pytest.raises(RuntimeLlmcError, match="tree_candidates=2 needs method 'ngram'"):
        Engine(artifact, EngineConfig(speculative={"method": "draft", "model": str(artifact), "tree_candidates": 2}))
    with pytest.raises(RuntimeLlmcError, match="tree_candidates=0 must be an integer >= 1"):
        Engine(artifact, EngineConfig(speculative={"method": "ngram", "tree_candidates": 0}))
