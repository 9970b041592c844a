"""Shared fixtures: `tiny_model`, the tiny-llama sample built fresh for each test (it takes
milliseconds, and tests may change it freely), and the SmolLM2-135M GGUF, fetched once into
LLMC_CACHE; its tests skip only when that fetch fails."""

import os

import pytest

# Triton runs here only through its interpreter, and triton reads this when first imported
# (transformers imports it early), so set it before any test module loads.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Engines apply the runtime's thread count to torch when built; keep the suite on one thread
# (see one_torch_thread below).
os.environ.setdefault("LLMC_NUM_THREADS", "1")
# Kernel timings of tiny models, taken beside the rest of the suite, would otherwise be too close to
# call or measured busy, and decide nothing: trust them, as before (tests of that unset it).
os.environ.setdefault("LLMC_TRUST_TIMINGS", "1")
# loads keep the kernel choices their artifact made (a test loading at another thread count than it compiled
# at would otherwise re-time them): tests/compiler/test_run_site.py turns the re-check on
os.environ.setdefault("LLMC_RECHECK_KERNELS", "0")


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    # Test shapes are small: a second intra-op thread gains little, and on a busy two-core
    # machine its barrier waits make every op up to 10x slower.
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def fixed_step_cost():
    """Speculation prices a verification step at the fixed costs (runtime/speculative.STEP_COSTS), not
    at what a tiny model measures beside the rest of the suite, so its choice of k, and a seeded
    request's draws, do not follow the machine's load; tests/runtime/test_step_cost.py measures."""
    from llmc.runtime import speculative

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(speculative, "measured_step_cost", lambda *args: None)
        yield


@pytest.fixture
def tiny_model():
    from llmc.compiler.frontends import load_model
    return load_model("tiny-llama")


@pytest.fixture(scope="session")
def smollm2_gguf():
    from llmc.compiler.frontends.samples import fetch_smollm2
    from llmc.errors import ModelLoadError
    try:
        return fetch_smollm2()
    except ModelLoadError as e:
        pytest.skip(f"SmolLM2-135M GGUF unavailable, the fetch failed: {e}")


@pytest.fixture(scope="session")
def smollm2_model(smollm2_gguf):
    """Loaded once per session (a few seconds): read it, do not modify it."""
    from llmc.compiler.frontends import load_model
    return load_model(str(smollm2_gguf))


@pytest.fixture(scope="session")
def smollm2_fp32(tmp_path_factory, smollm2_model):
    """SmolLM2 compiled for cpu with its GGUF dequantised (--quant none), once per session (30-45 s on
    2 cores); read-only: the SmolLM2, speculation and kept-Q4_1 tests each compiled the same artifact."""
    import llmc
    return llmc.compile("smollm2-135m", target="cpu", output=tmp_path_factory.mktemp("smol-fp32") / "smol.llmc",
                        quant="none")


@pytest.fixture(scope="session")
def compiled(tmp_path_factory):
    """tiny-llama compiled for cpu once per session, with torch kernels throughout (tests read and edit
    its plan's steps; the default, measured choice may put them in ONNX Runtime segments); read-only:
    copy it (fixture `art`) to change it."""
    import llmc
    return llmc.compile("tiny-llama", target="cpu", output=tmp_path_factory.mktemp("tiny-cpu") / "tiny.llmc",
                        kernels="cpu")


@pytest.fixture(scope="session")
def artifact(compiled):
    """The same tiny-llama artifact under the name the runtime and tools tests use; read-only."""
    return compiled


@pytest.fixture
def art(compiled, tmp_path):
    """A fresh copy of the session's tiny-llama artifact, free to change."""
    import shutil
    from pathlib import Path
    return Path(shutil.copytree(compiled, tmp_path / "art.llmc"))
