"""`llmc distill` and llmc.distill: a tiny-llama converted to one KV head learns back towards its
teacher (the session's tiny-llama artifact) on the project's sample text; the result is a verified
artifact that loads; an interrupted run resumes to the weights an uninterrupted one reaches; bad
input is refused in one line with exit code 2 and leaves nothing behind."""

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from llmc_cli import error_line, llmc_in_process

import llmc
from llmc.compiler.artifact import MANIFEST, read_artifact, sha256_file
from llmc.compiler.driver import distill as distill_module
from llmc.compiler.driver.distill import text_windows
from llmc.compiler.driver.distill_checkpoint import STATE
from llmc.compiler.driver.distill_hidden import layer_map, layer_streams
from llmc.compiler.driver.distill_options import DistillError
from llmc.compiler.driver.distill_student import StudentGraph, run_graph
from llmc.compiler.frontends.samples import build_tiny_llama
from llmc.compiler.inspect import summarize
from llmc.compiler.scoring import row_kl
from llmc.tools.evaluate import DEFAULT_TEXT, ArtifactScorer

TEXT = DEFAULT_TEXT   # samples/eval.txt: about 6,000 tiny-llama tokens
FAST = dict(seq_len=32, batch=2, lr=3e-3)


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    """tiny-llama with its 2 KV heads mean-pooled into 1 (calibrated on a little of the sample text)."""
    return llmc.compile("tiny-llama", target="cpu", output=tmp_path_factory.mktemp("student") / "mqa.llmc",
                        kernels="cpu", kv_heads=1, kv_grouping="index", calib=str(TEXT), calib_samples=2,
                        calib_seq_len=64)


def weights_of(path: Path) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in read_artifact(path).weights.items()}


def test_distillation_lowers_the_kl_of_a_one_kv_head_student(student, compiled, tmp_path, capfd):
    out = tmp_path / "distilled.llmc"
    code, stdout, _ = llmc_in_process(capfd, "distill", student, "--teacher", compiled, "--text", TEXT, "-o", out,
                                      "--steps", 12, "--seq-len", 64, "--batch", 2, "--lr", 2e-3, "-q")
    assert code == 0
    record = json.loads((out / MANIFEST).read_text())["distilled"]
    assert record["kl_after"] < 0.9 * record["kl_before"], record   # 0.0909 -> 0.0784 when written
    assert f"{record['kl_before']:.5f} -> {record['kl_after']:.5f}" in stdout
    assert record["teacher"]["manifest_sha256"] == sha256_file(compiled / MANIFEST)
    assert record["student_manifest_sha256"] == sha256_file(student / MANIFEST)
    assert record["text_sha256"] == hashlib.sha256(TEXT.read_bytes()).hexdigest()
    assert (record["steps"], record["seq_len"], record["batch"]) == (12, 64, 2)
    # the student's graph and plan, new weights of the same shapes; every hash checked on the way in
    before, after = read_artifact(student), read_artifact(out)
    assert (after.graph_json, after.plan_json) == (before.graph_json, before.plan_json)
    assert after.manifest["model"] == before.manifest["model"]
    assert {n: t.shape for n, t in after.weights.items()} == {n: t.shape for n, t in before.weights.items()}
    assert not torch.equal(after.weights["model.layers.0.self_attn.qkv_proj.weight"],
                           before.weights["model.layers.0.self_attn.qkv_proj.weight"])
    assert torch.equal(after.weights["model.rotary_emb.inv_freq"], before.weights["model.rotary_emb.inv_freq"])
    # the recorded KLs are what the artifacts on disk compute on the held-out windows (`llmc eval`'s scorer)
    scorers = {p: ArtifactScorer(p) for p in (student, out, compiled)}
    held_out = text_windows(scorers[out].tokenizer, TEXT.read_bytes(), "text", 64).held_out
    assert record["held_out_tokens"] == 64 * len(held_out)
    for path, recorded in ((student, record["kl_before"]), (out, record["kl_after"])):
        kl = [row_kl(scorers[compiled].logits(w, torch.arange(64)), scorers[path].logits(w, torch.arange(64)))
              for w in held_out]
        assert torch.cat(kl).mean().item() == pytest.approx(recorded, rel=1e-5)
    text = llmc.load(out).generate("Once upon a time", llmc.SamplingParams(max_tokens=4))[0].outputs[0].text
    assert isinstance(text, str)
    assert not Path(f"{out}.ckpt").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["distilled.llmc"]


@pytest.fixture(scope="module")
def draft(compiled, tmp_path_factory):
    """A one-layer --draft-of draft of the two-layer tiny-llama, in float weights."""
    return llmc.compile("tiny-llama", target="cpu", output=tmp_path_factory.mktemp("draft") / "draft.llmc",
                        kernels="cpu", draft_of=str(compiled), draft_layers=1, quant="none", calib=str(TEXT),
                        calib_samples=1, calib_seq_len=32)


def test_layer_streams_are_the_residual_stream_transformers_reports(compiled):
    """The values hidden-state matching reads are HF's hidden_states: the embedding, each layer's
    output, and (through the final norm) the last one."""
    model = build_tiny_llama().module
    ids = torch.randint(0, model.config.vocab_size, (24,), generator=torch.Generator().manual_seed(7))
    graph = StudentGraph(read_artifact(compiled))
    streams = layer_streams(graph.graph, "tiny")
    assert len(streams) == model.config.num_hidden_layers + 1
    with torch.no_grad():
        _, ours = run_graph(graph.graph, graph.weight, ids, tuple(streams))
        theirs = model(ids[None], output_hidden_states=True).hidden_states
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(ours[layer], theirs[layer][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model.model.norm(ours[-1][None])[0], theirs[-1][0], rtol=1e-4, atol=1e-5)


def test_a_draft_maps_its_layers_to_the_teacher_layers_it_kept_and_others_map_evenly():
    removed = [1, 3, 4, 6, 7, 9, 11, 13, 14, 16, 18, 19, 21, 22, 24, 26, 27, 29]   # 12 of 30 kept
    draft = {"pipeline": [{"name": "prune_layers", "details": {"layers_before": 30, "removed_layers": removed}}]}
    kept = [0, 2, 5, 8, 10, 12, 15, 17, 20, 23, 25, 28]
    # the stream after j draft layers is what teacher layer kept[j] reads; the last, the final stream
    assert layer_map(draft, 12, 30) == [(j, kept[j]) for j in range(1, 12)] + [(12, 30)]
    assert layer_map({"pipeline": []}, 12, 30) == [(1, 2), (2, 5), (3, 7), (4, 10), (5, 12), (6, 15), (7, 17),
                                                   (8, 20), (9, 22), (10, 25), (11, 27), (12, 30)]


def test_hidden_state_matching_lowers_the_hidden_loss_of_a_draft(draft, compiled, tmp_path, capfd):
    out = tmp_path / "distilled.llmc"
    code, stdout, _ = llmc_in_process(capfd, "distill", draft, "--teacher", compiled, "--text", TEXT, "-o", out,
                                      "--steps", 12, "--seq-len", 64, "--batch", 2, "--lr", 2e-3,
                                      "--hidden-weight", 1.0, "--hidden-loss", "mse", "-q")
    assert code == 0
    record = json.loads((out / MANIFEST).read_text())["distilled"]
    hidden = record["hidden"]
    assert (hidden["loss"], hidden["weight"], hidden["layer_map"]) == ("mse", 1.0, [[1, 2]])
    assert hidden["after"] < 0.9 * hidden["before"], hidden
    assert record["kl_after"] < record["kl_before"], record
    assert read_artifact(out).plan_json == read_artifact(draft).plan_json   # every hash checked
    text = llmc.load(out).generate("Once upon a time", llmc.SamplingParams(max_tokens=4))[0].outputs[0].text
    assert isinstance(text, str)
    # `llmc inspect` says it was distilled, from what, on which text, and how far it came
    report = summarize(out, brief=True)
    assert f"distilled from: tiny-llama (teacher manifest sha256 {sha256_file(compiled / MANIFEST)[:16]}), " \
           f"12 steps of 2 x 64 tokens" in report
    assert f"text sha256 {hashlib.sha256(TEXT.read_bytes()).hexdigest()[:16]}" in report
    assert f"KL(teacher || student) {record['kl_before']:.4f} -> {record['kl_after']:.4f}" in report
    assert f"hidden states matched (mse, weight 1, student -> teacher layer 1->2): held-out loss " \
           f"{hidden['before']:.4f} -> {hidden['after']:.4f}" in report


def test_hidden_state_matching_through_the_python_api_records_cosine_by_default(draft, compiled, tmp_path):
    out = llmc.distill(draft, compiled, TEXT, tmp_path / "d.llmc", steps=2, hidden_weight=0.5, **FAST)
    hidden = json.loads((out / MANIFEST).read_text())["distilled"]["hidden"]
    assert (hidden["loss"], hidden["weight"]) == ("cosine", 0.5) and 0 <= hidden["after"] <= 2
    assert "distilled from: tiny-llama" in summarize(out)
    assert "distilled" not in summarize(compiled)


def interrupt_at(monkeypatch, stop: int, error: type[BaseException]) -> None:
    """Make the run fail with `error` while it computes step `stop`'s gradients."""
    real = distill_module.accumulate_gradients

    def accumulate(run, step, options):
        if step == stop:
            raise error("stopped by the test")
        return real(run, step, options)
    monkeypatch.setattr(distill_module, "accumulate_gradients", accumulate)


@pytest.mark.parametrize("error, resumed_at", [(KeyboardInterrupt, 5), (RuntimeError, 4)],
                         ids=["ctrl-c-saves-a-checkpoint", "a-crash-keeps-the-last-one"])
def test_an_interrupted_run_resumes_where_it_stopped(student, compiled, tmp_path, monkeypatch, capfd, error,
                                                     resumed_at):
    whole = llmc.distill(student, compiled, TEXT, tmp_path / "whole.llmc", steps=7, checkpoint_every=2, **FAST)
    out, checkpoint = tmp_path / "resumed.llmc", tmp_path / "resumed.llmc.ckpt"
    with monkeypatch.context() as patch:
        interrupt_at(patch, 5, error)
        with pytest.raises(error):
            llmc.distill(student, compiled, TEXT, out, steps=7, checkpoint_every=2, **FAST)
    assert not out.exists()
    assert json.loads((checkpoint / STATE).read_text())["step"] == resumed_at
    capfd.readouterr()
    llmc.distill(student, compiled, TEXT, out, steps=7, checkpoint_every=2, quiet=False, **FAST)
    assert f"resuming at step {resumed_at} of 7 from checkpoint '{checkpoint}'" in capfd.readouterr().err
    ours, theirs = weights_of(out), weights_of(whole)
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    records = [json.loads((p / MANIFEST).read_text())["distilled"] for p in (out, whole)]
    assert records[0] == records[1]
    assert not checkpoint.exists()


def test_a_checkpoint_of_another_run_is_refused(student, compiled, tmp_path, monkeypatch):
    out = tmp_path / "out.llmc"
    with monkeypatch.context() as patch:
        interrupt_at(patch, 2, KeyboardInterrupt)
        with pytest.raises(KeyboardInterrupt):
            llmc.distill(student, compiled, TEXT, out, steps=4, **FAST)
    with pytest.raises(DistillError, match=r"belongs to another run \(its lr is 0.003, this run's 0.001\)"):
        llmc.distill(student, compiled, TEXT, out, steps=4, **{**FAST, "lr": 1e-3})
    assert not out.exists()


def other_tokenizer(teacher: Path, tmp_path: Path) -> Path:
    """A copy of `teacher` whose tokenizer swaps two tokens' ids (re-hashed: a valid artifact)."""
    copy = Path(shutil.copytree(teacher, tmp_path / "other-tokenizer.llmc"))
    file = copy / "tokenizer" / "tokenizer.json"
    data = json.loads(file.read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    file.write_text(json.dumps(data))
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["files"]["tokenizer/tokenizer.json"] = sha256_file(file)
    (copy / MANIFEST).write_text(json.dumps(manifest))
    return copy


def quantised_student(tmp_path: Path) -> Path:
    return llmc.compile("tiny-llama", target="cpu", output=tmp_path / "int4.llmc", kernels="cpu", quant="int4-rtn",
                        calib=str(TEXT), calib_samples=1, calib_seq_len=32)


def short_text(tmp_path: Path) -> Path:
    (tmp_path / "short.txt").write_text("Too short to hold two windows.")
    return tmp_path / "short.txt"


REFUSALS = {
    "zero steps": (lambda t, c: {"--steps": 0}, r"^--steps is 0; give a whole number of at least 1$"),
    "zero lr": (lambda t, c: {"--lr": 0}, r"^--lr is 0.0; give a positive finite number$"),
    "nan lr": (lambda t, c: {"--lr": "nan"}, r"^--lr is nan; give a positive finite number$"),
    "negative hidden weight": (lambda t, c: {"--hidden-weight": -1},
                               r"^--hidden-weight is -1.0; give a finite number of at least 0"),
    "unknown hidden loss": (lambda t, c: {"--hidden-loss": "l1", "--hidden-weight": 1},
                            r"^--hidden-loss is 'l1'; give one of cosine, mse$"),
    "one-token windows": (lambda t, c: {"--seq-len": 1}, r"^--seq-len is 1; give a whole number of at least 2$"),
    "windows past the positions": (lambda t, c: {"--seq-len": 4096},
                                   r"^--seq-len 4096 exceeds what teacher '.*' takes \(512 positions"),
    "short text": (lambda t, c: {"--text": short_text(t)},
                   r"^text '.*short.txt' has \d+ tokens, fewer than two windows of --seq-len 32"),
    "missing text": (lambda t, c: {"--text": t / "absent.txt"}, r"^text '.*absent.txt' not found"),
    "other tokenizer": (lambda t, c: {"--teacher": other_tokenizer(c, t)},
                        r"^student '.*mqa.llmc' and teacher '.*other-tokenizer.llmc' have different tokenizers "
                        r"\(token .* is id \d+ in the student and \d+ in the teacher\)"),
    "quantised student": (lambda t, c: {"student": quantised_student(t)},
                          r"^student '.*int4.llmc' stores int4-rtn weights \(qembedding, qlinear\), which "
                          r"gradients cannot train; compile the student with --quant none"),
    "student not an artifact": (lambda t, c: {"student": TEXT}, r"^student '.*eval.txt' is not an artifact"),
    "output exists": (lambda t, c: {"-o": t}, r"^output '.*' exists; pass --force to overwrite$"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_input_is_refused_in_one_line_leaving_nothing(case, student, compiled, tmp_path, capfd):
    overrides, message = REFUSALS[case]
    args = {"student": student, "--teacher": compiled, "--text": TEXT, "-o": tmp_path / "out.llmc",
            "--steps": 2, "--seq-len": 32, **overrides(tmp_path, compiled)}
    before = sorted(tmp_path.iterdir())
    code, _, err = llmc_in_process(capfd, "distill", args.pop("student"), *[x for kv in args.items() for x in kv])
    assert code == 2, err
    assert re.search(message, error_line(err)), error_line(err)
    assert sorted(tmp_path.iterdir()) == before
