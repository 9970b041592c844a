"""Bad values given to `llmc run`, `chat`, `bench` and `eval` at run time: out-of-range or
non-finite numbers, text that is not UTF-8, a KV budget the machine cannot hold, a plot path
that cannot be written. Each exits 2 with one `llmc: error:` line naming the option (or the
source of the text) and what it accepts, and changes no file."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from llmc_cli import error_line, llmc_in_process

import llmc

LLMC = Path(sys.executable).parent / "llmc"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return llmc.compile("tiny-llama", target="cpu", output=tmp_path_factory.mktemp("art") / "tiny.llmc")


@pytest.fixture
def rng(request):
    return random.Random(request.node.name)


def snapshot(*roots: Path) -> dict:
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for root in roots for p in root.rglob("*")}


@pytest.fixture
def unchanged(artifact, tmp_path, monkeypatch):
    """Run in an empty working directory; afterwards it is still empty and the artifact is as
    it was. Tests write their input files beside it, in tmp_path."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    before = snapshot(artifact)
    yield work
    assert snapshot(artifact) == before
    assert list(work.iterdir()) == []


# option -> (a bad value drawn from rng, fragments of the error line)
RUN_OPTIONS = {
    "temperature-nan": ("--temperature", lambda r: "nan", ["'--temperature'", "not a finite number", "x>=0"]),
    "temperature-inf": ("--temperature", lambda r: "inf", ["'--temperature'", "not a finite number"]),
    "temperature-negative": ("--temperature", lambda r: f"-{r.uniform(0.01, 5):.3f}", ["'--temperature'", "x>=0"]),
    "top-p-above-1": ("--top-p", lambda r: f"{1 + r.uniform(0.01, 5):.3f}", ["'--top-p'", "0.0<x<=1.0"]),
    "top-p-zero": ("--top-p", lambda r: "0", ["'--top-p'", "0.0<x<=1.0"]),
    "top-p-nan": ("--top-p", lambda r: "nan", ["'--top-p'", "not a finite number"]),
    "max-tokens-negative": ("--max-tokens", lambda r: str(-r.randrange(1, 10**6)), ["'--max-tokens'", "x>=1"]),
    "max-tokens-zero": ("--max-tokens", lambda r: "0", ["'--max-tokens'", "x>=1"]),
    "top-k-below-minus-1": ("--top-k", lambda r: str(-r.randrange(2, 100)), ["'--top-k'", "x>=-1"]),
    "seed-2-to-the-70": ("--seed", lambda r: str(2**70 + r.randrange(10**6)),
                         ["'--seed'", "0<=x<=18446744073709551615"]),
    "seed-negative": ("--seed", lambda r: str(-r.randrange(1, 100)), ["'--seed'", "0<=x<="]),
    "kv-memory-banana": ("--kv-memory", lambda r: "banana", ["--kv-memory", "'banana'", "2GiB"]),
    "kv-memory-negative": ("--kv-memory", lambda r: f"-{r.randrange(1, 9)}GiB", ["--kv-memory", "as a size"]),
    "kv-memory-zero": ("--kv-memory", lambda r: "0", ["--kv-memory", "more than 0 bytes"]),
    "kv-memory-100TiB": ("--kv-memory", lambda r: f"{r.randrange(100, 900)}TiB",
                         ["--kv-memory", "the KV cache needs", "the machine has", "available",
                          "smaller --kv-memory"]),
}


@pytest.mark.parametrize("case", RUN_OPTIONS)
def test_run_refuses_a_bad_number_in_one_line(case, artifact, unchanged, rng, capfd):
    option, value, fragments = RUN_OPTIONS[case]
    code, stdout, err = llmc_in_process(capfd, "run", artifact, "-p", "hello", option, value(rng))
    assert code == 2 and stdout == ""
    message = error_line(err)
    for fragment in fragments:
        assert fragment in message


BENCH_OPTIONS = {
    "qps-nan": (["--qps", "nan"], ["--qps is nan", "must be positive", "inf for all at once"]),
    "qps-negative": (["--qps", "-{f}"], ["--qps is -{f}", "must be positive"]),
    "qps-zero": (["--qps", "0"], ["--qps is 0.0", "must be positive"]),
    "num-requests-zero": (["-n", "0"], ["'--num-requests' / '-n'", "x>=1"]),
    "input-len-negative": (["--input-len", "-{i}"], ["'--input-len'", "x>=1"]),
    "input-spread-one": (["--input-spread", "1"], ["'--input-spread'", "0.0<=x<1.0"]),
    "output-spread-nan": (["--output-spread", "nan"], ["'--output-spread'", "not a finite number"]),
    "prefix-len-negative": (["--prefix-len", "-{i}"], ["'--prefix-len'", "x>=0"]),
    "seed-negative": (["--seed", "-{i}"], ["'--seed'", "x>=0"]),
    "max-num-seqs-zero": (["--max-num-seqs", "0"], ["'--max-num-seqs'", "x>=1"]),
    "plot-under-proc": (["--plot", "/proc/x/y.png"],
                        ["--plot '/proc/x/y.png'", "'/proc/x' is not a writable directory"]),
    "plot-under-a-file": (["--plot", "{tmp}/file.txt/y.png"], ["file.txt' is not a writable directory"]),
    "plot-unknown-format": (["--plot", "{tmp}/bench.xyz"], ["cannot write a .xyz image", ".png"]),
}


@pytest.mark.parametrize("case", BENCH_OPTIONS)
def test_bench_refuses_a_bad_value_before_it_runs(case, artifact, unchanged, tmp_path, rng, capfd):
    args, fragments = BENCH_OPTIONS[case]
    (tmp_path / "file.txt").write_text("not a directory\n")
    value = str(rng.randrange(1, 400) / 4)
    args = [a.format(f=value, i=rng.randrange(1, 100), tmp=tmp_path) for a in args]
    code, stdout, err = llmc_in_process(capfd, "bench", artifact, "--kv-memory", "4MiB", *args)
    assert code == 2 and stdout == ""  # refused before the run: no progress, no results
    message = error_line(err)
    for fragment in fragments:
        assert fragment.format(f=value) in message


def test_a_plot_that_fails_to_save_keeps_the_printed_results(artifact, unchanged, capfd, monkeypatch):
    from matplotlib.figure import Figure

    def disk_full(self, path, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", disk_full)
    code, stdout, err = llmc_in_process(capfd, "bench", artifact, "-n", "2", "--input-len", "4",
                                        "--output-len", "2", "--kv-memory", "4MiB", "--json",
                                        "--plot", unchanged / "bench.png")
    assert code == 2
    assert json.loads(stdout)["workload"]["num_requests"] == 2
    message = error_line(err)
    assert "bench.png' could not be written" in message and "No space left on device" in message


def test_run_refuses_a_prompt_that_is_not_utf8(artifact, unchanged, rng, capfd):
    text = "".join(rng.choice("abc ") for _ in range(rng.randrange(0, 5)))
    code, stdout, err = llmc_in_process(capfd, "run", artifact, "-p", "fine", "-p", text + "\udcff",
                                        "--max-tokens", "2")
    assert code == 2 and stdout == ""
    message = error_line(err)
    assert "--prompt 2 is not valid UTF-8 text" in message and f"byte 0xff at character {len(text)}" in message


# case: (command, option, file content, fragments of the error line)
TEXT_FILES = {
    "prompts-file-not-utf8": ("run", "--prompts-file", b"hello\n\xff\xfeworld\n",
                              ["is not valid UTF-8 text", "byte 0xff at offset 6, line 2", "one prompt per line"]),
    "prompts-file-binary": ("run", "--prompts-file", b"\x7fELF\x02\x01\x01\x00\x00",
                            ["holds a NUL byte at offset 7", "looks binary"]),
    "eval-text-not-utf8": ("eval", "--text", b"caf\xe9 au lait " * 10, ["cannot be read as UTF-8 text", "--text"]),
    "eval-text-binary": ("eval", "--text", b"text\x00with a NUL byte " * 10,
                         ["holds a NUL byte at character 4", "--text"]),
}


@pytest.mark.parametrize("case", TEXT_FILES)
def test_a_file_of_text_that_is_not_text_is_refused(case, artifact, unchanged, tmp_path, capfd):
    command, option, content, fragments = TEXT_FILES[case]
    path = tmp_path / "input.bin"
    path.write_bytes(content)
    code, stdout, err = llmc_in_process(capfd, command, artifact, option, path)
    assert code == 2 and stdout == ""
    message = error_line(err)
    assert f"'{path}'" in message
    for fragment in fragments:
        assert fragment in message


def test_eval_refuses_max_tokens_below_2(artifact, unchanged, capfd):
    code, stdout, err = llmc_in_process(capfd, "eval", artifact, "--max-tokens", "1")
    assert code == 2 and "'--max-tokens'" in error_line(err) and "x>=2" in error_line(err)


def test_console_script_refuses_binary_stdin(artifact, tmp_path):
    data = bytes(random.Random(3).randrange(128, 256) for _ in range(64))
    result = subprocess.run([str(LLMC), "run", str(artifact), "--max-tokens", "2"], input=data,
                            capture_output=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 2 and result.stdout == b""
    message = error_line(result.stderr.decode())
    assert message.startswith("stdin is not valid UTF-8 text") and "line 1" in message
    assert list(tmp_path.iterdir()) == []


def test_console_script_refuses_a_non_utf8_argument(artifact, tmp_path):
    result = subprocess.run([str(LLMC).encode(), b"run", str(artifact).encode(), b"-p", b"caf\xe9"],
                            capture_output=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 2 and result.stdout == b""
    assert "--prompt 1 is not valid UTF-8 text (byte 0xe9 at character 3)" in error_line(result.stderr.decode())
    assert list(tmp_path.iterdir()) == []
