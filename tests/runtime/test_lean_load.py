"""A lean load: the runtime holds about the weights' bytes once. A random-weight Llama in GGUF Q4_1 (4-bit
layers, a tied Q8_0 embedding and LM head) compiled for the CPU's torch kernels loads in a fresh process
with its RSS growing by at most 1.15x its weights plus the KV cache and a small bound, and the memory
report's split of that RSS adds up; the weights kernels read as stored are views of the weights file's
mapping, and no run writes a weight."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import llmc
from llmc.codegen.native import cpu_native
from llmc.compiler.artifact import read_artifact
from llmc.compiler.inspect import report
from llmc.runtime.executor import PlanExecutor
from llmc.runtime.host_memory import file_mappings
from llmc.runtime.kernel_check import verified_plan

ROOT = Path(__file__).resolve().parents[2]
KV_MEMORY = 16 << 20
# Measured on a 2-core x86 host: the load grew the RSS by 77-85 MiB, 3-10 MiB over 1.15x the weights (51 MiB)
# and the KV cache (16 MiB); while the load still copied every param, packed 4-bit codes for torch beside the
# native GEMV's and dequantised the LM head to fp32, the same load grew it by 281 MiB.
MARGIN = 40 << 20

MEASURE = """
import json, sys
import psutil, transformers.models.auto.tokenization_auto   # what any load imports, before the baseline
import llmc
from llmc.runtime import engine, memory_report
from llmc.runtime.host_memory import file_mappings
rss = lambda: psutil.Process().memory_info().rss
before = rss()
llm = llmc.load(sys.argv[1], kv_memory=int(sys.argv[2]))
loaded = rss()
llm.generate([{"prompt_token_ids": list(range(100, 140))}], llmc.SamplingParams(max_tokens=4))
ex = llm.engine.executor
weights = {start for start, end in file_mappings() for p in ex.plan.params if start <= ex.weight(p).data_ptr() < end}
written, current = 0, None   # a write to a private file mapping copies its page: an anonymous one
for line in open("/proc/self/smaps"):
    head = line.split()[0]
    if not head.endswith(":"):
        current = int(head.split("-")[0], 16)
    elif head == "Anonymous:" and current in weights:
        written += int(line.split()[1])
print(json.dumps({"before": before, "loaded": loaded, "split": memory_report.measure(llm.engine).to_dict(),
                  "written_kib": written}))
"""


@pytest.fixture(scope="module")
def lean_artifact(smollm2_gguf, tmp_path_factory) -> Path:
    spec = importlib.util.spec_from_file_location("make_model", ROOT / "bench" / "make_model.py")
    make_model = importlib.util.module_from_spec(spec)
    sys.modules["make_model"] = make_model   # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(make_model)
        shape = make_model.Shape(hidden=512, ffn=4096, layers=6, heads=8, kv_heads=4)
        folder = tmp_path_factory.mktemp("lean")
        gguf = make_model.make_model(shape, "q4_1", folder / "lean.gguf", tokenizer_gguf=smollm2_gguf)
    finally:
        del sys.modules["make_model"]
    return llmc.compile(str(gguf), target="cpu", output=folder / "lean.llmc", kernels="cpu")


def test_load_grows_rss_by_the_weights_once_and_the_split_adds_up(lean_artifact):
    # the dense switch forced: measuring it at load (a --kernels cpu plan records none) times GEMMs, not memory
    env = {**os.environ, "LLMC_QLINEAR_DENSE_FROM": "64"}
    done = subprocess.run([sys.executable, "-c", MEASURE, str(lean_artifact), str(KV_MEMORY)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.splitlines()[-1])
    split = got["split"]
    weights = split["weights_file"]
    assert weights > 40 << 20   # the model is the weights' size the bound is about, not the runtime's
    assert got["loaded"] - got["before"] <= 1.15 * weights + split["kv_cache"] + MARGIN, got
    parts = ("weights_mapped", "weights_repacked", "kv_cache", "activations", "rest")
    assert all(split[p] >= 0 for p in parts) and sum(split[p] for p in parts) == split["rss"], split
    assert split["weights_mapped"] + split["weights_repacked"] <= 1.15 * weights, split
    assert 0 < split["kv_cache"] <= split["kv_cache_allocated"]   # resident as the run's tokens filled it
    assert got["written_kib"] == 0   # nothing writes a weight: pages unmapped after load fault back unchanged
    expected = report(lean_artifact, kv_memory=KV_MEMORY)["memory_at_load"]   # what `llmc inspect` says
    assert split["kv_cache_allocated"] == expected["kv_cache"] and split["weights_file"] == expected["weights_file"]
    # the native GEMV reads the GGUF's 4-bit blocks in place: copies are params off a 64-byte boundary
    # (executor._held), few if any; where AMX runs the 4-bit GEMMs (a model in the last-level cache), their
    # tiles are the one copy of those weights (their stored pages left the RSS: the bound above)
    tiled = expected["weights_repacked"]
    assert (tiled == 0) == (not cpu_native.amx_ready() or not cpu_native.weights_fit_cache(weights))
    assert split["weights_repacked"] <= 1.01 * tiled + 0.01 * weights


def test_weights_read_as_stored_are_views_of_the_file_mapping(lean_artifact):
    art = read_artifact(lean_artifact)
    executor = PlanExecutor(verified_plan(art), art.weights)
    mappings = file_mappings()
    mapped = lambda t: any(start <= t.data_ptr() < end for start, end in mappings)
    assert all(mapped(art.weights[name]) for name in executor.plan.params)
    held = [name for name in executor.plan.params if executor.weight(name).data_ptr() == art.weights[name].data_ptr()]
    copied = sum(art.weights[name].nbytes for name in set(executor.plan.params) - set(held))
    assert copied <= 0.01 * sum(art.weights[name].nbytes for name in executor.plan.params)   # off 64-byte lines only
    if not cpu_native.available():
        return
    prepared = [attrs.get("native_gemv") for attrs in executor.held() if isinstance(attrs, dict)]
    heads = [w for w in prepared if type(w) is cpu_native.Q8Weights]
    assert heads and all(mapped(w.codes) and mapped(w.scales) for w in heads)   # GGUF's Q8_0 LM head, as stored
    fours = [w for w in prepared if type(w) is cpu_native.Q4Weights]
    assert fours and all(mapped(w.packed) and mapped(w.scales) and mapped(w.other) for w in fours)   # as stored
    assert all(attrs["cpu_weights"].packed.weights is attrs["native_gemv"] for attrs in executor.held()
               if type(attrs.get("native_gemv")) is cpu_native.Q4Weights)
    assert torch.equal(executor.weight("model.norm.weight"), art.weights["model.norm.weight"])
