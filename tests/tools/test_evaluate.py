"""`llmc eval`: the windows score every token once with the documented context, the perplexity is
HF transformers' on the same windows (Hugging Face's perplexity-guide loop), identical artifacts
agree exactly, a damaged one shows KL > 0, and the CLI prints the documented JSON keys."""

import json
import math

import pytest
import torch

import llmc
from llmc.cli import main as cli_main
from llmc.compiler.frontends import load_model
from llmc.errors import RuntimeLlmcError
from llmc.passes.base import PASSES, Pass, PassResult
from llmc.tools.evaluate import CONTEXT, DEFAULT_TEXT, STRIDE, eval_windows, evaluate_text, read_eval_text

TEXT = DEFAULT_TEXT.read_text()


class ShrinkLinears(Pass):
    """Test-only lossy pass: scales every linear weight by 0.8."""
    name = "shrink_linears_for_test"
    lossy = True

    def run(self, graph, ctx):
        linears = [n for n in graph.nodes if n.op == "linear"]
        for node in linears:
            graph.weights[node.inputs[1]] = 0.8 * graph.weights[node.inputs[1]]
        return PassResult(len(linears), True)


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(PASSES, ShrinkLinears.name, ShrinkLinears)
        return llmc.compile("tiny-llama", output=tmp_path_factory.mktemp("eval") / "damaged.llmc",
                            passes=ShrinkLinears.name, calib_samples=1, calib_seq_len=8)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama")


@pytest.mark.parametrize("n", [2, 3, 300, 511, 512, 513, 767, 768, 769, 1000, 4096])
def test_windows_score_each_token_once_with_full_context(n):
    windows = eval_windows(n)
    scored = [t for w in windows for t in range(w.first_target, w.end)]
    assert scored == list(range(1, n))
    assert windows[0].begin == 0 and windows[-1].end == n
    for w in windows:
        assert w.end - w.begin <= CONTEXT
        assert len(w.rows()) == w.end - w.first_target
        assert w.rows()[0] == w.first_target - 1 - w.begin
    for w in windows[1:]:
        assert w.first_target - w.begin >= CONTEXT - STRIDE and w.end - w.first_target <= STRIDE


def hf_windowed_perplexity(module, ids: torch.Tensor, max_length=CONTEXT, stride=STRIDE) -> float:
    """The loop of Hugging Face's "Perplexity of fixed-length models" guide, with HF's own loss;
    weighted by the labels the loss actually counts after its internal shift."""
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + max_length, len(ids))
        trg_len = end - prev_end
        input_ids = ids[begin:end][None]
        labels = input_ids.clone()
        labels[:, :-trg_len] = -100
        with torch.no_grad():
            loss = module(input_ids, labels=labels).loss.double().item()
        counted = int((labels[:, 1:] != -100).sum())
        nll_sum, n_tokens = nll_sum + loss * counted, n_tokens + counted
        prev_end = end
        if end == len(ids):
            break
    return math.exp(nll_sum / n_tokens)


def text_ids(tiny, max_tokens: int) -> torch.Tensor:
    return torch.tensor(tiny.tokenizer(TEXT, add_special_tokens=False, verbose=False)["input_ids"][:max_tokens])


def test_one_window_is_a_single_full_context_forward(artifact, tiny):
    ids = text_ids(tiny, 400)
    result = evaluate_text(artifact, TEXT, max_tokens=400)
    assert result["tokens"] == 399 and result["windows"] == 1
    with torch.no_grad():
        logits = tiny.module(ids[None]).logits[0].double()
    nll = torch.nn.functional.cross_entropy(logits[:-1], ids[1:])
    assert result["perplexity"] == pytest.approx(math.exp(nll.item()), rel=1e-4)


def test_sliding_windows_match_the_hf_perplexity_guide(artifact, tiny):
    ids = text_ids(tiny, 900)
    result = evaluate_text(artifact, TEXT, max_tokens=900)
    assert result["tokens"] == 899 and result["windows"] == 3
    assert result["perplexity"] == pytest.approx(hf_windowed_perplexity(tiny.module, ids), rel=1e-4)


def test_identical_artifacts_have_zero_kl_and_full_agreement(artifact):
    result = evaluate_text(artifact, TEXT, ref=artifact, max_tokens=600)
    assert result["kl"] == 0.0 and result["top1_agreement"] == 1.0
    assert result["ref_perplexity"] == result["perplexity"]


def test_damaged_artifact_diverges_from_its_reference(artifact, damaged):
    ours = evaluate_text(damaged, TEXT, ref=artifact, max_tokens=600)
    alone = evaluate_text(artifact, TEXT, max_tokens=600)
    assert ours["ref_perplexity"] == pytest.approx(alone["perplexity"], rel=1e-9)
    assert ours["perplexity"] != pytest.approx(alone["perplexity"], rel=1e-3)
    assert ours["kl"] > 1e-3 and 0.0 < ours["top1_agreement"] < 1.0


def test_cli_eval_json_has_the_documented_keys(artifact, damaged, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT[:1500])
    cli_main(["eval", str(damaged), "--text", str(text), "--ref", str(artifact), "--max-tokens", "300", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert {"perplexity", "tokens", "kl", "top1_agreement", "ref_perplexity"} <= set(result)
    assert result["tokens"] == 299
    cli_main(["eval", str(artifact), "--max-tokens", "50"])
    assert "perplexity" in capsys.readouterr().out  # on the default text, samples/eval.txt


def test_eval_user_errors_exit_2(artifact, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["eval", str(artifact), "--text", str(tmp_path / "missing.txt")])
    assert exit_info.value.code == 2
    assert "missing.txt' not found; pass --text FILE" in capsys.readouterr().err
    with pytest.raises(RuntimeLlmcError, match="at least 2"):
        evaluate_text(artifact, "", max_tokens=100)
    with pytest.raises(RuntimeLlmcError, match="--max-tokens is 1"):
        evaluate_text(artifact, TEXT, max_tokens=1)


def test_shipped_eval_text_is_long_enough_for_the_default_protocol():
    words = read_eval_text(None).split()
    assert len(words) > 2000
