"""Where an artifact runs: a GPU-target artifact defaults to CUDA and, with no GPU, fails with one
line telling the user to pass device="cpu" / --device cpu; that runs its Triton kernels through the
interpreter, from Python and from `llmc run`; the interpreter must be chosen before triton loads;
a CPU-target artifact refuses CUDA. And bench/gpu_check.py, which needs a GPU to measure, lists its
checks, exits 2 without a GPU, and runs its kernel checks at tiny sizes through the interpreter."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from llmc_cli import llmc_in_process as cli

import llmc
from llmc.errors import RuntimeLlmcError
from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")


@no_gpu
def test_gpu_artifact_without_gpu_fails_with_one_line(bf16_artifact, capsys):
    with pytest.raises(RuntimeLlmcError, match=r"targets h100-bf16 \(a GPU\).*no CUDA GPU.*device='cpu'.*--device cpu"):
        llmc.load(bf16_artifact)
    code, out, err = cli(capsys, "run", bf16_artifact, "-p", "The river")
    assert code == 2 and not out
    assert err.count("\n") == 1 and err.startswith("llmc: error: ") and "--device cpu" in err


def test_gpu_artifact_runs_on_cpu_through_the_interpreter(bf16_artifact, capsys):
    model = llmc.load(bf16_artifact, device="cpu", kv_memory="1MiB")
    assert model.engine.device == torch.device("cpu")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    expected = model.generate("The river", params)[0].outputs[0].text
    code, out, err = cli(capsys, "run", bf16_artifact, "--device", "cpu", "-p", "The river", "--max-tokens", "3",
                         "--kv-memory", "1MiB", "--no-stream")
    assert code == 0, err
    assert out == f"--- 'The river'\n{expected}\n"


def test_cpu_artifact_refuses_cuda_and_ignores_cpu(artifact):
    with pytest.raises(RuntimeLlmcError, match="compiled for target cpu.*CPU only.*GPU target"):
        Engine(artifact, EngineConfig(device="cuda"))
    assert Engine(artifact, EngineConfig(device="cpu", kv_memory="1MiB")).device == torch.device("cpu")


def test_unknown_device_is_refused(artifact):
    with pytest.raises(RuntimeLlmcError, match="device 'tpu' is not one of cpu, cuda"):
        Engine(artifact, EngineConfig(device="tpu"))


INTERPRETER_PROBE = """
import sys
from llmc.errors import RuntimeLlmcError
from llmc.runtime.device import use_triton_interpreter
if sys.argv[1] == "late":
    import triton.language  # noqa: F401  (as a library that imports triton first would)
try:
    use_triton_interpreter()
except RuntimeLlmcError as e:
    print("refused:", e)
    sys.exit(0)
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
print("interpreting" if isinstance(tl.zeros, InterpretedFunction) else "compiling")
"""


@pytest.mark.parametrize("when,expected", [("early", "interpreting"), ("late", "refused: ")])
def test_interpreter_is_chosen_before_triton_loads_or_refused(when, expected):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", INTERPRETER_PROBE, when], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(expected), run.stdout
    if when == "late":
        assert "set TRITON_INTERPRET=1 in the environment" in run.stdout


# -- bench/gpu_check.py -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module   # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_check"]


def test_gpu_check_dry_run_lists_its_checks(gpu_check, capsys):
    assert gpu_check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for section in ("kernel checks", "prefill attention", "decode attention", "GEMM", "SmolLM2 decode"):
        assert section in out
    assert "torch SDPA" in out and "roofline" in out and "h100-fp8" in out


@no_gpu
def test_gpu_check_without_gpu_exits_2_with_one_line(gpu_check, capsys):
    assert gpu_check.main(["--skip-model"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA GPU" in err


def test_gpu_check_kernel_checks_pass_at_tiny_sizes_in_the_interpreter(gpu_check, tmp_path, monkeypatch):
    """The real run's code paths (checks and timings) at tiny sizes; timing figures are not judged."""
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path))
    rows = gpu_check.run_all(torch.device("cpu"), gpu_check.Sizes.tiny(), "h100", 1e11, skip_model=True,
                             workdir=tmp_path, model_source="", deadline=0.0)
    checks = [r for r in rows if r.ok is not None]
    assert len(checks) >= 15 and all(r.ok for r in checks), gpu_check.format_table(checks)
    assert {r.section for r in rows} >= {"prefill attention", "decode attention", "GEMM"}
