"""Long commands show progress the way pip and Hugging Face tools do: on a terminal, bars (and a
line per stage that runs longer than a moment); piped with -q, only their result. Run in real
processes whose stdout and stderr are a pseudo-terminal, or a pipe."""

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios

import pytest

MAIN = "import sys; from llmc.cli import main; sys.argv[0] = 'llmc'; main()"


def on_terminal(args, env) -> str:
    """Everything `llmc ARGS` wrote with stdout and stderr on a pseudo-terminal."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))   # a new pty is 0 x 0
    proc = subprocess.Popen([sys.executable, "-c", MAIN, *map(str, args)], stdin=subprocess.DEVNULL,
                            stdout=follower, stderr=follower, env=env)
    os.close(follower)
    chunks = []
    while True:
        ready, _, _ = select.select([leader], [], [], 1.0)
        if ready:
            try:
                data = os.read(leader, 65536)
            except OSError:   # the terminal closed with the process
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    proc.wait(timeout=600)
    os.close(leader)
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")[-2000:]
    return b"".join(chunks).decode(errors="replace")


def piped(args, env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", MAIN, *map(str, args)], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL, timeout=600, check=True)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return dict(os.environ, LLMC_STAGE_DELAY="0")   # every stage's line, however short


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, env):
    out = tmp_path_factory.mktemp("progress") / "tiny.llmc"
    piped(["compile", "tiny-llama", "-o", out, "--kernels", "cpu", "-q"], env)
    return out


def test_compile_shows_stage_lines_and_bars_on_a_terminal_and_nothing_piped_with_q(tmp_path, env):
    shown = on_terminal(["compile", "tiny-llama", "--quant", "int8", "--calib-samples", "2", "--calib-seq-len", "16",
                         "--kernels", "cpu", "-o", tmp_path / "a.llmc"], env)
    for line in ("llmc: loading tiny-llama", "llmc: running", "llmc: quantize_int8: calibrating on 2 x 16 tokens",
                 "llmc: writing the artifact", "llmc: compiled in"):
        assert line in shown, shown[-3000:]
    assert "passes:" in shown and "|" in shown                 # tqdm's bar over the passes
    assert "reference logits (2 x 16 tokens)" in shown        # the bar of the accuracy walk
    quiet = piped(["compile", "tiny-llama", "--quant", "int8", "--calib-samples", "2", "--calib-seq-len", "16",
                   "--kernels", "cpu", "-o", tmp_path / "b.llmc", "-q"], env)
    assert quiet.stdout == "" and quiet.stderr == ""


def test_eval_shows_its_bar_on_a_terminal_and_only_its_result_piped_with_q(artifact, tmp_path, env):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 200)
    shown = on_terminal(["eval", artifact, "--text", text], env)
    assert "eval:" in shown and "window" in shown and "perplexity" in shown
    quiet = piped(["eval", artifact, "--text", text, "-q"], env)
    assert "perplexity" in quiet.stdout and "eval:" not in quiet.stdout + quiet.stderr


def test_export_shows_stage_lines_on_a_terminal_and_only_its_result_piped_with_q(artifact, tmp_path, env):
    shown = on_terminal(["export", artifact, "-o", tmp_path / "a.onnx"], env)
    for line in (f"llmc: reading {artifact}", "llmc: building the ONNX graph of", "llmc: writing model.onnx",
                 "llmc: checking model.onnx"):
        assert line in shown, shown[-2000:]
    quiet = piped(["export", artifact, "-o", tmp_path / "b.onnx", "-q"], env)
    assert quiet.stdout.strip() == f"wrote {tmp_path / 'b.onnx'}/model.onnx" and quiet.stderr == ""
