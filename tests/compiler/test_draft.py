"""`llmc compile M --draft-of TARGET`: a speculative-decoding draft of tiny-llama keeps half its
layers (by block influence) in int4, records which artifact it serves, runs, and is refused when
its tokenizer differs from the target's."""

import json

import pytest
import torch

import llmc
from llmc.cli import main
from llmc.compiler.artifact import sha256_file
from llmc.compiler.frontends import load_model
from llmc.compiler.inspect import summarize
from llmc.compiler.tokenizer_files import vocab_difference
from llmc.errors import ArtifactError, ModelLoadError, PassError

CALIB = dict(calib_samples=2, calib_seq_len=32)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return llmc.compile("tiny-llama", output=tmp_path_factory.mktemp("draft") / "target.llmc")


@pytest.fixture(scope="module")
def draft(target):
    return llmc.compile("tiny-llama", output=target.parent / "draft.llmc", draft_of=target, **CALIB)


def manifest_of(path):
    return json.loads((path / "manifest.json").read_text())


def test_draft_keeps_half_the_layers_in_int4_and_records_its_target(target, draft):
    ours, theirs = manifest_of(draft), manifest_of(target)
    assert theirs["model"]["num_layers"] == 2 and ours["model"]["num_layers"] == 1
    assert ours["model"]["kv_bytes_per_token"] * 2 == theirs["model"]["kv_bytes_per_token"]
    passes = [p["name"] for p in ours["pipeline"]]
    assert passes.index("prune_layers") < passes.index("quantize_int4")
    int4 = next(p for p in ours["pipeline"] if p["name"] == "quantize_int4")
    figures = int4["details"]["quant"]["int4"]
    # the kept layer's q, k, v, o, gate, up, down in int4; the untied LM head stays float by quantize_int4's rule
    assert int4["options"]["method"] == "rtn" and (figures["linears"], figures["kept_linears"]) == (7, 1)
    assert sum(ours["report"]["weight_bytes"].values()) < sum(theirs["report"]["weight_bytes"].values()) / 3
    assert ours["draft_of"] == {"model": "tiny-llama", "manifest_sha256": sha256_file(target / "manifest.json"),
                                "num_layers": 2, "vocab_size": theirs["model"]["vocab_size"]}
    assert "draft of: tiny-llama (2 layers; this draft has 1)" in summarize(draft)


def test_draft_runs_and_shares_the_targets_tokens(target, draft):
    params = llmc.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = [llmc.LLM(p).generate("The river starts", params)[0] for p in (target, draft)]
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids
    assert all(0 <= t < manifest_of(target)["model"]["vocab_size"] for t in outs[1].outputs[0].token_ids)


def test_inspect_json_shows_draft_of(draft, capfd):
    capfd.readouterr()
    main(["inspect", str(draft), "--json"])
    assert json.loads(capfd.readouterr().out)["draft_of"]["model"] == "tiny-llama"


def test_draft_layers_equal_to_the_model_only_quantises(target, tmp_path):
    path = llmc.compile("tiny-llama", output=tmp_path / "d.llmc", draft_of=target, draft_layers=2,
                        quant="int8", **CALIB)
    ours = manifest_of(path)
    assert ours["model"]["num_layers"] == 2 and "prune_layers" not in [p["name"] for p in ours["pipeline"]]
    assert any(p["name"] == "quantize_int8" for p in ours["pipeline"])


@pytest.fixture(scope="module")
def other_tokenizer_dir(tmp_path_factory):
    """tiny-llama's weights under a tokenizer with one token more."""
    tiny = load_model("tiny-llama")
    path = tmp_path_factory.mktemp("other") / "tiny-other-tok"
    tiny.module.save_pretrained(path, safe_serialization=True)
    tiny.tokenizer.add_tokens(["<|tool|>"])
    tiny.tokenizer.save_pretrained(path)
    return path


def test_tokenizer_mismatch_is_refused_naming_both(target, other_tokenizer_dir, tmp_path):
    out = tmp_path / "bad.llmc"
    with pytest.raises(ModelLoadError) as e:
        llmc.compile(str(other_tokenizer_dir), output=out, draft_of=target, **CALIB)
    message = str(e.value)
    assert str(other_tokenizer_dir) in message and str(target) in message and "tiny-llama" in message
    assert "513 tokens against 512" in message and not out.exists()


def test_cli_tokenizer_mismatch_is_one_line_exit_2(target, other_tokenizer_dir, tmp_path, capfd):
    with pytest.raises(SystemExit) as e:
        main(["compile", str(other_tokenizer_dir), "-o", str(tmp_path / "bad.llmc"), "--draft-of", str(target)])
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip() and "Loading weights" not in line]
    assert e.value.code == 2 and len(err) == 1 and "differs from the one of target artifact" in err[0]


def test_vocab_difference_names_the_first_token_that_moved():
    ours = {"a": 0, "b": 1, "c": 2}
    assert vocab_difference(ours, {"a": 0, "b": 2, "c": 1}, "draft", "target") == \
        "token 'b' is id 1 in the draft and 2 in the target"


@pytest.mark.parametrize("kwargs,error,message", [
    ({"draft_layers": 1}, PassError, "--draft-layers 1 needs --draft-of"),
    ({"draft_of": "missing.llmc"}, ArtifactError, "--draft-of 'missing.llmc' is not an artifact directory"),
    ({"draft_of": "TARGET", "draft_layers": 0}, PassError, "--draft-layers 0 must be at least 1"),
    ({"draft_of": "TARGET", "draft_layers": 3}, PassError, "--draft-layers 3 exceeds the 2 layers"),
    ({"draft_of": "TARGET", "prune": "layers:1"}, PassError, "drop layers: from --prune"),
])
def test_bad_draft_options_are_refused(target, tmp_path, kwargs, error, message):
    kwargs = {k: target if v == "TARGET" else v for k, v in kwargs.items()}
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        llmc.compile("tiny-llama", output=tmp_path / "x.llmc", **kwargs)


def test_draft_logits_follow_the_target_more_than_chance(target, draft):
    """The draft is useful only if it tends to agree with its target: on tiny-llama's own text
    its next-token choice matches the target's far above 1/vocab."""
    result = llmc.evaluate(draft, "The river starts as a thin stream in the hills and grows wider as it runs "
                                  "toward the sea. In spring the water is cold and fast.", ref=target)
    assert result["top1_agreement"] > 10 / manifest_of(target)["model"]["vocab_size"]
    assert torch.isfinite(torch.tensor(result["perplexity"]))
