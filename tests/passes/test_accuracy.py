"""Accuracy of lossy passes: perplexity, KL and top-1 agreement against float64 hand math, graph
logits against HF transformers, and the --max-ppl-increase budget, which fails a compile naming
the pass (exit 2, no artifact) and otherwise records the figures in the manifest."""

import json
import math
from dataclasses import dataclass

import pytest
import torch

import llmc
from llmc.cli import main as cli_main
from llmc.compiler.frontends import load_model
from llmc.compiler.pipeline import trace_and_lower
from llmc.errors import PassError
from llmc.passes.accuracy import (
    AccuracyMeter,
    check_budget,
    graph_logits,
    mean_kl,
    perplexity,
    top1_agreement,
)
from llmc.passes.base import PASSES, Pass, PassContext, PassManager, PassResult
from llmc.passes.options import PassOptions, option

VOCAB = 37


def random_case(seed: int, lengths=(9, 5)):
    g = torch.Generator().manual_seed(seed)
    logits = [3 * torch.randn(n, VOCAB, generator=g) for n in lengths]
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    return logits, seqs


def log_softmax_by_hand(row: list[float]) -> list[float]:
    top = max(row)
    lse = top + math.log(sum(math.exp(x - top) for x in row))
    return [x - lse for x in row]


def test_perplexity_matches_float64_hand_computation():
    logits, seqs = random_case(1)
    nll = [-log_softmax_by_hand(lg[t].double().tolist())[int(seq[t + 1])]
           for lg, seq in zip(logits, seqs) for t in range(len(seq) - 1)]
    assert len(nll) == 8 + 4
    assert perplexity(logits, seqs) == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-12)


def test_mean_kl_is_kl_of_reference_against_ours_by_hand():
    ref, _ = random_case(2)
    ours, _ = random_case(3)
    rows = [(r.double().tolist(), o.double().tolist()) for a, b in zip(ref, ours) for r, o in zip(a, b)]
    by_hand = []
    for r, o in rows:
        lp, lq = log_softmax_by_hand(r), log_softmax_by_hand(o)
        by_hand.append(sum(math.exp(a) * (a - b) for a, b in zip(lp, lq)))
    assert mean_kl(ref, ours) == pytest.approx(sum(by_hand) / len(by_hand), rel=1e-10)
    assert mean_kl(ref, ours) != pytest.approx(mean_kl(ours, ref), rel=1e-3)  # not symmetric
    assert mean_kl(ref, ref) == 0.0


def test_top1_agreement_counts_rows_with_the_same_argmax():
    ref, _ = random_case(4)
    ours = [lg.clone() for lg in ref]
    ours[0][2] = -ours[0][2]          # the argmax of -x is the argmin of x: one row disagrees
    ours[1][:, 0] = ref[1].max() + 1  # every row of the second sequence now picks token 0
    agree = [int(a.argmax() == b.argmax()) for x, y in zip(ref, ours) for a, b in zip(x, y)]
    assert top1_agreement(ref, ours) == pytest.approx(sum(agree) / len(agree))
    assert sum(agree) < len(agree) - 1
    assert top1_agreement(ref, ref) == 1.0


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama")


@pytest.fixture(scope="module")
def tiny_graph(tiny):
    return trace_and_lower(tiny.module, 64, lambda *args: None)


def token_seqs(seed: int, lengths=(12, 7)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g) for n in lengths]


def test_graph_logits_are_the_hf_models_logits(tiny, tiny_graph):
    seqs = token_seqs(5)
    ours = graph_logits(tiny_graph, seqs)
    with torch.no_grad():
        ref = [tiny.module(s[None]).logits[0] for s in seqs]
    for a, b in zip(ours, ref):
        assert a.shape == (len(b), 512)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


class ScaleLinears(Pass):
    """Test-only lossy pass: multiplies every linear weight by (1 + noise * N(0, 1))."""
    name = "scale_linears_for_test"
    lossy = True

    @dataclass(frozen=True)
    class Options(PassOptions):
        noise: float = option(0.5, "standard deviation of the relative noise", low=0.0)

    def run(self, graph, ctx):
        g = torch.Generator().manual_seed(0)
        linears = [n for n in graph.nodes if n.op == "linear"]
        for node in linears:
            w = graph.weights[node.inputs[1]]
            noise = self.options.noise * torch.randn(w.shape, generator=g)
            graph.weights[node.inputs[1]] = w * (1 + noise)
        return PassResult(len(linears), bool(linears))


class Identity(Pass):
    name = "identity_for_test"
    lossy = True

    def run(self, graph, ctx):
        return PassResult(0, False)


@pytest.fixture
def test_passes(monkeypatch):
    for cls in (ScaleLinears, Identity):
        monkeypatch.setitem(PASSES, cls.name, cls)


def run_pipeline(graph, passes, seqs, **options):
    copy = type(graph).from_json(graph.to_json())
    copy.weights = dict(graph.weights)
    ctx = PassContext(options=options, calibration=seqs, quiet=True)
    return PassManager(passes, ctx).run(copy)


def test_lossy_pass_records_its_cost_against_the_graph_before_it(tiny_graph):
    seqs = token_seqs(6)
    records = run_pipeline(tiny_graph, [Identity(), ScaleLinears(noise=0.3)], seqs)
    same, damaged = (r.accuracy for r in records)
    assert same == {"ppl_before": same["ppl_before"], "ppl_after": same["ppl_before"], "kl": 0.0,
                    "top1_agreement": 1.0, "tokens": 11 + 6}
    ref = graph_logits(tiny_graph, seqs)
    assert same["ppl_before"] == pytest.approx(perplexity(ref, seqs), rel=1e-5)
    assert damaged["ppl_before"] == same["ppl_before"]
    assert damaged["kl"] > 0.01 and damaged["top1_agreement"] < 1.0


def test_no_calibration_means_no_measurement(tiny_graph):
    records = run_pipeline(tiny_graph, [ScaleLinears()], None)
    assert records[0].accuracy is None


def test_budget_failure_names_the_pass_and_figures(tiny_graph):
    with pytest.raises(PassError, match=r"pass 'scale_linears_for_test' raised calibration perplexity "
                                        r"from \S+ to \S+ \(\+\S+%\), over the budget of 1%"):
        run_pipeline(tiny_graph, [ScaleLinears()], token_seqs(7), max_ppl_increase=1)


def test_budget_check_compares_percent_increase():
    check_budget("p", {"ppl_before": 10.0, "ppl_after": 10.9}, 10)
    check_budget("p", {"ppl_before": 10.0, "ppl_after": 99.0}, None)
    with pytest.raises(PassError, match=r"from 10 to 11.2 \(\+12.00%\), over the budget of 10%"):
        check_budget("p", {"ppl_before": 10.0, "ppl_after": 11.2}, 10)
    with pytest.raises(PassError):
        check_budget("p", {"ppl_before": 10.0, "ppl_after": float("nan")}, 10)


def test_reference_logits_are_computed_once_per_run(tiny_graph, monkeypatch):
    import llmc.passes.accuracy as accuracy
    calls = []
    real = accuracy.graph_logits
    monkeypatch.setattr(accuracy, "graph_logits", lambda g, s, progress=None: calls.append(1) or real(g, s, progress))
    run_pipeline(tiny_graph, [Identity(), Identity(), Identity()], token_seqs(8, (6,)))
    assert len(calls) == 1 + 3  # one reference, one measurement per lossy pass


def test_meter_needs_a_reference_first(tiny_graph):
    with pytest.raises(AssertionError):
        AccuracyMeter(token_seqs(9)).measure(tiny_graph)


def test_compile_over_budget_exits_2_and_writes_nothing(tmp_path, capsys, test_passes):
    out = tmp_path / "damaged.llmc"
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["compile", "tiny-llama", "-o", str(out), "--passes", "scale_linears_for_test,dce",
                  "--calib-samples", "2", "--calib-seq-len", "32", "--max-ppl-increase", "1", "-q"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "pass 'scale_linears_for_test' raised calibration perplexity" in err
    assert "relax --max-ppl-increase or choose a milder scheme" in err
    assert list(tmp_path.iterdir()) == []


def test_compile_within_budget_records_accuracy_and_calibration_source(tmp_path, test_passes):
    out = llmc.compile("tiny-llama", output=tmp_path / "mild.llmc",
                       passes="scale_linears_for_test:noise=0.01", calib_samples=2, calib_seq_len=32,
                       max_ppl_increase=50)
    entry = json.loads((out / "manifest.json").read_text())["pipeline"][0]
    acc = entry["accuracy"]
    assert entry["name"] == "scale_linears_for_test"
    assert set(acc) == {"ppl_before", "ppl_after", "kl", "top1_agreement", "tokens", "calibration"}
    assert acc["tokens"] == 2 * 31
    assert acc["calibration"] == {"source": "self-generated:0", "samples": 2, "seq_len": 32}
    assert 0 < acc["kl"] < 0.1 and abs(acc["ppl_after"] / acc["ppl_before"] - 1) < 0.5
