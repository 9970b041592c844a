"""The compile's shortcuts keep what it writes and says: a `llmc compile` process that ends without
the interpreter's teardown still prints its summary and timing line and leaves a whole artifact;
loading a model that is not ONNX never imports onnx."""

import subprocess
import sys
from pathlib import Path

from llmc.compiler.artifact import read_artifact

LLMC = Path(sys.executable).parent / "llmc"


def test_a_compile_process_prints_everything_and_leaves_a_whole_artifact(tmp_path):
    out = tmp_path / "tiny.llmc"
    done = subprocess.run([str(LLMC), "compile", "tiny-llama", "-o", str(out)], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "artifact size" in done.stdout  # the summary, printed after the compile
    assert "llmc: compiled in" in done.stderr
    read_artifact(out)  # every file present and matching the manifest's hashes


def test_loading_a_sample_never_imports_onnx():
    probe = ("import sys, llmc.api; from llmc.compiler.frontends import load_model; "
             "load_model('tiny-llama'); print('onnx' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert done.stdout.strip() == "False", done.stderr
