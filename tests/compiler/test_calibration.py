"""Calibration sequences: self-generated text is deterministic per seed and leaves the caller's RNG
alone, a --calib file is cut into consecutive chunks of its tokens, and the compile driver makes
calibration data only for a pipeline with a lossy pass."""

import hashlib
import json
import shutil

import pytest
import torch

from llmc.compiler import pipeline
from llmc.compiler.calibration import PROMPTS, calibration_sequences, calibration_source
from llmc.compiler.frontends import load_model
from llmc.errors import PassError
from llmc.passes.base import Pass, PassResult
from llmc.passes.registry import get_pass


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Sampled text is kept in $LLMC_CACHE/calibration: each test starts with none."""
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "calibration"


def test_self_generated_calibration_is_deterministic_per_seed(tiny, own_cache):
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a = calibration_sequences(tiny, None, 3, 24, seed=0)
    assert torch.equal(torch.rand(3), before)  # the global RNG is where the caller left it
    shutil.rmtree(own_cache)   # sampled again, not read back
    b = calibration_sequences(tiny, None, 3, 24, seed=0)
    c = calibration_sequences(tiny, None, 3, 24, seed=1)
    assert [s.shape for s in a] == [(24,)] * 3 and all(s.dtype == torch.long for s in a)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_sampled_text_is_kept_and_read_back_once_whole(tiny, own_cache, monkeypatch):
    """A model's sampled set is kept per seed and size and read back instead of sampling again; a file
    that is not a whole set of that shape (cut short, other sizes, tokens past the vocabulary) is sampled
    again and replaced."""
    from llmc.compiler import calibration

    sampled = []
    real = calibration.generated_sequences
    monkeypatch.setattr(calibration, "generated_sequences", lambda *a: sampled.append(a) or real(*a))
    first = calibration_sequences(tiny, None, 3, 24, seed=5)
    again = calibration_sequences(tiny, None, 3, 24, seed=5)
    assert len(sampled) == 1 and all(torch.equal(x, y) for x, y in zip(first, again))
    [kept] = own_cache.iterdir()
    calibration_sequences(tiny, None, 2, 24, seed=5)
    calibration_sequences(tiny, None, 3, 24, seed=6)
    assert len(sampled) == 3 and len(list(own_cache.iterdir())) == 3
    for bad in (kept.read_text()[:-7], "[[1, 2]]", json.dumps([[10 ** 9] * 24] * 3)):
        kept.write_text(bad)
        assert all(torch.equal(x, y) for x, y in zip(calibration_sequences(tiny, None, 3, 24, seed=5), first))
    assert len(sampled) == 6 and json.loads(kept.read_text()) == [s.tolist() for s in first]


def test_self_generated_sequences_start_with_the_prompts(tiny):
    seqs = calibration_sequences(tiny, None, 2, 40, seed=0)
    for seq, prompt in zip(seqs, PROMPTS):
        ids = tiny.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert seq[:len(ids)].tolist() == ids
    assert len(set(PROMPTS)) == len(PROMPTS) >= 16


def test_calib_file_is_cut_into_consecutive_chunks(tiny, tmp_path):
    text = " ".join(f"The river runs past mill number {i} toward the sea." for i in range(40))
    path = tmp_path / "calib.txt"
    path.write_text(text)
    ids = tiny.tokenizer(text, add_special_tokens=False)["input_ids"]
    seqs = calibration_sequences(tiny, str(path), 3, 16)
    assert [s.tolist() for s in seqs] == [ids[0:16], ids[16:32], ids[32:48]]
    assert len(calibration_sequences(tiny, path, 10_000, 16)) == len(ids) // 16
    assert calibration_source(path) == "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    assert calibration_source(None, 7) == "self-generated:7"


def test_bad_calibration_requests_are_user_errors(tiny, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("hello")
    with pytest.raises(PassError, match="short.txt' has .* tokens, fewer than one sequence"):
        calibration_sequences(tiny, short, 2, 64)
    with pytest.raises(PassError, match="missing.txt' cannot be read"):
        calibration_sequences(tiny, tmp_path / "missing.txt", 2, 16)
    with pytest.raises(PassError, match="exceeds the model's 512 positions"):
        calibration_sequences(tiny, None, 2, 1000)


class LossyNoop(Pass):
    name = "lossy_noop_for_test"
    lossy = True

    def run(self, graph, ctx):
        return PassResult(0, False)


def test_calibration_is_made_only_for_a_pipeline_with_a_lossy_pass(tiny, monkeypatch):
    made, logged = [], []
    monkeypatch.setattr(pipeline, "calibration_sequences",
                        lambda *args: made.append(args) or [torch.arange(8)])
    opts = pipeline.CompileOptions(calib_samples=4, calib_seq_len=8)
    log = lambda name, seconds, details: logged.append((name, details))
    assert pipeline.calibrate(tiny, [get_pass("dce"), get_pass("remove_noops")], opts, log) is None
    assert made == [] and logged == []
    seqs = pipeline.calibrate(tiny, [get_pass("dce"), LossyNoop()], opts, log)
    assert [s.tolist() for s in seqs] == [list(range(8))]
    assert made == [(tiny, None, 4, 8, 0)]
    assert logged == [("calibrate", {"source": "self-generated:0", "sequences": 1, "tokens": 8})]
